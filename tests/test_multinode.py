"""Two nodes on one machine: two torchrun agents (--nnodes=2, one rank each, one rendezvous on
localhost), each started by run_fsdp.sh as on a node of a cluster (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT, NPROC), against the 2-rank single-agent runs of the other tests' settings.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_multinode.py -q

  kontext      train_flux_kontext.py on two nodes, CACHE_LATENTS on and its own TEXT_CACHE_DIR
               outside OUTPUT_DIR (both caches filled by both nodes, each rank reading the other's
               files): metrics.jsonl equals the 2-rank run's, timings aside
  dmd_cut      train_dmd.py (the embedded default) on two nodes; SIGTERM to both torchrun agents, not
               to the ranks, as SLURM's --signal does, while the checkpoint's rename is held back
               FSDP_TEST_SAVE_DELAY_S seconds and torchrun's own fallback wait is shorter than that
               (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1, standing in for its default 30 s against a longer
               save): run_fsdp.sh's SHUTDOWN_TIMEOUT lets the ranks finish the step, save and exit
  dmd_resumed  the two nodes resumed from that checkpoint to MAX_STEPS: its checkpoint and its
               losses (both segments) equal the uninterrupted 2-rank run's
Each node runs on its own half of the CPUs, so its rank's threads (launch.cpu_threads: the CPUs a
rank may use over its node's ranks) are those of a rank of the 2-rank references, which are forked
from the launch server (tests/conftest.py) and train beside the two-node runs.
test_a_save_longer_than_the_shutdown_timeout_is_killed shows the other side with a stand-in rank
that takes 4 s to "save": SHUTDOWN_TIMEOUT=1 kills it mid-save.
"""
from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import (ROOT, Background, assert_dmd_resumed_bit_exact, complete_steps, dmd_run, finish, free_port,
                            kontext_run, launch_env, read_metrics, start)

# the DMD runs: the embedded default with GAN and EMA (as tests/test_train_dmd.py), no samples, a
# checkpoint only at the end or on a stop; the SIGTERM lands after step 2, with steps to spare
DMD_STEPS = 8
DMD = [f"--max_steps={DMD_STEPS}", "--log_every=1", "--dfake_gen_update_ratio=2", "--precision=fp32", "--use_gan=1",
       "--ema_decay=0.9", "--batch_size=1", "--seed=3", "--save_every=0", "--sample_every=0"]
SAVE_DELAY_S = 3  # the stop's checkpoint takes this much longer than its write: > torchrun's fallback wait (1 s)
TIMEOUT = 300


