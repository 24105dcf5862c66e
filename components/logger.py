"""The step log: the log line, progress (a tqdm bar or plain lines), metrics.jsonl, and the
TensorBoard / W&B backends (REPORT_TO) with their resume.

    python -m pytest tests/test_components.py -q
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from components.config import format_config
from core.dist import rank
from core.errors import ConfigError

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
