"""DMD2's pieces: one step's randomness per rank, the GAN head's cut forward, FAKE_SCORE_FP32's price."""
from __future__ import annotations

import json
import os
import time

from tools.bench.common import _root, _two_rank_memory, medium_unet


NOISE_GLOBAL_BATCH, NOISE_LATENT = 2048, (4, 64, 64)  # recipes/dmd_sd15_stage1.sh: 32 x 64 GPUs, 512 px


def _noise_before(seed: int, it: int, batch: int, shape: tuple, gan: bool) -> dict:
    """bench_noise's "before" draw (`draw_step_noise` in train_dmd.py at commit 525cc8f): every
    tensor for the whole global batch from one CPU generator; each rank then keeps its slice."""
    import torch
    from data.randomness import step_generator
    from algorithms import dmd2 as dm
    g = step_generator(seed, it)
    r = {"noise": torch.randn((batch, *shape), generator=g), "dm_t": dm.sample_dm_timesteps(batch, g),
         "dm_noise": torch.randn((batch, *shape), generator=g), "fake_t": dm.sample_fake_timesteps(batch, g),
         "fake_noise": torch.randn((batch, *shape), generator=g),
         "sim_noise": torch.randn((batch, 0, *shape), generator=g)}
    if gan:
        for name in ("gan_gen", "gan_fake", "gan_real"):
            r[name + "_t"] = torch.randint(0, 1000, (batch,), generator=g)
            r[name + "_noise"] = torch.randn((batch, *shape), generator=g)
    return r


