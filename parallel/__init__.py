"""The model-side machinery of sharded training, one concern per module (torchtitan's split: its
distributed/compile.py, distributed/context_parallel/, components/lora.py, models/*/parallelize.py):

    model_facts.py       ModelFacts (per model class: FSDP unit classes, default LoRA targets, attention
                         dispatch), given by each family (families/<name>/parallelism.py), and their registry
    execution_order.py   the order a forward runs its modules (diffusers' UNets differ from registration)
    parallelize.py       the recipe: AC -> compile -> fully_shard per unit (the model facts') -> root
    compile.py           torch.compile per unit, its report and checks
    context_parallel.py  Ulysses attention through diffusers' own implementation
    lora.py              peft LoRA adapters inside the FSDP units
    ema.py               EMA of sharded params (a full copy, or of the adapters only)
    loading.py           meta-device build, each rank loading only its slices of the safetensors
    memory.py            bytes per rank of params, grads, optimizer state; host/CUDA peaks

Imports go one way: the scripts, checkpoint.py, families/ and components/ import these (and pass a
model's facts); these import torch, diffusers, peft and the floors below only (fsdp_utils.py for the
generic FSDP2/DDP mechanics, precision.py, core/ for errors, rank-0 printing and gathers).
tests/test_layout.py checks it.
"""
