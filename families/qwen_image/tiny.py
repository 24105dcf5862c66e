"""The Qwen-Image-Edit family's tiny test folder (its spec's `tiny`): a Qwen-Image-Edit-2509 layout with random
weights.

qwen_image_edit: VAE 8x down -> 16 latent channels (the real z_dim and latents_mean/std), packed 2x2 ->
64-channel tokens (64 px -> 16); transformer hidden 32 (2 blocks, 2 heads of 16); Qwen2.5-VL text hidden 32
(2 layers), vision tower hidden 32 with the real patch 14, 2 frames, 2x2 merge; a Qwen2 byte-level BPE trained
here, Qwen's 22 added tokens after it. Its dataset has two references per edit (64 px scene, 32 px colour
swatch). The pipeline resizes every reference to a 1024^2 area for the VAE (384^2 for the VL encoder): about
10 s a reference on 2 CPU cores. Load the processor with the room's `load_processor` where torchvision is
missing.

    python -m pytest tests/test_tiny_models.py tests/test_qwen_image.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

from families.tiny.data import make_two_reference_edit_dataset
from families.tiny.models import quiet_logs, seeded
from families.tiny.tokenizers import write_qwen_tokenizer


# processor/preprocessor_config.json of Qwen2.5-VL (and so of Qwen-Image-Edit): 14 px patches, 2 frames,
# 2x2 merge, 3136 .. 12845056 pixels, CLIP mean and std; the video file repeats it for the video processor.
QWEN_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def _write_qwen_processor(folder, tokenizer):
    """Write processor/ as the real folder has it: the tokenizer's files, preprocessor_config.json
    (Qwen2VLImageProcessor) and video_preprocessor_config.json (Qwen2VLVideoProcessor). Written
    directly: transformers 5 cannot build a Qwen2VLProcessor to save without torchvision."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    for name, kind in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
        config = {**QWEN_VL_PREPROCESSOR, f"{kind}_processor_type": f"Qwen2VL{kind.title()}Processor",
                  "processor_class": "Qwen2VLProcessor"}
        (folder / name).write_text(json.dumps(config, indent=2) + "\n")


def _qwen_vl_text_encoder(tokenizer, seed, hidden=32):
    """A 2-layer Qwen2_5_VLForConditionalGeneration, text hidden `hidden`, with a 2-block vision tower
    of the real geometry whose merger outputs `hidden`; token ids from `tokenizer`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = hidden // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=-(-len(tokenizer) // 64) * 64,  # padded past the tokenizer, as the real 152064
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, rms_norm_eps=1e-6, max_position_embeddings=128000, max_window_layers=2,
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
            # multimodal RoPE: (t, h, w) sections of the head_dim/2 frequencies, the real 16:24:24
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]}),
        vision_config=dict(
            depth=2, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2, out_hidden_size=hidden,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
            fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu"),  # the last block attends fully
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def make_tiny_qwen_image_edit(folder, seed=0):
    """Write a Qwen-Image-Edit-2509-layout diffusers folder (QwenImageEditPlusPipeline: transformer,
    vae, text_encoder, tokenizer, processor, scheduler).

    VAE 8x down to 16 latent channels, packed 2x2 into 64-channel tokens (64 px -> 16 tokens);
    transformer hidden 32 (2 blocks); Qwen2.5-VL text hidden 32 with a vision tower of the real
    geometry (patch 14, temporal patch 2, 2x2 merge, 112 px windows). Returns the folder.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)

    folder = Path(folder)
    tokenizer = write_qwen_tokenizer(folder / "tokenizer")
    text_encoder = _qwen_vl_text_encoder(tokenizer, seed)
    z_dim = 16  # the Qwen-Image VAE's latent channels
    with seeded(seed + 1):
        # Qwen-Image-Edit-2509's transformer config but for the sizes: no zero_cond_t (2511 has it)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=text_encoder.config.text_config.hidden_size,
            guidance_embeds=False, axes_dims_rope=(4, 6, 6))  # (frame, h, w), must sum to the head dim
    with seeded(seed + 2):
        # 3 downsamples (8x), the first spatial only, as the real one (base_dim 96, dim_mult (1, 2, 4, 4),
        # 2 res blocks); latents_mean / latents_std: the class defaults, the real VAE's 16 per-channel values
        vae = AutoencoderKLQwenImage(
            base_dim=4, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
    # scheduler/scheduler_config.json of Qwen/Qwen-Image (and the Edit models): exponential
    # resolution-dependent shift, stretched so the last sigma is 0.02
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    pipe = QwenImageEditPlusPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, processor=None,
        transformer=transformer)
    with quiet_logs():  # "processor=None cannot be saved": written below
        pipe.save_pretrained(folder, safe_serialization=True)
    _write_qwen_processor(folder / "processor", tokenizer)
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def build_qwen_image_edit(root):
    """tiny_qwen_image_edit: the Qwen-Image-Edit-2509 folder and two-reference edits."""
    make_tiny_qwen_image_edit(root / "model")
    make_two_reference_edit_dataset(root / "data", 32)