def bench_noise() -> str:
    """Per-rank time to draw one DMD2 step's randomness at the stage-1 recipe's global batch, on
    one CPU thread (torchrun's OMP_NUM_THREADS=1): "before" (_noise_before), every rank draws all 2048
    samples; "after" (train_dmd.py's draw), a rank draws its own 2048 / world samples
    (algorithms/dmd2_unet.draw_sample_noise per sample)."""
    import functools
    import torch
    from algorithms import dmd2_unet as unet_dm
    from data.randomness import per_sample_draws
    torch.set_num_threads(1)

    def timed(fn, repeats=3):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1000
    lines = ["| DMD2 step randomness (global batch 2048, latents 4x64x64) | ranks | samples drawn per rank "
             "| before: ms per rank | after: ms per rank | after / before |", "|---|---:|---:|---:|---:|---:|"]
    for gan in (False, True):
        before = timed(lambda: _noise_before(10, 5, NOISE_GLOBAL_BATCH, NOISE_LATENT, gan), repeats=2)
        draw = functools.partial(unet_dm.draw_sample_noise, shape=NOISE_LATENT, n_sim=0, num_train_timesteps=1000,
                                 step_percent=(0.02, 0.98), gan_max_t=1000 if gan else None)
        for world in (8, 64):
            mine = range(NOISE_GLOBAL_BATCH // world)  # rank 0's samples
            after = timed(lambda: per_sample_draws(10, 5, mine, torch.device("cpu"), draw))
            lines.append(f"| {'stage 2 (GAN: 6 noise tensors)' if gan else 'stage 1 (3 noise tensors)'} | {world} "
                         f"| {len(mine)} | {before:.0f} | {after:.1f} | {after / before:.3f} |")
    lines += ["", "One CPU thread, best of 3 (before: of 2). After draws on the run's device: here the CPU; on "
              "a GPU the draws are device kernels (a few per sample) and no host memory or copy is involved."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the GAN head's features: the whole fake UNet (before) vs the forward cut after the mid block


def bench_gan_head() -> str:
    """Forward + backward of the GAN head's bottleneck features on the SD-1.5-layout medium UNet
    (as the benchmarks' other UNet rows), one process: the whole UNet run with the mid block's
    output captured by a hook (before) vs the forward stopped after the mid block (after)."""
    import torch
    from algorithms import dmd2 as dm

    unet = medium_unet(64).train()
    x = torch.randn(4, 4, 32, 32)
    text = torch.randn(4, 77, 256)

    def full(z):
        captured = []
        handle = unet.mid_block.register_forward_hook(lambda m, a, out: captured.append(out))
        unet(z, torch.zeros(4, dtype=torch.long), text, return_dict=False)
        handle.remove()
        return captured[0]

    def cut(z):
        return dm.bottleneck_features(unet, z, 0, text)

    results = {}
    for name, fn in (("whole UNet (before)", full), ("cut after the mid block (after)", cut)) * 2:
        times = []
        for _ in range(3):
            unet.zero_grad(set_to_none=True)
            z = x.clone().requires_grad_(True)
            t0 = time.perf_counter()
            fn(z).float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        results[name] = min(times) * 1000  # the second round's (warm) numbers overwrite the first's
    n = sum(p.numel() for p in unet.parameters()) / 1e6
    before, after = results["whole UNet (before)"], results["cut after the mid block (after)"]
    return "\n".join([
        "| GAN head features, forward + backward | ms (best of 3) | / before |", "|---|---:|---:|",
        f"| whole UNet (before) | {before:.0f} | 1.00 |",
        f"| cut after the mid block (after) | {after:.0f} | {after / before:.2f} |", "",
        f"{n:.0f} M-parameter SD-1.5-layout UNet (`medium_unet(64)`), batch 4 of 4x32x32 latents, fp32, one process, "
        f"{torch.get_num_threads()} threads. The features, and their gradients, are bit-identical "
        "(tests/test_dmd2.py::test_bottleneck_stops_after_the_mid_block_with_identical_values_and_grads)."])


# ----------------------------------------------------------------------------------------------
# the price of FAKE_SCORE_FP32 at SD-1.5's real architecture, and planned on GPUs


# The GPU's side, measured (one H100 80GB HBM3, torch 2.11, cuDNN 9.19; tools/gpu_check.py --suite=speed,
# SD-1.5's real UNet/VAE/CLIP with random weights, 512 px, batch 32, AC, bf16-mixed, ratio 5, steps 3-12):
# the step in ms with the published fp32 fake score (its attention in SDPA's fp32 memory-efficient
# kernel, 47 % of the GPU time) and with FAKE_SCORE_FP32=0. A FLOP count at the dense peaks would say
# 1.69x: attention's fp32 kernel runs at neither the TF32 nor the bf16 peak.
H100_STEP_MS = {"fp32": 1697, "bf16": 765}


def bench_fake_fp32() -> str:
    """FAKE_SCORE_FP32 on and off, side by side: two 2-rank CPU runs of train_dmd.py on SD-1.5's
    real architecture (random weights, tools/gpu/folders.real_folder), PRECISION=bf16, 128 px, batch 1
    per rank, a generator step every step (DFAKE_GEN_UPDATE_RATIO=1), LoRA rank 64 on the generator
    and the fake score (FAKE_LORA: the two runs fit in 6 GiB per rank beside other work; the price
    is in the fake score's fp32 gathers, compute and activations, which LoRA does not change); then the
    planner's GPU memory for both at 512 px and the step times measured on an H100 (H100_STEP_MS)."""
    import statistics
    from tools import memory_plan
    from tools.gpu import folders
    root = _root()
    folder = folders.real_folder("sd_unet", os.path.join(root, "gpu_check_models"))
    data = os.path.join(root, "fake_fp32_prompts.txt")
    with open(data, "w") as f:
        f.write("a red circle on a white background\na blue square on a black background\n")
    runs = {}
    for fp32 in (1, 0):
        out = os.path.join(root, f"fake_fp32_{fp32}")
        mem = _two_rank_memory("train_dmd.py", [
            f"--model_path={folder}", f"--data_path={data}", f"--output_dir={out}", "--precision=bf16",
            f"--fake_score_fp32={fp32}", "--resolution=128", "--batch_size=1", "--max_steps=3",
            "--dfake_gen_update_ratio=1", "--log_every=1", "--sample_every=0", "--save_every=0", "--lora_rank=64",
            "--fake_lora=1"])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
        runs[fp32] = {"ms": statistics.median(s["step_ms"] for s in steps[1:]), "rss": max(m["rss_peak"] for m in mem),
                      "states": max(m["params"] + m["grads_held"] + m["optim"] for m in mem)}
    on, off = runs[1], runs[0]
    lines = ["| SD-1.5 real architecture, 2 CPU ranks, bf16, 128 px, LoRA 64 on G and fake "
             "| step time (median of steps 2-3) | peak RSS / rank |",
             "|---|---:|---:|",
             f"| FAKE_SCORE_FP32=1 (published) | {on['ms'] / 1000:.1f} s | {on['rss'] / 2**30:.2f} GiB |",
             f"| FAKE_SCORE_FP32=0 | {off['ms'] / 1000:.1f} s | {off['rss'] / 2**30:.2f} GiB |",
             f"| on / off | {on['ms'] / off['ms']:.2f} | {on['rss'] / off['rss']:.2f} |", ""]
    plans = {}
    for fp32 in (True, False):
        s = memory_plan.Settings(world_size=8, precision="bf16-mixed", batch_size=32, resolution=512,
                                 activation_checkpointing=True, fake_score_fp32=fp32)
        plans[fp32] = memory_plan.plan(memory_plan.model_folder("sd15-dmd"), s)["gpu_total"]
    ms = H100_STEP_MS
    lines += ["| SD-1.5 stage 1 on GPUs (bf16-mixed, batch 32 per GPU, 512 px, AC) "
              "| FAKE_SCORE_FP32=1 | =0 | on / off |",
              "|---|---:|---:|---:|",
              f"| memory per GPU, 8 GPUs (planner) | {plans[True] / 2**30:.1f} GiB | {plans[False] / 2**30:.1f} GiB "
              f"| {plans[True] / plans[False]:.2f} |",
              f"| step on one H100, batch 32 (measured) | {ms['fp32']} ms | {ms['bf16']} ms "
              f"| {ms['fp32'] / ms['bf16']:.2f} |", "",
              "The H100 row: tools/gpu_check.py --suite=speed on one H100 80GB HBM3 (torch 2.11, cuDNN 9.19), "
              "SD-1.5's real architecture with random weights, DFAKE_GEN_UPDATE_RATIO=5, the mean of steps 3-12; "
              "the fp32 fake score's attention ran in SDPA's fp32 memory-efficient kernel (47 % of the GPU time; "
              "flash has no fp32 path, TF32 does not reach attention). FAKE_SCORE_ATTENTION_DTYPE's default "
              "(fp32 weights and math, bf16 attention) is the gpu_check row dmd_sd15_512px_b32_ac."]
    return "\n".join(lines)
