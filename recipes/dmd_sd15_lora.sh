#!/usr/bin/env bash
# DMD2 stage 1 on SD-1.5 with a LoRA generator: the official LoRA settings on the published SD-1.5
# stage-1 run. NOT a published run: the official code allows --generator_lora on SDXL only
# (main/sd_unified_model.py:46, `assert args.sdxl`) and reports no SD-1.5 LoRA result, so no FID
# is claimed here. What is taken from where:
#   - LoRA as the official SDXL LoRA run (main/sd_unified_model.py:44-69, defaults
#     main/train_sd.py:680-682; experiments/sdxl/..._backsim_scratch_lora.sh lines 9-10, 45):
#     rank 64, alpha 8 (scaling 0.125), dropout 0, peft's default init (kaiming-uniform lora_A, zero
#     lora_B), the 14 target module types of families/sd_unet.DMD2_LORA_TARGETS (all present in
#     SD-1.5's UNet), on the generator only (the fake score trains fully, FAKE_LORA=0), generator
#     and guidance LR 5e-5;
#   - everything else as dmd_sd15_stage1.sh (experiments/sdv1.5/
#     laion6.25_sd_baseline_8node_guidance1.75_lr1e-5_seed10_dfake10_from_scratch.sh, lines 9-31):
#     batch 32 per GPU, global 2048 (GRAD_ACCUM = 2048 / (32 x GPUs)), 512 px, real guidance 1.75,
#     dfake_gen_update_ratio 10, grad-norm clip 10, seed 10, bf16 mixed precision, gradient
#     checkpointing, no GAN; the text encoder in fp32 (main/sd_unified_model.py:85-88).
#
#   MODEL=/models/stable-diffusion-v1-5 DATA=/data/prompts.txt bash recipes/dmd_sd15_lora.sh
# Warmup: the official --warmup_step 500, advanced once per GPU on 64 GPUs = 7.8125 iterations
# (train_dmd.make_optimizer), the same for any world size here.
# The fake score in fp32, as published (main/sd_guidance.py:191 runs the DM loss's fake prediction at full
# precision); train_dmd.py's default computes it in bf16, which scored within the seed spread on the
# shapes demo (docs/dmd2.md), evidence too small to change a published recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to an SD-1.5 diffusers folder (unet/ vae/ text_encoder/ tokenizer/ scheduler/)}
DATA=${DATA:?set DATA to a prompts file (.txt, one a line, or .jsonl with "prompt")}
OUT=${OUT:-out/sd15_lora}
. recipes/lib/common.sh
PER_GPU=$(per_gpu 32 "$@")  # a --batch_size=N override keeps the global batch (GRAD_ACCUM follows)
ACCUM=$(grad_accum 2048 $PER_GPU)
exec bash run_fsdp.sh train_dmd.py --model_path="$MODEL" --data_path="$DATA" --output_dir="$OUT" \
    --lora_rank=64 --lora_alpha=8 --lora_dropout=0 --lora_init=default --fake_lora=0 \
    --lora_target_modules=to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,conv2,conv_shortcut,downsamplers.0.conv,upsamplers.0.conv,time_emb_proj \
    --generator_lr=5e-5 --guidance_lr=5e-5 --batch_size=$PER_GPU --grad_accum=$ACCUM \
    --resolution=512 --real_guidance_scale=1.75 --dfake_gen_update_ratio=10 --max_grad_norm=10 --seed=10 \
    --precision=bf16-mixed --fake_score_fp32=1 --text_encoder_dtype=fp32 --activation_checkpointing=1 --use_gan=0 \
    --max_steps=40000 --save_every=1000 --sample_every=500 --log_every=50 --warmup_steps=7.8125 --resume=auto "$@"
