"""The training loop's building blocks, one concern per module (torchtitan's components/):

    errors.py    how a run ends and stops: ConfigError / RunError / LocalError / Preempted, run_main, GracefulStop
    dist.py      rank-aware printing and every collective of the project (all_reduce, agree, ...)
    config.py    the scripts' UPPER_CASE settings: --name=value overrides, --help, the printed config
    checks.py    inputs checked before any work: OUTPUT_DIR writable and shared, MODEL_PATH's layout
    warnings.py  the filter for known, harmless library warnings
    logger.py    the step log: log line, progress, metrics.jsonl, TensorBoard / W&B
    guard.py     the non-finite-step guard
    optim.py     AdamW (fused where it can be) and the LR warmup
    metrics.py   model FLOPs and MFU, throughput, the logging window's means
    export.py    the diffusers export (model folder, LoRA weights, pipeline) and its size
    trainer.py   what both scripts do around their loops: start, restore, the end of a step, finish

Imports go one way: errors, dist, config, checks, warnings, logger, guard and optim sit at the bottom
(beside precision.py and algorithms/) and import nothing above them; metrics.py may import those and
precision.py; export.py also checkpoint.py and parallel/; trainer.py anything but the scripts.
tests/test_layout.py checks it.
"""
