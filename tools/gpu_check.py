"""The GPU acceptance check: both scripts at real width on one bare GPU machine, sized to the disk it
finds and timed to fit one call of at most 9.5 minutes (wheels, models and clean-up included), one table.

    bash tools/gpu_check.sh --out=$OUT             # on a machine with a CUDA GPU, no network needed
    python tools/gpu_check.py --tiny --cpu         # the same plumbing on the tiny models, on CPU

What it does, in order, under one deadline (--deadline_s; gpu_check.sh counts it from its own start):
tests/test_gpu.py starts in the background (three at a time where pytest-xdist is installed) while the
models are built (random weights: SD-1.5's UNet, VAE and CLIP at their real configs; FLUX.1 Kontext's
transformer at real width with --flux_blocks double + single blocks, its real VAE, CLIP-L and a
one-layer T5 of the real width; Qwen-Image-Edit-2509's transformer at real width with --qwen_blocks
blocks, its real VAE and a one-layer Qwen2.5-VL of the real width). Then every row is sized to the
disk: one checkpoint of its trained models and optimizers (checkpoint.checkpoint_bytes, the models
built on meta as tools/memory_plan.py builds them) and its export (components.export.export_bytes),
two checkpoints and the export for a row that resumes, against the free space of --out less the
model folders still to be written and HEADROOM. A FLUX or Qwen-Image-Edit row that does not fit
gets half the blocks (again, until it fits); any other row is not run and says why. The planner's
GPU totals are computed meanwhile in a background process. Then the plain-PyTorch reference of the
Kontext and Qwen-Image-Edit rows' transformer (bf16 weights, forward + backward, no FSDP, no optimizer;
apart, the fused AdamW step over its fp32 parameters and the VAE encode of a step's images). Then the
rows in order of value (plan_runs): Kontext 1024 px full fine-tune (save -> resume -> export -> load),
DMD2 SD-1.5 512 px, Kontext LoRA 512 px (resume), a cuDNN-attention probe, Kontext NF4 LoRA +
adamw8bit, DMD2 with a Kontext teacher (resume), Kontext LoRA under COMPILE=1, Qwen-Image-Edit LoRA at
1024 px with two references, its 512 px full fine-tune (resume, export loaded as the pipeline); the
Qwen-Image-Edit rows are a second call (--suite=qwen), FLUX.2 klein-base DMD2 a third (--suite=flux2: a LoRA
r64 generator and a full fake score at 512 px saved, resumed, exported and the export sampled in 4 steps by
Flux2KleinPipeline, and the same timed at 1024 px; klein-base-4B's transformer at --flux2_blocks of real width,
its real VAE, a narrow Qwen3 of the real width)
(--suite=speed: the step-time rows instead, and a DMD2 generator + fake-score step under
torch.profiler, its table in profile_*.txt). A row starts only when its expected seconds (each row's
expect_s in plan_runs, times how long the rows so far took against theirs) fit the time left; one
still running at the deadline is cut. Each row keeps one checkpoint at a time and its folder is
deleted once checked. On CPU the rows that need CUDA are skipped and the table says so, and the others
compute in fp32 (PRECISION=fp32, as the plain reference does there). --tiny runs on tools/tiny_models'
default folders (built once in its cache, $FSDP_DIFFUSION_CACHE).

Every row shows its model, its step time (the mean of the steps after the first two, whose warm-up
seconds and, under COMPILE=1, compile seconds are shown apart) as "x plain", its MFU (model FLOPs: the
trained networks' forward + backward, no VAE, no recomputation, against the peak of the dtype used),
its peak CUDA memory against the planner's, its disk need against the free space, and its seconds
against the expected; each DMD2 UNet row and FLUX.2 row is also set against the plain-eager time of its
network calls (dmd_network_ms, dmd_flow_network_ms) with the goal DMD_GOAL. Exit 0 when every row passed
(or was skipped for want of CUDA) and tests/test_gpu.py passed. Output (at most 8 files): gpu_check.md (the
table), gpu_check.json, runs.log (every run's output, tracebacks included), test_gpu.log, build.log, and with
--suite=speed profile_dmd_sd15_*.txt (and profile_dmd_qwen_*.txt).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
REAL = os.path.join(HERE, "real_size_configs")
GIB = 2**30
GB = 10**9  # disks as they are sold and df -H shows them (checkpoint.py's messages too)
HEADROOM = 2 * GB  # beside a row's checkpoints and export: logs, samples, the compile cache, profiler traces
CALL_S = 540  # the whole check, wheels included (gpu_check.sh sets GPU_CHECK_T0): 9 of the device tool's 10 minutes
END_RESERVE_S = 15  # kept back from the deadline: the table, stopping the tests, removing the work folder
# before the first row on an H100: wheels, imports, the build (~17 s), sizing, the planner's start
STARTUP_EXPECT_S = 45
REF_EXPECT_S = 15  # one plain reference on an H100: load, 7 timed forward + backward, AdamW, VAE encode
COMPILE_DMD_EXPECT_S = 300  # DMD2 SD-1.5 under COMPILE=1: ~27 graphs (docs/gpu.md) with AC, then 5 timed steps
TEST_WORKERS = 3  # tests/test_gpu.py's launches side by side (pytest-xdist): ~100 s instead of ~280 s


# ----------------------------------------------------------------------------------------------
# models and data, built offline


def _copy_small_parts(tiny: str, out: str, keep: tuple[str, ...]) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(tiny):
        if name in keep or name == "model_index.json":
            src = os.path.join(tiny, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(out, name))


def _init_device():
    """Where random weights are drawn: the GPU when there is one (seconds instead of a minute)."""
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sd15_folder(root: str, tiny: bool) -> str:
    """An SD-1.5 pipeline folder: the real UNet, VAE and CLIP configs with random weights (or, tiny,
    the project's tiny SD-1.5 folder: tiny_default), the tiny tokenizer, SD-1.5's scheduler."""
    if tiny:
        return tiny_default("sd15")
    from tools import tiny_models
    base = os.path.join(root, "sd15_tiny")
    if not os.path.isdir(base):
        tiny_models.make_tiny_sd15(base)
    out = os.path.join(root, "sd15_real")
    if not os.path.isdir(out):
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel
        _copy_small_parts(base, out, ("tokenizer", "scheduler"))
        with _init_device():
            for sub, cls in (("unet", UNet2DConditionModel), ("vae", AutoencoderKL)):
                config = cls.load_config(os.path.join(REAL, "sd15-dmd", sub))
                cls.from_config(config).save_pretrained(os.path.join(out, sub))
            config = CLIPTextConfig.from_pretrained(os.path.join(REAL, "sd15-dmd", "text_encoder"))
            CLIPTextModel(config).save_pretrained(os.path.join(out, "text_encoder"))
    return out


# a row kind's family among tools/tiny_models' defaults
TINY_DEFAULTS = {"sd15": "sd15", "flux": "flux_kontext", "qwen": "qwen_image_edit", "flux2": "flux2_klein"}


def tiny_default(kind: str) -> str:
    """The tiny rows' model folder of a row kind: tools/tiny_models' default of its family (what tiny_folder's
    builder writes, same seed), built once in that cache ($FSDP_DIFFUSION_CACHE: the tests share theirs)."""
    from tools import tiny_models
    return tiny_models.ensure_default(TINY_DEFAULTS[kind])[0]


def tiny_folder(root: str, name: str, builder: str) -> str:
    """root/name: a tiny model folder that tools/tiny_models.`builder` writes (once)."""
    from tools import tiny_models
    base = os.path.join(root, name)
    if not os.path.isdir(base):
        getattr(tiny_models, builder)(base)
    return base


def tiny_flux_folder(root: str) -> str:
    return tiny_folder(root, "flux_tiny", "make_tiny_flux_kontext")


def flux_parts(root: str) -> str:
    """Everything of a FLUX.1 Kontext folder but its transformer: the real VAE, CLIP-L and a
    one-layer T5 of the real width (random weights), the tiny tokenizers, the scheduler."""
    out = os.path.join(root, "flux_parts")
    if os.path.isdir(out):
        return out
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    _copy_small_parts(tiny_flux_folder(root), partial, ("tokenizer", "tokenizer_2", "scheduler"))
    width = FluxTransformer2DModel.load_config(os.path.join(REAL, "flux-kontext-dev", "transformer"))
    with _init_device():
        AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(REAL, "flux-kontext-dev", "vae"))
                                  ).save_pretrained(os.path.join(partial, "vae"))
        clip = CLIPTextConfig.from_pretrained(os.path.join(REAL, "flux-kontext-dev", "text_encoder"))
        CLIPTextModel(clip).save_pretrained(os.path.join(partial, "text_encoder"))
        vocab = len(T5TokenizerFast.from_pretrained(os.path.join(partial, "tokenizer_2")))
        t5 = T5Config(vocab_size=vocab, d_model=width["joint_attention_dim"], d_kv=64, d_ff=1024, num_layers=1,
                      num_heads=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1)
        T5EncoderModel(t5).save_pretrained(os.path.join(partial, "text_encoder_2"))
    os.replace(partial, out)
    return out


def _skeleton(out: str, config: dict, parts: str | None) -> str:
    """`out`/transformer/config.json holding `config`, no weights yet (transformer_weights writes them),
    beside links to `parts`' components (None: config only, enough to size a run)."""
    os.makedirs(os.path.join(out, "transformer"), exist_ok=True)
    with open(os.path.join(out, "transformer", "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in os.listdir(parts) if parts else ():
        dst, src = os.path.join(out, name), os.path.join(parts, name)
        if not os.path.lexists(dst):  # folders linked (gigabytes), files copied (the export rewrites its copy)
            os.symlink(src, dst) if os.path.isdir(src) else shutil.copy(src, dst)
    return out


def transformer_weights(folder: str) -> None:
    """The skeleton's transformer with random weights, of the class its config names (written once)."""
    import diffusers
    sub = os.path.join(folder, "transformer")
    if any(name.endswith(".safetensors") for name in os.listdir(sub)):
        return
    cls = getattr(diffusers, _config_class(sub))
    with _init_device():
        cls.from_config(cls.load_config(sub)).save_pretrained(sub)


def _config_class(sub: str) -> str:
    with open(os.path.join(sub, "config.json")) as f:
        return json.load(f)["_class_name"]


def flux_skeleton(root: str, blocks: tuple[int, int], parts: str | None) -> str:
    """work/flux_real_D_S: the FLUX transformer's real config with D double + S single blocks (_skeleton)."""
    from diffusers import FluxTransformer2DModel
    config = dict(FluxTransformer2DModel.load_config(os.path.join(REAL, "flux-kontext-dev", "transformer")))
    config.update(num_layers=blocks[0], num_single_layers=blocks[1])
    return _skeleton(os.path.join(root, f"flux_real_{blocks[0]}_{blocks[1]}"), config, parts)


QWEN = os.path.join(REAL, "qwen-image-edit")


def tiny_qwen_folder(root: str) -> str:
    return tiny_folder(root, "qwen_tiny", "make_tiny_qwen_image_edit")


def qwen_text_encoder_config(tiny: dict) -> dict:
    """The tiny folder's Qwen2.5-VL config (its vocabulary and special token ids: the tiny tokenizer's)
    at the real text and vision widths, one layer of each: the text cache gets embeddings of the
    real width, computed at the real per-layer cost."""
    with open(os.path.join(QWEN, "text_encoder", "config.json")) as f:
        real = json.load(f)
    text = {k: real[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "rms_norm_eps", "hidden_act", "max_position_embeddings")}
    section = real["rope_scaling"]["mrope_section"]
    text.update(num_hidden_layers=1, max_window_layers=1, layer_types=["full_attention"],
                rope_parameters={**tiny["text_config"]["rope_parameters"], "mrope_section": section})
    vision = {k: v for k, v in real["vision_config"].items() if k in tiny["vision_config"] and k != "model_type"}
    # one block, attending fully (the real tower's last of each 8 does); its merger to the text width
    vision.update(depth=1, fullatt_block_indexes=[0], out_hidden_size=real["hidden_size"])
    return {**tiny, "text_config": {**tiny["text_config"], **text},
            "vision_config": {**tiny["vision_config"], **vision}}


def qwen_parts(root: str) -> str:
    """Everything of a Qwen-Image-Edit-2509 folder but its transformer: the real AutoencoderKLQwenImage
    and a one-layer Qwen2.5-VL of the real width with a one-block vision tower (random weights), the
    tiny tokenizer and processor, the scheduler."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def encoder(tiny):
        with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
            config = Qwen2_5_VLConfig.from_dict(qwen_text_encoder_config(json.load(f)))
        return Qwen2_5_VLForConditionalGeneration(config)
    return _parts_folder(root, "qwen_parts", tiny_qwen_folder, ("tokenizer", "processor", "scheduler"),
                         AutoencoderKLQwenImage, QWEN, encoder)


def _parts_folder(root: str, name: str, tiny_folder_of, keep: tuple[str, ...], vae_class, real: str, encoder) -> str:
    """root/name (written once, through a .partial folder): the tiny folder's `keep` parts and model_index.json,
    a `vae_class` VAE of the real config in `real`/vae and `encoder(tiny folder)`'s text encoder, both with random
    weights drawn on the init device."""
    out = os.path.join(root, name)
    if os.path.isdir(out):
        return out
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    tiny = tiny_folder_of(root)
    _copy_small_parts(tiny, partial, keep)
    with _init_device():
        vae_class.from_config(vae_class.load_config(os.path.join(real, "vae"))).save_pretrained(
            os.path.join(partial, "vae"))
        encoder(tiny).save_pretrained(os.path.join(partial, "text_encoder"))
    os.replace(partial, out)
    return out


def qwen_skeleton(root: str, blocks: int, parts: str | None) -> str:
    """work/qwen_real_N: the Qwen-Image-Edit transformer's real config with N dual-stream blocks (_skeleton)."""
    with open(os.path.join(QWEN, "transformer", "config.json")) as f:
        config = {**json.load(f), "num_layers": blocks}
    return _skeleton(os.path.join(root, f"qwen_real_{blocks}"), config, parts)


def smaller_qwen_blocks(blocks: int) -> int | None:
    """Half the Qwen-Image-Edit blocks (4 -> 2 -> 1); None past 1."""
    return blocks // 2 or None


def qwen_pairs(root: str, size: int, tiny: bool = False) -> str:
    """Edits with two references (a shape, a colour swatch) at `size` px (tiny: TINY_SAMPLES): data.jsonl's path."""
    from tools import tiny_models
    folder = os.path.join(root, f"two_ref_pairs_{size}" + ("_tiny" if tiny else ""))
    if not os.path.isdir(folder):
        tiny_models.make_two_reference_edit_dataset(folder, TINY_SAMPLES if tiny else 24, size=size)
    return os.path.join(folder, "data.jsonl")


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


FLUX2 = os.path.join(REAL, "flux2-klein-4b")


def tiny_flux2_folder(root: str) -> str:
    return tiny_folder(root, "flux2_tiny", "make_tiny_flux2_klein")


def flux2_text_encoder_config(tiny: dict) -> dict:
    """The tiny klein's Qwen3 config (its vocabulary, special token ids and 28 layers: the pipeline stacks the
    hidden states of layers 9, 18 and 27) at the real hidden width, each layer narrow (2 heads of the real 128
    dims, an MLP of 256): the text cache gets embeddings of the real width (3 x 2560, the transformer's
    joint_attention_dim) from ~0.1 B parameters instead of 4 B."""
    with open(os.path.join(FLUX2, "text_encoder", "config.json")) as f:
        real = json.load(f)
    return {**tiny, "hidden_size": real["hidden_size"], "head_dim": real["head_dim"], "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 256}


def flux2_parts(root: str) -> str:
    """Everything of a FLUX.2 [klein]-base folder but its transformer: the real AutoencoderKLFlux2 and a
    narrow Qwen3 of the real width (flux2_text_encoder_config; random weights), the tiny tokenizer, the
    scheduler, model_index.json (is_distilled false: a base, sampled with true CFG)."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def encoder(tiny):
        with open(os.path.join(tiny, "text_encoder", "config.json")) as f:
            return Qwen3ForCausalLM(Qwen3Config.from_dict(flux2_text_encoder_config(json.load(f))))
    return _parts_folder(root, "flux2_parts", tiny_flux2_folder, ("tokenizer", "scheduler"), AutoencoderKLFlux2,
                         FLUX2, encoder)


def flux2_skeleton(root: str, blocks: tuple[int, int], parts: str | None) -> str:
    """work/flux2_real_D_S: klein-base-4B's transformer config with D double + S single blocks (_skeleton)."""
    with open(os.path.join(FLUX2, "transformer", "config.json")) as f:
        config = {**json.load(f), "num_layers": blocks[0], "num_single_layers": blocks[1]}
    return _skeleton(os.path.join(root, f"flux2_real_{blocks[0]}_{blocks[1]}"), config, parts)


def smaller_size(size):
    """The next smaller model of a row (smaller_qwen_blocks, smaller_blocks; a FLUX.2 size ("klein", D, S)
    halves as FLUX does); None: no smaller one."""
    if isinstance(size, int):
        return smaller_qwen_blocks(size)
    if isinstance(size, tuple) and size[0] == "klein":
        half = smaller_blocks(size[1:])
        return ("klein", *half) if half else None
    return smaller_blocks(size) if isinstance(size, tuple) else None


# the tiny rows' prompts and pairs: 4 to train on beside the 4 the Kontext script holds out for samples (each run
# encodes all of them into its text cache first, which the rows' plumbing does not need 24 or 64 of)
TINY_SAMPLES = 8


def datasets(root: str, size: int, tiny: bool = False) -> tuple[str, str]:
    """(DMD2 prompts .txt, Kontext pairs .jsonl at `size` px); tiny: TINY_SAMPLES of each."""
    from tools import tiny_models
    suffix = "_tiny" if tiny else ""
    prompts = os.path.join(root, f"prompts{suffix}.txt")
    if not os.path.exists(prompts):
        tiny_models.make_prompts_file(prompts, TINY_SAMPLES if tiny else 64)
    pairs = os.path.join(root, f"pairs_{size}{suffix}")
    if not os.path.isdir(pairs):
        tiny_models.make_edit_dataset(pairs, TINY_SAMPLES if tiny else 24, size=size)
    return prompts, os.path.join(pairs, "data.jsonl")


def model_label(size) -> str:
    """A row's model for the table: "FLUX 2+4 blocks", "FLUX.2 klein 2+4 blocks", "Qwen-Image-Edit 4 blocks",
    "SD-1.5", "tiny FLUX", ..."""
    if isinstance(size, tuple) and size[0] == "klein":
        return f"FLUX.2 klein {size[1]}+{size[2]} blocks"
    if isinstance(size, tuple):
        return f"FLUX {size[0]}+{size[1]} blocks"
    if isinstance(size, int):
        return f"Qwen-Image-Edit {size} blocks"
    return {"sd15": "SD-1.5", "tiny_sd15": "tiny SD-1.5", "tiny_flux": "tiny FLUX",
            "tiny_qwen": "tiny Qwen-Image-Edit",
            "tiny_flux2": "tiny FLUX.2 klein"}.get(size, "-")


# ----------------------------------------------------------------------------------------------
# disk: each row's checkpoints and export against the free space of --out


def disk_usage(path: str) -> tuple[str, int, int]:
    """(the existing folder measured, free bytes, total bytes) of `path`'s filesystem."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    usage = shutil.disk_usage(path)
    return path, usage.free, usage.total


def row_bytes(row: dict, folder: str) -> tuple[int, int]:
    """(one checkpoint, the export) of `row` on the model folder `folder`, in bytes. The trained
    models are built on meta as tools/memory_plan.py builds them (the roles of families.pipelines, the
    precision mode's storage dtype, LoRA adapters), with the row's optimizer, and counted by the
    scripts' own disk preflight arithmetic (checkpoint.checkpoint_bytes, export_bytes; frozen parts
    count where `folder` has their weights). Needs only the trained models' config.json. No row sets
    EMA_DECAY, so no EMA is counted."""
    import torch

    from checkpoint import checkpoint_bytes
    from components.export import export_bytes
    from parallel import lora as lora_lib
    from components import optim
    from precision import get_precision, parse_dtype
    from tools import memory_plan
    s = row["settings"]
    extra = s.get("extra", {})
    lora = lora_lib.Lora(s.get("lora_rank", 0), float(extra.get("lora_alpha", 0)))
    _, _, parts = memory_plan.build_components(folder, get_precision(s["precision"]), build=False, lora=lora,
                                               script=row["script"])
    trained, subfolder = {}, ""
    for part in (p for p in parts if p.holding.trained):
        model = torch.nn.Module.to(memory_plan.meta_model(os.path.join(folder, part.spec.subfolder)), part.dtype)
        # under DDP a model computed wider than it is stored is stored in its compute dtype (docs/gpu.md)
        if (extra.get("parallelism") == "ddp" and part.name == "fake_score"
                and fake_score_fp32(extra)):
            model = torch.nn.Module.to(model, torch.float32)
        if part.lora:
            with torch.device("meta"):
                lora_lib.add_lora(model, part.lora)
        trained[part.name], subfolder = model, subfolder or part.spec.subfolder
    optimizers = {k: optim.make_optimizer(s.get("optimizer", "adamw"), [p for p in m.parameters() if p.requires_grad],
                                           lr=1e-4, betas=(0.9, 0.999)) for k, m in trained.items()}
    export = export_bytes(folder, subfolder, next(iter(trained.values())), parse_dtype(s["export_dtype"]),
                          lora=bool(lora))
    return checkpoint_bytes(trained, optimizers), export


def peak_disk(one: int, export: int, resume: bool) -> int:
    """A row's most bytes on disk: its checkpoint and export; with a resume also the second
    checkpoint, written before the first is pruned (KEEP_LAST=1), and the new export written beside
    the old one (components.export swaps it in at the end)."""
    return max(2 * one + export, one + 2 * export) if resume else one + export


def folder_bytes(folder: str) -> int:
    """What writing a skeleton's transformer takes: its parameters in fp32, as save_pretrained writes them."""
    from tools import memory_plan
    model = memory_plan.meta_model(os.path.join(folder, "transformer"))
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def smaller_blocks(blocks: tuple[int, int]) -> tuple[int, int] | None:
    """Half the FLUX blocks of each kind, one of each at least (19+38 -> 9+19 -> 4+9 -> 2+4 -> 1+2 -> 1+1:
    a LoRA row targets modules of both kinds); None past 1+1."""
    half = (max(blocks[0] // 2, 1), max(blocks[1] // 2, 1))
    return half if half != blocks else None


def fit_to_disk(rows: list[dict], free: int, need, folder_cost, smaller) -> dict:
    """{run: model size} where every row's peak bytes `need(row, size)` fit `free` less HEADROOM and
    less the model folders the chosen sizes still need written (`folder_cost(size)`, 0 for one on
    disk): the rows run one after the other and each deletes its output once checked, so each must
    fit alone. The row furthest over gets `smaller(row, size)` (None: no smaller model, not run)
    until every row fits."""
    choice = {r["run"]: r["size"] for r in rows}
    while True:
        room = free - HEADROOM - sum(folder_cost(z) for z in set(choice.values()) if z is not None)
        over = [(excess, i) for i, r in enumerate(rows) if choice[r["run"]] is not None
                for excess in [need(r, choice[r["run"]]) - room] if excess > 0]
        if not over:
            return choice
        row = rows[max(over)[1]]
        choice[row["run"]] = smaller(row, choice[row["run"]])


# ----------------------------------------------------------------------------------------------
# time: one deadline, and rows started only where their expected seconds fit


class Deadline:
    """The seconds left, and whether a row expected to take `expect_s` fits them: its expectation
    times how long the rows so far took against theirs (at least half), with END_RESERVE_S kept."""

    def __init__(self, seconds: float, start: float):
        self.seconds, self.end = seconds, start + seconds
        self.taken = self.expected = 0.0

    def left(self) -> float:
        return self.end - time.monotonic() - END_RESERVE_S

    def scale(self) -> float:
        return max(0.5, self.taken / self.expected) if self.expected else 1.0

    def fits(self, expect_s: float) -> bool:
        return expect_s * self.scale() <= self.left()

    def record(self, expect_s: float, took_s: float) -> None:
        self.expected, self.taken = self.expected + expect_s, self.taken + took_s


# ----------------------------------------------------------------------------------------------
# the plain-PyTorch reference: the model alone, bf16 weights, no FSDP, no optimizer


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
    if kind not in ("flux", "flux2"):  # the UNet as CHANNELS_LAST runs it (sd_unet.to_channels_last): NHWC conv inputs
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


# ----------------------------------------------------------------------------------------------
# one training run: steps, then (optionally) resume one step and load the export


def launch(script: str, args: list[str], world: int, log: str, timeout: float) -> int:
    """torchrun of `script`; its output appended to `log`; killed (rc 124) past `timeout` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.join(ROOT, script), *args]
    with open(log, "a") as f:
        f.write(f"\n===== {' '.join(cmd[4:])}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"===== killed: past the check's deadline ({timeout:.0f} s left for it)\n")
            return 124


def fake_score_fp32(extra: dict) -> bool:
    """A DMD2 row's FAKE_SCORE_FP32: its own, or train_dmd.py's default (the planner's Settings mirrors it)."""
    from tools import memory_plan
    return bool(int(extra.get("fake_score_fp32", memory_plan.Settings.fake_score_fp32)))


def planned_bytes(model: str, world: int, s: dict, script: str, gpu_gb: float) -> int:
    """The planner's GPU total for a row, with the scripts' RESHARD_AFTER_FORWARD=auto on a GPU of `gpu_gb`."""
    from tools import memory_plan
    extra = s.get("extra", {})
    settings = memory_plan.Settings(world_size=world, precision=s["precision"], batch_size=s["batch_size"],
                                    resolution=s["resolution"], activation_checkpointing=s.get("ac", False),
                                    lora_rank=s.get("lora_rank", 0), base_dtype=s.get("base_dtype", ""),
                                    optimizer=s.get("optimizer", "adamw"), script=script,
                                    fake_score_fp32=fake_score_fp32(extra),
                                    fp8=extra.get("fp8", ""), reshard_after_forward=None, gpu_memory_gb=gpu_gb)
    return memory_plan.plan(model, settings)["gpu_total"]


def plan_all(jobs: list[tuple[str, tuple]], path: str) -> None:
    """In a background process (the planner takes seconds per row at real width, all CPU): each
    row's planned GiB, or the planner's error, one JSON line each in `path`."""
    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    for name, args in jobs:
        try:
            value = planned_bytes(*args) / GIB
        except Exception as e:  # noqa: BLE001 - a planner gap is a table cell, not the end of the check
            value = f"planner: {type(e).__name__}"
        with open(path, "a") as f:
            f.write(json.dumps({"run": name, "planned": value}) + "\n")


def run_args(script: str, s: dict, model: str, data: str, out: str) -> list[str]:
    args = [f"--model_path={model}", f"--data_path={data}", f"--output_dir={out}", f"--precision={s['precision']}",
            f"--batch_size={s['batch_size']}", f"--resolution={s['resolution']}", "--log_every=1", "--save_every=0",
            "--keep_last=1", "--sample_every=0", f"--activation_checkpointing={int(s.get('ac', False))}",
            f"--export_dtype={s['export_dtype']}"]
    args += [f"--{k}={v}" for k, v in s.get("extra", {}).items()]
    if s.get("lora_rank"):
        args.append(f"--lora_rank={s['lora_rank']}")
    if script == "train_flux_kontext.py":
        args.append("--val_every=0")
    return args


METRICS = ("step_ms", "mfu", "hfu", "model_tflop", "allocated_gib", "reserved_gib", "planned_gib")


def blank_result(row: dict, status: str, ok: bool) -> dict:
    """A row's result before (or without) running it; `ok`: whether it counts as passed."""
    return {"run": row["run"], "model": model_label(row.get("size")), "world": row["world"], "status": status,
            "ok": ok, "resume_export": "-", "wall_s": float("nan"), "expect_s": row["expect_s"],
            "disk_need_gb": float("nan"), "disk_free_gb": float("nan"), "warmup_s": float("nan"),
            "compile_s": float("nan"), "timed_steps": [], **{k: float("nan") for k in METRICS}}


def one_run(row: dict, folder: str, data: str, out: str, log: str, deadline: Deadline) -> dict:
    name, script, kind, world, s = row["run"], row["script"], row["kind"], row["world"], row["settings"]
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    args = run_args(script, s, folder, data, run_dir)
    steps = row["steps"]
    result = blank_result(row, "", False)
    rc = launch(script, args + [f"--max_steps={steps}"], world, log, deadline.left())
    records = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        records = [json.loads(line) for line in open(path) if '"step_ms"' in line]
    warm, later = timed_window(records, row["warmup"], finished=rc == 0)
    result["warmup_s"] = sum(r["step_ms"] for r in warm) / 1000
    result["timed_steps"] = [int(r["step"]) for r in later]
    result["losses"] = [r["loss"] for r in records if "loss" in r]  # the FP8 rows' side-by-side table
    result["step_indices"] = [int(r["step_index"]) for r in later if "step_index" in r]  # a few-step DMD2 run's
    if s["extra"].get("compile"):  # this launch's output: after its "===== <command>" line (a cut adds "===== killed")
        result["compile_s"] = compile_seconds(open(log).read().rsplit("\n===== --", 1)[-1])
    if later:  # the mean over whole DMD2 cycles (steps 3-12 at ratio 5: 2 generator + 8 fake-score steps)
        result["step_ms"] = statistics.mean(r["step_ms"] for r in later)
        for k_out, k_in in (("mfu", "mfu"), ("hfu", "hfu"), ("model_tflop", "model_tflop"),
                            ("allocated_gib", "cuda_peak_gib"),
                            ("reserved_gib", "cuda_reserved_gib")):
            if k_in in later[-1]:
                result[k_out] = later[-1][k_in]
    result["status"] = "pass" if rc == 0 else ("cut at the deadline" if rc == 124 else f"FAIL rc {rc} (runs.log)")
    result["ok"] = rc == 0
    if row["probe"]:  # a kernel the start-up check should stop: say what happened, pass or stop
        said = [line for line in open(log).read().rsplit("=====", 1)[-1].splitlines() if "start-up check" in line]
        result["status"] = (f"stopped at start: {said[0].split(': ', 2)[-1][:160]}" if rc == 1 and said
                            else "trained: the kernel passed the check" if rc == 0 else result["status"])
        result["ok"] = rc == 0 or (rc == 1 and bool(said))
        result["probe"] = said[:1]
    if rc == 0 and row["resume"]:
        if deadline.left() < 30:
            result["resume_export"], result["ok"] = "not run (deadline)", False
        else:
            rc2 = launch(script, args + [f"--max_steps={steps + 1}", "--resume=auto"], world, log, deadline.left())
            resumed = rc2 == 0 and "resumed from" in open(log).read().rsplit("=====", 1)[-1]
            result["resume_export"] = "pass" if resumed and export_loads(run_dir, kind, s, folder, data) else \
                ("cut at the deadline" if rc2 == 124 else "FAIL (runs.log)")
            result["ok"] = result["resume_export"] == "pass"
    table_path = os.path.join(run_dir, "profile", "ops_rank0.txt")
    if os.path.exists(table_path):  # PROFILE_STEPS' table (the traces stay behind: too big to bring back)
        shutil.copy(table_path, os.path.join(out, f"profile_{name}.txt"))  # its step times include the profiler
    shutil.rmtree(run_dir, ignore_errors=True)  # a full checkpoint is tens of GB: the next row needs the disk
    return result


def timed_window(records: list[dict], warmup: int, finished: bool) -> tuple[list[dict], list[dict]]:
    """(warm-up records, timed records) of a run's per-step records: the first `warmup` steps (the
    first steps' allocations, cuDNN's autotuning and, under COMPILE, every graph's compilation) are
    not timed. A finished run with no step past them (a 2-step probe) is timed over all its steps;
    one cut before its timed window has none."""
    if len(records) > warmup or not finished:
        return records[:warmup], records[warmup:]
    return [], records


def compile_seconds(log: str) -> float:
    """The seconds torch.compile spent in a run, from its last compile report in `log`
    (parallel/compile.compile_report: "... (12.3 s compiling)"); NaN when there is none."""
    import re
    found = re.findall(r"\(([0-9.]+) s compiling\)", log)
    return float(found[-1]) if found else float("nan")


def dmd_network_ms(plain: dict, steps: list[int], ratio: int, ac: bool) -> tuple[float, int]:
    """(ms per step, generator steps) of the network calls of DMD2 `steps` at plain-eager speed, from
    the plain reference's forward without grad F and forward + backward P at the row's batch (plain
    eager, no FSDP, no optimizer, no text encoder). A fake-score step runs the generator without
    grad and the fake score forward + backward: F + P (1.33 P at F = P / 3). A generator step (steps
    where dm.should_update_generator(step - 1, ratio), as train_dmd.py's loop decides) adds the
    generator's own forward + backward, the teacher's CFG pair and the fake score's DM-loss forward,
    and needs no generator forward without grad: 2 P + 3 F. With activation checkpointing every
    forward + backward recomputes its forward: P + F in place of P. The mean over `steps`."""
    from algorithms.dmd2 import should_update_generator
    f, p = plain["fwd_ms"], plain["fwd_bwd_ms"] + (plain["fwd_ms"] if ac else 0.0)
    gen = sum(should_update_generator(step - 1, ratio) for step in steps)
    total = gen * (2 * p + 3 * f) + (len(steps) - gen) * (f + p)
    return total / max(len(steps), 1), gen


def dmd_flow_network_ms(plain: dict, steps: list[int], indices: list[int], ratio: int, ac: bool,
                        lora_generator: bool, cfg_pair: bool) -> tuple[float, int]:
    """(ms per step, generator steps) of the network calls of a flow teacher's DMD2 `steps` (algorithms/dmd2_flow.py)
    at plain-eager speed. Every step encodes its references (V: the plain VAE encode) and runs the generator's
    backward simulation to the step's σ index k (`indices`, the logged step_index: k forwards without grad, F). A
    fake-score step then makes G's images without grad (F) and trains the fake score (P); a generator step makes
    them with grad (P_G: plain forward + backward, or with a LoRA generator the frozen weights' forward + backward,
    which computes no weight gradients), runs the teacher (true CFG: the pair as one batch of 2B, F2; else F) and
    the fake score's DM-loss forward (F), and trains the fake score (P):
        fake-score step  V + (k + 1) F + P
        generator step   V + k F + P_G + F2 + F + P
    With activation checkpointing every forward + backward recomputes its forward: + F. The mean over `steps`."""
    from algorithms.dmd2 import should_update_generator
    f, v, redo = plain["fwd_ms"], plain["vae_ms"], plain["fwd_ms"] if ac else 0.0
    p = plain["fwd_bwd_ms"] + redo
    p_gen = (plain["frozen_fwd_bwd_ms"] if lora_generator else plain["fwd_bwd_ms"]) + redo
    teacher = plain["fwd_pair_ms"] if cfg_pair else f
    total, gen = 0.0, 0
    for step, k in zip(steps, indices):
        if should_update_generator(step - 1, ratio):
            total, gen = total + v + k * f + p_gen + teacher + f + p, gen + 1
        else:
            total += v + (k + 1) * f + p
    return total / max(len(steps), 1), gen


def export_loads(run_dir: str, kind: str, s: dict, base: str = "", data: str = "") -> bool:
    import diffusers
    export = os.path.join(run_dir, "export")
    if kind == "flux2":
        return flux2_export_samples(export, base, s, data)
    if s.get("lora_rank"):
        return os.path.exists(os.path.join(export, "pytorch_lora_weights.safetensors"))
    if kind == "qwen":
        return qwen_export_loads(export)
    sub = "transformer" if kind == "flux" else "unet"
    return diffusers.AutoModel.from_pretrained(os.path.join(export, sub)) is not None


def flux2_export_samples(export: str, base: str, s: dict, data: str) -> bool:
    """A klein DMD2 export sampled as BFL's distilled klein is: the full export's Flux2KleinPipeline, or the base
    folder with is_distilled=True, load_lora_weights and the export's scheduler; 4 steps at the row's size on the
    first pair's context and prompt. Passes when the image is finite and the transformer saw the trained σ list."""
    import numpy as np
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from PIL import Image

    from algorithms.dmd2_flow import timestep_sigmas
    from parallel import attention
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if s.get("lora_rank"):
        pipe = Flux2KleinPipeline.from_pretrained(base, is_distilled=True, torch_dtype=dtype)
        pipe.load_lora_weights(export)
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(export, subfolder="scheduler")
    else:
        pipe = Flux2KleinPipeline.from_pretrained(export, torch_dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    attention.sdpa_flags(attention.DEFAULT)  # the kernel chosen, not torch's default (cuDNN first on Hopper)
    attention.set_backend(pipe.transformer, attention.DEFAULT)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(float(kw["timestep"][0])),
                                               with_kwargs=True)
    with open(data) as f:
        row = json.loads(f.readline())
    context = Image.open(os.path.join(os.path.dirname(data), row["image"])).convert("RGB")
    side = s["resolution"]
    images = pipe(image=[context], prompt=row["prompt"], num_inference_steps=4, height=side, width=side,
                  output_type="np", generator=torch.Generator().manual_seed(0),
                  max_sequence_length=int(s["extra"].get("max_sequence_length", 512))).images
    trained = timestep_sigmas(str(s["extra"]["denoising_steps"]).split(","))
    finite = bool(np.isfinite(images).all())
    print(f"export sampled in 4 steps: σ seen {seen}, trained {trained}, finite {finite}", flush=True)
    return finite and len(seen) == len(trained) and all(abs(a - b) < 1e-3 for a, b in zip(seen, trained))


def qwen_export_loads(export: str) -> bool:
    """The full export as a user loads it: the whole QwenImageEditPlusPipeline (its processor through
    families.qwen_image.load_processor, which needs no torchvision)."""
    import torch
    from diffusers import QwenImageEditPlusPipeline

    from families.qwen_image import load_processor
    processor = load_processor(os.path.join(export, "processor"))
    pipe = QwenImageEditPlusPipeline.from_pretrained(export, processor=processor, torch_dtype=torch.bfloat16)
    return pipe.transformer is not None and pipe.text_encoder is not None


# ----------------------------------------------------------------------------------------------
# the rows


# DMD2 with a Kontext teacher as recipes/dmd_kontext_4step.sh runs it (three transformers of the FLUX folder)
KONTEXT_DMD = {"denoising_steps": "999,749,499,249", "fake_score_fp32": 0}
# DMD2 with a Qwen-Image-Edit teacher as recipes/dmd_qwen_edit_4step_lora.sh runs it
QWEN_DMD = {**KONTEXT_DMD, "lora_alpha": 8, "generator_lr": 5e-5, "guidance_lr": 4e-7}
# DMD2 with a FLUX.2 klein-base teacher as recipes/dmd_flux2_klein_4step_lora.sh runs it, with bf16 bases and a
# full fake score (the recipe's NF4 bases and LoRA fake score are the 24 GB card's choice)
KLEIN_DMD = {**KONTEXT_DMD, "lora_alpha": 64, "generator_lr": 5e-5, "guidance_lr": 5e-5, "real_guidance_scale": 4.0,
             "real_guidance_norm": "token"}


def plan_runs(tiny: bool, suite: str = "acceptance") -> list[dict]:
    """The rows in order of value: what users hit first runs first. Each row's expect_s: its seconds
    on one H100 with its 64 GB disk (launches, steps, checkpoint writes and reads, export, the load
    check), as docs/gpu.md lists them. suite="speed": the step-time rows instead (Kontext 1024 px full
    fine-tune per attention kernel, AC, COMPILE and CACHE_LATENTS on and off; DMD2 SD-1.5 at the
    published batch 32 per GPU with AC, profiled, and with COMPILE; DMD2 under DDP in bf16)."""
    sd, lo, hi = (32, 32, 64) if tiny else (512, 512, 1024)
    base = {"precision": "bf16-mixed", "batch_size": 1}

    def row(name, script, kind, res, expect_s, warmup=2, **s):
        extra, steps = s.pop("extra", {}), s.pop("steps", 6)
        if script == "train_dmd.py":  # two whole cycles timed after the warm-up (COMPILE: one)
            extra, steps = {"dfake_gen_update_ratio": 5, **extra}, warmup + (5 if extra.get("compile") else 10)
        profile = s.pop("profile", None)  # (first, last): PROFILE_STEPS, the run ends with the window
        if profile:
            extra, steps = {**extra, "profile_steps": f"[{profile[0]},{profile[1]}]"}, profile[1]
        probe = s.pop("probe", False)
        export_dtype = s.pop("export_dtype", "bf16" if script == "train_flux_kontext.py" else "fp32")
        return {"run": name, "script": script, "kind": kind, "world": 1, "resume": s.pop("resume", False),
                "probe": probe, "gpu_only": probe, "steps": 2 if probe else steps, "warmup": warmup,
                "expect_s": expect_s,
                # the x-plain columns: the Kontext rows (their plain model is the trained transformer)
                "ref": script == "train_flux_kontext.py" or suite in ("speed", "flux2", "fp8", "fp8_qwen"),
                "settings": {**base, "resolution": res, "export_dtype": export_dtype, **s, "extra": extra}}

    kontext, dmd = "train_flux_kontext.py", "train_dmd.py"
    def qwen_dmd():  # the Qwen DMD2 rows' settings (qwen_areas reads the pipeline's constants: only when asked)
        return {**QWEN_DMD, **qwen_areas(tiny, lo)}  # references at the target's size, as planned

    if suite == "qwen":  # Qwen-Image-Edit-2509, two references per sample: a call of its own
        return [row(f"qwen_edit_{hi}px_lora16_2refs", kontext, "qwen", hi, 40, lora_rank=16,
                    extra={"lora_alpha": 16, **qwen_areas(tiny, hi, pipeline=True)}),
                row(f"qwen_edit_{lo}px_full", kontext, "qwen", lo, 190, resume=True, extra=qwen_areas(tiny, lo)),
                # recipes/dmd_qwen_edit_4step_lora.sh's Lightning settings: LoRA r64 alpha 8 generator, full
                # fake score, AC; references at the target's size (as the planner plans them), teacher true CFG 4
                row(f"dmd_qwen_edit_{lo}px_4step_lora64_ac", dmd, "qwen", lo, 160, ac=True, lora_rank=64,
                    resume=True, extra=qwen_dmd())]
    if suite == "flux2":  # FLUX.2 [klein]-base DMD2 (recipes/dmd_flux2_klein_4step_lora.sh without NF4): a call of
        # its own; a LoRA r64 generator, the full fake score, the teacher's true CFG 4 with the token rescale, AC;
        # saved, resumed and exported at 512 px (the export sampled in 4 steps), timed at 1024 px
        klein = {**KLEIN_DMD, **({"max_sequence_length": 32} if tiny else {})}
        k_lo, k_hi = (64, 64) if tiny else (512, 1024)  # Flux2ImageProcessor refuses a reference under 64 px
        return [row(f"dmd_flux2_klein_{k_lo}px_4step_lora64_ac", dmd, "flux2", k_lo, 170, ac=True, lora_rank=64,
                    resume=True, export_dtype="bf16", extra=klein),
                row(f"dmd_flux2_klein_{k_hi}px_4step_lora64_ac_timed", dmd, "flux2", k_hi, 120, ac=True,
                    lora_rank=64, export_dtype="bf16", extra=klein)]
    if suite in ("fp8", "fp8_qwen"):  # FP8 against bf16, eager and compiled, FP8_STEPS steps each from one seed
        # (the losses side by side): Kontext's 1024 px full fine-tune with CACHE_LATENTS (the transformer's step:
        # FP8 does not touch the VAE), or Qwen-Image-Edit's 1024 px LoRA with two references (a call of its own)
        if suite == "fp8":
            name, kind, s = f"kontext_{hi}px_full_cached", "flux", {"extra": {"cache_latents": 1}}
            expect = (50, 55, 85, 95)  # eager bf16 / fp8, compiled bf16 / fp8 (guesses until a GPU has run them)
        else:
            name, kind = f"qwen_edit_{hi}px_lora16_2refs", "qwen"
            s = {"lora_rank": 16, "extra": {"lora_alpha": 16, **qwen_areas(tiny, hi, pipeline=True)}}
            expect = (45, 50, 80, 90)
        rows = []
        for compiled in (False, True):
            for recipe in ("", "tensorwise", "rowwise"):
                extra = {**s["extra"], **({"compile": 1} if compiled else {}), **({"fp8": recipe} if recipe else {})}
                rows.append(row(name + ("_compile" if compiled else "") + (f"_fp8_{recipe}" if recipe else ""),
                                kontext, kind, hi, expect[2 * compiled + bool(recipe)], steps=FP8_STEPS,
                                **{**s, "extra": extra}))
        return rows
    if suite == "speed":
        from parallel import attention
        kernels = [k for k in ("native", "_native_flash", "_native_efficient", "_flash_3", "flash")
                   if k in attention.installed()]
        b32 = 2 if tiny else 32
        return ([row(f"kontext_{hi}px_full_{k}", kontext, "flux", hi, 45, extra={"attention_backend": k})
                 for k in kernels]
                + [row(f"kontext_{hi}px_full_ac", kontext, "flux", hi, 45, ac=True),
                   row(f"kontext_{hi}px_full_compile", kontext, "flux", hi, 80, extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_ac_compile", kontext, "flux", hi, 80, ac=True, extra={"compile": 1}),
                   row(f"kontext_{hi}px_full_cache_latents", kontext, "flux", hi, 50, extra={"cache_latents": 1}),
                   # the default: the fake score in the compute dtype (FAKE_SCORE_FP32=0)
                   row(f"dmd_sd15_{sd}px_b32_ac", dmd, "sd15", sd, 105, batch_size=b32, ac=True),
                   row(f"dmd_sd15_{sd}px_b32_ac_fp32_attention", dmd, "sd15", sd, 120, batch_size=b32, ac=True,
                       extra={"fake_score_fp32": 1, "fake_score_attention_dtype": "fp32"}),  # the published pass
                   # the fp32 fake score with its attention in bf16 (FAKE_SCORE_ATTENTION_DTYPE's default)
                   row(f"dmd_sd15_{sd}px_b32_ac_fp32_fake", dmd, "sd15", sd, 110, batch_size=b32, ac=True,
                       extra={"fake_score_fp32": 1}),
                   row(f"dmd_sd15_{sd}px_b32_ac_channels_last", dmd, "sd15", sd, 110, batch_size=b32, ac=True,
                       extra={"channels_last": 1}),
                   # a generator step (6: iteration 5 at ratio 5) and a fake-score step, profiled: profile_*.txt
                   row(f"dmd_sd15_{sd}px_b32_ac_profiled", dmd, "sd15", sd, 70, batch_size=b32, ac=True,
                       profile=(6, 7)),
                   # COMPILE: the first 2 steps (a generator and a fake-score step) compile every graph and are
                   # not timed; their seconds and the compile report's are columns apart. One call each:
                   # --runs=dmd_sd15_512px_b32_ac_compile (the expectation is a guess until a GPU has run it)
                   row(f"dmd_sd15_{sd}px_b32_ac_compile", dmd, "sd15", sd, COMPILE_DMD_EXPECT_S, batch_size=b32,
                       ac=True, extra={"compile": 1}),
                   row(f"dmd_sd15_{sd}px_b32_ac_compile_channels_last", dmd, "sd15", sd, COMPILE_DMD_EXPECT_S,
                       batch_size=b32, ac=True, extra={"compile": 1, "channels_last": 1}),
                   row(f"dmd_sd15_{sd}px_b4_ddp_bf16", dmd, "sd15", sd, 60, batch_size=4, precision="bf16",
                       extra={"parallelism": "ddp"}),
                   row(f"dmd_kontext_{hi}px_4step_ac", dmd, "flux", hi, 70, ac=True, export_dtype="bf16",
                       extra=KONTEXT_DMD),
                   # the Qwen-Image-Edit DMD2 row's generator step and the fake-score step after it, profiled
                   row(f"dmd_qwen_edit_{lo}px_4step_lora64_ac_profiled", dmd, "qwen", lo, 70, ac=True,
                       lora_rank=64, profile=(6, 7), extra=qwen_dmd())])
    return [
        row(f"kontext_{hi}px_full", kontext, "flux", hi, 85, resume=True),
        row(f"dmd_sd15_{sd}px_b4", dmd, "sd15", sd, 65, batch_size=4),
        row(f"kontext_{lo}px_lora16", kontext, "flux", lo, 50, lora_rank=16, resume=True, extra={"lora_alpha": 16}),
        # LoRA: the kernel's forward + backward at FLUX's 1024 px shapes without a full checkpoint to write
        row(f"kontext_{hi}px_lora16_cudnn_attention_probe", kontext, "flux", hi, 30, probe=True, lora_rank=16,
            extra={"lora_alpha": 16, "attention_backend": "_native_cudnn"}),
        row(f"kontext_{lo}px_nf4_lora16_adamw8bit", kontext, "flux", lo, 50, lora_rank=16, base_dtype="nf4",
            optimizer="adamw8bit", extra={"lora_alpha": 16, "base_dtype": "nf4", "optimizer": "adamw8bit"}),
        row(f"dmd_kontext_{lo}px_4step_ac", dmd, "flux", lo, 100, ac=True, resume=True, export_dtype="bf16",
            extra=KONTEXT_DMD),
        row(f"kontext_{lo}px_lora16_compile", kontext, "flux", lo, 55, lora_rank=16,
            extra={"lora_alpha": 16, "compile": 1}),
    ]


FP8_STEPS = 12  # the FP8 rows' steps: 2 of warm-up, 10 timed, and all 12 losses beside bf16's


def select_runs(rows: list[dict], spec: str) -> list[dict]:
    """--runs: each comma-separated key keeps the row of that exact name, or where no row has it,
    every row whose name contains it ("" = all), e.g. dmd_sd15_512px_b32_ac is that one row while
    b32_ac keeps every DMD2 batch-32 row."""
    names = {r["run"] for r in rows}
    keys = [k for k in spec.split(",") if k]
    return [r for r in rows if not keys or any(k == r["run"] or (k not in names and k in r["run"]) for k in keys)]


TINY_AREA = 64 * 64  # the tiny rows' reference and condition areas (tests/test_qwen_image.py's)


def qwen_areas(tiny: bool, resolution: int, pipeline: bool = False) -> dict:
    """A Qwen-Image-Edit row's REFERENCE_AREA and CONDITION_AREA: the pipeline's module constants
    (`pipeline`: VAE_IMAGE_SIZE too, 1024^2), else references at the target's RESOLUTION^2 as
    tools/memory_plan.py plans them; tiny: TINY_AREA for the text encoder, RESOLUTION^2 for the VAE."""
    if tiny:
        return {"reference_area": resolution ** 2, "condition_area": TINY_AREA}
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    return {"reference_area": plus.VAE_IMAGE_SIZE if pipeline else resolution ** 2,
            "condition_area": plus.CONDITION_IMAGE_SIZE}


# ----------------------------------------------------------------------------------------------
# the table


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


DMD_GOAL = 1.2  # the default DMD2 step against the plain-eager time of its network calls (dmd_network_ms)


def table(rows: list[dict], refs: dict, header: list[str]) -> str:
    lines = header + ["", "plain reference (bf16 weights, forward + backward, no FSDP, no optimizer; AdamW and VAE "
                          "apart; the UNet's channels_last row: NHWC conv inputs, as CHANNELS_LAST runs it):", "",
                      "| model | fwd+bwd ms | fwd ms (no grad) | model TFLOP | MFU | fused AdamW ms | VAE encode ms |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
    for key, r in refs.items():
        if "error" in r:
            lines.append(f"| {key} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {key} | {r['fwd_bwd_ms']:.1f} | {r['fwd_ms']:.1f} | {r['model_tflop']:.2f} | "
                     f"{_fmt(100 * r['mfu'], '.1f')} % | {r['adamw_ms']:.1f} | {r['vae_ms']:.1f} |")
        if "cl_fwd_bwd_ms" in r:
            lines.append(f"| {key}, channels_last | {r['cl_fwd_bwd_ms']:.1f} | - | {r['model_tflop']:.2f} | "
                         f"{_fmt(100 * r['cl_mfu'], '.1f')} % | - | - |")
    lines += ["", "| run | model | step ms | x plain fwd+bwd | x plain fwd+bwd+AdamW+VAE | MFU | HFU | "
                  "model TFLOP/step | peak alloc GiB | peak reserved GiB | planned GiB | error % | "
                  "disk GB need / free | s / expected | warm-up s (not timed) | compile s | train | resume/export |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ref = refs.get(r.get("ref", ""), {})
        plain = ref.get("fwd_bwd_ms")
        whole = plain + ref["adamw_ms"] + ref["vae_ms"] if plain and r.get("full") else None
        err = 100 * (r["reserved_gib"] - r["planned_gib"]) / r["planned_gib"] if r["planned_gib"] > 0 else None
        ratio, ratio_whole = (r["step_ms"] / plain if plain else None), (r["step_ms"] / whole if whole else None)
        lines.append(f"| {r['run']} | {r['model']} | {_fmt(r['step_ms'], '.0f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(ratio_whole, '.2f')} | {_fmt(100 * r['mfu'], '.1f')} | {_fmt(100 * r['hfu'], '.1f')} | "
                     f"{_fmt(r['model_tflop'], '.2f')} | {_fmt(r['allocated_gib'], '.2f')} | "
                     f"{_fmt(r['reserved_gib'], '.2f')} | {_fmt(r['planned_gib'], '.2f')} | {_fmt(err, '+.1f')} | "
                     f"{_fmt(r['disk_need_gb'], '.3g')} / {_fmt(r['disk_free_gb'], '.1f')} | "
                     f"{_fmt(r['wall_s'], '.0f')} / {r['expect_s']:.0f} | {_fmt(r.get('warmup_s'), '.1f')} | "
                     f"{_fmt(r.get('compile_s'), '.1f')} | {r['status']} | {r['resume_export']} |")
    return "\n".join(lines + dmd_bound_lines(rows, refs) + fp8_lines(rows))


def dmd_bound_lines(rows: list[dict], refs: dict) -> list[str]:
    """The DMD2 UNet rows against the plain-eager time of the same network calls (dmd_network_ms, from
    the plain rows at the row's batch), the ratio and the goal: the default step <= DMD_GOAL x."""
    lines = []
    for r in rows:
        ref = refs.get(r.get("ref", ""), {})
        if not r.get("ratio") or "fwd_ms" not in ref or not r.get("timed_steps"):
            continue
        if "frozen_fwd_bwd_ms" in ref and len(r.get("step_indices", [])) == len(r["timed_steps"]):  # FLUX.2
            ms, gen = dmd_flow_network_ms(ref, r["timed_steps"], r["step_indices"], int(r["ratio"]),
                                          r.get("ac", False), r.get("lora_generator", False), r.get("cfg_pair", False))
        elif any(k in r["model"].lower() for k in ("flux", "qwen")):
            continue  # a flow row without the plain calls of its backward simulation and teacher: no bound
        else:
            ms, gen = dmd_network_ms(ref, r["timed_steps"], int(r["ratio"]), r.get("ac", False))
        n, ratio = len(r["timed_steps"]), r["step_ms"] / ms
        lines.append(f"| {r['run']} | {gen} + {n - gen} | {ms:.0f} | {_fmt(r['step_ms'], '.0f')} | {ratio:.2f} | "
                     f"{'met' if ratio <= DMD_GOAL else 'not met'} |")
    if not lines:
        return []
    return ["", f"DMD2 against its network calls at plain-eager speed (goal: the default step <= {DMD_GOAL} x): "
                "a fake-score step = F + P (the generator without grad, the fake score forward + backward), a "
                "generator step = 2 P + 3 F (generator and fake score forward + backward, the teacher's CFG pair, "
                "the DM loss's fake forward); P = plain fwd+bwd (+ F with AC's recomputation), F = plain fwd "
                "without grad, at the row's batch; the timed steps' own mix of generator and fake-score steps "
                "(FLUX.2 rows: dmd_flow_network_ms, with the backward simulation's forwards at each step's logged "
                "σ index, the references' VAE encode, the teacher's true-CFG pair and a LoRA generator's "
                "frozen-weight backward)", "",
            "| run | generator + fake-score steps timed | network calls ms/step | step ms | ratio | goal |",
            "|---|---:|---:|---:|---:|---|", *lines]


FP8_GOAL = 1.25  # FP8's speed-up over the bf16 step of the same row (the Kontext 1024 px full fine-tune)


def fp8_lines(rows: list[dict]) -> list[str]:
    """Each FP8 row beside its bf16 twin (the same name without _fp8_<recipe>: same seed, data and noise): the
    speed-up (bf16 step / FP8 step; FP8_GOAL for the Kontext rows), MFU (a compiled row's from its eager twin's
    model FLOPs, which are the same: eager MFU x eager step / this step), and every step's loss side by side."""
    by_name = {r["run"]: r for r in rows}
    groups = {}
    for r in rows:
        base, _, recipe = r["run"].partition("_fp8_")
        if recipe and base in by_name:
            groups.setdefault(base, []).append((recipe, r))
    if not groups:
        return []
    lines = ["", f"FP8 against bf16 (same seed, data and noise; goal for the Kontext full fine-tune: >= {FP8_GOAL} x "
                 "the bf16 step; MFU against each op's own peak, float8 matmuls against the float8 peak; a compiled "
                 "row's MFU from its eager twin's model FLOPs):", "",
             "| run | step ms | bf16 step ms | speed-up | goal | MFU | bf16 MFU | largest loss difference, relative |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    tables = []

    def mfu(r):
        if r["mfu"] == r["mfu"] or "_compile" not in r["run"]:
            return r["mfu"]
        eager = by_name.get(r["run"].replace("_compile", "", 1), {})
        return eager.get("mfu", float("nan")) * eager.get("step_ms", float("nan")) / r["step_ms"]

    for base, members in groups.items():
        bf16 = by_name[base]
        for recipe, r in members:
            speed = bf16["step_ms"] / r["step_ms"]
            pairs = list(zip(bf16.get("losses", []), r.get("losses", [])))
            diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs), default=float("nan"))
            goal = ("met" if speed >= FP8_GOAL else "not met") if r["run"].startswith("kontext") else "-"
            lines.append(f"| {r['run']} | {_fmt(r['step_ms'], '.0f')} | {_fmt(bf16['step_ms'], '.0f')} | "
                         f"{_fmt(speed, '.2f')} | {goal if speed == speed else '-'} | {_fmt(100 * mfu(r), '.1f')} % | "
                         f"{_fmt(100 * mfu(bf16), '.1f')} % | {_fmt(diff, '.2e')} ({len(pairs)} steps) |")
        recipes = [recipe for recipe, _ in members]
        losses = [bf16.get("losses", [])] + [r.get("losses", []) for _, r in members]
        tables += ["", f"{base}: loss per step", "",
                   "| step | bf16 | " + " | ".join(f"fp8 {x}" for x in recipes) + " |",
                   "|---:|" + "---:|" * (1 + len(recipes))]
        for i in range(max(map(len, losses))):
            cells = " | ".join(_fmt(x[i] if i < len(x) else None, ".5f") for x in losses)
            tables.append(f"| {i + 1} | {cells} |")
    return lines + tables


# ----------------------------------------------------------------------------------------------


def start_tests(out: str) -> subprocess.Popen:
    """tests/test_gpu.py in the background: it uses the GPU little, the model build mostly the CPU."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist"):
        cmd += ["-n", str(TEST_WORKERS)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(os.path.join(out, "test_gpu.log"), "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish_tests(tests: subprocess.Popen | None, out: str, timeout: float) -> tuple[bool, str]:
    """(passed, its summary line): waited for until `timeout`, then cut."""
    if tests is None:
        return True, "not run (--skip_tests)"
    try:
        tests.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(tests.pid, signal.SIGKILL)
        tests.wait()
        return False, "cut at the deadline (test_gpu.log)"
    last = open(os.path.join(out, "test_gpu.log")).read().strip().splitlines()[-1:] or [""]
    return tests.returncode == 0, f"{last[0].strip('= ')} (rc {tests.returncode})"


def build(runs: list[dict], work: str, out: str, tiny: bool, blocks: tuple[int, int],
          qwen_blocks: int = 4, flux2_blocks: tuple[int, int] = (2, 4)) -> tuple[dict, dict, dict]:
    """Model folders for the rows, each row sized to the disk (row["size"]: FLUX blocks as a tuple,
    FLUX.2 klein's as ("klein", D, S), Qwen-Image-Edit blocks as an int, else a name; None: not run). Returns
    ({size: folder}, {run: peak disk bytes at its size; not run: at its smallest}, the disk as measured)."""
    folders = {}
    if any(r["kind"] == "sd15" for r in runs):
        folders["tiny_sd15" if tiny else "sd15"] = sd15_folder(work, tiny)
    parts = {}  # per transformer family: its folder's other parts at real width (a tiny run: its tiny folder)
    for kind, parts_of in (("flux", flux_parts), ("qwen", qwen_parts), ("flux2", flux2_parts)):
        if any(r["kind"] == kind for r in runs):
            if tiny:
                folders["tiny_" + kind] = tiny_default(kind)
            else:
                parts[kind] = parts_of(work)
    sizes = {"sd15": "sd15", "qwen": qwen_blocks, "flux2": ("klein", *flux2_blocks), "flux": blocks}
    for r in runs:
        r["size"] = "tiny_" + r["kind"] if tiny else sizes[r["kind"]]

    def folder(size):
        if size not in folders:
            folders[size] = (qwen_skeleton(work, size, parts.get("qwen")) if isinstance(size, int)
                             else flux2_skeleton(work, size[1:], parts.get("flux2")) if size[0] == "klein"
                             else flux_skeleton(work, size, parts.get("flux")))
        return folders[size]

    needs = {}

    def need(row, size):
        if (row["run"], size) not in needs:
            one, export = row_bytes(row, folder(size))
            needs[row["run"], size] = peak_disk(one, export, row["resume"])
        return needs[row["run"], size]

    same_disk = os.stat(disk_usage(work)[0]).st_dev == os.stat(disk_usage(out)[0]).st_dev
    unwritten = {}  # a transformer still to write costs its fp32 bytes where the runs write too

    def folder_cost(size):
        if not isinstance(size, (tuple, int)) or not same_disk:
            return 0
        if size not in unwritten:
            written = any(n.endswith(".safetensors") for n in os.listdir(os.path.join(folder(size), "transformer")))
            unwritten[size] = 0 if written else folder_bytes(folder(size))
        return unwritten[size]

    def smaller(row, size):
        return smaller_size(size)

    def smallest(row, size):
        while smaller(row, size) is not None:
            size = smaller(row, size)
        return size

    path, free, total = disk_usage(out)
    choice = fit_to_disk(runs, free, need, folder_cost, smaller)
    peaks = {r["run"]: need(r, choice[r["run"]] or smallest(r, r["size"])) for r in runs}
    to_write = sum(folder_cost(z) for z in set(choice.values()) if z is not None)
    for r in runs:
        r["size"] = choice[r["run"]]
    for size, f in list(folders.items()):
        if isinstance(size, (tuple, int)):
            if size in choice.values():
                transformer_weights(f)
            else:  # a size tried and not taken: its config and links only
                shutil.rmtree(f)
                del folders[size]
    return folders, peaks, {"path": path, "free": free, "total": total, "to_write": to_write}


def disk_line(disk: dict) -> str:
    return (f"disk: {disk['path']}: {disk['free'] / GB:.1f} GB free of {disk['total'] / GB:.1f} GB when the rows "
            f"were sized; model folders then written {disk['to_write'] / GB:.1f} GB; each row's need kept under "
            f"the free space less {HEADROOM / GB:.0f} GB")


def main() -> None:
    # counted from gpu_check.sh's start where it set GPU_CHECK_T0 (the wheels' install included)
    started = time.monotonic() - max(time.time() - float(os.environ.get("GPU_CHECK_T0", time.time())), 0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_check"))
    ap.add_argument("--work", default="", help="where models go; '' = --out/work (removed at the end)")
    ap.add_argument("--tiny", action="store_true", help="the tiny models (a plumbing check, minutes on CPU)")
    ap.add_argument("--cpu", action="store_true", help="allow a machine without CUDA (rows that need CUDA: skipped)")
    ap.add_argument("--flux_blocks", default="2,4", help="double,single FLUX blocks at real width (all: 19,38); "
                                                         "rows that do not fit the disk get fewer")
    ap.add_argument("--flux2_blocks", default="2,4",
                    help="double,single FLUX.2 klein blocks at real width (klein-base-4B: 5,20); rows that do not "
                         "fit the disk get fewer")
    ap.add_argument("--qwen_blocks", type=int, default=4, help="Qwen-Image-Edit dual-stream blocks at real width "
                                                              "(all: 60); rows that do not fit the disk get fewer")
    ap.add_argument("--deadline_s", type=float, default=0,
                    help=f"seconds for everything from the start; rows that do not fit are not started, runs "
                         f"past it are cut (0: {CALL_S} with CUDA, 1800 without)")
    ap.add_argument("--skip_tests", action="store_true", help="do not run tests/test_gpu.py")
    ap.add_argument("--runs", default="", help="comma-separated run names, or parts of names, to keep ('' = all)")
    ap.add_argument("--suite", default="acceptance",
                    choices=("acceptance", "speed", "qwen", "flux2", "fp8", "fp8_qwen"),
                    help="acceptance: every script and mode once; speed: step-time rows (kernels, AC, compile); "
                         "qwen: the Qwen-Image-Edit rows, flux2: FLUX.2 klein-base DMD2, fp8 / fp8_qwen: FP8 "
                         "against bf16 on Kontext's 1024 px full fine-tune / Qwen-Image-Edit's 1024 px LoRA (each a "
                         "call of its own)")
    a = ap.parse_args()
    blocks, flux2_blocks = (tuple(int(x) for x in v.split(",") if x.strip().isdigit())
                            for v in (a.flux_blocks, a.flux2_blocks))
    for name, value, got in (("flux_blocks", a.flux_blocks, blocks), ("flux2_blocks", a.flux2_blocks, flux2_blocks)):
        if len(got) != 2 or min(got) < 1:
            sys.exit(f"gpu_check: --{name}={value}: give double,single block counts, each >= 1 (e.g. 2,4)")
    if a.qwen_blocks < 1:
        sys.exit(f"gpu_check: --qwen_blocks={a.qwen_blocks}: give a block count >= 1 (e.g. 4)")
    import torch

    from components.warnings import quiet_known_warnings
    quiet_known_warnings()
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu:
        sys.exit("gpu_check: no CUDA GPU here (use --cpu --tiny for the plumbing check on CPU)")
    deadline = Deadline(a.deadline_s or (CALL_S if cuda else 1800), started)
    os.makedirs(a.out, exist_ok=True)
    work = a.work or os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 0.0
    name = f"{torch.cuda.get_device_name(0)} ({gpu_gb:.1f} GiB)" if cuda else "CPU"
    import diffusers
    versions = (f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if cuda else "")
                + f", diffusers {diffusers.__version__}")
    tests = None if a.skip_tests else start_tests(a.out)
    t = time.monotonic()
    runs = select_runs(plan_runs(a.tiny, a.suite), a.runs)
    if not cuda:  # a CPU without native bf16 emulates it (~80x slower); on CPU the rows check plumbing, not dtypes
        for r in runs:
            r["settings"]["precision"] = "fp32"
    folders, peaks, disk = build(runs, work, a.out, a.tiny, blocks, a.qwen_blocks, flux2_blocks)
    data = {}
    for r in runs:
        prompts, pairs = datasets(work, r["settings"]["resolution"], a.tiny)
        data[r["run"]] = (prompts if r["kind"] == "sd15" else
                          qwen_pairs(work, r["settings"]["resolution"], a.tiny) if r["kind"] == "qwen" else pairs)
    with open(os.path.join(a.out, "build.log"), "w") as log:
        log.write(f"models and data built and sized in {time.monotonic() - t:.0f} s\n{disk_line(disk)}\n")
    print(f"models and data built and sized in {time.monotonic() - t:.0f} s\n{disk_line(disk)}", flush=True)

    planner = None
    plans = os.path.join(work, "planned.jsonl")
    if os.path.exists(plans):  # an earlier check's, in a kept --work
        os.remove(plans)
    if cuda:  # the planner's GPU totals, all CPU work, beside the reference and the runs
        jobs = [(r["run"], (folders[r["size"]], r["world"], r["settings"], r["script"], gpu_gb))
                for r in runs if r["size"] is not None]
        planner = multiprocessing.get_context("spawn").Process(target=plan_all, args=(jobs, plans), daemon=True)
        planner.start()

    # the plain reference of the rows that compare with it, while the rows would still fit after it
    from transformers import AutoTokenizer
    refs = {}
    runnable = [r for r in runs if r["size"] is not None and (cuda or not r["gpu_only"])]
    for r in runs:
        s = r["settings"]
        r["ref"] = (f"{model_label(r['size'])}, {s['resolution']} px, batch {s['batch_size']}"
                    + {"qwen": ", target + 2 references", "flux2": ", target + 1 reference"}.get(r["kind"], "")
                    if r["ref"] and r in runnable else "")
        r["full"] = not s.get("lora_rank") and r["script"] == "train_flux_kontext.py"
    for r in runnable:
        s, folder = r["settings"], folders[r["size"]]
        if not r["ref"] or r["ref"] in refs:
            continue
        if deadline.left() - REF_EXPECT_S < sum(q["expect_s"] for q in runnable):
            refs[r["ref"]] = {"error": "left out: the rows would not fit after it"}
            continue
        references = ()
        if r["kind"] == "flux2":  # the pairs' one context at the target's size; the text padded to the run's length
            text_len, references = int(s["extra"].get("max_sequence_length", 512)), (s["resolution"],)
        else:
            tokenizer = "tokenizer_2" if r["kind"] == "flux" else "tokenizer"
            text_len = min(512, AutoTokenizer.from_pretrained(os.path.join(folder, tokenizer)).model_max_length)
        if r["kind"] == "qwen":  # the row's two references, each at its reference area (square images)
            text_len = qwen_text_tokens(folder, data[r["run"]], s["extra"]["condition_area"])
            # train_dmd.py reads its references at the target's size
            references = (round(s["extra"].get("reference_area", s["resolution"] ** 2) ** 0.5),) * 2
        try:
            refs[r["ref"]] = plain_reference(r["kind"], folder, s["resolution"], s["batch_size"], text_len, device,
                                             references)
        except Exception as e:  # noqa: BLE001 - the row says what failed; the runs still go on
            refs[r["ref"]] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"plain {r['ref']}: {refs[r['ref']]}", flush=True)

    rows, log = [], os.path.join(a.out, "runs.log")
    open(log, "w").close()
    for r in runs:
        if r["size"] is None:
            room = disk["free"] - disk["to_write"] - HEADROOM
            result = blank_result(r, f"not run: needs {peaks[r['run']] / GB:.1f} GB of disk with its smallest "
                                     f"model, {room / GB:.1f} GB to spare", False)
        elif r["gpu_only"] and not cuda:
            result = blank_result(r, "skipped: needs CUDA", True)
        elif not deadline.fits(r["expect_s"]):
            result = blank_result(r, f"not run: ~{r['expect_s'] * deadline.scale():.0f} s expected, "
                                     f"{max(deadline.left(), 0):.0f} s left", False)
        else:
            free = disk_usage(a.out)[1]
            if peaks[r["run"]] + HEADROOM > free:  # what earlier rows or the tests left behind
                result = blank_result(r, f"not run: needs {peaks[r['run']] / GB:.1f} GB of disk, "
                                         f"{free / GB:.1f} GB free", False)
            else:
                t = time.monotonic()
                result = one_run(r, folders[r["size"]], data[r["run"]], a.out, log, deadline)
                result["wall_s"] = time.monotonic() - t
                if result["ok"]:
                    deadline.record(r["expect_s"], result["wall_s"])
            result["disk_free_gb"] = free / GB
        result["disk_need_gb"] = peaks[r["run"]] / GB
        extra = r["settings"]["extra"]
        rows.append({**result, "ref": r["ref"], "full": r["full"], "ac": r["settings"].get("ac", False),
                     "ratio": extra.get("dfake_gen_update_ratio"),
                     "lora_generator": bool(r["settings"].get("lora_rank")),
                     "cfg_pair": r["kind"] == "flux2" and float(extra.get("real_guidance_scale", 0)) > 1})
        print(f"{r['run']}: {result}", flush=True)

    tests_ok, tests_line = finish_tests(tests, a.out, deadline.left())
    print(f"tests/test_gpu.py: {tests_line}", flush=True)
    if planner is not None:
        planner.join(timeout=max(deadline.left(), 1))
        planner.kill()
        planned = {}
        if os.path.exists(plans):
            planned = {p["run"]: p["planned"] for p in map(json.loads, open(plans))}
        for row in rows:
            value = planned.get(row["run"], float("nan"))
            row["planned_gib"] = value if isinstance(value, float) else float("nan")
            if isinstance(value, str):
                row["status"] += f"; {value}"
    header = [f"GPU check on {name}: {versions}", "", disk_line(disk), f"tests/test_gpu.py: {tests_line}",
              f"time: {time.monotonic() - started:.0f} s of the {deadline.seconds:.0f} s deadline"]
    report = table(rows, refs, header)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"device": name, "versions": versions, "disk": disk, "tests": tests_line, "refs": refs,
                   "rows": rows}, f, indent=1)
    print("\n" + report, flush=True)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if tests_ok and all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
