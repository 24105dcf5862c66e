"""What a model's `_keep_in_fp32_modules` change under bf16: diffusers keeps those modules in fp32 when a pipeline
loads in bf16 (`from_pretrained(torch_dtype=torch.bfloat16)`), while bf16-mixed training under FSDP2 computes every
parameter in its MixedPrecisionPolicy's bf16 (buffers stay as they are). Measured on Wan 2.1-1.3B's transformer at
real width (configs/wan2.1-t2v-1.3b, 2 blocks, random weights), single process:

    python tools/benchmarks.py fp32_modules
"""
from __future__ import annotations

import os

TIMESTEPS = (999.0, 500.0, 50.0)


def _wan_width_model(blocks: int = 2):
    """WanTransformer3DModel with Wan 2.1-1.3B's config but `blocks` blocks, random weights (seed 0), fp32."""
    import torch
    from diffusers import WanTransformer3DModel
    from families.wan import spec
    config = WanTransformer3DModel.load_config(os.path.join(spec.SPEC.builtin_folder("wan2.1-t2v-1.3b"), "transformer"))
    torch.manual_seed(0)
    return WanTransformer3DModel.from_config(config, num_layers=blocks).eval()


def _keep_matches(name: str, keep: list[str]) -> bool:
    """diffusers' rule (ModelMixin.from_pretrained): a parameter stays fp32 if any of its name's dotted parts is
    one of `_keep_in_fp32_modules`."""
    return any(k in name.split(".") for k in keep)


def bench_fp32_modules() -> str:
    """Relative error against fp32 of Wan's velocity (one forward, 3 x 8 x 8 latent tokens, 64 text tokens) at
    three timesteps: (a) the pipeline's bf16 load (its `_keep_in_fp32_modules` parameters fp32, the rest bf16),
    (b) bf16-mixed training's compute (every parameter bf16, buffers fp32), and the two against each other."""
    import copy

    import torch
    from tools import shapes
    ref = _wan_width_model()
    keep = list(type(ref)._keep_in_fp32_modules)
    pipeline, mixed = copy.deepcopy(ref), copy.deepcopy(ref)
    kept = 0
    for name, p in pipeline.named_parameters():
        if _keep_matches(name, keep):
            kept += p.numel()
        else:
            p.data = p.data.bfloat16()
    for p in mixed.parameters():
        p.data = p.data.bfloat16()
    g = torch.Generator().manual_seed(1)
    c = ref.config
    latents = torch.randn(1, c.in_channels, 3, 16, 16, generator=g)
    text = torch.randn(1, 64, c.text_dim, generator=g)

    def velocity(model, dtype, t):
        with torch.no_grad():
            return model(hidden_states=latents.to(dtype), timestep=torch.tensor([t]),
                         encoder_hidden_states=text.to(dtype), return_dict=False)[0].float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    rows = []
    for t in TIMESTEPS:
        v32, va, vb = velocity(ref, torch.float32, t), velocity(pipeline, torch.bfloat16, t), \
            velocity(mixed, torch.bfloat16, t)
        rows.append([f"{t:.0f}", f"{rel(va, v32):.2e}", f"{rel(vb, v32):.2e}", f"{rel(vb, va):.2e}"])
    table = shapes.md_table(["timestep", "(a) pipeline bf16 vs fp32", "(b) bf16-mixed vs fp32", "(b) vs (a)"], rows,
                            align=["---:"] * 4)
    total = sum(p.numel() for p in ref.parameters())
    return (f"WanTransformer3DModel, Wan 2.1-1.3B width, 2 blocks ({total / 1e6:.0f} M parameters, "
            f"{kept / 1e6:.2f} M of them in {keep} kept fp32 by the pipeline), random weights, torch "
            f"{torch.__version__}, CPU\n\n{table}")
