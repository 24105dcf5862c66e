"""Know before launching: per-rank GPU memory of a training run, from real-size models on the meta
device, wrapped exactly as the training scripts wrap them, with a fake process group (no GPU, no
weights, seconds). What each script builds, and in which role, is families.pipelines.PIPELINES; each
sharded model goes through its recipe (parallel/parallelize.py), and the units are read off the
sharded model (fsdp_utils.fsdp_units): the planner repeats no wrapping decision.

    python tools/memory_plan.py --model=flux-kontext-dev --world_size=4 --gpu_memory_gb=24
    python tools/memory_plan.py --model=sd15-dmd --world_size=8 --batch_size=4 --resolution=512
    python tools/memory_plan.py --model=sdxl-dmd --world_size=8 --gpu_memory_gb=80
    python tools/memory_plan.py --model=/path/to/diffusers/folder --world_size=2
    python tools/memory_plan.py --fit_table --model=sdxl-dmd   # markdown: world sizes x GPU memory
    python tools/memory_plan.py --model=flux-kontext-dev --world_size=2 --lora_rank=16   # LoRA fine-tuning
    python tools/memory_plan.py --fit_table --model=flux-kontext-dev --lora_rank=16 \\
        --world_sizes=1,2,4 --gpu_memory_gbs=24
    python tools/memory_plan.py --model=flux-kontext-dev --world_size=8 --resolution=1024 --context_parallel=2
    python tools/memory_plan.py --cp_table --model=flux-kontext-dev   # which CP fits 1024 / 2048 px on 24 / 80 GB
    python tools/memory_plan.py --model=flux-kontext-dmd --world_size=8 --resolution=1024 \\
        --activation_checkpointing=1 --fake_score_fp32=0 --gpu_memory_gb=80   # DMD2 with a FLUX Kontext teacher
    python tools/memory_plan.py --model=qwen-image-edit --world_size=1 --lora_rank=16 --base_dtype=nf4 \\
        --gpu_memory_gb=24   # Qwen-Image-Edit-2509 LoRA on an NF4 base, 1024 px, target + 2 references
    python tools/memory_plan.py --model=flux2-dev --world_size=8 --lora_rank=16 --base_dtype=nf4 \\
        --resolution=1024 --activation_checkpointing=1 --gpu_memory_gb=24   # FLUX.2 [dev], 2 references
    python tools/memory_plan.py --flux2_table   # FLUX.2 [dev] / klein: the fewest GPUs per run of docs/planner.md

The planner reads the family specs (families/<name>/spec.py, FamilySpec), with no per-family branch of its own.
NAME is a built-in configuration (families/<family>/configs/<NAME>/: configs only, no weights; the names are the
specs' `builtins`) or a local diffusers folder. A folder's pipeline is model_index.json's _class_name (without
one: the pipeline whose trained model and parts the folder holds), its family families.spec_of's; it is planned
for the pipeline's fine-tune script (train_flux_kontext.py), or train_dmd.py where that is its only one, or
--script; train_dmd.py on a pipeline that trains one model holds it in DMD2's three roles (DMD_ROLES), and a
built-in of such a pipeline has a DMD2 name (<name>-dmd, or its Builtin's `dmd`: flux-kontext-dmd). The plan's
label ("kind") is the spec's plan_names' (+ "_dmd"). Without --resolution: the model's native resolution (its
sample_size x VAE factor where its config has one: 512 for SD-1.5, 1024 for SDXL; else the spec's
plan_resolution or the pipeline's side: 512 for FLUX.1, 1024 for Qwen-Image-Edit and FLUX.2). The trained
model's forward inputs are its spec's example_inputs at the latents of latent_shapes (the target, then the
spec's plan_references: Kontext's context, Qwen-Image-Edit's 2 references at the target's size, FLUX.2's at
their area) and its text_length (the spec's text_len capped by its text_tokenizer: CLIP 77, T5 512, the
Qwen2.5-VL prompt's 475 with its reference images at 384^2 and the template). What is counted, per rank:
  params / grads / optimizer  the local shards (AdamW: 2 states), in the precision mode's dtypes;
                              frozen parts in their own dtype (SDXL's VAE: fp32, as train_dmd.py holds
                              it); with CPU offload these live on the host
  gathered                    unsharded FSDP units in compute dtype: the largest two (current + prefetched)
                              with reshard-after-forward, all of them without; plus the largest
                              unit's reduce-scatter buffer
  activations                 bytes saved for backward by one forward of the trainable model at the
                              batch and resolution, measured on the meta device with saved-tensor
                              hooks (with activation checkpointing: block inputs + one block's worth);
                              attention counted as the GPU's flash / memory-efficient SDPA kernels
                              save it (q, k, v, out, fp32 logsumexp), not as the math reference that
                              runs on meta (two fp32 L x L matrices per call): flash_attention_saves
  runtime                     a fixed 1 GiB for the CUDA context and allocator slack
  ema                         with --ema=1 (the scripts' EMA_DECAY > 0): the trained model's shards again, in
                              its storage dtype (LoRA: its adapters, fp32); offloaded with it
The text-cache fill, before training, is a phase of its own (fill_phase): the offline components (text encoders,
cached then freed) sharded over the ranks in units of their _no_split_modules, units in flight, one no-grad
forward of a batch measured on meta, the runtime reserve. A plan fits only if both phases fit; where only the
fill does not, the fit takes the encoders in NF4 (--text_encoder_dtype=nf4).
A family that plans its references at an area (FamilySpec.reference_area; FLUX.2: flux2-dev, flux2-klein-4b,
flux2-klein-9b): the target's tokens, --references (2) references' at --reference_area (the pipeline's 1024^2).
DMD2's fake score is counted as train_dmd.py runs it (FAKE_SCORE_FP32, default off): in the mode's compute
dtype; --fake_score_fp32=1 (as published): its units gathered and its training forward's activations in fp32,
whatever the precision mode.

DMD2 with a transformer teacher (e.g. flux-kontext-dmd; train_dmd.py on a FLUX folder): the pipeline's
transformer in DMD_ROLES (generator and fake score trainable, teacher frozen-sharded), each sharded by its
recipe; the VAE replicated, the text encoders offline. The activations are the larger of the generator's and
the fake score's training forwards (the generator's backward runs before the fake score's forward). With
--base_dtype=nf4 the frozen teacher is stored in NF4 like the LoRA bases where its spec says so (nf4_teacher);
the UNet teacher is not.

LoRA (--lora_rank=R > 0; --lora_alpha, --lora_target_modules as the scripts' LORA_*): the adapters are added
with parallel.lora.add_lora to the meta model before its recipe shards it, as the scripts do, so the
units fsdp_units reads include them. The script's model (FLUX's transformer, DMD's generator; with
--fake_lora DMD's fake score too) is then counted as two rows: its base, frozen and stored in the
compute dtype (sharded; no grads, no optimizer state), and its adapters (`<name>.lora`: fp32 params,
fp32 grads, 2 fp32 AdamW states, sharded). Units are all-gathered in the compute dtype, adapters
included; only the adapter grads are reduce-scattered (fp32). Activations are measured on the LoRA
model, inputs without grad (as the latents are), so the hooks see what autograd keeps under LoRA:
each adapted Linear's input (lora_A's grad) and rank-r intermediate (lora_B's), no input of a frozen
Linear for a weight grad, and elsewhere what the input grads need (norms, attention, nonlinearities);
tests/test_memory_plan.py checks this count against real-width blocks run on 2 CPU ranks. One LoRA model
(train_flux_kontext.py's) has almost no grads, so its step peaks where its activations do, at the turn
from forward to backward: the units in flight are those gathered then (in_flight_at_peak: the root,
the last unit, the one prefetched), not the two largest. With CPU offload the base shards live on
the host too (FSDP offloads every parameter of a unit). bf16 states change nothing under LoRA (the
base is already in the compute dtype, add_lora keeps adapters in fp32), so the fit search skips them.

Context parallelism (--context_parallel=C, train_flux_kontext.py's CONTEXT_PARALLEL; the families whose
room checks it: FLUX.1 Kontext, FLUX.2): the C ranks of a CP group take the same samples and each holds 1/C of
the joint sequence (text + target + reference image tokens), with Ulysses attention (each rank attends over the
full sequence for H/C heads). The components are sharded on the script's mesh (fsdp_utils.build_meshes: FSDP over all
dp x cp ranks), so the state rows and the gathered units are as without CP. A rank's activations
(_cp_activations): one forward over the full sequence is measured, as without CP; token-wise tensors
and attention's flash saves (q, k, v, out over all tokens for H/C heads, logsumexp) are 1/C of it on
each rank, and what has no sequence dimension (timestep, guidance and pooled embeddings, each block's
modulation vectors: 3.2 MiB at batch 1, against 8.8 MiB per token) is whole on every rank: that part
is the constant of A(L) = a + b L, from a second meta forward at half the side and a quarter of the text. Added: the
all-to-all buffers of one attention call (q, k, v and the output, sent and received) and the final
output all-gathered for the loss. The global batch is batch x world / C.
Checked before any work, one line each: C >= 1, C x dp_replicate divides the world, then the family's own
check (FamilySpec.check_context_parallel, its room's, as the script calls it): e.g. C divides the transformer's
attention heads, the text tokens and the image tokens.
--cp_table: for resolutions x GPU memory, per world size, the smallest CP that fits and the
cheapest settings (cheapest_fit) it needs, then any larger CP that needs fewer.

The package, by concern (tools/memory_plan.py is its command line and re-exports these names):
  build.py        the settings, the pipelines' components and their real-size models on meta
  shard.py        sharding them on a fake process group, as the scripts' recipes do
  activations.py  what one forward saves (flash SDPA's saves, context parallelism's share)
  plan.py         plan(): per-rank bytes by category, and the text-cache fill before training
  fit.py          the cheapest settings that fit, the report and the tables
  cli.py          the command line
"""
