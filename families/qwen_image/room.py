"""The Qwen-Image-Edit family (QwenImageEditPlusPipeline: Qwen-Image-Edit-2509 / 2511, 1-3 reference
images): its MMDiT transformer built and sharded through parallel/'s generic recipe (one FSDP unit
per QwenImageTransformerBlock), its VAE (AutoencoderKLQwenImage, per-channel latent mean / std), its
conditioning and its samples, for train_flux_kontext.py's editing fine-tuning.

Conditioning is the pipeline's own (diffusers 0.42.1 pipeline_qwenimage_edit_plus.py):
- the Qwen2.5-VL encoder reads the prompt with every reference image, each resized to the
  condition area (384^2, calculate_dimensions) by the pipeline's image processor (:696-705), through
  the pipeline's encode_prompt (:286); the text cache's key holds the images' bytes;
- each reference is VAE-encoded at its own size (the 1024^2 area, :702; REFERENCE_AREA), normalised
  by latents_mean / latents_std (:431-441), packed 2x2 like FLUX (:397) and appended after the
  target's tokens, with its own img_shapes entry (:753-761); the loss reads the target tokens only;
- the transformer takes timestep = σ (the pipeline passes t / 1000, :818), no guidance embedding,
  and the text's padding mask.

    python -m pytest tests/test_qwen_image.py -q
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from algorithms import flux_kontext as km
from algorithms.dmd2 import Guidance, cfg_combine
from core.dist import print0
from core.errors import ConfigError
from data.images import image_digest, image_size, load_pil
from data.references import PIPELINE_MULTIPLE, VAE_REFERENCE_AREA, VL_REFERENCE_AREA, reference_size
from data.text_cache import fill_text_cache, folder_identity, load_entries
from families.dit import build_transformer as build_dit
from families.qwen_image.parallelism import TRANSFORMER
from families.dit import distilled_scheduler  # noqa: F401 - this family's export scheduler too
from families.dit import reference_attention_shapes
from parallel import attention
from parallel.lora import Lora
from precision import dtype_name

NAME = "Qwen-Image-Edit"  # how the README and docs name the family
MAX_REFERENCES = 3  # the pipeline's "Picture 1..3" (Qwen-Image-Edit-2509's model card: 1-3 images)
NEGATIVE_PROMPT = " "  # the negative prompt of the model card's examples, for samples with true CFG
UNCONDITIONAL_PROMPT = NEGATIVE_PROMPT  # what CAPTION_DROPOUT trains: the text the pipeline's true CFG pairs with
TEXT_READS_IMAGES = True  # Qwen2.5-VL reads the prompt with the reference images (a flipped row: its own entry)
DEFAULT_RESOLUTION = 1024  # RESOLUTION 0: the pipeline's area (the output at 1024^2 pixels)
TRUE_CFG_SCALE = 4.0  # the pipeline's default true_cfg_scale: the teacher's in DMD2 (REAL_GUIDANCE_SCALE 0)
# DMD2's real score: the teacher's CFG pair combined as its pipeline combines it, the per-token rescale
# (algorithms/dmd2.cfg_combine): docs/demos.md measured it against none and scalar, and it kept the teacher's
# variety and saturation where the others did not
CFG_NORM = "token"
TEXT_PARTS = ("text_encoder", "tokenizer", "processor")


def edits(pipeline: str) -> bool:
    """Every Qwen-Image-Edit row edits its reference images."""
    return True


# ----------------------------------------------------------------------------------------------
# models


def build_transformer(folder, mesh, prec, device, *, load, sharding, block_classes, lora=Lora(), seed=0,
                      base_dtype="", attention_backend=attention.DEFAULT, trainable=True, compute=None,
                      frozen_dtype=None, weights="", merge=None, fp8=""):
    """QwenImageTransformer2DModel, as families/flux/room.py builds FLUX's (families/dit.py), sharded one
    unit per dual-stream block by its model facts (parallelism.py)."""
    from diffusers import QwenImageTransformer2DModel
    return build_dit(QwenImageTransformer2DModel, TRANSFORMER, folder, mesh, prec, device, load=load,
                       sharding=sharding, block_classes=block_classes, lora=lora, seed=seed,
                       base_dtype=base_dtype, attention_backend=attention_backend, trainable=trainable,
                       compute=compute, frozen_dtype=frozen_dtype, weights=weights, merge=merge, fp8=fp8,
                       prepare=prepare)


def prepare(model) -> None:
    """What the meta skeleton needs before it is adapted and sharded: the RoPE tables on the host,
    and the last block's text-stream output frozen."""
    rope_on_host(model)
    freeze_unused(model)


