"""Run a training script in this process (python SCRIPT.py args...) counting the tensor-to-host
reads (.item(), .tolist(), float(), int(), bool()) that the training code makes on tensors: each
one is a GPU->CPU sync on CUDA. Data-order code (CPU tensors by design) is not counted. Prints
`SYNCS <json>` at exit. Used by tests/test_trainer.py."""
import atexit
import collections
import json
import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.host_work import project_read  # noqa: E402 - the root made importable first

counts = collections.Counter()


def counted(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if project_read(caller, ROOT):
            counts[f"{os.path.relpath(caller.co_filename, ROOT)}:{caller.co_name}"] += 1
        return original(self, *args, **kwargs)
    setattr(torch.Tensor, name, read)


for method in ("item", "tolist", "__float__", "__int__", "__bool__"):
    counted(method)
atexit.register(lambda: print("SYNCS " + json.dumps(dict(counts)), flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
