"""The suite's fast launcher (tests/zygote.py) against torchrun: the same script, the same
arguments, what each rank sees and how the launch ends must not differ in anything the scripts
use, or the tests that go through it would test something users never run."""
from __future__ import annotations

import json
import textwrap

import pytest

from tests import conftest
from tests.conftest import ZygoteLaunch, finish, launch_env, start

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.distributed as dist
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "HF_HUB_OFFLINE", "PROBE_VALUE")
    seen = {k: os.environ.get(k) for k in keys}
    seen.update(argv=sys.argv[1:], script=os.path.basename(sys.argv[0]), name=__name__, cwd=os.getcwd(),
                path0=os.path.basename(sys.path[0]), seed=torch.initial_seed(), threads=torch.get_num_threads())
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        seen["sum"] = t.item()
        dist.destroy_process_group()
    sys.stdout.write("PROBE " + json.dumps(seen, sort_keys=True) + "\\n")  # one write: ranks share the pipe
    fail = os.environ.get("PROBE_FAIL_RANK")
    if fail is not None and os.environ.get("RANK", "0") == fail:
        sys.exit(int(os.environ.get("PROBE_CODE", "3")))
    if fail is not None:  # the others wait to be stopped, as a rank stuck in a collective would
        import time
        time.sleep(600)
''')


def start_probe(tmp_path, ranks, fast: bool, **env):
    """The probe launched by the fast launcher or by torchrun, not waited for: launches side by side
    (a torchrun launch leaves a core idle while its launcher imports, then while its ranks start)."""
    path = tmp_path / "probe.py"
    if not path.exists():  # written once: a launch may be reading it
        path.write_text(PROBE)
    proc = start(str(path), ["--a=1", "b c"], ranks=ranks, env=launch_env(**env), torchrun=not fast)
    assert isinstance(proc, ZygoteLaunch) == fast
    return proc


def finish_probe(proc):
    rc, out = finish(proc, timeout=120)
    lines = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("PROBE ")]
    return rc, sorted(lines, key=lambda r: int(r["RANK"] or 0)), out


@pytest.fixture(autouse=True)
def fast_launches_on(monkeypatch):
    """These tests compare the two launchers: the fast one on even under FSDP_TESTS_TORCHRUN=1."""
    monkeypatch.setenv("FSDP_TESTS_TORCHRUN", "0")


@pytest.mark.parametrize("ranks", [1, 2])
def test_ranks_see_what_torchrun_gives_them(tmp_path, ranks):
    procs = [start_probe(tmp_path, ranks, True, PROBE_VALUE="x"), start_probe(tmp_path, ranks, False, PROBE_VALUE="x"),
             start_probe(tmp_path, 2, True)]
    (rc_fast, fast, _), (rc_ref, ref, log), (_, seeds, _) = [finish_probe(proc) for proc in procs]  # side by side
    assert rc_fast == rc_ref == 0, log
    assert len(fast) == len(ref) == ranks
    for a, b in zip(fast, ref):
        assert a.pop("seed") and b.pop("seed")
        assert a == b
    assert len({r["seed"] for r in seeds}) == 2  # each rank its own fresh seed


def test_a_failing_rank_ends_the_launch_like_torchrun(tmp_path):
    """Rank 1 exits 3 while rank 0 sleeps: both launchers stop rank 0 and exit 1; one rank alone
    exits with its own code."""
    cases = {2: dict(PROBE_FAIL_RANK="1"), 1: dict(PROBE_FAIL_RANK="0", PROBE_CODE="2")}
    procs = {(fast, ranks): start_probe(tmp_path, ranks, fast, **env) for fast in (True, False)
             for ranks, env in cases.items()}
    done = {case: finish_probe(proc) for case, proc in procs.items()}  # all of them, before any assertion
    for (fast, ranks), (rc, lines, log) in done.items():
        if ranks == 2:
            assert rc == 1 and len(lines) == 2, (fast, log[-2000:])
        else:
            assert rc == 2, (fast, log[-2000:])


def test_import_time_environment_goes_through_torchrun():
    """A launch whose TORCH*/OMP*/HF_* variables differ from the server's runs through torchrun
    (the server's imports read them already); an in-process torch.compile, which writes its cache
    folder into os.environ, leaves later launches on the server."""
    import torch
    assert conftest._zygote(launch_env()) is not None
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))  # after the server started
    assert conftest._zygote(launch_env()) is not None
    assert conftest._zygote(launch_env(TORCH_LOGS="+dynamo")) is None
    assert conftest._zygote({**launch_env(), "OMP_NUM_THREADS": "2"}) is None
    assert conftest._zygote(launch_env(FSDP_DIFFUSION_CACHE="/elsewhere")) is not None
