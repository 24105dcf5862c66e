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

import run_utils

RECIPES = sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".sh"))


def dry_run(recipe: str, **env) -> list[str]:
    """The torchrun command line the recipe would run (DRY_RUN=1 in run_fsdp.sh)."""
    full = {**os.environ, "DRY_RUN": "1", "NPROC": "8", "MODEL": "/models/m", "DATA": "/data/d.jsonl",
            "INIT_FROM": "/ckpt/step_040000", **env}
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
    saved = run_utils.script_constants(vars(module))
    try:
        run_utils.apply_overrides(vars(module), settings)  # unknown name or bad value -> ConfigError
        monkeypatch.setenv("WORLD_SIZE", "8")
        module.INIT_FROM = "" if hasattr(module, "INIT_FROM") else None  # the folder does not exist here
        module.validate_config()
    finally:
        vars(module).update(saved)


@pytest.mark.parametrize("recipe,per_gpu,total", [("dmd_sd15_stage1.sh", 32, 2048), ("dmd_sd15_stage2.sh", 32, 2048),
                                                   ("dmd_sdxl_4step.sh", 2, 128), ("dmd_sdxl_1step.sh", 2, 128)])
def test_dmd_recipes_keep_the_published_global_batch(recipe, per_gpu, total):
    for nproc in (8, 4):
        cmd = dry_run(recipe, NPROC=str(nproc))
        assert f"--grad_accum={total // (per_gpu * nproc)}" in cmd and f"--batch_size={per_gpu}" in cmd, cmd
    r = subprocess.run(["bash", os.path.join(ROOT, "recipes", recipe)], capture_output=True, text=True,
                       env={**os.environ, "DRY_RUN": "1", "NPROC": "3", "MODEL": "m", "DATA": "d", "INIT_FROM": "c"})
    assert r.returncode == 2 and f"does not divide the published global batch {total}" in r.stderr


def test_stage2_keeps_the_original_teacher():
    for recipe in ("dmd_sd15_stage1.sh", "dmd_sd15_stage2.sh"):
        assert "--model_path=/models/m" in dry_run(recipe)
    stage2 = dry_run("dmd_sd15_stage2.sh")
    assert "--model_path=/models/m" in stage2 and "--init_from=/ckpt/step_040000" in stage2
