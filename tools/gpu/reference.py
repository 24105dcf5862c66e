"""The plain-PyTorch reference: the model alone (bf16 weights on a GPU, fp32 on CPU), forward + backward
without FSDP or an optimizer, and apart the fused AdamW step and the VAE encode; its inputs as each
family's forward builds them."""
from __future__ import annotations

import json
import os
import statistics
import time


def _timed(fn, device, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, wall clock on CPU)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _model_flops(fn) -> dict:
    """{peak kind: FLOPs} of one forward `fn()` (components.metrics' counter)."""
    from components.metrics import _FlopCount
    counter = _FlopCount()
    with counter:
        fn()
    return dict(counter.by_kind)


def plain_reference(name: str, folder: str, resolution: int, batch: int, text_len: int, device,
                    references: tuple[int, ...] = ()) -> dict:
    """Forward + backward of the bare model of the family `name` (ms, MFU; its GpuCheck.reference_inputs), and apart
    the fused AdamW step over fp32 copies of its parameters and the VAE encode of one step's images (square images
    of `resolution` px: Kontext's target + context, Qwen-Image-Edit's target + `references`, ...)."""
    import diffusers
    import torch

    from parallel import attention
    from components.metrics import peak_tflops
    from tools.gpu.folders import spec
    gpu = spec(name).gpu
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention.sdpa_flags(attention.DEFAULT)
    g = torch.Generator(device=device).manual_seed(0)
    model, args, images = gpu.reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g)
    model.to(device).train()

    def fwd_bwd():
        out = model(**args, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=False)

    def fwd():
        with torch.no_grad():
            model(**args, return_dict=False)

    out = {"fwd_bwd_ms": _timed(fwd_bwd, device), "fwd_ms": _timed(fwd, device)}
    if gpu.dmd_calls:
        out.update(gpu.dmd_calls(model, args, batch, device, _timed))
    flops = {k: 3 * n for k, n in _model_flops(lambda: model(**args, return_dict=False)).items()}
    peaks = peak_tflops(device)
    out["model_tflop"] = sum(flops.values()) / 1e12

    def mfu(ms):
        return sum(n / (peaks[k] * 1e12) for k, n in flops.items()) / (ms / 1000) if peaks else float("nan")
    out["mfu"] = mfu(out["fwd_bwd_ms"])
    if gpu.channels_last:  # the model as CHANNELS_LAST runs it: NHWC conv inputs
        gpu.channels_last(model)
        out["cl_fwd_bwd_ms"] = _timed(fwd_bwd, device)
        out["cl_mfu"] = mfu(out["cl_fwd_bwd_ms"])
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    model = args = None  # free the bf16 model before the fp32 AdamW state
    for p in master:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(master, lr=1e-5, fused=device.type == "cuda")
    out["adamw_ms"] = _timed(opt.step, device, warmup=1, repeat=3)
    master = opt = None
    with open(os.path.join(folder, "vae", "config.json")) as f:
        vae_class = getattr(diffusers, json.load(f)["_class_name"])
    vae = vae_class.from_pretrained(os.path.join(folder, "vae"), torch_dtype=dtype).to(device)
    pixels = torch.randn(images, 3, resolution, resolution, device=device, dtype=dtype, generator=g)
    if gpu.vae_frames:  # videos of that many frames (the target and each reference, one size in these rows)
        pixels = pixels[:, :, None].expand(-1, -1, gpu.vae_frames, -1, -1)
    with torch.no_grad():
        out["vae_ms"] = _timed(lambda: vae.encode(pixels).latent_dist.mode(), device, warmup=1, repeat=3)
    vae = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
