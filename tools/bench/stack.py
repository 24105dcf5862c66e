"""The stack users come from: FSDP1 with the DMD2 repository's settings, beside FSDP2 and DDP."""
from __future__ import annotations

import time

from tools.bench.common import _emit, _torchrun, medium_unet

# The official DMD2 code wraps its UNets with accelerate + torch FSDP1 (seed 000's config):
# TRANSFORMER_BASED_WRAP on BasicTransformerBlock and ResnetBlock2D, FULL_SHARD, bf16
# MixedPrecision (params, reduce, buffers), use_orig_params, BACKWARD_PRE, no forward prefetch.
# Here that is torch's own FullyShardedDataParallel with those arguments (accelerate only passes
# them through); on CPU it needs device_id=cpu and no sync_module_states (every rank builds the
# same seeded model). FSDP1 lives in this benchmark only, never in the training path.
#
# Modes (each its own 2-rank launch, so each peak is its own):
#   fsdp1             the settings above, AdamW as the DMD2 repository makes it (torch's default)
#   fsdp1 + fused     the same with the scripts' optimizer (components.optim.adamw: fused AdamW)
#   fsdp2             this project's recipe as the scripts run it (parallel/parallelize.py, PRECISION=bf16)
#   fsdp2 bare        fully_shard per block and on the root, MixedPrecisionPolicy(bf16, bf16), nothing else
#   ddp               DistributedDataParallel of the bf16 model
# (bf16 where the CPU computes it natively, else fp32 throughout: see native_bf16)
# Every mode but fsdp1 uses the scripts' optimizer, components.optim.adamw.
#   fsdp2 + KNOB      the recipe with one knob changed (see STACK_KNOBS)
# Workloads: `unet` = one UNet forward + backward + AdamW; `dmd` = one full DMD2 step (the
# generator's 1-step sample, the DM gradient from the fake score and the CFG teacher, the
# generator's backward and AdamW, the fake score's denoising loss, backward and AdamW), with
# algorithms/dmd2's functions, all three UNets wrapped by the mode (the teacher frozen).