def node_cpus(node_rank: int) -> set[int]:
    """Node `node_rank`'s own half of the CPUs this process may use: its one rank gets as many threads as
    each of a 2-rank run's ranks, which share them all (the thread count changes the DMD losses' last bits)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return set(cpus[node_rank * half:(node_rank + 1) * half]) or set(cpus)


def start_node(script, args, node_rank: int, port: int, env: dict, **extra) -> subprocess.Popen:
    """`bash run_fsdp.sh script args` as node `node_rank` of 2, one rank on it, on the node's own
    CPUs, the rendezvous on localhost:port; the process is torchrun itself (run_fsdp.sh execs it),
    in a session of its own."""
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}  # not the test's own allocation
    env.update(NNODES="2", NODE_RANK=str(node_rank), NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), **extra)
    # pinned by a python that execs bash (not preexec_fn: unsafe beside the stand-ins' thread)
    pin = f"import os, sys; os.sched_setaffinity(0, {sorted(node_cpus(node_rank))}); os.execvp('bash', sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", pin, "bash", os.path.join(ROOT, "run_fsdp.sh"), script,
                             *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def start_nodes(script, args, env: dict, **extra) -> list[subprocess.Popen]:
    port = free_port()
    return [start_node(script, args, n, port, env, **extra) for n in (0, 1)]


def finish_all(procs: dict) -> dict:
    """{name: (exit code, output)}, each waited for as conftest.finish does (killed past TIMEOUT)."""
    return {name: finish(proc, TIMEOUT) for name, proc in procs.items()}


def logged_steps(out) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kontext_setup, stand_ins):
    """All runs side by side: the two-node Kontext run, the two-node DMD run stopped by SIGTERM,
    the two references, the stand-in ranks (stand_ins); the DMD nodes resumed as soon as they stopped."""
    root = tmp_path_factory.mktemp("multinode")
    env = launch_env()
    kontext_args = ["--cache_latents=1"]
    procs = {}
    try:
        nodes = start_nodes("train_dmd.py", DMD + [f"--output_dir={root / 'dmd'}"], env,
                            FSDP_TEST_SAVE_DELAY_S=str(SAVE_DELAY_S), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
        procs.update(dmd0=nodes[0], dmd1=nodes[1])
        nodes = start_nodes("train_flux_kontext.py",
                            kontext_run(kontext_setup, root / "kontext", kontext_args)["args"]
                            + [f"--text_cache_dir={root / 'kontext_text_cache'}"], kontext_setup["env"])
        procs.update(kontext0=nodes[0], kontext1=nodes[1])
        procs["dmd_ref"] = start(**dmd_run(DMD, env, root / "dmd_ref"))
        procs["kontext_ref"] = start(**kontext_run(kontext_setup, root / "kontext_ref", kontext_args))
        stand_ins[1].start()
        deadline = time.monotonic() + TIMEOUT
        while logged_steps(root / "dmd") < 2 and procs["dmd0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        for name in ("dmd0", "dmd1"):  # the agents, as SLURM's --signal reaches them
            os.kill(procs[name].pid, signal.SIGTERM)
        signalled = time.monotonic()
        done = finish_all({name: procs[name] for name in ("dmd0", "dmd1")})
        done["dmd_stop_s"] = time.monotonic() - signalled  # until both agents were gone
        done["dmd_cut_steps"] = complete_steps(root / "dmd")
        done["dmd_partials"] = glob.glob(os.path.join(root, "dmd", "checkpoints", "*.partial"))
        nodes = start_nodes("train_dmd.py", DMD + [f"--output_dir={root / 'dmd'}", "--resume=auto"], env)
        procs.update(resumed0=nodes[0], resumed1=nodes[1])  # while the others still run
        done.update(finish_all({name: proc for name, proc in procs.items() if name not in done}))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return root, done


@pytest.mark.slow
def test_kontext_on_two_nodes_equals_two_ranks_on_one(runs):
    root, done = runs
    for name in ("kontext0", "kontext1", "kontext_ref"):
        assert done[name][0] == 0, f"{name}:\n{done[name][1][-3000:]}"
    for node in (0, 1):
        assert f"--nnodes=2 --node_rank={node} --master_addr=127.0.0.1" in done[f"kontext{node}"][1]
    log = done["kontext0"][1]
    assert "config (2 ranks" in log and "latent cache: " in log and "computed 0," not in log, log[-3000:]
    ref, two = read_metrics(root / "kontext_ref", timing=False), read_metrics(root / "kontext", timing=False)
    assert len(two) >= 3 and two == ref


@pytest.mark.slow
def test_sigterm_to_the_agents_waits_for_the_save(runs):
    """The ranks heard the agents' SIGTERM, finished the step, saved (the save held back longer than
    torchrun's fallback wait) and exited 143; no rank was killed, no save left half-done."""
    _, done = runs
    steps, log = done["dmd_cut_steps"], done["dmd0"][1]
    assert len(steps) == 1 and 2 <= steps[0] < DMD_STEPS, log[-3000:]
    assert not done["dmd_partials"], done["dmd_partials"]
    assert f"stopped: checkpoint saved at step {steps[0]}; rerun with --resume=auto" in log, log[-3000:]
    for name in ("dmd0", "dmd1"):
        rc, out = done[name]
        assert rc != 0 and "Received 15 death signal, shutting down workers" in out, out[-3000:]
        assert "forcefully exiting" not in out and "launcher (pid" not in out, out[-3000:]
        assert "--shutdown_timeout=270" in out
    assert done["dmd_stop_s"] >= SAVE_DELAY_S


@pytest.mark.slow
def test_the_two_nodes_resume_and_end_as_an_uninterrupted_run(runs):
    root, done = runs
    for name in ("resumed0", "resumed1", "dmd_ref"):
        assert done[name][0] == 0, f"{name}:\n{done[name][1][-3000:]}"
    step = done["dmd_cut_steps"][0]
    assert f"step_{step:06d} (step {step})" in done["resumed0"][1]
    assert_dmd_resumed_bit_exact(root / "dmd_ref", root / "dmd", step=DMD_STEPS)
    assert len(read_metrics(root / "dmd")) == DMD_STEPS  # both segments: each step logged once