def freeze_unused(model) -> None:
    """The modules nothing reads (parallelism.unused: the last block's text stream after attention)
    never get a grad, so they are frozen: no optimizer state that exists in one run and not in its
    resume, no unused parameter for DDP. LoRA refuses to adapt them (parallel/lora.lora_targets)."""
    for name in TRANSFORMER.unused(model):
        model.get_submodule(name).requires_grad_(False)


def rope_on_host(model) -> None:
    """QwenEmbedRope keeps its frequency tables as plain attributes made in __init__ (not buffers),
    which a meta build leaves on meta: remake them on the host (they follow the inputs' device at
    each call, transformer_qwenimage.py:239)."""
    rope = model.pos_embed
    with torch.device("cpu"):
        fresh = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
    rope.pos_freqs, rope.neg_freqs = fresh.pos_freqs, fresh.neg_freqs


def load_vae(folder, dtype, device):
    """The frozen AutoencoderKLQwenImage, replicated on every rank in its own dtype."""
    import fsdp_utils
    from diffusers import AutoencoderKLQwenImage
    vae = AutoencoderKLQwenImage.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=False)
    return fsdp_utils.prepare_frozen(vae, dtype, device)


def vae_factor(model_path) -> int:
    """2 ** (temporal downsamplings), as the pipeline computes it (:206): 8 for the real VAE."""
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        return 2 ** len(json.load(f)["temperal_downsample"])


def latent_channels(vae) -> int:
    return vae.config.z_dim


def _mean_std(vae, device):
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(1, c, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(1, c, 1, 1)
    return mean, std


def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, H/f, W/f) in fp32: the posterior's
    mode ("argmax", :145-155) of the one-frame video, (z - latents_mean) / latents_std (:431-441)."""
    param = next(vae.parameters())
    with torch.no_grad():
        x = images.to(device=param.device, dtype=param.dtype)[:, :, None]
        z = vae.encode(x).latent_dist.mode()[:, :, 0].float()
    mean, std = _mean_std(vae, z.device)
    return (z - mean) / std


def image_tokens(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> packed clean latent tokens (B, N, 4C) in fp32: how a reference
    image and the GAN's real target enter the transformer."""
    return km.pack_latents(encode_latents(vae, pixels))


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, h, w) -> images (B, 3, H, W) in [-1, 1], fp32 on CPU, by the
    pipeline's own arithmetic (:876-888: cast to the VAE's dtype, / (1 / std) + mean)."""
    dtype, c = next(vae.parameters()).dtype, vae.config.z_dim
    z = latents[:, :, None].to(dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
    with torch.no_grad():
        return vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0].float().cpu()


def attention_shapes(model_path, text_length, shapes, vae_factor, batch):
    """The run's attention calls for the start-up kernel check (families/dit.reference_attention_shapes; the
    text's length estimated: `text_length`), its VAE mid-block as wide as base_dim x the last dim_mult."""
    with open(os.path.join(model_path, "vae", "config.json")) as f:
        v = json.load(f)
    return reference_attention_shapes(model_path, text_length, shapes, vae_factor, batch,
                                      v["base_dim"] * v["dim_mult"][-1])


# ----------------------------------------------------------------------------------------------
# conditioning: the Qwen2.5-VL embeddings of the prompt with its reference images, cached


def controls(row) -> list:
    """A row's reference images (data.sources: "controls" with several, else "control")."""
    if row.get("controls"):
        return row["controls"]
    return row["control"] if isinstance(row["control"], list) else [row["control"]]


