"""What the memory planner (tools/planner/) plans of the Z-Image family: its FamilySpec's planner fields, as one
dict of keyword arguments (`PLAN`) that families/z_image/spec.py's SPEC takes (`FamilySpec(..., **plan_spec.PLAN)`):
the built-ins `z-image`, `z-image-dmd`, `z-image-omni` and `z-image-omni-dmd` (configs/, sourced in CONFIGS.md), 512
text tokens, the transformer's forward inputs on meta (ZImageOmniPipeline's omni-mode call with its references, their
SigLIP features and the caption segments), Omni's references by FLUX.2's rule (two at 1024^2 by default), the Omni
fill's batches, the teacher in NF4 with an NF4 LoRA base (as train_dmd.py builds it).

    python tools/memory_plan.py --model=z-image-dmd --world_size=1 --lora_rank=64 --fake_lora=1 --base_dtype=nf4
    python tools/memory_plan.py --model=z-image-omni --world_size=1 --lora_rank=64 --activation_checkpointing=1
    python -m pytest tests/test_memory_plan.py -q -k z_image
"""
from __future__ import annotations

import torch

from families.flux2.spec import plan_references  # noqa: F401 - Omni prepares references with Flux2ImageProcessor
from families.spec import Builtin

TEXT_LEN = 512  # the pipeline's max_sequence_length, the chat template included; a prompt keeps its real tokens
OMNI = "ZImageOmniPipeline"
# the Omni template's pieces around the references (<|im_start|>user\n<|vision_start|>, <|vision_end|><|vision_start|>,
# <|vision_end|><|im_end|>): a few tokens each, a segment of its own that the transformer pads to 32 anyway
TEMPLATE_TOKENS = 4
SIGLIP_PATCHES = 256  # configs/z-image-omni/siglip_processor's max_num_patches: a reference's SigLIP grid at most
SIGLIP_PATCH, VAE_FACTOR = 16, 8  # its patch in pixels; pixels per latent (FLUX.1's VAE)


def siglip_grid(h: int, w: int) -> tuple[int, int]:
    """The SigLIP grid of a reference of (h, w) latents as Siglip2ImageProcessor sizes it (at most SIGLIP_PATCHES
    patches at the image's ratio)."""
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches
    height, width = get_image_size_for_max_num_patches(h * VAE_FACTOR, w * VAE_FACTOR, SIGLIP_PATCH, SIGLIP_PATCHES)
    return height // SIGLIP_PATCH, width // SIGLIP_PATCH


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """ZImageTransformer2DModel's forward arguments as the room's velocity passes them: one (C, 1, h, w) latent per
    sample (shapes[0]: the target's (h, w)), the timestep (B,), one (text_len, cap_feat_dim) caption per sample. A
    transformer with SigLIP inputs (Omni) in omni mode, as omni.model_output calls it: per sample x = the references
    (shapes[1:]) + [the target], the noise mask, the caption segments (the prompt's at text_len, the template's
    pieces at TEMPLATE_TOKENS), each reference's SigLIP features + [None]."""
    def latent(h, w):
        return torch.randn(config["in_channels"], 1, h, w, device=device, dtype=dtype)

    def caption(n):
        return torch.randn(n, config["cap_feat_dim"], device=device, dtype=dtype)
    if not config.get("siglip_feat_dim"):
        return dict(x=[latent(*shapes[0]) for _ in range(batch)], t=torch.rand(batch, device=device, dtype=dtype),
                    cap_feats=[caption(text_len) for _ in range(batch)], return_dict=False)
    refs = shapes[1:]
    lengths = [TEMPLATE_TOKENS] * len(refs) + [text_len] + [TEMPLATE_TOKENS] if refs else [text_len]
    siglip = [torch.randn(*siglip_grid(*r), config["siglip_feat_dim"], device=device, dtype=dtype) for r in refs]
    return dict(x=[[latent(*r) for r in refs] + [latent(*shapes[0])] for _ in range(batch)],
                t=torch.rand(batch, device=device, dtype=dtype),
                cap_feats=[[caption(n) for n in lengths] for _ in range(batch)],
                siglip_feats=[siglip + [None] for _ in range(batch)] if refs else None,
                image_noise_mask=[[0] * len(refs) + [1] for _ in range(batch)], return_dict=False)


def plan_tokens(config, shapes) -> int:
    """The image tokens of the target's (h, w) latents and each reference's: one per 2 x 2 patch (all_patch_size),
    before the transformer pads each image to a multiple of 32."""
    p = config["all_patch_size"][0]
    return sum((h // p) * (w // p) for h, w in shapes)


def sequence_extras(config, references) -> str:
    """The Omni sequence's parts besides the target, the references and the prompt: each reference's SigLIP grid
    and the template's segments (example_inputs' inputs; the transformer pads each to a multiple of 32)."""
    if not config.get("siglip_feat_dim") or not references:
        return ""
    grids = [siglip_grid(h, w) for h, w in references]
    tokens = " + ".join(f"{h * w}" for h, w in grids)
    return (f"{tokens} SigLIP tokens ({len(grids)} reference(s), at most {SIGLIP_PATCHES} patches each) + "
            f"{len(references) + 1} template segments of {TEMPLATE_TOKENS} tokens")


def fill_batch(pipeline: str, subfolder: str, prompts: int, references: int) -> int:
    """ZImageOmniPipeline's fill: _encode_prompt runs each prompt as its references + 2 segments (1 without), each
    padded to the length, in one batch; the SigLIP encodes one reference at a time (omni.prepare_edit_text)."""
    if pipeline != OMNI:
        return prompts
    return 1 if subfolder == "siglip" else prompts * (references + 2 if references else 1)


# FamilySpec(**PLAN): ZImagePipeline is fine-tuned (--model=z-image) and distilled (--model=z-image-dmd), and so is
# ZImageOmniPipeline (--model=z-image-omni, z-image-omni-dmd: its references planned as FLUX.2's, the room's edits).
# Z-Image-Turbo is not built in: its transformer, text encoder and VAE configs are the base's (only its
# scheduler's shift, 3.0, differs, which the planner does not read), and a distilled model is no DMD2 teacher
PLAN = dict(
    text_len=TEXT_LEN,  # at most 512 tokens: the planner plans a prompt of the full length
    example_inputs=example_inputs,
    plan_tokens=plan_tokens,
    builtins={"z-image": Builtin("ZImagePipeline"), "z-image-omni": Builtin(OMNI)},
    plan_names={"ZImagePipeline": "z_image", OMNI: "z_image_omni"},
    plan_references=plan_references, references=2, reference_area=1024 * 1024,  # ZImagePipeline: none (no edits)
    fill_batch=fill_batch,
    sequence_extras=sequence_extras,
    nf4_teacher=True)  # train_dmd.py: BASE_DTYPE=nf4 with LoRA stores the frozen teacher in NF4 too
