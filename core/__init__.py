"""The ground floor: what every other folder of the training code may import, and which imports none
of them.

    errors.py    how a run ends and stops: ConfigError / RunError / LocalError / Preempted, run_main, GracefulStop
    dist.py      rank-aware printing and every collective of the project (all_reduce, agree, ...), each on the
                 communication device
    launch.py    what a rank learns from its launcher: rank and world (torchrun's or SLURM's variables),
                 its GPU, its CPU threads, whether two ranks share a GPU

tests/test_layout.py checks that nothing here imports the project.
"""
