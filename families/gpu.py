"""What the GPU check (tools/gpu/) asks of a family: a `GpuCheck`, its spec's `gpu` (families/<name>/gpu.py's GPU).
The check builds the family's models at real width with random weights (its `parts` beside a skeleton of its
trained model with fewer blocks), sizes them to the disk, times its plain reference and loads its exports by
these facts alone; a family without one has no rows there.

    python -m pytest tests/test_gpu_check.py -q -m "not slow"
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GpuCheck:
    label: str  # the table's model: "FLUX" -> "FLUX 2+4 blocks" at real width, "tiny FLUX" on the tiny folder
    configs: str  # the built-in whose real configs its rows take (FamilySpec.builtin_folder)
    # (subfolder, build(tiny, real)) in build order: the parts at real width with random weights, each a model
    # with save_pretrained (`tiny`: the family's first tiny folder, whose tokenizers it may read; `real`: configs)
    parts: tuple[tuple[str, Callable], ...]
    keep: tuple[str, ...]  # what the real folder copies from the tiny one beside model_index.json (tokenizers...)
    # (folder, data, settings) -> (text tokens, reference sides in px): what the plain reference sizes to a row
    reference_shape: Callable
    # the trained model's config keys of its block counts (its skeleton keeps the real width, fewer blocks),
    # with the check's default counts; (): the real model built whole
    blocks: tuple[str, ...] = ()
    default_blocks: tuple[int, ...] = ()
    data_references: int = 1  # the rows' data: edits with this many references (0: a prompts file)
    # (root, size, tiny, script) -> the rows' data (a file's path) where the family writes its own; None: by
    # data_references (tools/gpu/folders.dataset)
    data: Callable | None = None
    reference_note: str = ""  # what the reference's label adds ("target + 2 references")
    encodes_target: bool = True  # a step's VAE encode takes its target beside its references (DMD2: references only)
    vae_frames: int = 0  # a video VAE: the pixels it encodes have this many frames (0: an image VAE)
    # (folder, settings) -> the target's latent grid as the spec's example_inputs takes it (a video's (T, h, w));
    # None: a square image of the row's resolution
    target_grid: Callable | None = None
    # (model, kwargs, batch, device, timed) -> {name: ms}: a DMD2 step's further plain calls, each timed(fn, device)
    dmd_calls: Callable | None = None
    channels_last: Callable | None = None  # model -> model with NHWC conv inputs: a reference row of its own
    true_cfg: bool = False  # its DMD2 teacher pairs prompt and negative in one batch when REAL_GUIDANCE_SCALE > 1
    # (export, base folder, settings, data) -> bool: the export loaded as a user loads it; None: a LoRA export's
    # weights file exists, a full one's trained model loads (diffusers.AutoModel)
    export_loads: Callable | None = None
    # (row, tiny) -> the family's own suite (--suite=<family>), `row` the check's row builder
    # row(name, script, family, resolution, expect_s, **settings); None: no suite of its own
    suite: Callable | None = None


def true_cfg_calls(model, args: dict, batch: int, device, timed) -> dict:
    """GpuCheck.dmd_calls of a family whose DMD2 teacher batches its CFG pair (true_cfg): the plain calls a step
    makes beyond forward and forward + backward, each `timed(fn, device)`: the teacher's pair, one forward without
    grad of a batch of 2B (prompt and negative, as the room's cond.velocity batches them), and a LoRA model's
    forward + backward, whose frozen weights pass gradients to their inputs only (the adapters' own matmuls are
    not counted)."""
    import torch
    pair = {k: torch.cat([v, v]) if torch.is_tensor(v) else list(v) + list(v) if isinstance(v, list) else v
            for k, v in args.items()}  # a list: one entry per sample (Z-Image's latents and captions)
    image = next(iter(args))  # example_inputs' first: the image tokens (hidden_states, Z-Image's x)

    def pair_fwd():
        with torch.no_grad():
            model(**pair, return_dict=False)

    def frozen_fwd_bwd():
        x = args[image]
        x = x.detach().requires_grad_() if torch.is_tensor(x) else [t.detach().requires_grad_() for t in x]
        output_loss(model(**{**args, image: x}, return_dict=False)[0]).backward()

    out = {"fwd_pair_ms": timed(pair_fwd, device)}
    model.requires_grad_(False)
    try:
        out["frozen_fwd_bwd_ms"] = timed(frozen_fwd_bwd, device)
    finally:
        model.requires_grad_(True)
    return out


def output_loss(out):
    """The plain reference's loss on a model's output: its mean square in fp32; a list output (one tensor per sample,
    Z-Image's) the sum of theirs."""
    return sum(o.float().square().mean() for o in out) if isinstance(out, (list, tuple)) else \
        out.float().square().mean()


def export_pipeline(pipeline_class, export: str, base: str, s: dict, **base_kwargs) -> tuple:
    """(the pipeline, the transformer's timesteps as it samples) of a row's export loaded as a user loads it: a LoRA
    export on the base folder (`base_kwargs`: what the family's loading line adds, e.g. FLUX.2 klein's is_distilled)
    with load_lora_weights and the export's scheduler where it has one (a distilled export's), a full export by
    from_pretrained; bf16 on a GPU, fp32 on CPU, the attention kernel chosen (parallel/attention.DEFAULT), not torch's
    default (cuDNN first on Hopper)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from parallel import attention
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if s.get("lora_rank"):
        pipe = pipeline_class.from_pretrained(base, torch_dtype=dtype, **base_kwargs)
        pipe.load_lora_weights(export)
        if os.path.isdir(os.path.join(export, "scheduler")):  # a distilled export's; a fine-tune's samples as the base
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(export, subfolder="scheduler")
    else:
        pipe = pipeline_class.from_pretrained(export, torch_dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    attention.sdpa_flags(attention.DEFAULT)
    attention.set_backend(pipe.transformer, attention.DEFAULT)
    seen = []
    pipe.transformer.register_forward_pre_hook(  # the timestep by name, or second (ZImagePipeline passes t so)
        lambda m, a, kw: seen.append(float((kw["timestep"] if "timestep" in kw else a[1])[0])), with_kwargs=True)
    return pipe, seen


def qwen3_config_at_real_width(tiny: dict, real: str) -> dict:
    """A tiny folder's Qwen3 config (its vocabulary, special token ids and layer count) at the real hidden width
    (`real`: the configs' folder), each layer narrow (2 heads of the real head dims, an MLP of 256): the text cache
    gets embeddings of the real width from a few million parameters per layer instead of 4 B in all."""
    with open(os.path.join(real, "text_encoder", "config.json")) as f:
        real = json.load(f)
    return {**tiny, "hidden_size": real["hidden_size"], "head_dim": real["head_dim"], "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 256}
