"""Host-side work of a training step, measured on CPU: what a GPU step costs the host beyond the
trained models' own kernels.

    python tools/host_work.py train_flux_kontext.py --max_steps=4 [--name=value ...]
    python tools/host_work.py --repo=/path/to/other/checkout train_dmd.py --max_steps=4

Runs the script in this process (one rank) and counts, in the main thread, outside the forward
calls of the diffusion models (UNet2DConditionModel, FluxTransformer2DModel: trained, teacher and
fake score alike) and outside autograd's backward: the aten ops dispatched (each a kernel launch or
more on a GPU), the bytes those ops copy (copy_, _to_copy, clone: casts and device moves), and the
host syncs (.item(), .tolist(), float(), int(), bool() on tensors, in the project's own code
outside its data-order functions, whose tensors live on the CPU by design); and, as `step_ops` and
`step_copied_bytes`, the ops and copied bytes of the whole step. Prints `HOST_WORK <json>` at
exit. tools/benchmarks.py host takes the difference of a 4-step and a 2-step run: the per-step cost
without setup, checkpoint and export. The data loader's thread is not counted (it prepares the next
step while this one runs).
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODELS = ("UNet2DConditionModel", "FluxTransformer2DModel")
COPIES = ("copy_", "_to_copy", "clone")
counts = collections.Counter()
_depth = [0]


def _in_model_or_backward() -> bool:
    return _depth[0] > 0 or torch._C._current_graph_task_id() != -1


def _is_model(module) -> bool:
    # by the class's ancestry: fully_shard makes a UNet2DConditionModel an FSDPUNet2DConditionModel
    return any(c.__name__ in MODELS for c in type(module).__mro__)


def _enter(module, args):
    if _is_model(module):
        _depth[0] += 1


def _exit(module, args, output):
    if _is_model(module):
        _depth[0] -= 1


class _Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # the whole step too, models and backward included (FSDP2's cast-copies are there)
        counts["step_ops"] += 1
        if func._overloadpacket.__name__ in COPIES and torch.is_tensor(out):
            counts["step_copied_bytes"] += out.numel() * out.element_size()
        if not _in_model_or_backward():
            counts["ops"] += 1
            counts["op:" + func._overloadpacket.__name__] += 1
            if func._overloadpacket.__name__ in COPIES and torch.is_tensor(out):
                counts["copied_bytes"] += out.numel() * out.element_size()
        return out


# data-order code reads CPU tensors by design (never a GPU sync): its reads are not counted
DATA_CODE = {"load_pairs", "micro_batches", "dmd_micro_batches", "draw_sample_noise", "step_flips", "step_indices",
             "bucket_schedule", "choose_step_index"}


def project_read(code, repo: str) -> bool:
    """Whether a tensor read made by the function `code` counts as a host sync of the training
    code: the project's own (not a library's, the tests' or the data package's, whose tensors
    live on the CPU by design) and not a data-order function."""
    path = code.co_filename
    return (path.startswith(repo + os.sep) and os.sep + ".venv" + os.sep not in path
            and not path.startswith((os.path.join(repo, "data") + os.sep, os.path.join(repo, "tests") + os.sep))
            and not path.endswith("data_utils.py") and code.co_name not in DATA_CODE)


def _count_syncs(name, repo):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if not _in_model_or_backward() and project_read(sys._getframe(1).f_code, repo):
            counts["syncs"] += 1
        return original(self, *args, **kwargs)
    setattr(torch.Tensor, name, read)


def main(argv: list[str]) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if argv and argv[0].startswith("--repo="):
        repo, argv = os.path.abspath(argv[0].split("=", 1)[1]), argv[1:]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        _count_syncs(name, repo)
    torch.nn.modules.module.register_module_forward_pre_hook(_enter)
    torch.nn.modules.module.register_module_forward_hook(_exit)
    atexit.register(lambda: print("HOST_WORK " + json.dumps(dict(counts)), flush=True))
    sys.path.insert(0, repo)
    os.chdir(repo)
    sys.argv = argv
    mode = _Count()
    mode.__enter__()  # left on until exit: the script's main thread runs inside it
    runpy.run_path(os.path.join(repo, argv[0]), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
