"""The training loop's building blocks, one concern per module (torchtitan's components/):

    config.py    the scripts' UPPER_CASE settings: --name=value overrides, --help, the printed config
    checks.py    inputs checked before any work: OUTPUT_DIR writable and shared, MODEL_PATH's layout
    warnings.py  the filter for known, harmless library warnings
    logger.py    the step log: log line, progress, metrics.jsonl, TensorBoard / W&B
    guard.py     the non-finite-step guard
    optim.py     AdamW (fused where it can be), torchao's 8-/4-bit AdamW and the LR warmup
    metrics.py   model FLOPs and MFU, throughput, the logging window's means
    export.py    the diffusers export (model folder, LoRA weights, pipeline) and its size
    validation.py      DMD2's validation figures (variety, distance, colour), the teacher's cache, the collapse warning
    dmd_validation.py  train_dmd.py's VAL_EVERY: its rows, the teacher's guidance, each parametrisation's samplers
    trainer.py   what both scripts do around their loops: start, restore, the end of a step, finish

Imports go one way: components/ sits above every other folder of the training code (core/, precision,
algorithms/, fsdp_utils, data/, parallel/, checkpoint, families/) and below the scripts; none of those
imports it. tests/test_layout.py checks it.
"""
