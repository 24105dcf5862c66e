"""The shell launchers: recipes/*.sh build a torchrun command through run_fsdp.sh whose every
setting is a real setting of its script, with a valid value (checked by the script's own parser
and validation, without training).

    python -m pytest tests/test_recipes.py -q
"""
import os
import shlex
import subprocess

import pytest

from tests.conftest import ROOT

from components.config import apply_overrides, script_constants

RECIPES = sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".sh"))


def dry_run(recipe: str, **env) -> list[str]:
    """The torchrun command line the recipe would run (DRY_RUN=1 in run_fsdp.sh)."""
    full = {**os.environ, "DRY_RUN": "1", "NPROC": "8", "MODEL": "/models/m", "DATA": "/data/d.jsonl",
            "INIT_FROM": "/ckpt/step_040000", "GENERATOR_INIT": "/models/g.safetensors", **env}
    r = subprocess.run(["bash", os.path.join(ROOT, "recipes", recipe)], env=full, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("+ torchrun"))
    return shlex.split(line[2:])


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_settings_are_the_scripts_settings(recipe, monkeypatch):
    cmd = dry_run(recipe)
    script = next(a for a in cmd if a.endswith(".py"))
    settings = cmd[cmd.index(script) + 1:]
    assert "--nproc_per_node=8" in cmd
    module = __import__(script[:-3])
    saved = script_constants(vars(module))
    try:
        apply_overrides(vars(module), settings)  # unknown name or bad value -> ConfigError
        monkeypatch.setenv("WORLD_SIZE", "8")
        module.INIT_FROM = "" if hasattr(module, "INIT_FROM") else None  # the folder does not exist here
        module.GENERATOR_INIT = "" if hasattr(module, "GENERATOR_INIT") else None  # nor the file
        module.validate_config()
    finally:
        vars(module).update(saved)


@pytest.mark.parametrize("recipe,per_gpu,total", [("dmd_sd15_stage1.sh", 32, 2048), ("dmd_sd15_stage2.sh", 32, 2048),
                                                   ("dmd_sdxl_4step.sh", 2, 128), ("dmd_sdxl_1step.sh", 2, 128),
                                                   ("dmd_sdxl_4step_lora.sh", 2, 128), ("dmd_sd15_lora.sh", 32, 2048)])
def test_dmd_recipes_keep_the_published_global_batch(recipe, per_gpu, total):
    for nproc in (8, 4):
        cmd = dry_run(recipe, NPROC=str(nproc))
        assert f"--grad_accum={total // (per_gpu * nproc)}" in cmd and f"--batch_size={per_gpu}" in cmd, cmd
    r = subprocess.run(["bash", os.path.join(ROOT, "recipes", recipe)], capture_output=True, text=True,
                       env={**os.environ, "DRY_RUN": "1", "NPROC": "3", "MODEL": "m", "DATA": "d", "INIT_FROM": "c",
                            "GENERATOR_INIT": "g"})
    assert r.returncode == 2 and f"does not divide the published global batch {total}" in r.stderr


GRAD_ACCUM_RECIPES = [(r, n) for r in RECIPES if "grad_accum " in open(os.path.join(ROOT, "recipes", r)).read()
                      for n in (1, 2, 4)]
PUBLISHED_BATCH = {"dmd_sd15": 2048, "dmd_sdxl": 128, "dmd_kontext": 64}