def text_key(prompt, row) -> str:
    """The cache key of a prompt read with its row's reference images: their bytes are part of it, and
    whether they are read mirrored (a RANDOM_FLIP step's row has "mirror")."""
    return "\n".join([prompt, *(image_digest(c) for c in controls(row))] + (["mirrored"] if row.get("mirror") else []))


def load_processor(folder):
    """The Qwen2VLProcessor of a processor/ folder. Its video processor needs torchvision (transformers
    5); without torchvision: the same processor without the video processor (a subclass, so the
    pipeline accepts it), which is all the Qwen-Image-Edit pipelines use (text and images)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.utils import is_torchvision_available, logging

    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(folder)

    class ImageTextQwen2VLProcessor(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    level = logging.get_verbosity()
    logging.set_verbosity_error()  # the fall back to the image processor's PIL twin warns
    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
    finally:
        logging.set_verbosity(level)
    return ImageTextQwen2VLProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(folder))


def load_text_encoder(model_path, dtype, device):
    """A QwenImageEditPlusPipeline holding only Qwen2.5-VL, its tokenizer and processor: its
    encode_prompt and image processor are the pipeline's own text path."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(model_path, "text_encoder"),
                                                                 dtype=dtype)
    return QwenImageEditPlusPipeline(
        scheduler=None, vae=None, transformer=None, text_encoder=encoder.to(device).eval(),
        tokenizer=Qwen2Tokenizer.from_pretrained(os.path.join(model_path, "tokenizer")),
        processor=load_processor(os.path.join(model_path, "processor")))


