"""The GPU check's models and data, built offline: SD-1.5, FLUX.1 Kontext, Qwen-Image-Edit-2509 and FLUX.2
klein folders at real width with random weights (transformer skeletons of a chosen block count, written
once their size is chosen, beside the other parts), the tiny rows' default folders, the rows' data."""
from __future__ import annotations

import json
import os
import shutil


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/
ROOT = os.path.dirname(HERE)
REAL = os.path.join(HERE, "real_size_configs")


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


def qwen_pairs(root: str, size: int, tiny: bool = False) -> str:
    """Edits with two references (a shape, a colour swatch) at `size` px (tiny: TINY_SAMPLES): data.jsonl's path."""
    from tools import tiny_models
    folder = os.path.join(root, f"two_ref_pairs_{size}" + ("_tiny" if tiny else ""))
    if not os.path.isdir(folder):
        tiny_models.make_two_reference_edit_dataset(folder, TINY_SAMPLES if tiny else 24, size=size)
    return os.path.join(folder, "data.jsonl")


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
