"""The SD UNet family's spec: SD-1.5 and SDXL, trained by train_dmd.py's UNet setup."""
from __future__ import annotations

import torch

import families.sd_unet as room
from families.sd_unet import gpu, parallelism, tiny  # gpu: the GPU check's facts
from families.pipelines import Component
from families.spec import Builtin, FamilySpec, PipelineSpec, UnetDistillationRoom

_SD15 = (Component("generator", "unet", "trainable", "UNet2DConditionModel"),
         Component("fake_score", "unet", "trainable", "UNet2DConditionModel"),
         Component("teacher", "unet", "frozen-sharded", "UNet2DConditionModel"),
         Component("vae", "vae", "replicated", "AutoencoderKL"),
         Component("text_encoder", "text_encoder", "replicated", "CLIPTextModel"))
_FILES = (Component("tokenizer", "tokenizer", "files"), Component("scheduler", "scheduler", "files"))
_SDXL = (*_SD15, Component("text_encoder_2", "text_encoder_2", "replicated", "CLIPTextModelWithProjection"),
         *_FILES, Component("tokenizer_2", "tokenizer_2", "files"))


def example_inputs(config, batch: int, shapes, text_len: int, device, dtype) -> dict:
    """UNet2DConditionModel's forward kwargs as algorithms/dmd2 calls it: the latents (B, C, h, w) of the one image
    in `shapes`, integer timesteps (B,), the CLIP embeddings (B, text_len, cross_attention_dim); SDXL (text_time
    added conditions): the pooled `text_embeds` and the 6 `time_ids`."""
    (h, w), = shapes
    inputs = dict(sample=torch.randn(batch, config["in_channels"], h, w, device=device, dtype=dtype),
                  timestep=torch.full((batch,), 500, device=device, dtype=torch.long),
                  encoder_hidden_states=torch.randn(batch, text_len, config["cross_attention_dim"], device=device,
                                                    dtype=dtype), return_dict=False)
    if config.get("addition_embed_type") == "text_time":
        time_dim = config["addition_time_embed_dim"]
        pooled = config["projection_class_embeddings_input_dim"] - 6 * time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, pooled, device=device, dtype=dtype),
                                       "time_ids": torch.randn(batch, 6, device=device, dtype=dtype)}
    return inputs


SPEC = FamilySpec(
    name="sd_unet", room=room,
    pipelines=(PipelineSpec("StableDiffusionPipeline", (*_SD15, *_FILES), ("train_dmd.py",)),
               PipelineSpec("StableDiffusionXLPipeline", _SDXL, ("train_dmd.py",), resolution=1024)),
    protocols={"train_dmd.py": UnetDistillationRoom},
    default_resolution=512,  # the UNet's sample_size x the VAE factor: SD-1.5 64 x 8, SDXL 128 x 8
    text_len=77,  # CLIP's context
    example_inputs=example_inputs,
    check_context_parallel=None,  # train_dmd.py has no context parallelism
    tiny={"sd15": tiny.build_sd15, "sdxl": tiny.build_sdxl},  # tools/tiny_models.BUILDERS
    models=parallelism.MODELS,
    gpu=gpu.GPU,
    builtins={"sd15-dmd": Builtin("StableDiffusionPipeline"), "sdxl-dmd": Builtin("StableDiffusionXLPipeline")},
    plan_names={"StableDiffusionPipeline": "sd15", "StableDiffusionXLPipeline": "sdxl"},
    text_tokenizer="tokenizer",
    # train_dmd.py keeps SDXL's VAE in fp32 by default (it overflows in fp16/bf16; so does the official DMD2 code)
    fp32_components={"StableDiffusionXLPipeline": ("vae",)},
    bench_medium={"sd15": dict(block_out_channels=(128, 256), layers_per_block=2, norm_num_groups=32,
                               attention_head_dim=8)})