# ----------------------------------------------------------------------------------------------
# run_fsdp.sh's SHUTDOWN_TIMEOUT: torchrun's wait for the ranks after a signal

STAND_IN_RANK = """
import os, signal, sys, time
out = sys.argv[1]
def stop(signum, frame):  # what a rank does on SIGTERM: finish, save (4 s here), exit 143
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(4)
    open(os.path.join(out, "saved"), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "ready"), "w").close()
time.sleep(120)
"""


def signal_stand_ins(folder) -> dict:
    """The stand-in rank under run_fsdp.sh twice, SHUTDOWN_TIMEOUT=1 ("short") and the default with
    torchrun's own fallback at 1 s ("default"), each SIGTERMed once ready: {case: (exit code, output)}."""
    script = folder / "rank.py"
    script.write_text(STAND_IN_RANK)
    env = {k: v for k, v in launch_env().items() if k not in ("SHUTDOWN_TIMEOUT", "NNODES") and "SLURM" not in k}
    env.update(NPROC="1", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    cases = {"short": dict(SHUTDOWN_TIMEOUT="1"), "default": dict(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")}
    procs = {}
    try:
        for name, extra in cases.items():
            os.makedirs(folder / name)
            procs[name] = subprocess.Popen(["bash", os.path.join(ROOT, "run_fsdp.sh"), str(script), str(folder / name)],
                                           cwd=ROOT, env={**env, **extra}, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while not all((folder / n / "ready").exists() for n in cases) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in procs.values():
            os.kill(proc.pid, signal.SIGTERM)
        return {name: finish(proc, 60) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """signal_stand_ins in the background: they mostly wait (a 4 s save, torchrun's timeouts), so
    `runs` starts them beside its own runs; the test waits for them (and starts them if need be)."""
    folder = tmp_path_factory.mktemp("stand_ins")
    background = Background(signal_stand_ins, folder)
    yield folder, background
    background.join()  # none left running past the module, whatever failed


@pytest.mark.slow
def test_a_save_longer_than_the_shutdown_timeout_is_killed(stand_ins):
    """SIGTERM to torchrun: it passes it on, waits SHUTDOWN_TIMEOUT for the rank, then SIGKILLs it.
    1 s against a 4 s save: killed mid-save; run_fsdp.sh's default with torchrun's own fallback at
    1 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): the save ends, as SHUTDOWN_TIMEOUT is passed explicitly."""
    folder, background = stand_ins
    done = background.result()
    assert "--shutdown_timeout=1 " in done["short"][1] and "forcefully exiting" in done["short"][1]
    assert not (folder / "short" / "saved").exists()
    assert "--shutdown_timeout=270 " in done["default"][1] and "forcefully exiting" not in done["default"][1]
    assert (folder / "default" / "saved").exists(), done["default"][1][-3000:]


def dry_run(**env) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if "SLURM" not in k and k != "SHUTDOWN_TIMEOUT"},
           "DRY_RUN": "1", "NPROC": "1", **env}
    return subprocess.run(["bash", "run_fsdp.sh", "train_dmd.py"], cwd=ROOT, env=env, capture_output=True, text=True)


def test_run_fsdp_passes_the_shutdown_timeout_within_the_sbatch_signal_lead():
    """torchrun gets --shutdown_timeout from SHUTDOWN_TIMEOUT (default shorter than the sbatch's
    --signal lead time, so the save ends before SLURM's limit); a bad value fails in one line."""
    assert "--shutdown_timeout=270 " in dry_run().stdout
    assert "--shutdown_timeout=40 " in dry_run(SHUTDOWN_TIMEOUT="40").stdout
    bad = dry_run(SHUTDOWN_TIMEOUT="4m")
    assert bad.returncode == 2 and bad.stderr.strip() == "run_fsdp.sh: SHUTDOWN_TIMEOUT=4m: expected whole seconds"
    sbatch = open(os.path.join(ROOT, "recipes", "slurm_example.sbatch")).read()
    lead = int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", sbatch, re.M).group(1))
    default = int(re.search(r"SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}", open(os.path.join(ROOT, "run_fsdp.sh"))
                            .read()).group(1))
    assert default < lead and "SHUTDOWN_TIMEOUT" in sbatch
