"""The plain-PyTorch reference: the model alone (bf16 weights on a GPU, fp32 on CPU), forward + backward
without FSDP or an optimizer, and apart the fused AdamW step and the VAE encode; its inputs the family spec's
example_inputs, as its room's forward lays them out."""
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


def _vae_encode_ms(folder: str, images: int, resolution: int, frames: int, device, dtype, g) -> float:
    """The VAE encode of `images` square images of `resolution` px (`frames`: videos of that many frames, the
    target and each reference one size in these rows), ms."""
    import diffusers
    import torch
    with open(os.path.join(folder, "vae", "config.json")) as f:
        vae_class = getattr(diffusers, json.load(f)["_class_name"])
    vae = vae_class.from_pretrained(os.path.join(folder, "vae"), torch_dtype=dtype).to(device)
    pixels = torch.randn(images, 3, resolution, resolution, device=device, dtype=dtype, generator=g)
    if frames:
        pixels = pixels[:, :, None].expand(-1, -1, frames, -1, -1)
    with torch.no_grad():
        return _timed(lambda: vae.encode(pixels).latent_dist.mode(), device, warmup=1, repeat=3)


def plain_reference(name: str, folder: str, resolution: int, batch: int, text_len: int, device,
                    references: tuple[int, ...] = (), grid: tuple[int, ...] | None = None) -> dict:
    """Forward + backward of the bare trained model of the family `name` (ms, MFU) on its spec's example_inputs
    (square images: the target of `resolution` px, or the target's latent `grid` (GpuCheck.target_grid: a video's
    (T, h, w)), then each of `references` px), and apart the fused AdamW step over fp32 copies of its parameters
    and the VAE encode of one step's images (GpuCheck.encodes_target: the target too, then every reference; a step
    that encodes none, DMD2 of text to video: 0 ms)."""
    import diffusers
    import torch

    import families
    from families.gpu import output_loss
    from parallel import attention
    from components.metrics import peak_tflops
    from tools.gpu.folders import spec, trained_subfolder
    family = spec(name)
    gpu = family.gpu
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention.sdpa_flags(attention.DEFAULT)
    g = torch.Generator(device=device).manual_seed(0)
    trained = os.path.join(folder, trained_subfolder(name))
    with open(os.path.join(trained, "config.json")) as f:
        class_name = json.load(f)["_class_name"]
    model = getattr(diffusers, class_name).from_pretrained(trained, torch_dtype=dtype)
    if families.MODELS[class_name].attention_dispatcher:
        attention.set_backend(model, attention.DEFAULT)
    if hasattr(family.room, "vae_factor"):
        factor = family.room.vae_factor(folder)
    else:  # an AutoencoderKL: a factor of 2 per down block after the first
        with open(os.path.join(folder, "vae", "config.json")) as f:
            factor = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    torch.manual_seed(0)  # example_inputs draws from the default generator
    shapes = [tuple(grid) if grid else (resolution // factor,) * 2] + [(s // factor, s // factor) for s in references]
    args = family.example_inputs(model.config, batch, shapes, text_len, device, dtype)
    args.pop("return_dict", None)
    images = (gpu.encodes_target + len(references)) * batch
    model.to(device).train()

    def fwd_bwd():
        output_loss(model(**args, return_dict=False)[0]).backward()
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
    out["vae_ms"] = _vae_encode_ms(folder, images, resolution, gpu.vae_frames, device, dtype, g) if images else 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
