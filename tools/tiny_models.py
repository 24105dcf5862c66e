"""Tiny but real diffusers model folders with random weights, for tests and tools.

They have the exact folder layout of SD-1.5, SDXL, FLUX.1 Kontext [dev], Qwen-Image-Edit-2509 and
FLUX.2 [klein] / [dev], are written with `save_pretrained` (safetensors) and read back through the same
`from_pretrained` path as real weights, so tests exercise the real loading code. Everything is built
offline (no hub). The scripts' embedded defaults are not these: they are the trained tiny models shipped
in `assets/`.

    python -m tools.tiny_models sd15        # build (or reuse) the default folders, print the paths
    python -m tools.tiny_models flux_kontext qwen_image_edit

Each family's builders live in its package (families/<name>/tiny.py, its tiny configs described there),
named by its spec's `tiny` (BUILDERS gathers them); what they share (the tokenizers, the synthetic
datasets of the coloured-shapes world) is families/tiny/. Their names are importable from here too.

Cache convention: `ensure_default(kind)` builds once (`tools.build_once.build_once`) under
`$FSDP_DIFFUSION_CACHE/tiny_<kind>_v1/` (default `~/.cache/fsdp_diffusion/tiny_<kind>_v1/`) with
`model/` (the diffusers folder) and `data/` (the default dataset, always holding a `data.jsonl`).
Bump `DEFAULTS_VERSION` whenever a tiny config changes, so stale caches are never reused.

Scripts should derive sizes from the configs: vae_scale_factor = 2 ** (len(vae block_out_channels)
- 1) (Qwen: 2 ** len(vae temperal_downsample)), default resolution = unet sample_size * vae_scale_factor.
"""
import os
import sys
from pathlib import Path

import families
from families.flux.tiny import build_flux_kontext as _build_flux_kontext  # noqa: F401
from families.flux.tiny import make_tiny_flux_kontext, write_t5_tokenizer  # noqa: F401
from families.flux2.tiny import (MISTRAL_CHAT_TEMPLATE, MISTRAL_SPECIAL_TOKENS, PIXTRAL_PREPROCESSOR,  # noqa: F401
                                 QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE, _build_flux2_data, _flux2_parts,
                                 _mistral3_text_encoder, _qwen3_text_encoder, make_tiny_flux2_dev,
                                 make_tiny_flux2_klein, write_pixtral_processor, write_qwen3_tokenizer)
from families.flux2.tiny import build_flux2_dev as _build_flux2_dev  # noqa: F401
from families.flux2.tiny import build_flux2_klein as _build_flux2_klein  # noqa: F401
from families.qwen_image.tiny import (QWEN_VL_PREPROCESSOR, _qwen_vl_text_encoder,  # noqa: F401
                                      _write_qwen_processor, make_tiny_qwen_image_edit)
from families.qwen_image.tiny import build_qwen_image_edit as _build_qwen_image_edit  # noqa: F401
from families.sd_unet.tiny import _sd_vae, make_tiny_sd15, make_tiny_sdxl  # noqa: F401
from families.sd_unet.tiny import build_sd15 as _build_sd15  # noqa: F401
from families.sd_unet.tiny import build_sdxl as _build_sdxl  # noqa: F401
from families.tiny.data import (make_edit_dataset, make_image_prompt_dataset, make_prompts_file,  # noqa: F401
                                make_two_reference_edit_dataset)
from families.tiny.data import write_jsonl as _write_jsonl  # noqa: F401
from families.tiny.models import IMAGE_SIZE, seeded  # noqa: F401
from families.tiny.models import clip_text_encoder as _clip_text_encoder  # noqa: F401
from families.tiny.models import quiet_logs as _quiet_logs  # noqa: F401
from families.tiny.scenes import COLOURS, SHAPES, describe, draw_shape, random_scene  # noqa: F401
from families.tiny.tokenizers import (CHARS, OTHER_WORDS, QWEN_ADDED_TOKENS, QWEN_EDIT_SYSTEM_PROMPT,  # noqa: F401
                                      QWEN_EDIT_WORDS, TEXT_MAX_LENGTH, WORDS, _bpe, _word_merges,
                                      write_clip_tokenizer, write_qwen_tokenizer)
from tools.build_once import READY, build_once  # noqa: F401 - READY: the marker of a finished folder

DEFAULTS_VERSION = 1  # part of the cache folder name; bump on any change to a tiny config
# kind -> build(root): each family's tiny folders, as its spec names them
BUILDERS = {kind: build for spec in families.SPECS for kind, build in spec.tiny.items()}


def load_qwen_processor(folder):
    """The family room's processor loader (families/qwen_image/room.py's load_processor)."""
    from families.qwen_image import load_processor
    return load_processor(folder)


def default_cache_dir():
    """$FSDP_DIFFUSION_CACHE, else ~/.cache/fsdp_diffusion."""
    return Path(os.environ.get("FSDP_DIFFUSION_CACHE", "~/.cache/fsdp_diffusion")).expanduser()


def ensure_default(kind, cache_dir=None, timeout=600.0):
    """Build the tiny default for `kind` (a key of BUILDERS: "sd15", "flux2_dev", ...) once;
    return (model_path, data_path) as strings: <cache_dir>/tiny_<kind>_v<N>/{model,data}.

    Safe for many ranks at once (`tools.build_once.build_once`): one of them builds in a temp folder,
    under a lock file beside the folder, and publishes it with an atomic rename (READY marker
    inside); everyone else reuses it.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny default {kind!r}; choose from {sorted(BUILDERS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"tiny_{kind}_v{DEFAULTS_VERSION}"
    build_once(final, BUILDERS[kind], timeout, ready_text=f"tiny {kind} defaults v{DEFAULTS_VERSION}\n")
    return str(final / "model"), str(final / "data")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(BUILDERS):
        print(name, *ensure_default(name))
