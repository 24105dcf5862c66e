"""One rank of tests/conftest.run_ranks, run as a script by the launch server (tests/zygote.py):
argv[1] holds the pickled (fn, args); the rank brings the process group up, runs
fn(rank, world, *args) and leaves. A failure prints its traceback and exits 1, and the launcher
stops the other ranks (a rank left waiting in a collective would otherwise sit out the timeout)."""
from __future__ import annotations

import os
import pickle
import sys
import traceback


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        fn, args = pickle.load(f)
    import torch.distributed as dist
    import fsdp_utils
    try:
        d = fsdp_utils.init_distributed(timeout_s=120)
        fn(d.rank, d.world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        print(f"rank {os.environ.get('RANK', '0')}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    # leave without the interpreter's finalization, as conftest._entry does (gloo's threads may abort it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
