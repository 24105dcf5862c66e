"""How a run behaves, whatever it trains: errors that end it cleanly, rank-aware printing and the
small collectives by which all ranks agree (stop, skip, fail together), the `--name=value`
settings parser, input checks made before any work, the step log, non-finite-step guard, LR
warmup and the warning filter. Both training scripts use it; it knows nothing of FSDP.

    python -m pytest tests/test_run_utils.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------
# errors: each kind ends the run in one line with its own exit code (see run_main)

class ConfigError(Exception):
    """A mistake in settings or inputs that every rank sees identically: rank 0 reports it in one
    line and every rank exits with code 2, before any collective is left waiting."""



class Preempted(Exception):
    """Raised by a script after it saved a checkpoint on SIGTERM/SIGINT; run_main exits 128+signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class LocalError(Exception):
    """A failure found on one rank whose message says all there is to say (a start-up check of a
    kernel): that rank prints it in one line with its rank number and exits 1 at once, as any local
    failure does, without a traceback."""


class RunError(Exception):
    """A failure during training that every rank has learnt of together (through a collective:
    a failed save, too many non-finite steps): rank 0 reports it in one line, all ranks exit 1."""


# ----------------------------------------------------------------------------------------------
# rank-aware printing, and the collectives by which every rank takes the same branch

def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


# Every collective of the project goes through these helpers (tests/test_layout.py checks that no
# other module calls torch.distributed's collectives): NCCL takes CUDA tensors only, gloo takes any,
# so a CPU tensor handed to a collective passes every CPU test and fails on the first GPU run. The
# helpers put each tensor on the group's communication device and hand the result back where the
# caller's tensor was.

def comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL
    (init_distributed made it the current device), the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _distributed() -> bool:
    return dist.is_initialized() and world_size() > 1


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor: `t` reduced over all ranks (sum by default), on t's device."""
    if not _distributed():
        return t.clone()
    x = t.to(comm_device(), copy=True)
    dist.all_reduce(x, op=op)
    return x.to(t.device)


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable objects: small metadata only)."""
    if not _distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)  # pickles through a tensor on the current device (CUDA under NCCL)
    return out


def broadcast_from_rank0(obj):
    """Rank 0's `obj` on every rank (e.g. a path only rank 0 looked up)."""
    if not _distributed():
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=comm_device())
    return box[0]


def barrier() -> None:
    if _distributed():
        dist.barrier()


def agree(*flags) -> tuple[bool, ...]:
    """For each flag (a bool, or a 0-d tensor on any device), True only if it is True on every rank:
    one MIN all-reduce and one host sync for all of them, so that all ranks take the same branch
    (skip a step whose loss was non-finite on one rank, stop when one rank was signalled)."""
    device = next((f.device for f in flags if torch.is_tensor(f)), torch.device("cpu"))
    vector = torch.stack([(f.detach() if torch.is_tensor(f) else torch.tensor(f)).to(device, torch.float64).reshape(())
                          for f in flags])
    return tuple(v > 0.5 for v in all_reduce(vector, op=dist.ReduceOp.MIN).tolist())