@pytest.mark.parametrize("recipe,nodes", GRAD_ACCUM_RECIPES)
def test_global_batch_is_the_published_one_on_any_node_count(recipe, nodes):
    """GRAD_ACCUM x world x batch = the published global batch on 1, 2 and 4 nodes of 8 GPUs: set by
    hand, from a SLURM job's variables alone, and by hand inside a SLURM job (the node's rank then
    still comes from SLURM_NODEID, not 0 on every node)."""
    total = next(v for k, v in PUBLISHED_BATCH.items() if recipe.startswith(k))
    slurm = dict(SLURM_JOB_ID="77", SLURM_NNODES=str(nodes), SLURM_NODEID=str(nodes - 1),
                 SLURM_JOB_NODELIST=f"gpu[01-{nodes:02d}]", SLURM_GPUS_ON_NODE="8")
    by_hand = dict(NNODES=str(nodes), NODE_RANK=str(nodes - 1), MASTER_ADDR="10.0.0.1", NPROC="8")
    for env in (by_hand, slurm, {**slurm, "NNODES": str(nodes)}):
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC")}
        full = {**base, "DRY_RUN": "1", "MODEL": "/models/m", "DATA": "/data/d.jsonl", "INIT_FROM": "/ckpt/c",
                "GENERATOR_INIT": "/models/g.safetensors", **env}
        r = subprocess.run(["bash", os.path.join(ROOT, "recipes", recipe)], env=full, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        cmd = shlex.split(next(line for line in r.stdout.splitlines() if line.startswith("+ torchrun"))[2:])
        flags = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
        assert int(flags["nnodes"]) == nodes and flags["nproc_per_node"] == "8", (env, cmd)
        assert int(flags["grad_accum"]) * nodes * 8 * int(flags["batch_size"]) == total, (env, cmd)
        if nodes > 1:
            hsdp = "HSDP_PER_NODE=${HSDP_PER_NODE:-0}" not in open(os.path.join(ROOT, "recipes", recipe)).read()
            assert flags["node_rank"] == str(nodes - 1), (env, cmd)
            assert flags.get("dp_replicate") == (str(nodes) if hsdp else None), (env, cmd)  # NF4: no HSDP


def test_stage2_keeps_the_original_teacher():
    for recipe in ("dmd_sd15_stage1.sh", "dmd_sd15_stage2.sh"):
        assert "--model_path=/models/m" in dry_run(recipe)
    stage2 = dry_run("dmd_sd15_stage2.sh")
    assert "--model_path=/models/m" in stage2 and "--init_from=/ckpt/step_040000" in stage2


DMD_RECIPES = [r for r in RECIPES if r.startswith("dmd_")]


@pytest.mark.parametrize("recipe", DMD_RECIPES)
def test_dmd_recipes_keep_clip_in_fp32_as_published(recipe):
    """The official code keeps CLIP in fp32 (main/sd_unified_model.py:85-88, sdxl_text_encoder.py:8-14). A FLUX
    teacher has no published DMD2 run: its recipes keep T5 and CLIP in the compute dtype, as FluxKontextPipeline
    runs them (T5-XXL alone is 17.7 GiB in fp32, most of a 24 GB card); a Qwen-Image-Edit teacher's Qwen2.5-VL
    (8.3 B) stays in the compute dtype, as its pipeline runs it, and so do FLUX.2's Qwen3 and Mistral-Small 3,
    Wan's UMT5-XXL and Z-Image's Qwen3-4B."""
    cmd = dry_run(recipe)
    if recipe.startswith(("dmd_kontext", "dmd_qwen", "dmd_flux2", "dmd_wan", "dmd_z_image")):
        assert not any(a.startswith("--text_encoder_dtype=") for a in cmd), cmd
    else:
        assert "--text_encoder_dtype=fp32" in cmd


@pytest.mark.parametrize("recipe", ["dmd_kontext_4step.sh", "dmd_kontext_4step_lora.sh"])
def test_kontext_dmd_recipes_run_what_the_planner_fits(recipe):
    """The memory settings of the Kontext-DMD2 recipes are the planner's rows in docs/planner.md, which
    tests/test_memory_plan.py checks fit (8 x 80 GB full, 8 x 24 GB LoRA + NF4)."""
    from tests.test_memory_plan import KONTEXT_DMD
    _, planned = KONTEXT_DMD[recipe]
    cmd = dry_run(recipe, NPROC=str(planned["world_size"]))
    flags = dict(a[2:].split("=", 1) for a in cmd[cmd.index("train_dmd.py") + 1:])
    for name, value in planned.items():
        if name != "world_size":
            assert flags.get(name, "0" if value is False else None) == str(int(value) if isinstance(value, bool)
                                                                             else value), (name, flags.get(name))
    assert flags.get("optimizer", "adamw") == "adamw" and "cpu_offload" not in flags  # as planned


@pytest.mark.parametrize("recipe,lr", [("dmd_sdxl_4step_lora.sh", "5e-5"), ("dmd_sd15_lora.sh", "5e-5")])
def test_lora_recipes_carry_the_official_lora_settings(recipe, lr):
    """The official --generator_lora run: rank 64, alpha 8, peft's default init, its 14 targets, the
    generator only (the fake score trains fully), LR 5e-5 for both models."""
    from families.sd_unet import DMD2_LORA_TARGETS
    cmd = dry_run(recipe)
    for want in ("--lora_rank=64", "--lora_alpha=8", "--lora_init=default", "--fake_lora=0",
                 f"--generator_lr={lr}", f"--guidance_lr={lr}"):
        assert want in cmd, (want, cmd)
    targets = next(a for a in cmd if a.startswith("--lora_target_modules=")).split("=", 1)[1].split(",")
    assert tuple(targets) == DMD2_LORA_TARGETS


def test_sdxl_1step_starts_the_generator_from_generator_init():
    assert "--generator_init=/models/g.safetensors" in dry_run("dmd_sdxl_1step.sh")
    assert "--generator_init=" in dry_run("dmd_sdxl_1step.sh", GENERATOR_INIT="")  # set but empty: the teacher
    env = {k: v for k, v in os.environ.items() if k != "GENERATOR_INIT"}
    r = subprocess.run(["bash", os.path.join(ROOT, "recipes", "dmd_sdxl_1step.sh")], capture_output=True, text=True,
                       env={**env, "DRY_RUN": "1", "NPROC": "8", "MODEL": "m", "DATA": "d"})
    assert r.returncode != 0 and "ODE-pretrained" in r.stderr and "+ torchrun" not in r.stdout


@pytest.mark.parametrize("recipe,total", [("dmd_sd15_stage1.sh", 2048), ("dmd_sdxl_4step.sh", 128)])
def test_a_batch_size_override_keeps_the_published_global_batch(recipe, total):
    """--batch_size=N after the recipe's own: GRAD_ACCUM follows, so the global batch stays the published one."""
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "recipes", recipe), "--batch_size=1"],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", "NPROC": "8", "MODEL": "m", "DATA": "d", "GENERATOR_INIT": "g"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(next(line for line in r.stdout.splitlines() if line.startswith("+ torchrun"))[2:])
    # the last one wins (components.config.apply_overrides)
    batch = [a for a in cmd if a.startswith("--batch_size=")][-1]
    assert batch == "--batch_size=1" and f"--grad_accum={total // 8}" in cmd, cmd
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "recipes", recipe), "--batch_size=abc"],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", "NPROC": "8", "MODEL": "m", "DATA": "d"},
        timeout=60,
    )
    assert r.returncode == 2 and "--batch_size=abc is not a positive integer" in r.stderr


def test_every_recipe_is_listed_in_the_recipes_doc():
    """docs/recipes.md names every recipes/*.sh and *.sbatch, each under its family's heading (or SLURM's)."""
    doc = open(os.path.join(ROOT, "docs", "recipes.md"), encoding="utf-8").read()
    shipped = sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith((".sh", ".sbatch")))
    assert shipped and [f for f in shipped if f"recipes/{f}" not in doc] == []
