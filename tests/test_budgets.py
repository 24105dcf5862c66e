"""The suite's time budgets (tests/budgets.py, docs/testing.md's table): every test file counts for an area
with a budget, and tests count for the family their names name.

    python -m pytest tests/test_budgets.py -q
"""
from __future__ import annotations

import glob
import os

from tests import budgets


def test_every_test_file_counts_for_an_area_with_a_budget():
    table = budgets.budgets()
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(budgets.ROOT, "tests", "test_*.py")))
    assert files and all(budgets.area_of(f"tests/{f}::test_x") in table for f in files), \
        [f for f in files if budgets.area_of(f"tests/{f}::test_x") not in table]
    named = {a for t in (budgets.FAMILY_FILES, budgets.AREA_FILES) for a in t}
    assert named == set(table), named ^ set(table)


def test_a_shared_files_family_case_counts_for_the_family():
    assert budgets.area_of("tests/test_memory_plan.py::test_qwen_lora_plan_matches") == "qwen_image"
    assert budgets.area_of("tests/test_memory_plan.py::test_flux2_lora_plan[klein]") == "flux2"
    assert budgets.area_of("tests/test_compile.py::test_flux_compiled_matches_eager") == "flux"
    assert budgets.area_of("tests/test_memory_plan.py::test_fit_table_is_markdown") == "planner"
    assert budgets.area_of("tests/test_flux2.py::test_refusals_are_one_line") == "flux2"


def test_the_report_marks_an_area_over_its_budget():
    fast, slow = budgets.budgets()["planner"]
    lines = budgets.report_lines({"planner": slow + 1, "flux2": 0.5}, "slow")
    assert lines[0].endswith("planner  OVER") and not lines[1].endswith("OVER")