STACK_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D")
UNET_STAGES = ["CrossAttnDownBlock2D", "DownBlock2D", "UNetMidBlock2DCrossAttn", "CrossAttnUpBlock2D", "UpBlock2D"]
STACK_KNOBS = {  # mode -> changes to the recipe (fsdp_utils.Sharding fields, block classes, reduce dtype)
    "fsdp2 + per stage": {"blocks": UNET_STAGES},     # a unit per down/mid/up block: fewer, larger all-gathers
    "fsdp2 + prefetch 1": {"prefetch": 1},            # explicit prefetch of the next unit
    "fsdp2 + no reshard": {"reshard_after_forward": False},  # no all-gathers in backward (holds full params)
    "fsdp2 + fp32 reduce": {"reduce": "fp32"},        # reduce-scatter in fp32 (bf16-mixed's choice; bf16 runs only)
}


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed build-time memory back first
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _wrap(model, mode: str, mesh, device, trainable: bool, dtype):
    """`model` (in `dtype`, on CPU) wrapped as `mode` does it; returns the module to call."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import fsdp_utils
    from families import MODELS
    from parallel.parallelize import parallelize
    from precision import get_precision
    prec = get_precision("bf16" if dtype == torch.bfloat16 else "fp32")  # pure: params, compute, reduce alike
    if mode.startswith("fsdp1"):
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        classes = {type(m) for m in model.modules() if type(m).__name__ in STACK_BLOCKS}
        return FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy(classes), sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
            use_orig_params=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False,
            device_id=device, sync_module_states=False)
    if mode == "ddp":  # the scripts' DDP path (inputs cast); the teacher replicated, its inputs cast
        if trainable:
            return fsdp_utils.apply_ddp(fsdp_utils.apply_precision(model, prec.mp_policy()), device, verbose=False)
        return fsdp_utils.apply_precision(model, prec.frozen_mp_policy(dtype))
    if mode == "fsdp2 bare":
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for name in STACK_BLOCKS:
            for m in model.modules():
                if type(m).__name__ == name:
                    fully_shard(m, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    knob = STACK_KNOBS.get(mode, {})
    if not trainable:  # the scripts' frozen teacher: prepare_frozen, then sharded by its recipe
        fsdp_utils.prepare_frozen(model, dtype)
        parallelize(model, mesh, prec.frozen_mp_policy(dtype), fsdp_utils.Sharding(frozen=True), knob.get("blocks"),
                    verbose=False, facts=MODELS.get(type(model).__name__))
        return model.to(device)
    policy = prec.mp_policy()
    if knob.get("reduce") == "fp32":
        import dataclasses
        policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
    sharding = fsdp_utils.Sharding(reshard_after_forward=knob.get("reshard_after_forward", True),
                                   prefetch=knob.get("prefetch", 0))
    parallelize(model, mesh, policy, sharding, knob.get("blocks"), verbose=False,
                facts=MODELS.get(type(model).__name__))
    return model


def _step_memory(fn) -> tuple[int, int]:
    """Run fn twice; return (tensor peak above the start, heap in use at the peak). Tensor peak: the
    most bytes of tensors allocated during the first run that were live at once, from torch's
    profiler memory events: what a caching allocator would have to add.
    The profiler does not see frees of tensors made before it started, so a tensor the step frees
    and makes again (FSDP1's sharded gradient, kept until the next forward) counts in full. Malloc:
    the bytes glibc reports in use (mallinfo2, sampled every 2 ms from a thread: all threads'
    mallocs, tensors and everything else) during the second run, which is not profiled (the
    profiler's own event records would count); its highest value is the heap in use at the step's
    peak, comparable across modes that carry different things from one step into the next. RSS
    above it is freed heap that glibc keeps mapped."""
    import ctypes
    import threading
    import torch
    from torch.profiler import ProfilerActivity, profile

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        mallinfo2 = None
    in_use = (lambda: (lambda m: m.uordblks + m.hblkhd)(mallinfo2())) if mallinfo2 else (lambda: 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    heap_peak, done = [in_use()], threading.Event()

    def sample():
        while not done.wait(0.002):
            heap_peak[0] = max(heap_peak[0], in_use())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, heap_peak[0]


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); without, oneDNN emulates bf16
    matmuls and convolutions some 50-90x slower than fp32, which drowns every FSDP cost measured."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def worker_stack(workload: str, mode: str, width: str, steps: str, dtype: str = "bf16") -> None:
    import statistics
    import torch
    import fsdp_utils
    from components.optim import adamw
    from algorithms import dmd2
    from parallel.memory import host_rss_bytes, local_state_bytes
    d = fsdp_utils.init_distributed()
    mesh = fsdp_utils.build_meshes(d.device)[0] if mode.startswith("fsdp2") else None
    dt, batch, latent, tokens = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]), 2, 32, 77
    names = ("unet",) if workload == "unet" else ("generator", "fake", "teacher")
    models = {n: medium_unet(int(width)).to(dt) for n in names}  # same seed: the same weights
    models["teacher"].requires_grad_(False) if "teacher" in models else None
    wrapped = {n: _wrap(m, mode, mesh, d.device, (n != "teacher"), dt) for n, m in models.items()}
    trained = [n for n in names if n != "teacher"]
    # FSDP1: AdamW as the DMD2 repository makes it (torch's default: foreach over its plain
    # tensors); the rest the scripts' optimizer (components.optim.adamw: fused)
    opts = {n: torch.optim.AdamW(wrapped[n].parameters(), lr=1e-5) if mode == "fsdp1" else
            adamw(wrapped[n].parameters(), lr=1e-5) for n in trained}
    n_params = sum(p.numel() for p in models[names[0]].parameters()) if mode != "fsdp1" else \
        sum(p.numel() for p in medium_unet(int(width)).parameters())
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas = torch.cumprod(1 - betas, 0)
    g = torch.Generator().manual_seed(1 + d.rank)

    def step():
        text = torch.randn(batch, tokens, 256, generator=g).to(dt)
        if workload == "unet":
            x = torch.randn(batch, 4, latent, latent, generator=g)
            target = torch.randn(batch, 4, latent, latent, generator=g)
            t = torch.randint(0, 1000, (batch,), generator=g)
            out = wrapped["unet"](x.to(dt), t, text).sample.float()
            loss = (out - target).square().mean()
            loss.backward()
            opts["unet"].step()
            opts["unet"].zero_grad(set_to_none=True)
            return
        noise = torch.randn(batch, 4, latent, latent, generator=g)
        x = dmd2.generator_forward(wrapped["generator"], noise.to(dt), 999, text, alphas).float()
        t = torch.randint(20, 981, (batch,), generator=g)
        grad, _ = dmd2.dm_grad(x.to(dt), t, torch.randn(batch, 4, latent, latent, generator=g).to(dt),
                               wrapped["teacher"], wrapped["fake"], text, torch.zeros(1, tokens, 256, dtype=dt),
                               1.75, alphas)
        dmd2.dm_loss(x, grad).backward()
        opts["generator"].step()
        opts["generator"].zero_grad(set_to_none=True)
        loss = dmd2.fake_score_loss(wrapped["fake"], x.detach().to(dt),
                                    torch.randn(batch, 4, latent, latent, generator=g).to(dt),
                                    torch.randint(0, 1000, (batch,), generator=g), text, alphas)
        loss.backward()
        opts["fake"].step()
        opts["fake"].zero_grad(set_to_none=True)

    step()  # warm-up: allocator, AdamW state, FSDP lazy init
    _reset_peak_rss()
    base = host_rss_bytes()
    times = []
    for _ in range(int(steps)):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([_vm_hwm(), _vm_hwm() - base, base], dtype=torch.float64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    live = torch.tensor(_step_memory(step), dtype=torch.float64)  # two more steps, untimed
    torch.distributed.all_reduce(live, op=torch.distributed.ReduceOp.MAX)
    states = local_state_bytes({n: wrapped[n] for n in trained}, opts)  # after zero_grad: no grads
    states = 2 * states["params"] + states["optim"]  # params, grads as held in a step (same size), AdamW
    _emit({"workload": workload, "mode": mode, "dtype": dtype, "params": n_params, "states": states,
           "step_s": statistics.median(times), "rss_peak": peak[0].item(), "peak_above": peak[1].item(),
           "live_peak": live[0].item(), "malloc_at_peak": live[1].item()})
    fsdp_utils.cleanup_distributed()


STACK_RUNS = {  # workload -> (UNet width, timed steps, modes)
    "unet": (96, 3, ["fsdp1", "fsdp1 + fused", "fsdp2", "fsdp2 bare", "ddp", *STACK_KNOBS]),
    "dmd": (64, 3, ["fsdp1", "fsdp2", "fsdp2 bare", "ddp"]),
}
STACK_ROUNDS = 3  # every mode runs this often, the rounds interleaved (drift hits all modes alike)


def bench_stack() -> str:
    import statistics

    def each(rs: list, key: str, unit: float, fmt: str = ".2f") -> str:
        return ", ".join(format(r[key] / unit, fmt) for r in rs)
    dtype = "bf16" if native_bf16() else "fp32"
    lines = [] if dtype == "bf16" else [
        "This CPU has no native bf16 (no AVX512-BF16 / AMX): oneDNN emulates bf16 matmuls and convolutions "
        "some 50-90x slower than fp32, which would drown every FSDP cost, so every mode runs in fp32 "
        "(FSDP1's MixedPrecision and FSDP2's MixedPrecisionPolicy name fp32; all else as listed).", ""]
    for workload, (width, steps, modes) in STACK_RUNS.items():
        if dtype == "fp32":  # a bf16 -> fp32 knob is a no-op in fp32
            modes = [m for m in modes if STACK_KNOBS.get(m, {}).get("reduce") != "fp32"]
        runs: dict = {m: [] for m in modes}
        for _ in range(STACK_ROUNDS):
            for m in modes:
                runs[m] += _torchrun("stack", workload, m, str(width), str(steps), dtype)
        ref = runs["fsdp1"]
        t_ref = statistics.mean(r["step_s"] for r in ref)
        p_ref = statistics.mean(r["rss_peak"] for r in ref)
        h_ref = statistics.mean(r["malloc_at_peak"] for r in ref)
        what = ("UNet forward + backward + AdamW" if workload == "unet" else
                "full DMD2 step: generator, fake score (trained), teacher (frozen, CFG)")
        lines += [f"**{what}**: SD-1.5-layout UNet of {ref[0]['params'] / 1e6:.0f} M params in {dtype}, batch 2 "
                  f"at 32×32 latents, 77 text tokens; median of {steps} steps after one warm-up step, "
                  f"{STACK_ROUNDS} runs per mode (interleaved)", "",
                  "| mode | step time (s), each run | step / FSDP1 | peak RSS in the steps / rank (GiB), each run "
                  "| peak RSS / FSDP1 | heap in use at the step's peak / rank (MiB) | heap / FSDP1 "
                  "| RSS the steps add / rank (MiB), each run "
                  "| tensors the step allocates, peak / rank (MiB), each run "
                  "| model states / rank (MiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m, rs in runs.items():
            t = statistics.mean(r["step_s"] for r in rs)
            p = statistics.mean(r["rss_peak"] for r in rs)
            h = statistics.mean(r["malloc_at_peak"] for r in rs)
            lines.append(f"| {m} | {each(rs, 'step_s', 1)} | {t / t_ref:.2f} "
                         f"| {each(rs, 'rss_peak', 2**30, '.3f')} | {p / p_ref:.2f} "
                         f"| {h / 2**20:.0f} | {h / h_ref:.2f} "
                         f"| {each(rs, 'peak_above', 2**20, '.0f')} | {each(rs, 'live_peak', 2**20, '.0f')} "
                         f"| {rs[0]['states'] / 2**20:.0f} |")
        lines.append("")
    lines.append("2 CPU ranks (gloo), one thread each. Peak RSS in the steps: the largest rank's peak RSS during the "
                 "timed steps (reset with /proc/self/clear_refs after the warm-up step): what the rank occupies, "
                 "model states included. Heap in use at the step's peak: glibc's bytes in use (mallinfo2: all "
                 "threads, tensors and all else) at the highest point of one more step, not profiled, sampled every "
                 "2 ms: what a caching allocator plus the libraries would hold; RSS above it is freed heap that "
                 "glibc keeps mapped. RSS the steps add: the peak RSS in the steps minus the RSS before them. "
                 "Tensors the step allocates: the most bytes of tensors made during one more step that were live "
                 "at once (torch's profiler memory events). The last two start from what each mode carries from "
                 "one step into the next: FSDP1 keeps its sharded gradient (the flat parameter's .grad) until the "
                 "next forward, FSDP2 and DDP free gradients at zero_grad(set_to_none=True), so FSDP1's \"adds\" "
                 "start from a higher floor; the two absolute columns and their ratios are the fair comparison. "
                 "Model states: params + grads (as held in a step) + AdamW state of the trained model(s) on one "
                 "rank. FSDP1: torch's FullyShardedDataParallel with the DMD2 repository's settings (benchmark only).")
    return "\n".join(lines)
