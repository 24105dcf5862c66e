"""What both training scripts do around their loops, written once: the start (settings checked,
model folder and LoRA targets checked, process group up, config printed, stop handler, resume
path), the checkpointer and resume, the updates that end a step (clip, agree on finiteness,
step), the end of each step (metric window, log line, validation, samples, checkpoint, stop) and
the end of the run (memory, compile report, export, teardown). The loops stay in the scripts.

The settings both scripts share have one meaning here (their comments in the scripts say the same):
LOG_EVERY, SAMPLE_EVERY and SAVE_EVERY count steps; 0 turns the thing off (SAVE_EVERY=0: only the
final checkpoint); samples and a checkpoint are also written at MAX_STEPS.

    python -m pytest tests/test_trainer.py -q
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import checkpoint
import fsdp_utils
import precision
from components import profiling
from components.checks import check_model_folder, check_output_dir, check_output_dir_shared, shared_folders
from components.config import apply_overrides, check_settings, format_config, script_constants
from core.dist import agree, print0
from core.errors import ConfigError, GracefulStop, set_error_dir
from components.export import export_bytes, export_lora, export_pipeline
from components.guard import NonFiniteGuard, is_finite
from components.logger import RunLogger, check_report_to
from components.metrics import ModelFlops, throughput, window_add, window_metrics
from components.warnings import quiet_known_warnings
from parallel import attention
from parallel import compile as compiling
from parallel import lora as lora_lib
from parallel import lowbit
from families import MODELS, pipelines
from parallel import memory

# ----------------------------------------------------------------------------------------------
# the start


def check_shared_settings(c: dict) -> None:
    """The settings both scripts have, checked alike before any work (`c`: the script's constants)."""
    check_settings({
        "MAX_STEPS >= 1": c["MAX_STEPS"] >= 1, "BATCH_SIZE >= 1": c["BATCH_SIZE"] >= 1,
        "GRAD_ACCUM >= 1": c["GRAD_ACCUM"] >= 1, "WARMUP_STEPS >= 0": c["WARMUP_STEPS"] >= 0,
        "0 <= EMA_DECAY < 1": 0 <= c["EMA_DECAY"] < 1, "PREFETCH >= 0": c["PREFETCH"] >= 0,
        "RESOLUTION >= 0": c["RESOLUTION"] >= 0,
        "LOG_EVERY, SAVE_EVERY, SAMPLE_EVERY >= 0": min(c["LOG_EVERY"], c["SAVE_EVERY"], c["SAMPLE_EVERY"]) >= 0,
        "MAX_BAD_STEPS >= 1": c["MAX_BAD_STEPS"] >= 1, "COLLECTIVE_TIMEOUT_S > 0": c["COLLECTIVE_TIMEOUT_S"] > 0,
        "SHARD_TEXT_ENCODER in (auto, 0, 1)": str(c["SHARD_TEXT_ENCODER"]) in ("auto", "0", "1"),
    })
    try:
        precision.get_precision(c["PRECISION"])
        for name in ("TEXT_ENCODER_DTYPE", "VAE_DTYPE", "EXPORT_DTYPE"):
            if c[name]:
                precision.parse_dtype(c[name])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lora_lib.check_lora(lora_lib.Lora.from_settings(c))
    lowbit.check_lowbit(c)
    check_report_to(c["REPORT_TO"])
    world = int(os.environ.get("WORLD_SIZE", 1))
    fsdp_utils.check_dp_replicate(c["DP_REPLICATE"], world)
    fsdp_utils.check_parallelism(c["PARALLELISM"], c["CPU_OFFLOAD"], c["DP_REPLICATE"])
    fsdp_utils.parse_reshard(c["RESHARD_AFTER_FORWARD"])
    compiling.check_compile(c["COMPILE"])
    profiling.profile_steps(c["PROFILE_STEPS"], c["MAX_STEPS"])


def check_text_sharding(value, room) -> None:
    """SHARD_TEXT_ENCODER=1 for a family whose text encoders the scripts never shard (they fit one GPU;
    a room that does says SHARDED_TEXT_FILL): refused in one line."""
    if str(value) == "1" and not getattr(room, "SHARDED_TEXT_FILL", False):
        raise ConfigError(f"SHARD_TEXT_ENCODER=1: {room.NAME}'s text encoders are not sharded here (they fit one "
                          "GPU); leave it at auto")


def pipeline_of(folder: str, script: str) -> str:
    """The folder's pipeline class (model_index.json's _class_name) when `script` trains it
    (pipelines.SCRIPTS), else the script's first, whose folder check then names what is missing."""
    kinds = pipelines.SCRIPTS[script]
    try:
        with open(os.path.join(folder, "model_index.json")) as f:
            kind = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return kinds[0]
    return kind if kind in kinds else kinds[0]


@dataclass
class Run:
    """One training run's shared state: its settings, process group and the pieces that own the
    start and end of every step."""
    config: dict  # the resolved settings, as printed and saved in every checkpoint
    pipeline: str  # the diffusers pipeline class MODEL_PATH holds
    d: fsdp_utils.Dist
    lora: lora_lib.Lora
    stopper: GracefulStop
    resume_path: str | None
    start_step: int = 0
    ckpt: checkpoint.Checkpointer | None = None
    guard: NonFiniteGuard | None = None
    logger: RunLogger | None = None
    memory_table: functools.partial | None = None
    window: dict = field(default_factory=dict)
    clock: float = 0.0  # when the last step ended (after its samples and checkpoint), for the step's wall time
    flops: dict = field(default_factory=dict)  # {step kind: {"model"|"recomputed"|"vae": {peak kind: FLOPs}}}
    model_flops: ModelFlops | None = None  # watch_model_flops: where MFU is reported
    vae_flops: ModelFlops | None = None  # the VAE's forwards, counted apart
    devices_checked: dict | None = None  # {name: (module, optimizer)} whose devices the first step checks
    stop_agreed: bool = False  # some rank was signalled (SIGTERM/SIGINT): every rank saves and stops after this step
    profiler: profiling.StepProfiler | None = None  # PROFILE_STEPS

    def output(self, *parts: str) -> str:
        return os.path.join(self.config["OUTPUT_DIR"], *parts)


def start(namespace: dict, validate, resolve) -> tuple[Run, object]:
    """The prelude of both scripts' main(): `--name=value` overrides applied to the script's
    constants (`namespace`), the shared settings and then the script's own checked (`validate()`,
    whose result is returned beside the Run), the "" defaults filled (`resolve()` returns the
    resolved config), MODEL_PATH checked against the pipeline layout, LoRA targets checked on the
    meta skeleton, OUTPUT_DIR writable: all before any work. Then the process group, the config
    printed, the stop handler and the checkpoint to resume from (a bad path fails here)."""
    quiet_known_warnings()  # before anything imports diffusers
    apply_overrides(namespace, sys.argv[1:])
    check_shared_settings(script_constants(namespace))
    validated = validate()
    embedded = not namespace["MODEL_PATH"]
    config = resolve()
    model_path = config["MODEL_PATH"]
    pipeline = pipeline_of(model_path, os.path.basename(namespace["__file__"]))
    check_model_folder(model_path, pipeline, pipelines.folder_layout(pipeline))
    lora = lora_lib.Lora.from_settings(config)
    trained = pipelines.trained_component(pipeline)
    facts = MODELS[trained.class_name]  # its family's (families/<name>/parallelism.py)
    if lora:  # unknown target modules fail here, on the meta skeleton, before any work
        lora_lib.check_lora_targets(trained.class_name, os.path.join(model_path, trained.subfolder), lora, facts)
    dispatcher = facts.attention_dispatcher
    attention.check_backend(config["ATTENTION_BACKEND"], dispatcher)
    for setting, folder in shared_folders(config).items():
        check_output_dir(folder, setting)
    set_error_dir(config["OUTPUT_DIR"])

    d = fsdp_utils.init_distributed(cpu_offload=config["CPU_OFFLOAD"], timeout_s=config["COLLECTIVE_TIMEOUT_S"])
    precision.apply_tf32(config["TF32"])
    sdpa = attention.sdpa_flags(config["ATTENTION_BACKEND"])
    print0(f"config ({d.world_size} ranks, {d.backend}, {d.device}):\n{format_config(config)}")
    print0(f"model {model_path} ({pipeline}) | data {config['DATA_PATH']}"
           + (" (the embedded default)" if embedded else ""))
    print0(f"attention: {trained.class_name} {config['ATTENTION_BACKEND']}"
           + (" (diffusers' dispatcher)" if dispatcher else "")
           + f"; torch SDPA for the other models: {sdpa}")
    slow_bf16 = precision.cpu_bf16_warning(precision.get_precision(config["PRECISION"]), d.device)
    if slow_bf16:
        print0(slow_bf16)
    for setting, folder in shared_folders(config).items():
        check_output_dir_shared(folder, setting)
    stopper = GracefulStop()
    resume_path = checkpoint.resolve_resume(config["RESUME"], config["OUTPUT_DIR"])  # rank 0's answer
    run = Run(config, pipeline, d, lora, stopper, resume_path)
    run.profiler = profiling.StepProfiler(profiling.profile_steps(config["PROFILE_STEPS"], config["MAX_STEPS"]),
                                          config["OUTPUT_DIR"], d.device)
    return run, validated


def check_attention(run: Run, trained: list[attention.Shape], others: list[attention.Shape],
                    dtype: torch.dtype) -> None:
    """On CUDA, the start-up self-check of ATTENTION_BACKEND (parallel/attention.py) at the run's own
    attention shapes: `trained` for the trained model (through the dispatcher where it uses it),
    `others` for the models that call torch's SDPA under its flags (VAE, frozen encoders). A kernel
    that fails or computes wrong values stops this rank in one line before any model is built. On
    CPU the kernels are torch's portable ones: not checked."""
    if run.d.device.type != "cuda":
        return
    name = run.config["ATTENTION_BACKEND"]
    trained_class = pipelines.trained_component(run.pipeline).class_name
    attend = (attention.dispatcher_attend(name) if MODELS[trained_class].attention_dispatcher
              else attention.sdpa_attend)
    alternative = "_native_math" if name == attention.DEFAULT else attention.DEFAULT
    calls = [(s, attend) for s in trained] + [(s, attention.sdpa_attend) for s in others]
    lines = attention.self_check(calls, name, dtype, run.d.device, alternative)
    print0("attention check passed:\n" + "\n".join("  " + line for line in lines))


def mesh_and_sharding(run: Run, context_parallel: int = 1):
    """(FSDP mesh or None under PARALLELISM=ddp, CP mesh or None, the Sharding settings)."""
    c = run.config
    meshes = (fsdp_utils.build_meshes(run.d.device, c["DP_REPLICATE"], context_parallel)
              if c["PARALLELISM"] == "fsdp" else (None, None))
    sharding = fsdp_utils.Sharding(fsdp_utils.parse_reshard(c["RESHARD_AFTER_FORWARD"]), c["CPU_OFFLOAD"],
                                   c["ACTIVATION_CHECKPOINTING"], c["PREFETCH"], c["COMPILE"])
    return (*meshes, sharding)


def report_components(run: Run, caption: str, audit: list[dict], trained: dict, optimizers: dict) -> None:
    """The dtype table of every component, the memory table at start (kept for the end) and the disk
    preflight (checkpoint.disk_preflight: stops the run here when not even one checkpoint fits)."""
    print0(f"components ({caption}):\n{precision.format_audit(audit)}")
    run.memory_table = functools.partial(memory.memory_report, trained, optimizers)
    print0(f"memory at start:\n{run.memory_table()}")
    # disk for KEEP_LAST + 1 checkpoints and the export: checkpoints hold the trainable models and the (frozen)
    # EMA, not a teacher (read from MODEL_PATH); the first of `trained` is the model the export writes
    c = run.config
    saved = {k: m for k, m in trained.items() if k == "ema" or any(p.requires_grad for p in m.parameters())}
    export = export_bytes(c["MODEL_PATH"], pipelines.trained_component(run.pipeline).subfolder,
                          next(iter(trained.values())), precision.parse_dtype(c["EXPORT_DTYPE"]),
                          lora=bool(run.lora), merged=c["LORA_EXPORT_MERGED"],
                          frozen={"vae": c["VAE_PATH"]} if c.get("VAE_PATH") else None,
                          out_dir=run.output("export"), link_frozen=c["EXPORT_SYMLINKS"])
    checkpoint.disk_preflight(c["OUTPUT_DIR"], saved, optimizers, c["KEEP_LAST"], export, run.resume_path)


def restore(run: Run, checkpointed: dict, optimizers: dict, schedulers: dict) -> int:
    """The checkpointer (what checkpoints hold: `checkpointed` models, `optimizers` {name: (module,
    optimizer)}, `schedulers`; when one is written: SAVE_EVERY, MAX_STEPS, a stop), the
    non-finite guard and the logger; resumes from RESUME when set. Returns the step to start after."""
    c = run.config
    run.ckpt = checkpoint.Checkpointer(c["OUTPUT_DIR"], checkpointed, optimizers, schedulers, c,
                                       keep_last=c["KEEP_LAST"], async_save=c["ASYNC_SAVE"],
                                       save_every=c["SAVE_EVERY"], last_step=c["MAX_STEPS"])
    run.guard = NonFiniteGuard(c["MAX_BAD_STEPS"])
    if run.resume_path:
        meta = run.ckpt.load(run.resume_path)
        run.start_step = meta["step"]
        run.guard.load(meta)
        print0(f"resumed from {run.resume_path} (step {run.start_step})")
    run.devices_checked = optimizers
    check_devices(run)  # every inner tensor of NF4 weights (and resumed optimizer states) where its parameter is
    if run.d.device.type == "cuda":  # the logged peaks are the loop's, not loading's
        torch.cuda.reset_peak_memory_stats(run.d.device)
    run.clock = time.perf_counter()
    run.logger = RunLogger(c["OUTPUT_DIR"], c["MAX_STEPS"], run.start_step, report_to=c["REPORT_TO"],
                           config=c, wandb_project=c["WANDB_PROJECT"], wandb_run_name=c["WANDB_RUN_NAME"])
    run.profiler.after_step(run.start_step)  # PROFILE_STEPS starting at the first step after it
    return run.start_step


# ----------------------------------------------------------------------------------------------
# the end of a step


def apply_updates(run: Run, updates: list[tuple[list, torch.optim.Optimizer, str]], logs: dict, step: int) -> bool:
    """The step's optimizer updates, [(params, optimizer, name)]: clip each (the norm over all
    shards, logged as grad_norm_<name>, or grad_norm for an unnamed one), then, only when every
    loss and norm is finite on every rank, step them all. Grads are zeroed either way. The one
    collective that decides it also carries whether any rank was signalled to stop (end_step acts
    on it): the step's only host sync outside logging steps. Returns whether it stepped."""
    with profiling.phase("updates"):
        return _apply_updates(run, updates, logs, step)


def _apply_updates(run: Run, updates: list[tuple[list, torch.optim.Optimizer, str]], logs: dict, step: int) -> bool:
    for params, _, name in updates:
        logs["grad_norm_" + name if name else "grad_norm"] = fsdp_utils.clip_grad_norm_(
            params, run.config["MAX_GRAD_NORM"])
    # the step's one host sync: every rank's finiteness and stop signal in one collective
    finite = is_finite(*[v for k, v in logs.items() if k.startswith(("loss", "grad_norm"))])
    ok, go_on = agree(finite, not run.stopper.signalled())
    run.guard.record(ok)
    run.stop_agreed = not go_on
    for _, opt, _ in updates:
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if ok and run.devices_checked:  # optimizers make their states at their first step: check those once
        check_devices(run)
        run.devices_checked = None
    if not ok:
        print0(f"step {step}: non-finite loss or grad norm on some rank, updates skipped on all "
               f"({run.guard.in_a_row} in a row, {run.guard.skipped} in all)")
    return ok


def check_devices(run: Run) -> None:
    """Every parameter's and optimizer state's inner tensors (NF4, low-bit states, DTensor shards) on
    the device the parameter reports (lowbit.check_devices: metadata only, no copies)."""
    for module, optimizer in run.devices_checked.values():
        lowbit.check_devices(module, optimizer)


def due(step: int, every: int, last_step: int | None = None) -> bool:
    """Every `every` steps (0: never), and at `last_step` too when given (and every > 0)."""
    return every > 0 and (step % every == 0 or step == last_step)


def end_step(run: Run, step: int, logs: dict, extra: dict, trainer_state: dict, *, validate=None,
             sample=None, work: dict | None = None) -> None:
    """Everything after the updates, the same in both scripts: the compile report after the first
    step; the step's values into the logging window and, every LOG_EVERY steps and at the last, the
    log line of the window's means (losses also averaged over ranks) with `extra` (LRs); `validate()`
    -> {name: value} added to that step's record when given (the caller decides when it is due; not
    timed as training); samples every SAMPLE_EVERY steps and at the last (`sample(path)`, a
    collective; rank 0 writes the PNG); then the checkpoint when due (trainer_state: the script's
    extras) and, on a stop or too many non-finite steps, the save and the exit. `work`: what one
    step processes over all ranks ({"images": n[, "tokens": n]}), logged as rates (throughput)."""
    c = run.config
    run.profiler.updates_done(step)  # PROFILE_STEPS: the window ends with the last step's updates
    if c["COMPILE"] and step == run.start_step + 1:  # the training step's graphs, breaks and compile time
        print0(compiling.compile_report())
    now = time.perf_counter()
    window_add(run.window, {**logs, "step_s": now - run.clock})  # the step itself: data wait, compute, updates
    metrics = None
    if due(step, c["LOG_EVERY"], c["MAX_STEPS"]):
        metrics = window_metrics(run.window, {**extra, "skipped_steps": run.guard.skipped})
        metrics.update(throughput(metrics, work or {}, run.d))
    if validate is not None:  # logged with the step's line (one record per step)
        with run.logger.paused():
            metrics = {**(metrics or {}), **validate()}
    run.logger.step_done(step, metrics)
    run.ckpt.poll()
    if sample is not None and due(step, c["SAMPLE_EVERY"], c["MAX_STEPS"]):
        path = run.output("samples", f"step_{step:06d}.png")
        sample(path)
        run.logger.log_images(step, "samples", path)
    stopping = run.stop_agreed or run.guard.exhausted
    if run.stop_agreed:
        run.stopper.acknowledge()
    run.ckpt.save(step, {**trainer_state, **run.guard.state()}, stopping=stopping)
    if stopping:
        run.logger.close()
        raise run.guard.error(step) if run.guard.exhausted else run.stopper.preempted(step)
    run.profiler.after_step(step)
    run.clock = time.perf_counter()  # the next step's time starts here: samples and saves are not steps


# ----------------------------------------------------------------------------------------------
# the end of the run


def finish(run: Run, final_weights, frozen: dict[str, str] | None = None, scheduler: dict | None = None,
           base_lora=None, index: dict | None = None) -> None:
    """After the loop (the final checkpoint and samples were written at MAX_STEPS): the memory table
    (its peak is training's, not the export gather's), the whole run's compile report (with the
    samples' and validation's recompiles), the export of `final_weights()` (the model, or its EMA)
    into OUTPUT_DIR/export/: a diffusers pipeline folder, or with LoRA the adapters in diffusers'
    LoRA format (fp32: a few MB) and, with LORA_EXPORT_MERGED, a merged pipeline in export_merged/;
    `frozen` maps a component to another folder used instead of MODEL_PATH's; `scheduler`, a scheduler
    config every export that carries the trained model gets as its scheduler/ (a distilled model's
    own sampling), in place of MODEL_PATH's; `base_lora`, adapters merged into the model's base as it
    loaded (train_dmd.py's TEACHER_LORA), joined into the LoRA export so that it loads on MODEL_PATH; `index`,
    model_index.json entries a pipeline export sets (a distilled FLUX.2 klein's is_distilled). Then teardown."""
    c = run.config
    run.logger.close()
    run.ckpt.wait()
    print0(f"memory after training:\n{run.memory_table()}")
    if c["COMPILE"]:
        print0(compiling.compile_report("compile, whole run"))
    component = pipelines.trained_component(run.pipeline).subfolder
    with final_weights() as final_model:
        # a model of several pipeline components (Wan 2.2 A14B's experts) exports each; LoRA: the first's file in
        # export/, each other's in export/<its name>/ (load_lora_weights(..., load_into_<its name>=True))
        parts = final_model.pipeline_parts() if hasattr(final_model, "pipeline_parts") else {component: final_model}
        if run.lora:
            for i, (name, part) in enumerate(parts.items()):  # base_lora: the first part's, or {part: its}
                base = base_lora.get(name) if isinstance(base_lora, dict) else base_lora if i == 0 else None
                export_lora(part, run.output("export", *([name] if i else [])), run.pipeline, component,
                            torch.float32, scheduler if i == 0 else None, base_lora=base)
        if not run.lora or c["LORA_EXPORT_MERGED"]:
            export_pipeline(c["MODEL_PATH"], run.output("export_merged" if run.lora else "export"),
                            parts, precision.parse_dtype(c["EXPORT_DTYPE"]), frozen=frozen,
                            scheduler=scheduler, link_frozen=c["EXPORT_SYMLINKS"], index=index)
    fsdp_utils.cleanup_distributed()
