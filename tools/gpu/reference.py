"""The plain-PyTorch reference: the model alone (bf16 weights on a GPU, fp32 on CPU), forward + backward
without FSDP or an optimizer, and apart the fused AdamW step and the VAE encode; its inputs as each
family's forward builds them."""
from __future__ import annotations

import json
import os
import statistics
import time


def qwen_text_tokens(folder: str, data: str, condition_area: int) -> int:
    """The length of the prompt embeddings the run trains on: the first sample's prompt with its
    references (each at `condition_area`) through the pipeline's template and processor, less the
    system prompt's tokens it drops (encode_prompt without the encoder; the samples' prompts differ
    by a word at most)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2Tokenizer

    from families import qwen_image as qi
    with open(data) as f:
        row = json.loads(f.readline())
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=None, transformer=None, text_encoder=None,
                                     tokenizer=Qwen2Tokenizer.from_pretrained(os.path.join(folder, "tokenizer")),
                                     processor=qi.load_processor(os.path.join(folder, "processor")))
    images = qi.condition_images(pipe, [os.path.join(os.path.dirname(data), c) for c in qi.controls(row)],
                                 condition_area)
    # the pipeline's _get_qwen_prompt_embeds: "Picture i: " and the image's tokens before the prompt
    pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(images)))
    ids = pipe.processor(text=[pipe.prompt_template_encode.format(pictures + row["prompt"])], images=images,
                         return_tensors="pt")["input_ids"]
    return ids.shape[1] - pipe.prompt_template_encode_start_idx


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


def plain_reference(kind: str, folder: str, resolution: int, batch: int, text_len: int, device,
                    references: tuple[int, ...] = ()) -> dict:
    """Forward + backward of the bare model (ms, MFU), and apart the fused AdamW step over fp32
    copies of its parameters and the VAE encode of one step's images (Kontext: target + context;
    Qwen-Image-Edit: target + `references`, square images of those sides)."""
    import torch
    from diffusers import AutoencoderKL

    from parallel import attention
    from components.metrics import peak_tflops
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention.sdpa_flags(attention.DEFAULT)
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "flux":
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=dtype)
        attention.set_backend(model, attention.DEFAULT)
        c, side = model.config, resolution // 16
        image = 2 * side * side  # target + context tokens
        ids = torch.zeros(image, 3, device=device)
        args = dict(hidden_states=torch.randn(batch, image, c.in_channels, device=device, dtype=dtype, generator=g),
                    encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, device=device,
                                                      dtype=dtype, generator=g),
                    pooled_projections=torch.randn(batch, c.pooled_projection_dim, device=device, dtype=dtype,
                                                   generator=g),
                    timestep=torch.full((batch,), 0.5, device=device), guidance=torch.ones(batch, device=device),
                    txt_ids=torch.zeros(text_len, 3, device=device), img_ids=ids)
        images = 2 * batch
    elif kind == "qwen":
        model, args = qwen_reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g)
        images = (1 + len(references)) * batch
    elif kind == "flux2":
        model, args = flux2_reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g)
        images = len(references) * batch  # what a DMD2 step encodes: its references (the generator makes the target)
    else:
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel.from_pretrained(os.path.join(folder, "unet"), torch_dtype=dtype)
        c, side = model.config, resolution // 8
        args = dict(sample=torch.randn(batch, c.in_channels, side, side, device=device, dtype=dtype, generator=g),
                    timestep=torch.full((batch,), 500, device=device),
                    encoder_hidden_states=torch.randn(batch, text_len, c.cross_attention_dim, device=device,
                                                      dtype=dtype, generator=g))
        images = batch
    model.to(device).train()

    def fwd_bwd():
        out = model(**args, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=False)

    def fwd():
        with torch.no_grad():
            model(**args, return_dict=False)

    out = {"fwd_bwd_ms": _timed(fwd_bwd, device), "fwd_ms": _timed(fwd, device)}
    if kind == "flux2":
        out.update(flux2_dmd_calls(model, args, batch, device))
    flops = {k: 3 * n for k, n in _model_flops(lambda: model(**args, return_dict=False)).items()}
    peaks = peak_tflops(device)
    out["model_tflop"] = sum(flops.values()) / 1e12

    def mfu(ms):
        return sum(n / (peaks[k] * 1e12) for k, n in flops.items()) / (ms / 1000) if peaks else float("nan")
    out["mfu"] = mfu(out["fwd_bwd_ms"])
    if kind == "sd15":  # the UNet as CHANNELS_LAST runs it (sd_unet.to_channels_last): NHWC conv inputs
        from families.sd_unet import to_channels_last
        to_channels_last(model)
        out["cl_fwd_bwd_ms"] = _timed(fwd_bwd, device)
        out["cl_mfu"] = mfu(out["cl_fwd_bwd_ms"])
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    model = args = None  # free the bf16 model before the fp32 AdamW state
    for p in master:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(master, lr=1e-5, fused=device.type == "cuda")
    out["adamw_ms"] = _timed(opt.step, device, warmup=1, repeat=3)
    master = opt = None
    from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage
    vae_class = {"qwen": AutoencoderKLQwenImage, "flux2": AutoencoderKLFlux2}.get(kind, AutoencoderKL)
    vae = vae_class.from_pretrained(os.path.join(folder, "vae"), torch_dtype=dtype).to(device)
    pixels = torch.randn(images, 3, resolution, resolution, device=device, dtype=dtype, generator=g)
    if kind == "qwen":  # one-frame videos: the target and each reference (one size in these rows)
        pixels = pixels[:, :, None]
    with torch.no_grad():
        out["vae_ms"] = _timed(lambda: vae.encode(pixels).latent_dist.mode(), device, warmup=1, repeat=3)
    vae = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def qwen_reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g):
    """(QwenImageTransformer2DModel, its forward's inputs) as families/qwen_image.forward calls it: the
    target's and each reference's 2x2-packed tokens with their img_shapes, timestep σ, the prompt's
    hidden states without a mask (no padding in a batch of equal prompts)."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from parallel import attention
    model = QwenImageTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=dtype)
    attention.set_backend(model, attention.DEFAULT)
    c = model.config
    shapes = [(1, side // 16, side // 16) for side in (resolution, *references)]
    tokens = sum(h * w for _, h, w in shapes)
    args = dict(hidden_states=torch.randn(batch, tokens, c.in_channels, device=device, dtype=dtype, generator=g),
                encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, device=device, dtype=dtype,
                                                  generator=g),
                encoder_hidden_states_mask=None, timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
                img_shapes=[shapes] * batch, guidance=None)
    return model, args


def flux2_reference_inputs(folder, resolution, references, batch, text_len, device, dtype, g):
    """(Flux2Transformer2DModel, its forward's inputs) as families/flux2.forward calls it: the target's and each
    reference's packed tokens (square images of those sides) with the room's 4-D ids, timestep σ, the text's
    hidden states with their ids, no guidance (klein)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    from families import flux2
    from parallel import attention
    model = Flux2Transformer2DModel.from_pretrained(os.path.join(folder, "transformer"), torch_dtype=dtype)
    attention.set_backend(model, attention.DEFAULT)
    c, cell = model.config, 2 * flux2.vae_factor(folder)  # pixels per token: the VAE's factor, then 2x2 packing
    grids = [(side // cell, side // cell) for side in (resolution, *references)]
    tokens = sum(h * w for h, w in grids)
    text = torch.randn(batch, text_len, c.joint_attention_dim, device=device, dtype=dtype, generator=g)
    args = dict(hidden_states=torch.randn(batch, tokens, c.in_channels, device=device, dtype=dtype, generator=g),
                encoder_hidden_states=text, timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
                img_ids=flux2.image_ids(grids, device).expand(batch, -1, -1), txt_ids=flux2.text_ids(text),
                guidance=None)
    return model, args


def flux2_dmd_calls(model, args: dict, batch: int, device) -> dict:
    """The plain calls a klein DMD2 step makes beyond forward and forward + backward (dmd_flow_network_ms):
    the teacher's true-CFG pair, one forward without grad of a batch of 2B (families/flux2.Flux2Cond.velocity
    batches prompt and negative), and a LoRA generator's forward + backward, whose frozen weights pass gradients
    to their inputs only (the adapters' own matmuls are not counted)."""
    import torch
    pair = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in args.items()}

    def pair_fwd():
        with torch.no_grad():
            model(**pair, return_dict=False)

    def frozen_fwd_bwd():
        x = args["hidden_states"].detach().requires_grad_()
        model(**{**args, "hidden_states": x}, return_dict=False)[0].float().square().mean().backward()

    out = {"fwd_pair_ms": _timed(pair_fwd, device)}
    model.requires_grad_(False)
    try:
        out["frozen_fwd_bwd_ms"] = _timed(frozen_fwd_bwd, device)
    finally:
        model.requires_grad_(True)
    return out
