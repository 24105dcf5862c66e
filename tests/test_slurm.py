"""run_fsdp.sh inside a SLURM job: the torchrun command it builds (DRY_RUN=1) from the job's
variables, without scontrol (the node list is parsed in bash) and with it (a stand-in scontrol
earlier in PATH); outside SLURM nothing changes (tests/test_recipes.py). srun without torchrun:
the ranks slurm_rank_env derives from a task's SLURM variables, and (slow) two real
processes started as srun would, no torchrun.

    python -m pytest tests/test_slurm.py -q
"""
import os
import re
import shlex
import subprocess

import sys

import pytest

from core.launch import slurm_first_host, slurm_rank_env
from core.errors import ConfigError
from tests.conftest import ROOT, finish, free_port, launch_env


def clean_path() -> str:
    """PATH without any folder that holds an scontrol (none on a test machine, usually)."""
    dirs = os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.path.exists(os.path.join(d, "scontrol")))


def launch(path: str | None = None, **slurm) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("NNODES", "NODE_RANK", "NPROC", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DRY_RUN="1", PATH=path or clean_path(), **slurm)
    return subprocess.run(["bash", os.path.join(ROOT, "run_fsdp.sh"), "train_dmd.py", "--max_steps=10"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def torchrun(**slurm) -> list[str]:
    r = launch(**slurm)
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("+ torchrun"))
    return shlex.split(line[2:])


JOB = dict(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="node[03-04]",
           SLURM_GPUS_ON_NODE="8")


def test_two_node_job_gets_its_rendezvous_from_slurm():
    assert torchrun(**JOB) == ["torchrun", "--nnodes=2", "--node_rank=1", "--master_addr=node03",
                               "--master_port=29500", "--nproc_per_node=8", "--shutdown_timeout=270", "train_dmd.py",
                               "--max_steps=10"]


@pytest.mark.parametrize("nodelist,first", [("node[01-04,07]", "node01"), ("gpu-a1,gpu-a2", "gpu-a1"),
                                            ("node7,node9", "node7"), ("rack[2-3]-gpu[09-12],login1", "rack2-gpu09")])
def test_first_host_of_the_node_list(nodelist, first):
    assert f"--master_addr={first}" in torchrun(**{**JOB, "SLURM_JOB_NODELIST": nodelist})


def test_scontrol_is_used_when_present(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[03-04]" ] && printf "n-first\\nn-second\\n"\n')
    fake.chmod(0o755)
    assert "--master_addr=n-first" in torchrun(path=f"{tmp_path}{os.pathsep}{clean_path()}", **JOB)


def test_explicit_settings_win():
    cmd = torchrun(**JOB, MASTER_ADDR="10.0.0.1", MASTER_PORT="30000", NPROC="4")
    assert "--master_addr=10.0.0.1" in cmd and "--master_port=30000" in cmd and "--nproc_per_node=4" in cmd
    cmd = torchrun(**JOB, NNODES="1", NPROC="8")  # NNODES=1: this node alone
    assert "--standalone" in cmd and "--node_rank=1" not in cmd


def test_hand_settings_agree_with_the_allocation_or_stop():
    """NNODES set by hand (as the recipes' docs show) still takes this node's rank from SLURM_NODEID;
    an NNODES or NODE_RANK that contradicts the job stops in one line; outside SLURM a multi-node
    launch needs NODE_RANK (0 on every node would make every node the first)."""
    cmd = torchrun(**JOB, NNODES="2")
    assert "--nnodes=2" in cmd and "--node_rank=1" in cmd and "--master_addr=node03" in cmd
    for bad, culprit in (({"NNODES": "4"}, "NNODES=4 but this SLURM job has 2 node(s)"),
                         ({"NODE_RANK": "0"}, "NODE_RANK=0 but this is node 1 of the SLURM job")):
        r = launch(**JOB, **bad)
        assert r.returncode == 2 and culprit in r.stderr and "+ torchrun" not in r.stdout, r.stderr
    r = launch(NNODES="2", MASTER_ADDR="10.0.0.1", NPROC="8")
    assert r.returncode == 2 and "set NODE_RANK on each node" in r.stderr


def test_gpu_count_from_gpus_per_node():
    job = {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}
    assert "--nproc_per_node=4" in torchrun(**job, SLURM_GPUS_PER_NODE="h100:4")


def test_single_node_job_stays_standalone():
    cmd = torchrun(SLURM_JOB_ID="7", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="gpu12",
                   SLURM_GPUS_ON_NODE="4")
    assert cmd[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=4"]


def test_several_tasks_per_node_is_refused():
    r = launch(**JOB, SLURM_LOCALID="3")
    assert r.returncode == 2 and "run one task per node" in r.stderr and "+ torchrun" not in r.stdout


def test_example_sbatch_runs_one_launcher_per_node(tmp_path):
    """recipes/slurm_example.sbatch with a stand-in srun that runs its command once, as node 1
    would: the torchrun command is the two-node one, with settings train_dmd.py has."""
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    sbatch = os.path.join(ROOT, "recipes", "slurm_example.sbatch")
    text = open(sbatch).read()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --nodes=2" in text
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(JOB, DRY_RUN="1", SLURM_SUBMIT_DIR=ROOT, PATH=f"{tmp_path}{os.pathsep}{clean_path()}")
    r = subprocess.run(["bash", sbatch], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(next(line for line in r.stdout.splitlines() if line.startswith("+ torchrun"))[2:])
    assert cmd[:7] == ["torchrun", "--nnodes=2", "--node_rank=1", "--master_addr=node03", "--master_port=29500",
                       "--nproc_per_node=8", "--shutdown_timeout=270"] and cmd[7] == "train_dmd.py"
    assert cmd[8] == "--dp_replicate=2"  # HSDP: one replica per node
    srun_line = next(line for line in text.splitlines() if line.startswith("srun "))
    assert '--cpus-per-task="$SRUN_CPUS_PER_TASK"' in srun_line  # srun does not inherit it (Slurm >= 22.05)
    constants = set(re.findall(r"^([A-Z][A-Z0-9_]*) *(?::[^=]*)?= ", open(os.path.join(ROOT, "train_dmd.py")).read(),
                               re.M))
    for arg in cmd[8:]:
        assert arg.startswith("--") and arg[2:].split("=")[0].upper() in constants, arg


def test_context_parallel_group_spanning_nodes_is_warned():
    """A CP group should sit inside one node: with 6 GPUs per node, --context_parallel=4 warns
    (and still launches); 2 and 3 do not."""
    def run(cp):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(DRY_RUN="1", NPROC="6", NNODES="2", NODE_RANK="0", MASTER_ADDR="node01", PATH=clean_path())
        return subprocess.run(["bash", os.path.join(ROOT, "run_fsdp.sh"), "train_flux_kontext.py",
                               f"--context_parallel={cp}"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
    spanning = run(4)
    assert spanning.returncode == 0 and "--context_parallel=4 does not divide NPROC=6" in spanning.stderr
    assert "--context_parallel=4" in spanning.stdout
    for cp in (2, 3):
        assert "warning" not in run(cp).stderr


def test_multi_node_interface_and_hsdp_per_node():
    """SOCKET_IFNAME sets NCCL's and gloo's interface (unless they are set); HSDP_PER_NODE=1 (the
    recipes' default) adds one replica per node unless the arguments choose DP_REPLICATE."""
    r = launch(**JOB, SOCKET_IFNAME="ib0", HSDP_PER_NODE="1")
    assert r.returncode == 0, r.stderr
    assert "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0" in r.stderr
    assert "--dp_replicate=2" in r.stdout
    assert "--dp_replicate" not in launch(**JOB).stdout  # plain run_fsdp.sh: FSDP over all ranks
    one_node = launch(SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_GPUS_ON_NODE="8", HSDP_PER_NODE="1")
    assert "--dp_replicate" not in one_node.stdout and "network interface" not in one_node.stderr


# ----------------------------------------------------------------------------------------------
# srun without torchrun: one task per GPU, the ranks from SLURM's variables

TASK = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="13", SLURM_NTASKS="16", SLURM_LOCALID="5",
            SLURM_NODEID="1", SLURM_TASKS_PER_NODE="8(x2)", SLURM_JOB_NODELIST="gpu[07-08]")


def test_srun_task_gets_torchruns_variables(monkeypatch):
    monkeypatch.setenv("PATH", clean_path())
    assert slurm_rank_env(TASK) == dict(RANK="13", WORLD_SIZE="16", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8",
                                                   MASTER_ADDR="gpu07", MASTER_PORT="29500")
    uneven = slurm_rank_env({**TASK, "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3",
                                        "SLURM_NTASKS": "7", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"})
    assert (uneven["LOCAL_WORLD_SIZE"], uneven["MASTER_ADDR"], uneven["MASTER_PORT"]) == ("1", "10.0.0.1", "31000")
    step = {**TASK, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "c[3,5]"}
    assert slurm_rank_env(step) == dict(  # the step's own counts and nodes
        RANK="13", WORLD_SIZE="4", LOCAL_RANK="5", LOCAL_WORLD_SIZE="2", MASTER_ADDR="c3", MASTER_PORT="29500")
    per_node = {k: v for k, v in TASK.items() if k != "SLURM_TASKS_PER_NODE"}
    assert slurm_rank_env({**per_node, "SLURM_NTASKS_PER_NODE": "8"})["LOCAL_WORLD_SIZE"] == "8"
    assert slurm_rank_env({**per_node, "SLURM_NNODES": "4"})["LOCAL_WORLD_SIZE"] == "4"


def test_other_launches_are_left_alone():
    """torchrun set RANK; a batch script or salloc shell is no srun step; a one-task step running
    `python script.py` stays a world of one."""
    assert slurm_rank_env({**TASK, "RANK": "0"}) == {}
    assert slurm_rank_env({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}) == {}
    assert slurm_rank_env({**TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == {}
    assert slurm_rank_env({}) == {}


@pytest.mark.parametrize("nodelist,first", [("node[01-04,07]", "node01"), ("gpu-a1,gpu-a2", "gpu-a1"),
                                            ("node7,node9", "node7"), ("rack[2-3]-gpu[09-12],login1", "rack2-gpu09")])
def test_first_host_in_python_as_in_bash(nodelist, first):
    assert slurm_first_host(nodelist) == first


def test_scontrol_is_used_when_present_in_python(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "g-first\\ng-second\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{clean_path()}")
    assert slurm_rank_env(TASK)["MASTER_ADDR"] == "g-first"


def test_a_bad_task_count_is_one_line():
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE='2\\(x2\\)': no task count for node 5"):
        slurm_rank_env({**TASK, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "5"})


PROBE = """
import fsdp_utils
from core.dist import all_gather_objects
d = fsdp_utils.init_distributed(timeout_s=120)
print("probe", d.rank, d.world_size, d.local_rank, all_gather_objects(d.rank), flush=True)
fsdp_utils.cleanup_distributed()
"""


@pytest.mark.slow
def test_two_tasks_started_as_srun_would_form_one_world():
    """Two plain `python` processes with the variables srun gives its tasks (no torchrun, no RANK):
    one world of two, its rendezvous at the node list's first host."""
    port = str(free_port())
    procs = []
    for r in range(2):
        env = launch_env(**{**TASK, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
                            "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"},
                         MASTER_PORT=port, PATH=clean_path())
        env = {k: v for k, v in env.items() if k not in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}
        procs.append(subprocess.Popen([sys.executable, "-c", PROBE], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = [finish(p, timeout=180) for p in procs]
    for r, (rc, out) in enumerate(outs):
        assert rc == 0, out
        assert f"probe {r} 2 {r} [0, 1]" in out, out
    assert "srun: 2 tasks, 2 on this node, rendezvous at localhost:" in outs[0][1]
