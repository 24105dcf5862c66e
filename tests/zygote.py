"""The test suite's fast launcher: one process that has imported torch, diffusers, transformers and
peft once, and forks each launch's ranks from that state (test machinery only; users run torchrun).

Why: on the 2-core machines the suite runs on, a 2-rank torchrun of a tiny model spends most of its
time starting up (the launcher and each rank import torch, then the rank imports diffusers and
transformers: ~10 s of CPU per launch), not training. A forked rank starts with those imports done.

What a launch gets is what torchrun gives its workers, minus the elastic agent: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=localhost and MASTER_PORT (rank 0 hosts the store), the
script run as __main__ with its arguments in sys.argv, unbuffered output (`python -u`), fresh random
seeds; one rank runs as plain `python script.py` (no rank variables). When a rank fails, the others
get SIGTERM (then SIGKILL after 30 s) and the launch exits 1, as torchrun does; one rank's exit code
is its own.

Protocol (AF_UNIX SOCK_SEQPACKET at argv[1]): a client sends one JSON request
{"script", "args", "ranks", "env", "cwd"} with the write end of its output pipe attached; the server
forks a launcher in a session of its own (killpg of its pid stops every rank) which answers
{"pid": ...}, runs the ranks with their stdout and stderr on the pipe, then answers {"rc": ...}.
The server prints "ready" once listening and exits when its parent (pytest) is gone.

Only third-party libraries are imported here, never the project's modules, so each launch reads its
own environment and code. tests/conftest.py starts this lazily, falls back to torchrun when it is
unusable or a launch's environment differs in what these imports read (TORCH*, OMP*, HF_*, ...),
and FSDP_TESTS_TORCHRUN=1 sends every launch through torchrun.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback

PRELOAD = ("numpy", "PIL.Image", "tqdm", "safetensors.torch", "torch", "torch.distributed", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "torch.distributed.tensor",
           "torch.nn.parallel", "torch.utils.data", "diffusers", "transformers", "peft")
# names whose first touch imports diffusers' / transformers' lazily loaded modules the scripts use
PRELOAD_ATTRS = {
    "diffusers": (
        "UNet2DConditionModel",
        "AutoencoderKL",
        "FluxTransformer2DModel",
        "DDPMScheduler",
        "DDIMScheduler",
        "EulerDiscreteScheduler",
        "FlowMatchEulerDiscreteScheduler",
        "StableDiffusionPipeline",
        "StableDiffusionXLPipeline",
        "FluxKontextPipeline",
    ),
    "transformers": (
        "CLIPTextModel",
        "CLIPTextModelWithProjection",
        "CLIPTokenizer",
        "T5EncoderModel",
        "T5TokenizerFast",
    ),
}
GRACE_S = 30  # after a rank fails, how long the others get between SIGTERM and SIGKILL (torchrun's default)


def preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            module = importlib.import_module(name)
        except Exception:  # an optional library missing: its users import it themselves
            continue
        for attr in PRELOAD_ATTRS.get(name, ()):
            try:
                getattr(module, attr)
            except Exception:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(script: str, args: list[str]) -> None:
    """In a forked rank: run `script` as __main__ and leave with its exit code (never returns)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):  # python -u: every write reaches the pipe at once
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True, line_buffering=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import numpy as np
    import torch
    torch.seed()  # a fresh process's seeds are its own, not the server's
    np.random.seed()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # as the interpreter exits: None is 0, an int itself, anything else printed and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launcher(conn: socket.socket, request: dict, out_fd: int) -> None:
    """In the forked launcher: start the ranks, wait for them as torchrun does, answer the exit code."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    conn.send(json.dumps({"pid": os.getpid()}).encode())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    ranks = request["ranks"]
    if ranks > 1:
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks),
                          LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(ranks))
    children = {}
    for r in range(ranks):
        pid = os.fork()
        if pid == 0:
            conn.close()
            if ranks > 1:
                os.environ.update(RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0")
            run_rank(request["script"], request["args"])
        children[pid] = r
    codes, kill_at = {}, None
    while len(codes) < ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for p in children:
                    if children[p] not in codes:
                        _signal(p, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.01)
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[children[pid]] = code
        if code != 0 and kill_at is None and ranks > 1:
            os.write(2, f"launcher: rank {children[pid]} exited with {code}; stopping the others\n".encode())
            for p, r in children.items():
                if r not in codes:
                    _signal(p, signal.SIGTERM)
            kill_at = time.monotonic() + GRACE_S
    if ranks == 1:
        rc = codes[0]
    else:
        rc = 0 if all(c == 0 for c in codes.values()) else 1
    os.close(1)
    os.close(2)
    conn.send(json.dumps({"rc": rc}).encode())
    os._exit(0)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    parent = os.getppid()
    preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # forking a threaded process is unsafe: let the client use torchrun
        print(f"not forking: {threads} threads after the imports", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap finished launchers
                pass
        except ChildProcessError:
            pass
        if not select.select([listener], [], [], 0.2)[0]:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
        if os.fork() == 0:
            try:
                listener.close()
                launcher(conn, json.loads(message), fds[0])
            finally:  # never back into this loop
                os._exit(1)
        conn.close()
        os.close(fds[0])


if __name__ == "__main__":
    serve(sys.argv[1])
