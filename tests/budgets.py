"""Each family's and shared area's share of the suite's time, against its budget in docs/testing.md ("Budgets"),
printed at the end of every pytest run (tests/conftest.py's summary), so a new family knows its share.

    python -m pytest tests/test_layout.py -q   # checks every test file belongs to an area with a budget

A test counts for a family where its file is the family's, or where its name names the family (a shared
file's Qwen-Image-Edit case counts for qwen_image); else for its file's shared area.
"""
from __future__ import annotations

import os
import re

from families import NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A family's own file is tests/test_<family>.py, and a shared file's test counts for it where its name holds the
# family's name: a new family needs no line here. The families' older files and words, beside those:
EXTRA_FILES = {"qwen_image": ("test_qwen_edit_eval.py",), "z_image": ("test_z_image_omni.py",),
               "flux": ("test_flux_kontext.py", "test_train_flux_kontext.py", "test_train_dmd_kontext.py",
                        "test_kontext_eval.py"),
               "sd_unet": ("test_train_dmd_sdxl.py",)}
EXTRA_WORDS = {"flux2": ("klein",), "qwen_image": ("qwen",), "flux": ("kontext",), "sd_unet": ("sdxl", "sd15", "unet")}
FAMILY_FILES = {name: (f"test_{name}.py", *EXTRA_FILES.get(name, ())) for name in NAMES}
# (word, family), the longest word first: flux2 before flux
FAMILY_WORDS = sorted(((w, name) for name in NAMES for w in (name, *EXTRA_WORDS.get(name, ()))),
                      key=lambda pair: -len(pair[0]))
# the shared areas, by file
AREA_FILES = {
    "dmd2": ("test_dmd2.py", "test_train_dmd.py", "test_validation.py", "test_decoupled_dmd.py",
             "test_diversity_dmd.py", "test_student_sampler.py"),
    "planner": ("test_memory_plan.py", "test_memory.py"),
    "gpu tools": ("test_gpu_check.py", "test_gpu.py", "test_benchmarks.py", "test_host_work.py", "test_identity.py",
                  "test_profiling.py"),
    "distributed": ("test_fsdp_utils.py", "test_parallelize.py", "test_ddp.py", "test_multinode.py", "test_slurm.py",
                    "test_context_parallel.py", "test_zygote.py", "test_loading.py", "test_attention.py",
                    "test_compile.py", "test_float8.py"),
    "checkpoint": ("test_checkpoint.py", "test_fault_tolerance.py", "test_disk_preflight.py", "test_export.py",
                   "test_ema.py"),
    "lora and low-bit": ("test_lora.py", "test_lora_merge.py", "test_lowbit.py"),
    "run and data": ("test_components.py", "test_trainer.py", "test_precision.py", "test_data.py"),
    "demos and docs": ("test_assets.py", "test_shapes_eval.py", "test_palette_eval.py", "test_video_eval.py",
                       "test_readme.py",
                       "test_recipes.py", "test_layout.py", "test_tiny_models.py", "test_families.py",
                       "test_budgets.py"),
}
_BY_FILE = {f: area for table in (FAMILY_FILES, AREA_FILES) for area, files in table.items() for f in files}


def area_of(nodeid: str) -> str:
    """The family or shared area a test (pytest node id) counts for; "other" for a file no table names."""
    path, _, name = nodeid.partition("::")
    file = os.path.basename(path)
    if file not in sum(FAMILY_FILES.values(), ()):
        for word, family in FAMILY_WORDS:
            if word in name.lower():
                return family
    return _BY_FILE.get(file, "other")


def budgets(path: str = os.path.join(ROOT, "docs", "testing.md")) -> dict[str, tuple[float, float]]:
    """{area: (fast-loop seconds, slow-half seconds)} from docs/testing.md's budget table: the rows between
    the "<!-- budgets -->" and "<!-- /budgets -->" markers, `| area | fast s | slow s | ... |`."""
    with open(path) as f:
        text = f.read()
    block = text.split("<!-- budgets -->", 1)[1].split("<!-- /budgets -->", 1)[0]
    found = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"\d+", cells[1]) and re.fullmatch(r"\d+", cells[2]):
            found[cells[0].strip("`*")] = (float(cells[1]), float(cells[2]))
    return found


def report_lines(seconds: dict[str, float], half: str) -> list[str]:
    """One line per area that ran: its seconds beside its budget for `half` ("fast", "slow" or "all": both
    summed), OVER where it is past it."""
    table = budgets()
    lines = []
    for area in sorted(seconds, key=lambda a: -seconds[a]):
        fast, slow = table.get(area, (0.0, 0.0))
        budget = {"fast": fast, "slow": slow}.get(half, fast + slow)
        over = "  OVER" if seconds[area] > budget else ""
        lines.append(f"{seconds[area]:7.1f} / {budget:5.0f}  {area}{over}")
    return lines
