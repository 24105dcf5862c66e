"""The order in which a model's forward runs its modules, and its FSDP units in that order: what
the recipes (parallel/parallelize.py) shard by, so that prefetching and the unit kept gathered after
forward follow the real execution.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

import torch.nn as nn


def execution_order(model: nn.Module) -> list[nn.Module]:
    """`model` and its submodules, depth first, in the order its forward runs them.

    That is registration order except in diffusers' UNets, whose constructors register modules in
    another order than forward calls them: UNet2DConditionModel registers `up_blocks` before
    `mid_block` (forward: down, mid, up), and each cross-attention block registers `attentions`
    before `resnets` (forward: resnet 0, attention 0, resnet 1, ...; a mid block starts with an
    extra resnet). tests/test_parallelize.py checks this against forward pre-hooks of real UNets."""
    out = []

    def visit(m: nn.Module) -> None:
        out.append(m)
        for child in _children_in_forward_order(m):
            visit(child)
    visit(model)
    return out


def _children_in_forward_order(m: nn.Module) -> list[nn.Module]:
    children = dict(m.named_children())
    names = list(children)
    if "mid_block" in names and "up_blocks" in names:  # UNet2DConditionModel: down, mid, up
        names.remove("mid_block")
        names.insert(names.index("up_blocks"), "mid_block")
    if isinstance(children.get("resnets"), nn.ModuleList) and isinstance(children.get("attentions"), nn.ModuleList):
        resnets, attentions = list(children["resnets"]), [a for a in children["attentions"] if a is not None]
        if "Mid" in type(m).__name__:  # resnet 0, then (attention i, resnet i + 1)
            interleaved = resnets[:1] + [x for pair in zip(attentions, resnets[1:]) for x in pair]
        else:  # (resnet i, attention i)
            interleaved = [x for pair in zip(resnets, attentions) for x in pair]
        interleaved += [r for r in resnets if r not in interleaved]
        rest = [children[n] for n in names if n not in ("resnets", "attentions")]
        return interleaved + rest
    return [children[n] for n in names]


def units_in_order(model: nn.Module, class_names) -> list[nn.Module]:
    """The submodules of `model` whose class is one of `class_names`, in execution order."""
    return [m for m in execution_order(model) if m is not model and type(m).__name__ in class_names]
