"""How a run ends and stops: the errors that end it in one line with their own exit codes
(run_main), the traceback files of a local failure, and the stop on SIGTERM / SIGINT.

    python -m pytest tests/test_components.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch.distributed as dist

from core.dist import rank

# each kind ends the run in one line with its own exit code (see run_main)

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


CONFIG_ERROR_GRACE_S = 10.0  # how long a rank other than 0 waits for rank 0 to print a shared ConfigError


def run_main(main_fn) -> None:
    """Run a script's main(): errors end the process with one clear line and a non-zero code.

    A ConfigError is the same on every rank, so only rank 0 prints it and all exit 2 (the other ranks
    wait CONFIG_ERROR_GRACE_S first, so a launcher that stops the rest when one rank exits cannot stop
    rank 0 before its line; a rank still there then prints its own, an error rank 0 did not hit). Any other
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
        else:  # give rank 0 time to print it before a launcher stops this rank (a launcher stops the
            # others as soon as one rank exits: let its SIGTERM end this one, past any stop handler);
            # still here afterwards, the error was this rank's own
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(CONFIG_ERROR_GRACE_S)
            print(f"[rank {rank()}] error: {e}", file=sys.stderr, flush=True)
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
    `signalled()` (inside the step's one collective, components.trainer.apply_updates), so all ranks
    finish the same step, save together and exit. A second signal exits at once, except a SIGTERM
    within `duplicate_window_s` of a first SIGTERM: that is the same stop delivered twice (SLURM
    signals every process of the job
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
