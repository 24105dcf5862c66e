"""plan(): a run's per-rank bytes by category, and the text-cache fill before training."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_utils
from families import MODELS, pipelines, spec_of  # FSDP units and LoRA targets per model class; the family specs
from precision import dtype_name, get_precision
from tools.planner.activations import (ActivationProfile, _activations, _builtin_activations, _cp_activations,
                                        check_context_parallel, reference_grids)
from tools.planner.build import (ADAPTER_DTYPE, BUILTINS, DMD_SCRIPT, GIB, NF4_BYTES, NF4_LOAD_BYTES_PER_PARAM,
                                  RUNTIME_BYTES, STATE_BYTES, TEXT_FILL_BATCH, Part, Settings, _config, _size,
                                  build_components, frames, latent_shapes, layout, meta_model, model_folder,
                                  native_resolution, pipeline_of, plans_references, text_length, vae_factor,
                                  with_script)
from tools.planner.shard import fill_sharded, shard_components

# ----------------------------------------------------------------------------------------------
# the plan

# the built-in real-size configs never change within a process: their shard counts (and measured
# activations: _builtin_activations) are kept for every later plan (tests and fit tables plan the same
# models many times)
_BUILTIN_SHARDS: dict = {}


def plan(name: str, s: Settings, shard_cache: dict | None = None) -> dict:
    """Per-rank GPU bytes by category (and host bytes with CPU offload) for these settings.
    `shard_cache`: a dict to keep shard_components' counts in across calls that differ only in
    precision, CPU offload, checkpointing, batch or resolution (the counts do not depend on them:
    fully_shard splits each parameter's dim 0 over the mesh whatever its dtype or where it lives);
    a built-in configuration always keeps them in one dict for the process (_BUILTIN_SHARDS).
    LoRA (s.lora_rank > 0): see the module's docstring; the LoRA components' rows are their frozen
    base (name) and their adapters (name + ".lora"), and the plan says what is trainable (`lora`).
    Context parallelism (s.context_parallel = C > 1, where the family has it; checked first, check_context_parallel):
    sharded on the script's dp x cp mesh; the activations are a rank's share of one forward's over the
    full sequence (_cp_activations), and the plan has `cp`: the degree, the sequence it splits, that
    one forward's activations, the part held whole and the buffers. DMD2 on a transformer family (s.script
    train_dmd.py on its folder, or a name like flux-kontext-dmd): the three transformers of
    pipeline_components, the teacher in NF4 with BASE_DTYPE=nf4 under LoRA (FamilySpec.nf4_teacher).
    s.ema: an "ema" row, a copy of the trained model's shards in its storage dtype (LoRA: of its
    adapters, fp32), wherever they live."""
    s = with_script(name, s)
    precision = get_precision(s.precision)
    folder = model_folder(name)
    builtin = os.path.abspath(folder) in {os.path.abspath(f) for f, _ in BUILTINS.values()}
    if builtin:  # whoever plans them (memo_planner too): the built-in configs are sharded once per process
        shard_cache = _BUILTIN_SHARDS
    activations = _builtin_activations if builtin else _activations
    sequence = check_context_parallel(folder, s)
    kind = layout(folder, s.script)[1]
    pipeline = pipeline_of(folder)
    family = spec_of(pipeline)
    if (s.references is not None or s.reference_area) and not (family.reference_area and plans_references(folder)):
        raise SystemExit(f"plan: --references / --reference_area: for families that plan references by area; "
                         f"{name} is {kind}, planned with its pipeline's references")
    # resharding after forward, like checkpointing and offload, changes what fully_shard keeps, not its shards
    key = (os.path.abspath(folder), s.world_size, s.dp_replicate, tuple(s.block_classes))
    key += (kind,)  # the same folder, other components (DMD2's roles)
    if s.lora:  # the adapters change the counts (alpha does not); a full fine-tune keeps its key
        key += (s.lora_rank, tuple(s.lora_targets), s.fake_lora)
    if s.context_parallel > 1:  # another mesh (same shards: FSDP spans dp x cp), so sharded again
        key += (s.context_parallel,)
    key += (repr(MODELS), repr(pipelines.PIPELINES))  # the recipes' unit classes and roles decide the shards
    cached = shard_cache is not None and key in shard_cache
    script, kind, comps = build_components(folder, precision, build=not cached, lora=s.lora, fake_lora=s.fake_lora,
                                           script=s.script)
    if s.resolution is None:
        s = dataclasses.replace(s, resolution=native_resolution(folder))
    if s.frames is None:
        s = dataclasses.replace(s, frames=frames(folder, s))
    trainable = next(c for c in comps if c.holding.trained)
    sharded = shard_cache[key] if cached else shard_components(comps, s, precision)
    if shard_cache is not None:
        shard_cache[key] = sharded
    # the outermost units are the blocks the recipe checkpoints; the root (listed last) is not a block
    unit_names = tuple(n for n, _ in sharded[trainable.name]["units"][:-1])
    ac = s.activation_checkpointing
    refs, shapes = reference_grids(folder, s), latent_shapes(folder, s)
    profile = activations(folder, trainable.spec.subfolder, unit_names, precision.compute_dtype, s.batch_size,
                          shapes, trainable.lora)
    acts = profile.total(ac)
    for c in comps:  # LoRA: a trained model without adapters (DMD's full fake score) may save more
        if s.lora and c.holding.trained and c is not trainable:
            names = tuple(n for n, _ in sharded[c.name]["units"][:-1])
            acts = max(acts, activations(folder, c.spec.subfolder, names, precision.compute_dtype,
                                         s.batch_size, shapes, c.lora).total(ac))
    # DMD's FAKE_SCORE_FP32: the fake score's units (its experts' too) are gathered and its training forward saves
    # in fp32
    fp32_compute = {c.name for c in comps if c.name.startswith("fake_score") and c.holding.trained
                    and s.fake_score_fp32}
    for c in comps:
        if c.name in fp32_compute and precision.compute_dtype != torch.float32:
            names = tuple(n for n, _ in sharded[c.name]["units"][:-1])
            acts = max(acts, activations(folder, c.spec.subfolder, names, torch.float32, s.batch_size,
                                         shapes, c.lora).total(ac))
    one_forward = acts
    if s.context_parallel > 1:  # one forward's share (DMD2: of the larger of the trained roles' forwards)
        cp = _cp_activations(folder, trainable, unit_names, precision.compute_dtype, s, sequence, one_forward,
                             activations)
        acts = cp["per_rank"]
    p_size, c_size, r_size = _size(precision.param_dtype), _size(precision.compute_dtype), _size(precision.reduce_dtype)

    def compute_size(c: Part) -> int:
        return _size(torch.float32) if c.name in fp32_compute else c_size

    # FP8=tensorwise: a full trained model's FP8 weights gathered in float8 (as the scripts decide it)
    from parallel import float8
    float8_gather = s.fp8 == "tensorwise" and float8.gathers_in_float8(False, s.world_size // s.dp_replicate)

    def trained_unit_bytes(c: Part) -> list[int]:  # a full trained model's gathered units; FP8's weights in float8
        fp8 = sharded[c.name]["fp8_units"] if float8_gather else [0] * len(sharded[c.name]["units"])
        return [u * compute_size(c) - f * (compute_size(c) - 1) for (_, u), f in zip(sharded[c.name]["units"], fp8)]
    rows, gathered_units, result_load, lora_units = {}, [], [], {}
    nf4_teacher = family.nf4_teacher and script == DMD_SCRIPT and s.base_dtype == "nf4" and s.lora_rank > 0
    for c in comps:
        info, h = sharded[c.name], c.holding
        if not h.resident:
            rows[c.name] = dict(params=0, grads=0, optim=0, note="text embeddings cached before training",
                                sharded=False)
            continue
        local = info["local"] if h.sharded else info["global"]
        note = c.spec.role + (" (fp32)" if c.name in family.fp32_components.get(pipeline, ()) else "") + \
            (" (fp32 compute)" if c.name in fp32_compute and c_size != _size(torch.float32) else "")
        if c.lora:  # the frozen base, then its adapters: only they have grads and optimizer state
            n, a = info["trainable_local"], _size(ADAPTER_DTYPE)
            base_local = local - n
            if s.base_dtype == "nf4":  # the quantised share of the base, the rest (biases, norms, ...) as is
                base_bytes, load_peak, units = _nf4_base(info, base_local, _size(c.dtype), compute_size(c),
                                                         s.world_size)
                result_load.append(load_peak)
            else:
                base_bytes = base_local * _size(c.dtype)
                units = [u * compute_size(c) for _, u in info["units"]]  # base and adapters, in compute dtype
            gathered_units += units
            lora_units[c.name] = {name: b for (name, _), b in zip(info["units"], units)}
            rows[c.name] = dict(params=base_bytes, grads=0, optim=0,
                                note=f"frozen LoRA base ({'nf4' if s.base_dtype == 'nf4' else dtype_name(c.dtype)})",
                                count=info["global"] - info["trainable_global"], local_count=base_local, sharded=True)
            rows[c.name + ".lora"] = dict(params=n * a, grads=n * a, optim=int(n * _state_bytes(s.optimizer, a)),
                                          note=f"LoRA adapters, rank {c.lora.rank} ({dtype_name(ADAPTER_DTYPE)})"
                                          + _optimizer_note(s.optimizer),
                                          count=info["trainable_global"], local_count=n, sharded=True, adapters=True)
            continue
        if nf4_teacher and h.sharded and not h.trained:  # stored and gathered as the NF4 LoRA bases are
            base_bytes, load_peak, units = _nf4_base(info, local, _size(c.dtype), _size(c.dtype), s.world_size)
            result_load.append(load_peak)
            gathered_units += units
            rows[c.name] = dict(params=base_bytes, grads=0, optim=0, note=f"{note} (nf4)", count=info["global"],
                                local_count=local, sharded=True)
            continue
        trained = (info["trainable_local"] if h.sharded else info["trainable_global"]) if h.trained else 0
        rows[c.name] = dict(params=local * _size(c.dtype), grads=trained * p_size,
                            optim=int(trained * _state_bytes(s.optimizer, p_size)),
                            note=note + (_optimizer_note(s.optimizer) if h.trained else ""),
                            count=info["global"], local_count=local, sharded=h.sharded)
        if h.sharded and h.trained:
            gathered_units += trained_unit_bytes(c)
            if s.fp8 == "tensorwise":  # + one fp32 scale per converted weight, precomputed every step
                rows[c.name]["note"] += ", FP8: weights gathered in float8"
                rows[c.name]["params"] += 4 * info["fp8_count"]
        elif h.sharded:
            gathered_units += [u * _size(c.dtype) for _, u in info["units"]]
    biggest = sorted(gathered_units, reverse=True)
    free = reshard_free(comps, sharded, s, compute_size)
    copies = sum(sum(trained_unit_bytes(c)) if c.holding.trained and not c.lora else
                 sum(u * compute_size(c) for _, u in sharded[c.name]["units"]) for c in comps if c.name in free)
    trained_parts = [c for c in comps if c.holding.trained]
    frozen_sharded = [c for c in comps if c.holding.resident and c.holding.sharded and not c.holding.trained]
    at_peak = None
    if trainable.lora and trained_parts == [trainable] and not frozen_sharded and not free:
        at_peak = in_flight_at_peak(profile, lora_units[trainable.name], ac)
    if free and free == {c.name for c in trained_parts}:  # kept gathered from forward to backward
        gathered = copies
    elif at_peak is not None:  # one LoRA model: its few grads put the step's peak where the activations peak
        gathered = at_peak
    else:  # any others hold two units at a time, counted beside all the activations and grads
        gathered = copies + sum(biggest[:2])
    if s.lora:  # reduce-scatter input of the largest unit's grads: LoRA units' adapters only, in fp32
        gathered += max(max(sharded[c.name]["trainable_units"]) * _size(ADAPTER_DTYPE) if c.lora else
                        max(u for _, u in sharded[c.name]["units"]) * r_size for c in comps if c.holding.trained)
    else:
        # reduce-scatter input of the largest unit
        gathered += max(u for _, u in sharded[trainable.name]["units"]) * r_size
    if s.ema:  # sharded like the model it copies (train_*.py's ema_lib.build_ema), so offloaded with it
        rows = _with_ema(rows, trainable, sharded[trainable.name])
    trained = {c.name for c in comps if c.holding.trained} | {c.name + ".lora" for c in comps if c.lora} | {"ema"}
    states = sum(r["params"] + r["grads"] + r["optim"] for n, r in rows.items() if n in trained)
    frozen = sum(r["params"] for n, r in rows.items() if n not in trained)
    host = states if s.cpu_offload else 0
    gpu = (0 if s.cpu_offload else states) + frozen + gathered + acts + RUNTIME_BYTES
    result = dict(kind=kind, script=script, rows=rows, gathered=gathered, reshard_free=sorted(free),
                  at_peak=at_peak is not None,
                  largest_unit=biggest[0] if biggest else 0,
                  activations=acts, runtime=RUNTIME_BYTES, gpu_total=gpu, host_total=host, settings=s,
                  units={c.name: sharded[c.name]["units"] for c in comps if c.holding.sharded})
    if s.context_parallel > 1:
        result["cp"] = dict(sequence, degree=s.context_parallel, one_forward=one_forward, whole=cp["whole"],
                            buffers=cp["buffers"])
    if result_load:  # BASE_DTYPE=nf4: the host peak while loading (meta path), per rank
        result["load_peak"] = max(result_load)
    if s.lora:  # what trains: {component: (adapter params, all its params incl. adapters)}, and the targets
        result["lora"] = {c.name: (sharded[c.name]["trainable_global"], sharded[c.name]["global"])
                          for c in comps if c.lora}
        result["lora_targets"] = tuple(s.lora_targets) or default_lora_targets(folder, trainable.spec.subfolder)
    if refs:  # the sequence of a family that plans its references by area (format_plan's words)
        result.update(references=refs, reference_area=s.reference_area or family.reference_area,
                      patch=2 * vae_factor(folder), text=text_length(folder))
        if family.sequence_extras is not None:
            result["sequence_extras"] = family.sequence_extras(_config(folder, trainable.spec.subfolder), refs)
    fill = fill_phase(folder, comps, sharded, s, precision)
    if fill:
        result["fill"] = fill
    return result


@functools.lru_cache(maxsize=None)
def default_lora_targets(folder: str, subfolder: str) -> tuple:
    """The model's default LoRA targets (families.MODELS, from each family's parallelism.py); a callable default
    is asked of the model, built on meta."""
    default = getattr(MODELS.get(_config(folder, subfolder).get("_class_name", "")), "lora_targets", ())
    return tuple(default(meta_model(os.path.join(folder, subfolder))) if callable(default) else default)


# ----------------------------------------------------------------------------------------------
# the text-cache fill: the offline components, before training

class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held at once by the tensors the ops within create, each counted until it is
    freed (views and in-place results share an input's storage: not counted): what a forward without grad
    holds beyond its weights, on meta."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    self.live += n
                    weakref.finalize(t, self._free, n)
            self.peak = max(self.peak, self.live)
        return out


@functools.lru_cache(maxsize=None)
def fill_activations(folder: str, subfolder: str, dtype: torch.dtype, batch: int, text: int) -> int:
    """The peak bytes beyond the weights of one forward without grad of a text encoder over `batch` prompts
    of `text` tokens (at most its positions), as the pipelines' encode_prompt runs it: a language model
    (Qwen2.5-VL, Mistral 3, Qwen3) keeps every layer's hidden states (they read middle layers) and its logits,
    without a KV cache; CLIP and T5 return their last state. The mask is given 4-D (the data-dependent checks
    of a 2-D one cannot run on meta); attention runs meta's math SDPA, so one layer's L x L scores count. An image
    encoder (no input_ids) reads `batch` images at its own size instead (a NaFlex one, SigLIP2: its most patches)."""
    model = meta_model(os.path.join(folder, subfolder)).to(dtype)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text = min(text, getattr(config, "max_position_embeddings", None) or text)
    language_model = model.get_output_embeddings() is not None
    with torch.device("meta"):
        kw = dict(input_ids=torch.zeros(batch, text, dtype=torch.long),
                  attention_mask=torch.ones(batch, 1, text, text, dtype=torch.bool),
                  output_hidden_states=language_model)
        signature = inspect.signature(model.forward).parameters
        if "spatial_shapes" in signature:  # a NaFlex image encoder (SigLIP2): its most patches as a square, no mask
            side, patch = math.isqrt(config.num_patches), config.patch_size
            kw = dict(pixel_values=torch.zeros(batch, side * side, config.num_channels * patch * patch, dtype=dtype),
                      spatial_shapes=torch.tensor([[side, side]] * batch, device="cpu"), pixel_attention_mask=None)
        elif "input_ids" not in signature:  # an image encoder (Wan 2.1 I2V's CLIP)
            side = config.image_size
            kw = dict(pixel_values=torch.zeros(batch, config.num_channels, side, side, dtype=dtype))
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw["use_cache"] = False
    live = _LiveBytes()
    with torch.no_grad(), live:
        model(**kw)
    return live.peak


def fill_phase(folder: str, comps: list[Part], sharded: dict, s: Settings, precision) -> dict | None:
    """The text-cache fill's per-rank peak, before training (None without offline components): every offline
    component loaded at once in the compute dtype (s.text_encoder_dtype nf4: its Linear weights in NF4), sharded
    over the ranks in units of its own _no_split_modules (fill_sharded), run one at a time on TEXT_FILL_BATCH
    prompts of the text length (the sequences or images its spec's fill_batch says they make): its shards, the
    units in flight (the root, which stays gathered through the forward, and the two largest blocks: current and
    prefetched; with NF4 one Linear dequantised), the activations without grad (fill_activations) and the runtime
    reserve. Freed before the trained model is built."""
    offline = [c for c in comps if not c.holding.resident]
    if not offline:
        return None
    text, size = text_length(folder), _size(precision.compute_dtype)
    params = gathered = acts = 0
    pipeline, references = pipeline_of(folder), len(latent_shapes(folder, s)) - 1
    spec = spec_of(pipeline)
    batches = {c.name: spec.fill_batch(pipeline, c.spec.subfolder, TEXT_FILL_BATCH, references) if spec.fill_batch
               else TEXT_FILL_BATCH for c in offline}
    for c in offline:
        info = sharded[c.name]
        if s.text_encoder_dtype == "nf4":
            shard, _, units = _nf4_base(info, info["local"], size, size, max(1, s.world_size))
        else:
            shard, units = info["local"] * size, [u * size for _, u in info["units"]]
        params += shard
        if fill_sharded(c, s):
            blocks = sorted(units[:-1], reverse=True)
            gathered = max(gathered, units[-1] + sum(blocks[:2]))
        elif s.text_encoder_dtype == "nf4":  # whole, dequantised one Linear at a time
            gathered = max(gathered, info["nf4_largest"] * size)
        acts = max(acts, fill_activations(folder, c.spec.subfolder, precision.compute_dtype, batches[c.name], text))
    return dict(components={c.name: sharded[c.name]["global"] for c in offline}, params=params, gathered=gathered,
                activations=acts, runtime=RUNTIME_BYTES, total=params + gathered + acts + RUNTIME_BYTES,
                batch=max(batches.values()), text=text, sharded=any(fill_sharded(c, s) for c in offline),
                dtype="nf4" if s.text_encoder_dtype == "nf4" else dtype_name(precision.compute_dtype))


def peak_bytes(p: dict) -> int:
    """A plan's per-GPU peak over its phases: training, and the text-cache fill before it."""
    return max(p["gpu_total"], (p.get("fill") or {}).get("total", 0))


def in_flight_at_peak(profile: ActivationProfile, unit_bytes: dict, checkpointing: bool) -> int | None:
    """The all-gathered bytes in flight when one model's activations and units together peak, for
    {unit name: gathered bytes} (root "<root>"): at each unit, in forward or backward, the root (FSDP2
    keeps it gathered), that unit and the neighbour prefetched (the next in forward, the previous in
    backward), beside the activations held then (ActivationProfile.timeline); at least the root and
    the last unit, kept gathered from forward to backward. None where the profile's units are not
    the sharded ones (then the caller's bound applies)."""
    timeline = profile.timeline(checkpointing)
    if not timeline or any(n not in unit_bytes for n, _ in timeline):
        return None
    root, g = unit_bytes.get("<root>", 0), [unit_bytes[n] for n, _ in timeline]
    peak = max(t + root + g[i] + max(g[i - 1] if i else 0, g[i + 1] if i + 1 < len(g) else 0)
               for i, (_, t) in enumerate(timeline))
    return max(peak - profile.total(checkpointing), root + g[-1])


def reshard_free(comps: list[Part], sharded: dict, s: Settings, compute_size) -> set[str]:
    """The trained components that keep their gathered params from forward to backward: all of them
    with reshard_after_forward=False; with auto (None) those the scripts' rule keeps
    (fsdp_utils.reshard_free_fits: one rank per shard group, the compute copy at most a share of
    s.gpu_memory_gb; unknown memory: none)."""
    if s.reshard_after_forward:
        return set()
    free = set()
    for c in comps:
        if not c.holding.trained:
            continue
        copy = sum(u for _, u in sharded[c.name]["units"]) * compute_size(c)
        if s.reshard_after_forward is False or not fsdp_utils.reshard_free_fits(
                s.world_size // s.dp_replicate, s.cpu_offload, copy, int(s.gpu_memory_gb * GIB))[0]:
            free.add(c.name)
    return free


def _nf4_base(info: dict, base_local: int, stored: int, compute: int, world: int) -> tuple[int, int, list[int]]:
    """A frozen base whose Linear weights BASE_DTYPE=nf4 quantises (shard_components' nf4 counts):
    (its shard's bytes, the host peak while loading it, the bytes of each unit in flight). The rest
    (biases, norms, ...) stays in the stored dtype (`stored` bytes); units are gathered as codes plus
    the rest in the compute dtype, and one Linear's weight is dequantised at a time."""
    q = -(-info["nf4_global"] // world)
    base_bytes = int(q * NF4_BYTES + (base_local - q) * stored)
    load_peak = int(base_bytes + info["nf4_largest"] * NF4_LOAD_BYTES_PER_PARAM)
    frac = info["nf4_global"] / max(1, info["global"] - info.get("trainable_global", 0))
    unit_bytes = frac * NF4_BYTES + (1 - frac) * compute
    temp = info["nf4_largest"] * compute
    return base_bytes, load_peak, [int(u * unit_bytes) + temp for _, u in info["units"]]


def _with_ema(rows: dict, trainable: Part, info: dict) -> dict:
    """`rows` with an "ema" row after the trained model's: a copy of its local shards in its storage
    dtype, or (LoRA) of its adapters in theirs (parallel/ema.py's AdapterEMA); no grads, no state."""
    if trainable.lora:
        n, count, dtype, what = info["trainable_local"], info["trainable_global"], ADAPTER_DTYPE, "adapters"
    else:
        n, count, dtype, what = info["local"], info["global"], trainable.dtype, "weights"
    row = dict(params=n * _size(dtype), grads=0, optim=0, count=count, local_count=n, sharded=True,
               adapters=bool(trainable.lora), note=f"EMA of {trainable.name}'s {what} ({dtype_name(dtype)})")
    after = trainable.name + (".lora" if trainable.lora else "")
    out = {}
    for name, r in rows.items():
        out[name] = r
        if name == after:
            out["ema"] = row
    return out


def _state_bytes(optimizer: str, param_bytes: int) -> float:
    """Bytes per parameter of AdamW's two states under OPTIMIZER: adamw keeps them in the params'
    dtype, torchao's 8-/4-bit ones block-quantised whatever it is."""
    return 2 * (STATE_BYTES[optimizer] if optimizer in STATE_BYTES else param_bytes)


def _optimizer_note(optimizer: str) -> str:
    return f", {optimizer} states" if optimizer != "adamw" else ""
