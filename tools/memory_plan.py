"""`python tools/memory_plan.py`: the memory planner's command line (tools/planner/cli.py); what it plans and
how, in tools/planner/'s docstring. Its names are importable from here too (tools/gpu_check.py, tools/benchmarks.py
and the tests plan through tools.memory_plan).

    python tools/memory_plan.py --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    python tools/memory_plan.py --help
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: tools.planner

from parallel import lora as lora_lib
from precision import get_precision
from tools.planner.activations import (activation_bytes, activation_profile, ActivationProfile, _activations,
                                       ATTENTION_NOTE, _builtin_activations, check_context_parallel, _cp_activations,
                                       flash_attention_saves, _flash_sdpa, _FlashSDPA, _image_tokens, _meta_inputs,
                                       _no_cp, _ORIGINAL_SDPA, reference_grids)
from tools.planner.build import (ADAPTER_DTYPE, build_components, BUILTINS, _config, default_script, DMD_ROLES,
                                 DMD_SCRIPT, GIB, HOLDING, Holding, latent_shapes, layout, meta_model,
                                 model_folder, native_resolution, NF4_BYTES, NF4_LOAD_BYTES_PER_PARAM, Part,
                                 pipeline_components, pipeline_of, RUNTIME_BYTES, Settings, _size, STATE_BYTES,
                                 TEXT_FILL_BATCH, text_length, vae_factor, with_script)
from tools.planner.cli import main
from tools.planner.fit import (cheapest_fit, check_lora_targets, _count, _cp_caption, cp_frontier, _cp_lines, cp_table,
                               _ddp_total, fewest_gpus, _fill_lines, FIT_ORDER, fit_table, _fit_without_offload,
                               FLUX2_ROWS, flux2_table, format_plan, _largest_batch, _lora_caption, _lora_lines,
                               lowbit_tables, memo_planner, _reference_lines, _setting_name)
from tools.planner.plan import (_BUILTIN_SHARDS, default_lora_targets, fill_activations, fill_phase, in_flight_at_peak,
                                _LiveBytes, _nf4_base, _optimizer_note, peak_bytes, plan, reshard_free, _state_bytes,
                                _with_ema)
from tools.planner.shard import (_add_lora_on_meta, fake_world, fill_sharded, _fp8_names, _fp8_per_unit,
                                 shard_components, _trainable_per_unit)

__all__ = ["activation_bytes", "activation_profile", "ActivationProfile", "_activations", "ADAPTER_DTYPE",
           "_add_lora_on_meta", "ATTENTION_NOTE", "build_components", "_builtin_activations", "BUILTINS",
           "_BUILTIN_SHARDS", "cheapest_fit", "check_context_parallel", "check_lora_targets", "_config", "_count",
           "_cp_activations", "_cp_caption", "cp_frontier", "_cp_lines", "cp_table", "_ddp_total", "default_script",
           "default_lora_targets", "DMD_ROLES", "DMD_SCRIPT", "fake_world", "fewest_gpus", "fill_activations",
           "_fill_lines", "fill_phase", "fill_sharded", "FIT_ORDER", "fit_table", "_fit_without_offload",
           "flash_attention_saves", "_flash_sdpa", "_FlashSDPA", "FLUX2_ROWS", "flux2_table",
           "format_plan", "_fp8_names", "_fp8_per_unit", "get_precision", "GIB",
           "HOLDING", "Holding", "_image_tokens", "in_flight_at_peak", "latent_shapes",
           "_largest_batch", "layout", "_LiveBytes", "_lora_caption", "lora_lib", "_lora_lines",
           "lowbit_tables", "main", "memo_planner", "_meta_inputs", "meta_model", "model_folder",
           "native_resolution", "_nf4_base", "NF4_BYTES", "NF4_LOAD_BYTES_PER_PARAM", "_no_cp",
           "_optimizer_note", "_ORIGINAL_SDPA", "Part", "peak_bytes", "pipeline_components",
           "pipeline_of", "plan", "reference_grids", "_reference_lines", "reshard_free", "RUNTIME_BYTES",
           "_setting_name", "Settings", "shard_components", "_size", "STATE_BYTES", "_state_bytes", "TEXT_FILL_BATCH",
           "text_length", "_trainable_per_unit", "vae_factor", "_with_ema", "with_script"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
