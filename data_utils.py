"""Data for both training scripts: which samples and which random numbers a step uses (pure
functions of SEED and the step, so any world size and a resume see the same), data files checked
row by row before any work, one image loader, PNG grids, and folders built once under a lock
(the tiny test models and the demos' task data).

    python -m pytest tests/test_data_utils.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import json
import math
import os

import torch

from run_utils import ConfigError

# ----------------------------------------------------------------------------------------------
# data order and randomness: functions of (seed, step), identical on every rank

def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, stream): randomness for the *global* batch of a
    step, identical on every rank and after a resume, whatever the world size."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 9_176 + stream * 7_919) % (2**63 - 1))
    return g


def sample_generator(seed: int, step: int, index: int, device, stream: int = 0) -> torch.Generator:
    """A generator on `device` seeded from (seed, step, index, stream): the randomness of sample
    `index` of the step's global batch. A rank draws only its own samples' numbers, on the run's
    device, and they do not depend on which rank holds the sample, the world size or GRAD_ACCUM.
    (The seed is a 64-bit hash of the four numbers, so no two samples or steps share a stream.)"""
    import hashlib
    key = hashlib.blake2b(f"{seed},{step},{index},{stream}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(key, "little") >> 1)
    return g


def per_sample_draws(seed: int, step: int, indices, device, draw, stream: int = 0) -> dict[str, torch.Tensor]:
    """`draw(generator)` -> {name: tensor of one sample} for each global sample index in
    `indices` (this rank's), stacked along a new dim 0: what a rank needs of the step's randomness,
    nothing more (every tensor made on `device` by its own generator; no host copy)."""
    parts = [draw(sample_generator(seed, step, i, device, stream)) for i in indices]
    return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}


def global_batch_indices(step: int, global_batch: int, n: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of `step`: epochs of seeded permutations laid end to
    end, so the data position is just the step (resumable on any world size)."""
    out, pos = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=step_generator(seed, epoch, stream=99)).tolist()
        take = perm[offset:offset + global_batch - len(out)]
        out += take
        pos += len(take)
    return out


def rank_slice(items, rank_: int, world: int):
    """This rank's contiguous share of a global batch (list or tensor along dim 0)."""
    per = len(items) // world
    return items[rank_ * per:(rank_ + 1) * per]


# ----------------------------------------------------------------------------------------------
# data files: validated up front, identically on every rank

