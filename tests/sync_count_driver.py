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
DATA_CODE = {"load_pairs", "micro_batches", "draw_sample_noise", "step_flips", "step_indices",
             "bucket_schedule", "choose_step_index"}
counts = collections.Counter()


def counted(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        path = caller.co_filename
        if path.startswith(ROOT) and os.sep + ".venv" + os.sep not in path and os.sep + "tests" + os.sep not in path \
                and not path.startswith(os.path.join(ROOT, "data") + os.sep) \
                and caller.co_name not in DATA_CODE:
            counts[f"{os.path.relpath(path, ROOT)}:{caller.co_name}"] += 1
        return original(self, *args, **kwargs)
    setattr(torch.Tensor, name, read)


for method in ("item", "tolist", "__float__", "__int__", "__bool__"):
    counted(method)
atexit.register(lambda: print("SYNCS " + json.dumps(dict(counts)), flush=True))
sys.argv = sys.argv[1:]
sys.path.insert(0, ROOT)
runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