def mean_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over ranks (for logging), one all-reduce."""
    if not values:
        return {}
    keys = sorted(values)
    t = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return {k: v / world_size() for k, v in zip(keys, t.tolist())}


def first_error(error: str | None) -> str | None:
    """Collective: the first failing rank's message (None when every rank succeeded), on every
    rank, so all ranks stop together after a local failure (e.g. one rank's disk is full)."""
    return next((e for e in all_gather_objects(error) if e), None)


# ----------------------------------------------------------------------------------------------
# running a script's main(), and stopping it on a signal

def run_main(main_fn) -> None:
    """Run a script's main(): errors end the process with one clear line and a non-zero code.

    A ConfigError is the same on every rank, so only rank 0 prints it and all exit 2. Any other
    exception is local to one rank: that rank prints its traceback and a one-line summary with its
    rank number (also into OUTPUT_DIR/error_rank{N}.txt and torchrun's error file) and exits at once
    (os._exit) without entering another collective; torchrun then stops the other ranks, and the
    collective timeout set in init_distributed turns any leftover wait into an error. A LocalError
    is such a failure already diagnosed: one line, no traceback.
    """
    try:
        main_fn()
    except ConfigError as e:
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(2)
    except Preempted as e:
        # the checkpoint is saved: a launcher's SIGTERM (torchrun sends one to the other ranks as
        # soon as the first exits) must not turn this rank's exit code 128+signal into a kill
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if rank() == 0:
            print(f"stopped: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(128 + e.signum)
    except RunError as e:
        if rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _teardown_quietly()
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"[rank {rank()}] interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except LocalError as e:
        _report_local(f"[rank {rank()}] error: {e}", None, e)
        os._exit(1)
    except Exception as e:  # noqa: BLE001 - the point is to report any failure where it can be found
        import traceback
        text = traceback.format_exc()
        line = f"[rank {rank()}] error: {type(e).__name__}: {e}".rstrip()
        if "CUDA error" in str(e) or "CUBLAS_STATUS" in str(e):
            line += ("\n(CUDA reports kernel failures asynchronously: the frame above may be a later kernel's; "
                     "rerun with CUDA_LAUNCH_BLOCKING=1 to find the one that failed)")
        _report_local(line, text, e)
        os._exit(1)


_ERROR_DIR: list[str] = []  # OUTPUT_DIR once the run knows it (set_error_dir): where error_rank{N}.txt goes


def set_error_dir(output_dir: str) -> None:
    """From here on, an unexpected exception also writes OUTPUT_DIR/error_rank{N}.txt."""
    _ERROR_DIR[:] = [output_dir]


def _report_local(line: str, text: str | None, exc: BaseException | None = None) -> None:
    """A rank's own failure, where a cluster user looks: the traceback then the one-line summary on
    stderr, OUTPUT_DIR/error_rank{N}.txt, and torchelastic's error file (TORCHELASTIC_ERROR_FILE,
    set by torchrun) so that torchrun's failure summary names the exception and its traceback."""
    print((text or "") + line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _ERROR_DIR:
        with contextlib.suppress(OSError):
            os.makedirs(_ERROR_DIR[0], exist_ok=True)
            with open(os.path.join(_ERROR_DIR[0], f"error_rank{rank()}.txt"), "w") as f:
                f.write((text or "") + line + "\n")
    if exc is not None and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(exc)


def _teardown_quietly() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class GracefulStop:
    """SIGTERM / SIGINT (cluster preemption, Ctrl-C): remember it; once per step the ranks agree on
    `signalled()` (inside the step's one collective, train_common.apply_updates), so all ranks
    finish the same step, save together and exit. A second signal exits at once, except a SIGTERM within `duplicate_window_s` of a
    first SIGTERM: that is the same stop delivered twice (SLURM signals every process of the job
    step, and torchrun forwards the one it got to its workers), and must not cut the save short."""

    def __init__(self, duplicate_window_s: float = 10.0):
        self.signum: int | None = None
        self.window, self._at = duplicate_window_s, 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == self.signum == signal.SIGTERM and time.monotonic() - self._at < self.window:
                return
            os._exit(128 + signum)
        self.signum, self._at = signum, time.monotonic()
        print(f"[rank {rank()}] {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(signal again to quit at once)", file=sys.stderr, flush=True)

    def signalled(self) -> bool:
        """Whether this rank got a signal (local; agree on it across ranks before acting)."""
        return self.signum is not None

    def acknowledge(self) -> None:
        """All ranks agreed to stop: this rank saves and exits by itself from now on. A SIGTERM
        (torchrun forwards one to every rank as soon as the first one exits) is ignored so it cannot
        cut the save or the final message short; a SIGINT (a user's second Ctrl-C) still exits at once."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def signal_received(self) -> int:
        """The signal to report (SIGTERM if this rank only heard of it from another rank)."""
        return self.signum or signal.SIGTERM

    def preempted(self, step: int) -> Preempted:
        """What the loop raises once the stop's checkpoint is saved (run_main exits 128+signal)."""
        return Preempted(self.signal_received(), f"checkpoint saved at step {step}; rerun with --resume=auto")


# ----------------------------------------------------------------------------------------------
# settings: UPPER_CASE constants at the top of a script, overridden as --name=value

CONFIG_TYPES = (bool, int, float, str, list)


def script_constants(namespace: dict) -> dict:
    """The settings of a script: its UPPER_CASE module constants of plain types."""
    return {k: v for k, v in namespace.items()
            if k.isupper() and not k.startswith("_") and isinstance(v, CONFIG_TYPES)}


def _parse_value(name: str, raw: str, default):
    kind = type(default)
    try:
        if kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is list:
            text = raw.strip()
            items = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
            if not isinstance(items, list):
                raise ValueError
            return [_parse_value(name, str(v), default[0]) for v in items] if default else items
        return raw
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"--{name.lower()}={raw!r}: expected {kind.__name__}") from None


def apply_overrides(namespace: dict, argv: list[str]) -> dict:
    """Apply `--name=value` overrides (case-insensitive, type-checked) to a script's constants,
    in place in `namespace`. Returns the final config dict. Unknown names suggest close matches."""
    consts = script_constants(namespace)
    by_lower = {k.lower(): k for k in consts}
    if "--help" in argv or "-h" in argv:
        print0(settings_help(namespace.get("__file__", ""), consts))
        raise SystemExit(0)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"argument {arg!r}: write settings as --name=value")
        key, raw = arg[2:].split("=", 1)
        name = by_lower.get(key.lower().replace("-", "_"))
        if name is None:
            close = difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown setting --{key}{hint}")
        namespace[name] = _parse_value(name, raw, consts[name])
    return script_constants(namespace)


def settings_help(script: str, consts: dict) -> str:
    """--help: every setting of `script` as --name=default (type) and its comment, under the group
    comments of the script's header, in the script's order."""
    out = [f"usage: torchrun --nproc_per_node=N {os.path.basename(script)} [--name=value ...]  "
           "(or python, one process); settings:"]
    group = None
    for line in open(script, encoding="utf-8") if script else ():
        if line.startswith(("def ", "class ")):
            break
        m = re.match(r"^([A-Z][A-Z0-9_]*) = .*?\s+#\s*(.*)$", line.rstrip("\n"))
        if m and m.group(1) in consts:
            if group:
                out.append(f"\n{group}")
                group = None
            name, value = m.group(1), consts[m.group(1)]
            out.append(f"  --{name.lower()}={json.dumps(value)} ({type(value).__name__}): {m.group(2)}")
        elif line.startswith("# ") and not line.startswith("# ---"):
            group = line[2:].strip()
    return "\n".join(out)


def format_config(config: dict) -> str:
    width = max(len(k) for k in config)
    return "\n".join(f"  {k.ljust(width)} = {v!r}" for k, v in config.items())


def check_settings(checks: dict[str, bool]) -> None:
    """{requirement: holds?} -> one ConfigError listing every requirement that does not hold."""
    failed = [k for k, ok in checks.items() if not ok]
    if failed:
        raise ConfigError(f"invalid settings: need {'; '.join(failed)}")


def quiet_known_warnings() -> None:
    """Silence the warnings that are noise in these scripts, and only those:
    - FSDP2 warns when a wrapped block returns a view (FLUX blocks return slices): harmful only if
      the view is then changed in place, which neither diffusers' model code nor the scripts do
      (the parity tests check losses and gradients against unwrapped models);
    - diffusers' ModelMixin.to(dtype) warns "modules ... should be kept in float32: []" even when
      there are none (UNet, VAE, FLUX transformer);
    - diffusers' from_pretrained recommends installing accelerate for low_cpu_mem_usage: this suite
      uses no accelerate by design (big models are built on meta and loaded shard by shard);
    - transformers says its CLIP/Siglip image processors fall back to PIL without torchvision: no
      image processor is used here;
    - the per-file "Loading weights" bars of transformers/diffusers from_pretrained, which write
      carriage returns into log files (the run's own bar and log lines stay);
    - torch's deprecation notice for funcol.all_gather_tensor, which diffusers' context-parallel
      output gather still calls (a FutureWarning about diffusers' code, nothing users can change);
    - with torchao installed (OPTIMIZER / BASE_DTYPE), what importing it prints on every rank on
      import of diffusers: its CUDA-only kernel libraries that do not load on CPU builds, torch's
      notice about torchao registering Enum constants with pytree, and diffusers' note that its
      torchao checkpoint classes moved (nothing here loads torchao-serialized checkpoints).
    Every other warning stays visible. Called before the scripts first import diffusers."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=r"`torch.distributed._functional_collectives.all_gather_tensor` is "
                            r"deprecated", category=FutureWarning)
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda record: not any(s in record.getMessage() for s in ("should be kept in float32: []",
                                                                  "because `accelerate` was not found")))
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed)" not in record.getMessage())
    logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
        lambda record: "Unable to import `torchao` Tensor objects" not in record.getMessage())
    try:
        import diffusers.utils.logging
        import transformers.utils.logging
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


# ----------------------------------------------------------------------------------------------
# inputs checked up front, before any rank starts work

def check_output_dir(path: str) -> None:
    """OUTPUT_DIR must be creatable and writable (a probe file is written and removed), so a bad
    path fails before any work instead of at the first save."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"OUTPUT_DIR={path!r} is not writable ({e.strerror or e})") from None


def check_output_dir_shared(path: str) -> None:
    """Collective, after the process group is up: every rank sees a file rank 0 writes in OUTPUT_DIR.
    Checkpoints (DCP: each rank writes its shards, rank 0 the metadata and the rename), the text
    cache and resume need one folder that all ranks share; a node-local OUTPUT_DIR on a multi-node
    run would otherwise fail mid-run, at the first save. Fails on every rank, naming the hosts that
    do not see it."""
    probe = os.path.join(path, ".shared_check")
    token = broadcast_from_rank0(f"{socket.gethostname()}:{os.getpid()}:{time.time()}")
    if rank() == 0:
        with open(probe, "w") as f:
            f.write(token)
    barrier()
    try:
        with open(probe) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    blind = [h for h in all_gather_objects(None if seen else f"rank {rank()} on {socket.gethostname()}") if h]
    barrier()
    if rank() == 0:
        os.remove(probe)
    if blind:
        raise ConfigError(f"OUTPUT_DIR={path!r} is not shared by all ranks: {', '.join(blind)} cannot see the file "
                          "rank 0 wrote there; on several nodes put OUTPUT_DIR on a filesystem every node mounts")


_COMPONENT_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json", "tokenizer.json", "vocab.json")


def check_model_folder(path: str, pipeline: str, components: dict, setting: str = "MODEL_PATH") -> None:
    """`path` must be a diffusers pipeline folder with every component a script loads.

    components: {subfolder: expected class name in model_index.json, or None for any}. A wrong
    folder (e.g. a FLUX folder given to an SD-1.5 script) fails in one line naming what is missing."""
    if not os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r}: no such folder")
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise ConfigError(f"{setting}={path}: no model_index.json, not a diffusers pipeline folder "
                          f"(expected a {pipeline} folder)")
    try:
        with open(index) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{index}: unreadable ({e})") from None
    problems = []
    for name, cls in components.items():
        folder, entry = os.path.join(path, name), meta.get(name)
        found = isinstance(entry, list) and len(entry) == 2 and entry[1] or None
        if not os.path.isdir(folder) or not any(os.path.isfile(os.path.join(folder, f)) for f in _COMPONENT_FILES):
            problems.append(f"{name}/")
        elif cls and found and found != cls:
            problems.append(f"{name} (is {found}, need {cls})")
    if problems:
        raise ConfigError(f"{setting}={path}: a {meta.get('_class_name', 'diffusers')} folder, not the {pipeline} "
                          f"layout this script trains: missing {', '.join(problems)}")