def load_records(path: str, required: tuple[str, ...], image_keys: tuple[str, ...] = (),
                 skip_bad: bool = False, check_images: bool = True) -> tuple[list[dict], int]:
    """Rows of a `.jsonl` (or prompts of a `.txt`, one a line) with image paths made absolute
    (relative to the file). A bad row -> ConfigError naming file and line, or with skip_bad it is
    dropped and counted. Every rank reads the whole file, so all ranks agree on errors and length."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"DATA_PATH={path!r}: no such file")
    base, rows, skipped = os.path.dirname(os.path.abspath(path)), [], 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _parse_row(path, line, required, image_keys, base, check_images)
        except ValueError as e:
            if not skip_bad:
                raise ConfigError(f"{path}:{lineno}: {e}") from None
            skipped += 1
            continue
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no usable samples ({skipped} skipped)")
    return rows, skipped


def _parse_row(path, line, required, image_keys, base, check_images) -> dict:
    if path.endswith(".txt"):
        return {"prompt": line.strip()}
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    for key in required:
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"missing or empty {key!r}")
    for key in image_keys:
        full = os.path.join(base, row[key])
        if check_images:
            _check_image(full)
        row[key] = full
    return row


def _check_image(path: str) -> None:
    from PIL import Image
    if not os.path.isfile(path):
        raise ValueError(f"image {path} not found")
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - any decoder failure means a corrupt file
        raise ValueError(f"image {path} is unreadable ({type(e).__name__})") from None



# ----------------------------------------------------------------------------------------------
# the next step's data, prepared while this step runs

class Prefetcher:
    """`load(step)` (host work: decoding and resizing images, reading cached embeddings) run on a
    background thread one step ahead: `get(step)` returns step's data, moved to `device` with
    non-blocking copies (from pinned memory on CUDA), and starts loading step + 1 (up to
    `last_step`), so the host prepares step N + 1 while the device runs step N. Also returns the
    seconds `get` waited for the data (the step's data wait). `load` is a pure function of the
    step, so what a step sees does not depend on timing. An exception in `load` is raised by the
    `get` of its step."""

    def __init__(self, load, last_step: int, device: torch.device):
        from concurrent.futures import ThreadPoolExecutor
        self.load, self.last_step, self.device = load, last_step, device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: dict = {}

    def _host(self, step: int):
        data = self.load(step)
        return _map_tensors(data, torch.Tensor.pin_memory) if self.device.type == "cuda" else data

    def _start(self, step: int) -> None:
        if step <= self.last_step and step not in self.pending:
            self.pending[step] = self.pool.submit(self._host, step)

    def get(self, step: int):
        import time
        self._start(step)
        t0 = time.perf_counter()
        data = self.pending.pop(step).result()
        waited = time.perf_counter() - t0
        self._start(step + 1)
        return _map_tensors(data, lambda t: t.to(self.device, non_blocking=True)), waited

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _map_tensors(obj, fn):
    """fn applied to every tensor in nested lists, tuples and dicts (other leaves kept)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


# ----------------------------------------------------------------------------------------------
# images

def load_image(path: str, height: int, width: int) -> torch.Tensor:
    """(3, height, width) in [-1, 1]: resized (Lanczos) to cover the size, then centre-cropped.
    An image already of that size is returned unchanged (PIL's resize to the same size copies)."""
    import numpy as np
    from PIL import Image
    with Image.open(path) as im:
        im = im.convert("RGB")
        scale = max(height / im.height, width / im.width)
        rw, rh = max(width, math.ceil(im.width * scale)), max(height, math.ceil(im.height * scale))
        im = im.resize((rw, rh), Image.Resampling.LANCZOS)
        left, top = (rw - width) // 2, (rh - height) // 2
        im = im.crop((left, top, left + width, top + height))
        x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)
    return x.float() / 127.5 - 1.0


def save_image_grid(images: torch.Tensor, path: str, nrow: int) -> None:
    """(N,3,H,W) in [-1,1] -> one PNG grid with `nrow` images per row."""
    import numpy as np
    from PIL import Image
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    n, c, h, w = images.shape
    rows = math.ceil(n / nrow)
    grid = torch.zeros(c, rows * h, nrow * w, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, r * h:(r + 1) * h, col * w:(col + 1) * w] = images[i]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid.permute(1, 2, 0).numpy())).save(path)


# ----------------------------------------------------------------------------------------------
# folders built once: by one process, under a lock, published by an atomic rename

READY = "READY"  # written last inside the temp folder; a folder without it is never used


def build_once(final_folder, builder, timeout: float = 600.0, ready_text: str = "ready\n"):
    """Make `final_folder` exist, complete, built exactly once however many processes ask.

    Unless it already holds the READY marker: take an exclusive lock on `<final_folder>.lock`
    (polled; TimeoutError after `timeout` seconds), check again, call `builder(tmp)` on a new
    empty temp folder beside it, write READY (`ready_text`) into it last and rename it to
    `final_folder` (atomic), so that a reader never sees a half-built folder. The temp folder is
    removed if the builder fails. A `final_folder` that exists without the marker was not made
    here: RuntimeError (delete it and rerun). Returns `final_folder` as a Path."""
    import shutil
    import uuid
    from pathlib import Path

    final = Path(final_folder)
    if (final / READY).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(final.with_name(final.name + ".lock"), timeout):
        if (final / READY).exists():
            return final
        if final.exists():
            raise RuntimeError(f"{final} exists but has no {READY} marker; delete it and rerun")
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            builder(tmp)
            (tmp / READY).write_text(ready_text)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class _FileLock:
    """Exclusive flock on `path` (created if missing), polled every 0.2 s so that a stuck holder
    raises TimeoutError after `timeout` seconds instead of hanging."""

    def __init__(self, path, timeout: float):
        self.path, self.timeout, self.file = path, timeout, None

    def __enter__(self):
        import fcntl
        import time
        self.file = open(self.path, "a")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.file.close()
                    raise TimeoutError(
                        f"waited {self.timeout:.0f}s for {self.path}; is a build stuck?") from None
                time.sleep(0.2)

    def __exit__(self, *exc):
        import fcntl
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        return False
