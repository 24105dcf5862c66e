"""Folders built once: by one process, under a lock, published by an atomic rename (the tiny test
models and the demos' task data).

    python -m pytest tests/test_tiny_models.py -q
"""
from __future__ import annotations

import os

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
