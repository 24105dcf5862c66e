"""The ground floor: what every other folder of the training code may import, and which imports none
of them.

    errors.py    how a run ends and stops: ConfigError / RunError / LocalError / Preempted, run_main, GracefulStop
    dist.py      rank-aware printing and every collective of the project (all_reduce, agree, ...), each on the
                 communication device

tests/test_layout.py checks that nothing here imports the project.
"""