def condition_images(pipe, sources, area, mirror=False):
    """The reference images as the pipeline hands them to the text encoder: each resized (its image
    processor's resize) to calculate_dimensions(area, its ratio) (:696-705); with `mirror`, the
    mirror images, as the pipeline would be given them."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
    out = []
    for source in sources:
        image = load_pil(source, mirror)
        w, h = calculate_dimensions(area, image.width / image.height)
        out.append(pipe.image_processor.resize(image, h, w))
    return out


def condition_area(settings) -> int:
    return settings.get("CONDITION_AREA") or VL_REFERENCE_AREA


def prepare_edit_text(texts, model_path, cache_dir, settings, dtype, device) -> str:
    """Fill the text cache for the (prompt, row) pairs: one entry per prompt and image set (each rank
    its share, the encoder freed after); returns the encoder identity."""
    area = condition_area(settings)
    identity = folder_identity(model_path, TEXT_PARTS, area, dtype_name(dtype))

    def encode(pipe, part):
        out = []
        for prompt, sources, mirror in part:  # one at a time, as the pipeline does (its batch is 1)
            embeds, _ = pipe.encode_prompt(prompt=[prompt], image=condition_images(pipe, sources, area, mirror),
                                           device=device)
            out.append({"prompt": prompt, "prompt_embeds": embeds[0].cpu().clone()})
        return out

    items = {text_key(p, row): (p, controls(row), bool(row.get("mirror"))) for p, row in texts}
    computed, reused = fill_text_cache(items, cache_dir, identity, lambda: load_text_encoder(model_path, dtype, device),
                                       encode)
    print0(f"text cache: {computed + reused} prompts with their reference images, computed {computed}, reused "
           f"{reused} ({cache_dir}; condition area {area}, {dtype_name(dtype)})")
    return identity


def load_text(texts, cache_dir, identity, device):
    """(embeddings (B, T, D) padded with zeros to the longest, mask (B, T) bool or None where
    nothing is padded, as the pipeline's encode_prompt returns them)."""
    if not texts:
        return None
    items = [e["prompt_embeds"] for e in load_entries([text_key(p, row) for p, row in texts], cache_dir, identity)]
    longest = max(e.shape[0] for e in items)
    embeds = torch.zeros(len(items), longest, items[0].shape[1], dtype=items[0].dtype)
    mask = torch.zeros(len(items), longest, dtype=torch.bool)
    for i, e in enumerate(items):
        embeds[i, :e.shape[0]], mask[i, :e.shape[0]] = e, True
    return embeds.to(device), (None if bool(mask.all()) else mask.to(device))


def repeat_text(text, i, n):
    embeds, mask = text_row(text, i)
    return embeds.expand(n, -1, -1), None


def text_row(text, i):
    """Sample i's embeddings alone, without padding (mask None), as the pipeline's batch of 1 has them."""
    embeds, mask = text
    length = int(mask[i].sum()) if mask is not None else embeds.shape[1]
    return embeds[i:i + 1, :length], None


# ----------------------------------------------------------------------------------------------
# editing fine-tuning (train_flux_kontext.py; families/spec.EditingRoom lists what the script asks of a room)


def check_edit_settings(model_path, settings, changed: set) -> None:
    """What this family refuses, in one line before any work (`changed`: the settings given a value
    other than the script's default)."""
    for name, why in (("BUCKET_ASPECTS", "target and references are sized by their own ratios"),
                      ("MAX_SEQUENCE_LENGTH", "the text is as long as the prompt and its image tokens")):
        if name in changed:
            raise ConfigError(f"{name}={settings[name]}: not used by Qwen-Image-Edit: {why}")
    check_context_parallel(model_path, settings["CONTEXT_PARALLEL"], settings, ())
    if settings["GUIDANCE"] not in (0, 1.0):
        raise ConfigError(f"GUIDANCE={settings['GUIDANCE']}: Qwen-Image-Edit has no guidance embedding (its guidance "
                          "is true CFG: SAMPLE_GUIDANCE for samples); leave GUIDANCE at 1")


def check_context_parallel(model_path, context_parallel, settings, shapes) -> None:
    """CONTEXT_PARALLEL > 1 is refused for this family (check_edit_settings asks it too; so does the planner)."""
    if context_parallel > 1:
        raise ConfigError(f"CONTEXT_PARALLEL={context_parallel}: not for Qwen-Image-Edit here (its text is a padded, "
                          "masked sequence of varying length per sample); use CONTEXT_PARALLEL=1")


def reference_area(settings) -> int:
    return settings.get("REFERENCE_AREA") or VAE_REFERENCE_AREA


def target_size(size, row, settings) -> tuple[int, int]:
    """The target at RESOLUTION^2 pixels by the pipeline's rule for its output (calculate_dimensions
    of the last reference's ratio at inference; here the target's own ratio), so a target and a
    reference of one size and area hold the same pixels."""
    h, w = row.get("size") or image_size(controls(row)[-1])
    return reference_size(h, w, settings["RESOLUTION"] ** 2, PIPELINE_MULTIPLE)


def reference_sizes(size, row, settings) -> tuple | None:
    """Each reference at its own size: calculate_dimensions(REFERENCE_AREA, its ratio) (:702)."""
    if row is None:
        return None
    sizes = row.get("control_sizes") or [image_size(c) for c in controls(row)]
    return tuple(reference_size(h, w, reference_area(settings), PIPELINE_MULTIPLE) for h, w in sizes)


def image_loader(settings):
    """How a row's images are read (data/buckets.load_pairs): None, stretched to their sizes as the pipeline's
    image processor resizes them."""
    return None


def edit_attention_shapes(model_path, settings, shapes, batch, context_parallel):
    # the prompt template, ~188 tokens per 384^2 reference (27 x 27 patches of 14 merged 2 x 2), the prompt
    area = condition_area(settings)
    text = 64 + max(len(s[1]) for s in shapes) * (area // (28 * 28) + 8) + 256
    return attention_shapes(model_path, text, shapes, vae_factor(model_path), batch)


def model_inputs(x0, references, noise, sigmas) -> dict:
    """[noisy target ; each clean reference] tokens (packed 2x2 as the pipeline packs, :397) with
    their img_shapes, and the flow-matching target n - x0 on the target tokens."""
    shapes = [(1, x0.shape[-2] // 2, x0.shape[-1] // 2), *[(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references]]
    return {**km.edit_tokens(x0, references, noise, sigmas), "img_shapes": [shapes] * x0.shape[0]}


def forward(transformer, inputs, sigmas, guidance, text):
    """The transformer on model_inputs' tokens: timestep σ (B,), the text and its mask."""
    hidden = inputs["hidden_states"]
    timestep = torch.as_tensor(sigmas, device=hidden.device).reshape(-1).expand(hidden.shape[0])
    embeds, mask = text
    return transformer(hidden_states=hidden, timestep=timestep, guidance=None, encoder_hidden_states=embeds,
                       encoder_hidden_states_mask=mask, img_shapes=inputs["img_shapes"], return_dict=False)[0]


def sample_pipeline(scheduler, vae, transformer):
    return scheduler, transformer


@torch.no_grad()
def sample(pipe, vae, references, text, size, steps, guidance, generator, negative=None) -> torch.Tensor:
    """One edit (3, h, w) on CPU by the pipeline's denoising loop (:740-870) on latents: noise drawn as
    it draws it, σ = linspace(1, 1/steps) shifted by calculate_shift of the target's token count,
    the references' clean tokens after the noisy target's, true CFG with its norm rescale when
    `guidance` > 1 and a `negative` text is given."""
    import numpy as np
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_shift, retrieve_timesteps
    from diffusers.utils.torch_utils import randn_tensor
    scheduler, transformer = pipe
    embeds, mask = text
    device, dtype = embeds.device, embeds.float().dtype
    f = 2 ** len(vae.temperal_downsample)
    h, w = 2 * (size[0] // (f * 2)), 2 * (size[1] // (f * 2))
    c = vae.config.z_dim
    latents = km.pack_latents(randn_tensor((1, 1, c, h, w), generator=generator, device=device,
                                           dtype=dtype)[:, 0])
    refs = [image_tokens(vae, r).to(dtype) for r in references]
    img_shapes = [[(1, h // 2, w // 2), *[(1, x.shape[-2] // f // 2, x.shape[-1] // f // 2) for x in references]]]
    cfg = scheduler.config
    mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    scheduler.set_begin_index(0)
    cfg_on = guidance > 1 and negative is not None
    for t in timesteps:
        model_input = torch.cat([latents, *refs], dim=1)
        timestep = t.expand(1).to(latents.dtype) / 1000

        def velocity(e, m):
            return transformer(hidden_states=model_input, timestep=timestep, guidance=None, encoder_hidden_states=e,
                               encoder_hidden_states_mask=m, img_shapes=img_shapes,
                               return_dict=False)[0][:, :latents.shape[1]]
        pred = velocity(embeds.float(), mask)
        if cfg_on:
            pred = cfg_combine(pred, velocity(negative[0].float(), negative[1]), guidance, "token")
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return decode_latents(vae, km.unpack_latents(latents, h, w))[0]


# ----------------------------------------------------------------------------------------------
# DMD2 (train_dmd.py's flow setup): the conditioning algorithms/dmd2_flow.py's flow-matching step reads, the
# samples' decoding, the teacher's guidance, the refusals


@dataclass
class QwenCond:
    """One micro-batch's conditioning, shared by generator, teacher and fake score: its text (and
    the negative prompt's, read with the same images), the references' clean tokens and img_shapes,
    as fine-tuning builds them (model_inputs, forward)."""
    text: tuple  # (embeddings (B, T, D), mask or None)
    negative: tuple | None  # the negative prompt's, for the teacher's true CFG; None: no CFG
    references: list  # [(B, Nr, 64) packed clean reference latents]
    size: tuple[int, int]  # the target latent's (h, w)
    reference_sizes: list = field(default_factory=list)  # each reference latent's (h, w)

    def velocity(self, model, guidance: float, norm: str = "none"):
        """v(x_σ, σ) of `model`: x_σ the packed target tokens (B, Nt, 64), the references appended
        after them, the prediction cut back to the target's. guidance > 1 (the teacher): true CFG,
        v_neg + s (v − v_neg), the pair in one batch of 2B, rescaled by `norm`
        (algorithms/dmd2.cfg_combine: "token" is the pipeline's own per-token rescale, :841-845)."""
        h, w = self.size
        shapes = [(1, h // 2, w // 2), *[(1, rh // 2, rw // 2) for rh, rw in self.reference_sizes]]

        def v(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            hidden = torch.cat([x, *(r.to(x.dtype) for r in self.references)], dim=1)
            b = x.shape[0]
            sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(b)
            if guidance > 1 and self.negative is not None:
                text = _pair(self.text, self.negative)
                out = forward(model, {"hidden_states": torch.cat([hidden, hidden]), "img_shapes": [shapes] * 2 * b},
                              torch.cat([sigma, sigma]), None, text)[:, :x.shape[1]].float()
                return cfg_combine(out[:b], out[b:], guidance, norm)
            out = forward(model, {"hidden_states": hidden, "img_shapes": [shapes] * b}, sigma, None, self.text)
            return out[:, :x.shape[1]].float()
        return v


def _pair(text, negative):
    """[text ; negative] as one batch: padded to the longer, masked where padded."""
    (a, ma), (b, mb) = text, negative
    longest = max(a.shape[1], b.shape[1])

    def padded(e, m):
        mask = m if m is not None else torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
        extra = longest - e.shape[1]
        return (torch.nn.functional.pad(e, (0, 0, 0, extra)),
                torch.nn.functional.pad(mask, (0, extra), value=False))
    (ea, ma), (eb, mb) = padded(a, ma), padded(b, mb)
    mask = torch.cat([ma, mb])
    return torch.cat([ea, eb]), (None if bool(mask.all()) else mask)


def dmd_cond(text, negative, vae, references: list, size) -> QwenCond:
    """QwenCond of a micro-batch: references (B, 3, H, W) pixels per position, encoded and packed."""
    tokens = [image_tokens(vae, r) for r in references]
    f = 2 ** len(vae.temperal_downsample)
    return QwenCond(text, negative, tokens, size, [(r.shape[-2] // f, r.shape[-1] // f) for r in references])


@torch.no_grad()
def decode_tokens(vae, tokens: torch.Tensor, size) -> torch.Tensor:
    """Packed latent tokens of a (h, w) latent -> images (B, 3, H, W), fp32 on CPU (decode_latents)."""
    return decode_latents(vae, km.unpack_latents(tokens.float(), *size))


def dmd_guidance(settings) -> Guidance:
    """No guidance embedding: the teacher's true CFG against NEGATIVE_PROMPT (REAL_GUIDANCE_SCALE, 0: the
    pipeline's TRUE_CFG_SCALE; REAL_GUIDANCE_NORM, "": CFG_NORM); the export samples without it."""
    scale, norm = settings["REAL_GUIDANCE_SCALE"] or TRUE_CFG_SCALE, settings["REAL_GUIDANCE_NORM"] or CFG_NORM
    return Guidance(scale, norm, negative=NEGATIVE_PROMPT if scale > 1 else None, export_call="true_cfg_scale=1")


def check_dmd_settings(pipeline, settings, changed: set, data_kind: str) -> None:
    """What a Qwen-Image-Edit teacher refuses, in one line before any work."""
    refused = [
        ("BUCKET_ASPECTS", "target and references are sized by their own ratios, as the pipeline sizes them"),
        ("MAX_SEQUENCE_LENGTH", "the text is as long as the prompt and its image tokens"),
        ("FLUX_GUIDANCE", "Qwen-Image-Edit has no guidance embedding; its teacher's guidance is true CFG "
         "(REAL_GUIDANCE_SCALE, REAL_GUIDANCE_NORM)"),
    ]
    for name, why in refused:
        if name in changed:
            raise ConfigError(f"{name}={settings[name]} with a {pipeline} teacher: {why}")
    if data_kind == "txt":
        raise ConfigError(f"DATA_PATH={settings['DATA_PATH']} holds prompts only; a {pipeline} teacher edits images: "
                          "give rows with \"control\" image(s) and a \"prompt\" (.jsonl, folders or datasets)")


def distilled_index(model_path) -> dict:
    """model_index.json entries a distilled generator's pipeline export sets: none."""
    return {}
