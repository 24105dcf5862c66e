"""The Wan family in the GPU check (families/gpu.GpuCheck): Wan 2.1 T2V-1.3B's transformer at real width (1536, 12
heads) with fewer blocks beside its real AutoencoderKLWan and a narrow UMT5 of the real width (random weights), DMD2
of text to video as recipes/dmd_wan21_t2v_1.3b_lora.sh runs it (81 frames at 480 x 832), the teacher's CFG pair
timed apart, the LoRA export sampled by WanPipeline in 4 steps at the trained σ list.

    bash tools/gpu_check.sh --suite=wan --skip_tests --out=$OUT      # on a GPU (docs/gpu.md)
    python tools/gpu_check.py --tiny --cpu --suite=wan               # the tiny Wan 2.1 T2V on CPU: 32 px, 9 frames
    python -m pytest tests/test_gpu_check.py -q -k wan
"""
from __future__ import annotations

import json
import os

from families.gpu import GpuCheck, export_pipeline, true_cfg_calls


def text_encoder_config(tiny: dict, real: str) -> dict:
    """The tiny folder's UMT5 config (its vocabulary and special token ids: the tiny tokenizer's) at the real width
    and depth (`real`: the configs' folder; d_model 4096, 24 layers of 64-dim heads, its relative-position buckets),
    each layer narrow (2 heads, a gated MLP of 256): the text cache gets embeddings of the real width (4096, the
    transformer's text_dim) from ~0.13 B parameters instead of 5.7 B."""
    with open(os.path.join(real, "text_encoder", "config.json")) as f:
        real = json.load(f)
    keep = ("d_model", "d_kv", "num_layers", "relative_attention_num_buckets", "relative_attention_max_distance",
            "feed_forward_proj", "layer_norm_epsilon")
    return {**tiny, **{k: real[k] for k in keep}, "num_decoder_layers": real["num_layers"], "num_heads": 2,
            "d_ff": 256}


def _vae(tiny: str, real: str):
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(os.path.join(real, "vae")))


def _text_encoder(tiny: str, real: str):
    from transformers import UMT5Config, UMT5EncoderModel
    with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
        return UMT5EncoderModel(UMT5Config.from_dict(text_encoder_config(json.load(f), real)))


def clip_settings(folder: str, s: dict) -> dict:
    """A row's settings as the room reads them (train_dmd.py's names): its folder, RESOLUTION (the height),
    NUM_FRAMES and BUCKET_ASPECTS (0 / none: the pipeline's 81 frames at 480 x 832)."""
    extra = s["extra"]
    aspects = [float(x) for x in str(extra.get("bucket_aspects", "")).split(",") if x.strip()]
    return {"MODEL_PATH": folder, "RESOLUTION": s["resolution"], "NUM_FRAMES": int(extra.get("num_frames", 0)),
            "BUCKET_ASPECTS": aspects}


def target_grid(folder: str, s: dict) -> tuple[int, int, int]:
    """The row's clip as the room lays it out: (latent frames, h, w), e.g. 21 x 60 x 104 for 81 frames at 480p."""
    from families import wan
    settings = clip_settings(folder, s)
    return wan.latent_grid(wan.video_size(settings), settings)


def reference_shape(folder, data, settings):
    """(the text padded to the run's length, no references: text to video)."""
    return int(settings["extra"].get("max_sequence_length", 512)), ()


def export_samples(export: str, base: str, s: dict, data: str) -> bool:
    """A Wan DMD2 LoRA export sampled as docs/families/wan.md loads it: WanPipeline.from_pretrained(base),
    load_lora_weights(export), the export's scheduler, 4 steps without CFG at the row's clip on the first prompt.
    Passes when the video is finite, of the clip's shape, and the transformer saw the trained σ list (x 1000)."""
    import numpy as np
    import torch
    from diffusers import WanPipeline

    from algorithms.dmd2_flow import timestep_sigmas
    from families import wan
    pipe, seen = export_pipeline(WanPipeline, export, base, s)
    with open(data) as f:
        prompt = f.readline().strip()
    settings = clip_settings(base, s)
    (h, w), frames = wan.video_size(settings), wan.num_frames(settings)
    with torch.no_grad():
        video = pipe(prompt=prompt, height=h, width=w, num_frames=frames, num_inference_steps=4, guidance_scale=1.0,
                     output_type="np", generator=torch.Generator().manual_seed(0),
                     max_sequence_length=int(s["extra"].get("max_sequence_length", 512))).frames
    trained = [1000 * x for x in wan.generator_sigmas(base, timestep_sigmas(str(s["extra"]["denoising_steps"])
                                                                          .split(",")))]
    finite, shape = bool(np.isfinite(video).all()), tuple(video.shape)
    print(f"export sampled in 4 steps: {shape} video, timesteps seen {[round(t, 3) for t in seen]}, trained "
          f"{[round(t, 3) for t in trained]}, finite {finite}", flush=True)
    return (finite and shape == (1, frames, h, w, 3) and len(seen) == len(trained)
            and all(abs(a - b) <= 1e-5 * b for a, b in zip(seen, trained)))


# DMD2 of Wan 2.1 T2V-1.3B as recipes/dmd_wan21_t2v_1.3b_lora.sh runs it: a LoRA r64 generator and a LoRA r64 fake
# score on the bf16 teacher, its CFG 5 (WanPipeline's default, the pair as one batch), 4 steps
WAN_DMD = {"denoising_steps": "999,749,499,249", "conditioning_timestep": 999, "fake_score_fp32": 0,
           "lora_alpha": 64, "fake_lora": 1, "generator_lr": 5e-5, "guidance_lr": 5e-5, "real_guidance_scale": 5.0}


def suite(row, tiny: bool) -> list:
    """--suite=wan: the recipe's DMD2 at 81 frames of 480 x 832 (32,760 video tokens + 512 text; tiny: 9 frames of
    32 x 32), AC: saved, resumed, exported and the export sampled in 4 steps; then the same timed only. Each row
    beside the plain reference of its transformer (the teacher's CFG pair and the frozen-weight backward among its
    calls) and the planner's peak."""
    clip = {"num_frames": 9, "bucket_aspects": "1.0"} if tiny else {"num_frames": 81}  # 81: the pipeline's
    side = 32 if tiny else 480
    name = f"dmd_wan21_t2v_{side}p_{clip['num_frames']}f_4step_lora64_ac"
    settings = dict(ac=True, lora_rank=64, export_dtype="bf16", ref=True, extra={**WAN_DMD, **clip})
    return [row(name, "train_dmd.py", "wan", side, 110, resume=True, **settings),
            row(f"{name}_timed", "train_dmd.py", "wan", side, 50, **settings)]


GPU = GpuCheck(suite=suite, label="Wan 2.1 T2V-1.3B", configs="wan2.1-t2v-1.3b",
               parts=(("vae", _vae), ("text_encoder", _text_encoder)), keep=("tokenizer", "scheduler"),
               reference_shape=reference_shape, dmd_calls=true_cfg_calls, target_grid=target_grid,
               blocks=("num_layers",), default_blocks=(2,), data_references=0, reference_note=", one clip",
               true_cfg=True, export_loads=export_samples,
               encodes_target=False)  # DMD2 of text to video: the generator makes the target, nothing is encoded
