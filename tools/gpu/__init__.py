"""The GPU acceptance check: both scripts at real width on one bare GPU machine, sized to the disk it
finds and timed to fit one call of at most 9.5 minutes (wheels, models and clean-up included), one table.

    bash tools/gpu_check.sh --out=$OUT             # on a machine with a CUDA GPU, no network needed
    python tools/gpu_check.py --tiny --cpu         # the same plumbing on the tiny models, on CPU

What it does, in order, under one deadline (--deadline_s; gpu_check.sh counts it from its own start):
tests/test_gpu.py starts in the background (three at a time where pytest-xdist is installed) while the
models are built (random weights: SD-1.5's UNet, VAE and CLIP at their real configs; FLUX.1 Kontext's
transformer at real width with --flux_blocks double + single blocks, its real VAE, CLIP-L and a
one-layer T5 of the real width; Qwen-Image-Edit-2509's transformer at real width with --qwen_image_blocks
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
Qwen-Image-Edit rows are a second call (--suite=qwen_image), FLUX.2 klein-base DMD2 a third (--suite=flux2: a LoRA
r64 generator and a full fake score at 512 px saved, resumed, exported and the export sampled in 4 steps by
Flux2KleinPipeline, and the same timed at 1024 px; klein-base-4B's transformer at --flux2_blocks of real width,
its real VAE, a narrow Qwen3 of the real width), Wan 2.1 T2V-1.3B DMD2 a fourth (--suite=wan: the recipe's LoRA r64
generator and fake score at 81 frames of 480 x 832, saved, resumed, exported and sampled in 4 steps by WanPipeline,
and the same timed; the transformer at --wan_blocks of real width, the real AutoencoderKLWan, a narrow UMT5 of the
real width), Z-Image a fifth (--suite=z_image: the text-to-image LoRA fine-tune and DMD2 to a 4-step LoRA student at
1024 px, each saved, resumed, exported and sampled by ZImagePipeline; the transformer at --z_image_blocks of real
width, its real VAE, a narrow Qwen3 of the real width)
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

The package, by concern: folders (the models and data built offline), budget (each row's disk, the planner's GPU
memory, the deadline), reference (the plain-PyTorch reference), run (one row's launches, its timing, its export
loaded), rows (plan_runs: the suites' rows), report (the table), cli (main: all of it in order). tools/gpu_check.py
runs cli.main.
"""
from tools.gpu import budget, folders, reference, report, rows, run  # noqa: F401 - gpu.<module> (cli: the entry's)