# ----------------------------------------------------------------------------------------------
# the step: log line + progress (tqdm bar or plain lines) + JSONL (+ TensorBoard / W&B),
# non-finite guard, LR warmup

# REPORT_TO names -> the package each needs (checked with find_spec, imported only on rank 0)
REPORT_TO_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _installed(package: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_report_to(value: str) -> list[str]:
    """REPORT_TO ("", "tensorboard", "wandb", "tensorboard,wandb"; "none" = "") -> the backend
    names. An unknown name or a backend whose package is not installed is a ConfigError, raised
    during config validation (before any work) instead of at the first logged step."""
    names = []
    for raw in str(value or "").split(","):
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name not in REPORT_TO_BACKENDS:
            raise ConfigError(f"REPORT_TO={value}: unknown logger {name!r}; use tensorboard, wandb, "
                              "tensorboard,wandb, or '' for metrics.jsonl only")
        package = REPORT_TO_BACKENDS[name]
        if not _installed(package):
            raise ConfigError(f"REPORT_TO={value}: the {package} package is not installed (pip install {package})")
        if name not in names:
            names.append(name)
    return names


def _format_duration(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _format_rate(steps_per_s: float) -> str:
    if steps_per_s <= 0:
        return "? it/s"
    return f"{steps_per_s:.2f} it/s" if steps_per_s >= 1 else f"{1 / steps_per_s:.2f} s/it"


WANDB_RUN_ID_FILE = "wandb_run_id.txt"


class RunLogger:
    """What rank 0 reports about the loop (other ranks only time their steps):

    - `step 00042/10000 | loss_dm 0.1234 | ... | 812 ms` on each logging step, and the same values
      as a JSON line {"step", metrics..., "step_ms"} in OUTPUT_DIR/metrics.jsonl;
    - progress: a tqdm bar on a terminal; when stdout is a file or pipe (torchrun redirected,
      SLURM) plain `progress 120/1000 (12.0%) | 1.85 it/s | elapsed 1m05s | eta 7m55s` lines
      every `progress_every_steps` steps (0: every 5% of the run) or `progress_every_s` seconds,
      whichever comes first. progress="bar" / "lines" forces one;
    - report_to (see check_report_to): every metrics.jsonl value also as a scalar at its step in
      TensorBoard (OUTPUT_DIR/tensorboard/) and/or W&B (wandb.init(dir=OUTPUT_DIR), whose run id
      is kept in OUTPUT_DIR/wandb_run_id.txt so a resumed run continues the same W&B run); the
      config once (TensorBoard text `config` at the start step, W&B run config).

    Resume: built with start_step = the checkpoint's step, it sends nothing at steps <= start_step
    to TensorBoard or W&B again, and opens TensorBoard with purge_step=start_step + 1, so events
    that a crashed run wrote after the checkpoint are dropped by TensorBoard's readers (a fresh
    run, start_step 0, purges from step 0: an old run's curves in a reused OUTPUT_DIR go).
    metrics.jsonl is append-only: after a crash it keeps the lost steps' lines too (take the
    last line of each step)."""

    def __init__(self, output_dir: str, max_steps: int, start_step: int = 0, *, report_to: str = "",
                 config: dict | None = None, wandb_project: str = "", wandb_run_name: str = "",
                 progress: str = "auto", progress_every_steps: int = 0, progress_every_s: float = 30.0):
        if progress not in ("auto", "bar", "lines"):
            raise ConfigError(f"RunLogger progress={progress!r}: expected auto, bar or lines")
        backends = check_report_to(report_to)
        self.output_dir, self.max_steps, self.start_step = output_dir, max_steps, start_step
        self.is_main = rank() == 0
        self.bar, self.file, self.tb, self.wandb_run = None, None, None, None
        # steps the backends already hold from before the checkpoint are not sent again
        self._first_new_step = start_step + 1 if start_step > 0 else 0
        self._wandb_next_step = 0
        if self.is_main:
            os.makedirs(output_dir, exist_ok=True)
            self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
            if progress == "bar" or (progress == "auto" and _is_terminal(sys.stdout)):
                from tqdm import tqdm
                self.bar = tqdm(total=max_steps, initial=start_step, dynamic_ncols=True, file=sys.stdout)
            self._every_steps = progress_every_steps if progress_every_steps > 0 else max(1, max_steps // 20)
            self._every_s = progress_every_s
            if "tensorboard" in backends:
                self._open_backend("tensorboard", self._open_tensorboard, config)
            if "wandb" in backends:
                self._open_backend("wandb", self._open_wandb, config, wandb_project, wandb_run_name)
            self._t0 = self._last_print_t = time.monotonic()
            self._last_print_step = start_step
        self._t = time.perf_counter()

    # backends (rank 0 only)

    def _open_backend(self, name: str, opener, *args) -> None:
        """A logger that cannot start (W&B not logged in, unwritable folder) is reported and left
        out: it runs on rank 0 only, so an exception here would leave the other ranks waiting."""
        try:
            opener(*args)
        except Exception as e:  # noqa: BLE001 - logging must not end a training run
            print(f"warning: REPORT_TO={name}: could not start ({type(e).__name__}: {e}); "
                  "continuing without it (metrics.jsonl is still written)", file=sys.stderr, flush=True)

    def _open_tensorboard(self, config: dict | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        purge = self.start_step + 1 if self.start_step > 0 else 0
        self.tb = SummaryWriter(log_dir=os.path.join(self.output_dir, "tensorboard"), purge_step=purge,
                                flush_secs=30)
        if config:
            # four-space indent: a code block in TensorBoard's markdown text view
            text = "\n".join("  " + line for line in format_config(config).splitlines())
            self.tb.add_text("config", text, global_step=self.start_step)
            self.tb.flush()

    def _open_wandb(self, config: dict | None, project: str, run_name: str) -> None:
        import wandb
        run_id = self._wandb_run_id()
        name = run_name or os.path.basename(os.path.normpath(os.path.abspath(self.output_dir)))
        self.wandb_run = wandb.init(project=project or None, name=name, dir=self.output_dir,
                                    config=dict(config or {}), resume="allow", id=run_id)
        # a resumed W&B run already has the steps it logged before the crash; W&B would drop
        # (and warn about) anything logged below its step counter
        self._wandb_next_step = int(getattr(self.wandb_run, "step", 0) or 0)

    def _wandb_run_id(self) -> str:
        """The W&B run id for this OUTPUT_DIR: a resumed run (start_step > 0) reuses the stored one,
        a fresh run makes a new one and stores it."""
        import uuid
        path = os.path.join(self.output_dir, WANDB_RUN_ID_FILE)
        if self.start_step > 0 and os.path.isfile(path):
            with open(path) as f:
                stored = f.read().strip()
            if stored:
                return stored
        run_id = uuid.uuid4().hex[:16]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(run_id + "\n")
        os.replace(tmp, path)
        return run_id

    def _to_backends(self, step: int, values: dict) -> None:
        if step < self._first_new_step:
            return
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, global_step=step)
            self.tb.flush()
        if self.wandb_run is not None and step >= self._wandb_next_step:
            self.wandb_run.log(dict(values), step=step)

    # what the scripts call

    @contextlib.contextmanager
    def paused(self):
        """Work inside (a validation pass) is not counted in the step's step_ms."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._t += time.perf_counter() - start

    def step_done(self, step: int, metrics: dict | None) -> None:
        """Advance the progress; if metrics were given (a logging step), write the line, the JSONL
        record and the backends' scalars."""
        now = time.perf_counter()
        ms, self._t = (now - self._t) * 1000, now
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.update(1)
        if metrics is not None:
            record = {"step": step, **{k: float(v) for k, v in metrics.items()}, "step_ms": round(ms, 1)}
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            parts = [f"step {step:05d}/{self.max_steps}"] + [f"{k} {v:.4g}" for k, v in metrics.items()]
            self._write_line(" | ".join(parts + [f"{ms:.0f} ms"]))
            self._to_backends(step, {k: v for k, v in record.items() if k != "step"})
        if self.bar is None:
            self._maybe_progress(step)

    def log_scalars(self, step: int, values: dict) -> None:
        """Out-of-band values (e.g. evaluation results) at `step`: a {"step", values...} line in
        metrics.jsonl and scalars in the backends. Nothing is printed. Ignored for steps that a
        resumed run already logged (<= start_step)."""
        if not self.is_main or step < self._first_new_step:
            return
        record = {"step": step, **{k: float(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self._to_backends(step, {k: v for k, v in record.items() if k != "step"})

    def log_images(self, step: int, tag: str, path: str) -> None:
        """A saved image (e.g. the sample grid PNG) as image `tag` at `step` in the backends; an
        unreadable file is a warning, not an error."""
        if not self.is_main or step < self._first_new_step or (self.tb is None and self.wandb_run is None):
            return
        try:
            if self.tb is not None:
                import numpy as np
                from PIL import Image
                with Image.open(path) as im:
                    pixels = np.asarray(im.convert("RGB"), dtype=np.uint8)
                self.tb.add_image(tag, pixels, global_step=step, dataformats="HWC")
                self.tb.flush()
            if self.wandb_run is not None and step >= self._wandb_next_step:
                import wandb
                self.wandb_run.log({tag: wandb.Image(path)}, step=step)
        except OSError as e:
            print(f"warning: could not log image {path}: {e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the bar and metrics.jsonl, flush and close TensorBoard, finish the W&B run."""
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    # printing

    def _write_line(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def _maybe_progress(self, step: int) -> None:
        now = time.monotonic()
        if not (step >= self.max_steps or step - self._last_print_step >= self._every_steps
                or now - self._last_print_t >= self._every_s):
            return
        self._last_print_t, self._last_print_step = now, step
        elapsed = now - self._t0
        rate = (step - self.start_step) / elapsed if elapsed > 0 else 0.0
        eta = _format_duration((self.max_steps - step) / rate) if rate > 0 else "?"
        pct = 100.0 * step / self.max_steps if self.max_steps else 100.0
        print(f"progress {step}/{self.max_steps} ({pct:.1f}%) | {_format_rate(rate)} | "
              f"elapsed {_format_duration(elapsed)} | eta {eta}", flush=True)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def is_finite(*values):
    """Whether every value (floats, or 0-d tensors such as losses and grad norms) is finite: a 0-d
    bool tensor where tensors are given, computed where they live, so no host sync (agree reads it
    together with the other flags of the step)."""
    tensors = [v.detach().to(torch.float64).reshape(()) for v in values if torch.is_tensor(v)]
    plain = all(math.isfinite(float(v)) for v in values if not torch.is_tensor(v))
    if not tensors:
        return plain
    device = tensors[0].device
    return torch.stack([t.to(device) for t in tensors]).isfinite().all() & plain


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient norm is non-finite on any rank: every rank records
    the same agreed outcome (agree(is_finite(...)), one collective), so no rank steps alone.
    Counts skipped steps (`skipped_steps` in metrics and checkpoints); `exhausted` after
    `max_in_a_row` bad steps in a row, when the script saves and stops with RunError."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.skipped, self.in_a_row = max_in_a_row, 0, 0

    def record(self, good: bool) -> bool:
        """Count a step whose finiteness all ranks agreed on (agree); returns `good`."""
        if good:
            self.in_a_row = 0
        else:
            self.skipped += 1
            self.in_a_row += 1
        return good

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def state(self) -> dict:
        return {"skipped_steps": self.skipped, "bad_steps_in_a_row": self.in_a_row}

    def load(self, meta: dict) -> None:
        self.skipped, self.in_a_row = int(meta.get("skipped_steps", 0)), int(meta.get("bad_steps_in_a_row", 0))

    def error(self, step: int) -> RunError:
        return RunError(f"{self.in_a_row} non-finite steps in a row (MAX_BAD_STEPS={self.max_in_a_row}) at step "
                        f"{step}; checkpoint saved. Lower the LR or check the data, then --resume=auto")

def warmup_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: float,
                     first_step: int = 1) -> torch.optim.lr_scheduler.LambdaLR:
    """Constant LR after a linear warmup over `warmup_steps` scheduler steps: the factor of the base
    LR at scheduler step i (0-based) is min(1, (i + first_step) / warmup_steps), 1 when
    warmup_steps = 0. first_step=1: the first update already at LR / warmup_steps; first_step=0:
    the first at LR 0, as diffusers' constant_with_warmup and so the official DMD2 code count
    (train_dmd.make_optimizer says why its warmup may be fractional)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(warmup_steps, first_step))


class _Warmup:
    def __init__(self, steps: float, first_step: int):
        self.steps, self.first_step = steps, first_step

    def __call__(self, step: int) -> float:
        return min(1.0, (step + self.first_step) / self.steps) if self.steps > 0 else 1.0
