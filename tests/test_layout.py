"""The house's layout, checked: the root holds only the two scripts and the three modules users edit
(fsdp_utils, precision, checkpoint), imports go one way, a tier per folder (scripts -> components/ ->
families/ -> checkpoint -> parallel/ -> fsdp_utils, data/ -> precision, algorithms/ -> core/; a folder's
subpackages, such as families/flux2/, in its tier), no import cycle, tools/ never importing demos/, and
the two scripts' settings: every UPPER_CASE constant overridable, the shared ones in the same order with
the same comment.

    python -m pytest tests/test_layout.py -q
"""
from __future__ import annotations

import ast
import glob
import importlib
import os

import pytest

from tests.conftest import ROOT

ROOT_FILES = ("checkpoint.py", "fsdp_utils.py", "precision.py", "train_dmd.py", "train_flux_kontext.py")
# one tier per folder or root module, lower = further down: a module imports lower tiers and its own
# folder (acyclically), never a folder of its own tier or above
TIERS = {"core": 0,
         "precision": 1, "algorithms": 1,
         "fsdp_utils": 2, "data": 2,
         "parallel": 3,
         "checkpoint": 4,
         "families": 5,
         "components": 6,
         "train_dmd": 7, "train_flux_kontext": 7}
PROJECT = ("core", "families", "components", "data", "fsdp_utils", "parallel", "precision", "algorithms", "checkpoint",
           "train_dmd", "train_flux_kontext", "tools", "demos", "tests")
FOLDERS = ("core", "families", "components", "data", "parallel", "algorithms", "tools", "demos")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str) -> set[str]:
    """Project modules `path` imports anywhere in the file (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            if n.split(".")[0] in PROJECT:
                out.add(n)
    return out


def _project_files() -> list[str]:
    files = glob.glob(os.path.join(ROOT, "*.py"))
    for folder in FOLDERS:  # with its subpackages (families/<name>/)
        files += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    return sorted(files)


def _graph() -> dict[str, set[str]]:
    files = _project_files()
    modules = {_module_name(f) for f in files}
    graph = {}
    for f in files:
        # "from parallel import lora" names the module parallel.lora; keep the names that are modules
        graph[_module_name(f)] = {n if n in modules else n.rsplit(".", 1)[0] for n in _imports(f)} & modules
        graph[_module_name(f)].discard(_module_name(f))
    return graph


def _tier(module: str) -> int | None:
    return TIERS.get(module.split(".")[0])


def _tier_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        tier = _tier(module)
        if tier is None:  # tools/, demos/: they may use any of the training code
            continue
        for dep in sorted(deps):
            dep_tier = _tier(dep)
            if dep_tier is None:
                out.append(f"{module} imports {dep}: the training code never imports tools/ or demos/")
            elif not (dep_tier < tier or (dep_tier == tier and dep.split(".")[0] == module.split(".")[0])):
                out.append(f"{module} (tier {tier}) imports {dep} (tier {dep_tier}): imports go one way")
    return out


def test_root_holds_only_the_scripts_and_the_modules_users_edit():
    root_py = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "*.py")))
    assert root_py == sorted(ROOT_FILES), root_py


def test_every_module_of_the_training_code_has_a_tier():
    """A new folder of the training code names its tier here."""
    for module in _graph():
        if not module.startswith(("tools", "demos")):
            assert _tier(module) is not None, f"{module}: add its folder to TIERS"


def test_imports_follow_the_tiers():
    assert "families.flux2.room" in _graph()  # subpackages are read too
    violations = _tier_violations(_graph())
    assert not violations, violations


def test_the_tier_check_catches_an_upward_import():
    """The check itself: an import from a lower tier up, or sideways into another folder of its tier, is caught."""
    assert _tier_violations({"core.errors": {"components.trainer"}})  # ground -> the run's components
    assert _tier_violations({"parallel.lowbit": {"components.optim"}})  # sharding -> the run's components
    assert _tier_violations({"data.sources": {"fsdp_utils"}})  # same tier, another folder
    assert _tier_violations({"checkpoint": {"components.export"}})
    assert _tier_violations({"parallel.lora": {"tools.tiny_models"}})
    assert _tier_violations({"families.flux2.room": {"components.trainer"}})  # a subpackage: its folder's tier
    assert _tier_violations({"families.flux2.tiny": {"tools.shapes"}})
    assert not _tier_violations({"components.trainer": {"checkpoint", "components.export", "data.sources"},
                                 "components.logger": {"components.config"}, "parallel.lowbit": {"core.errors"}})


def test_no_import_cycle_and_tools_never_import_demos():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("tools"):
            assert not any(d.startswith("demos") for d in deps), (
                f"{module} imports {deps}: demos may import tools, not the reverse"
            )
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = "done"
    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("script", ["train_dmd", "train_flux_kontext"])
def test_every_upper_case_constant_is_a_setting(script):
    """The scripts' docstrings say every UPPER_CASE constant can be overridden as --name=value."""
    from components.config import script_constants
    module = importlib.import_module(script)
    upper = {k for k, v in vars(module).items() if k.isupper() and not k.startswith("_") and not callable(v)}
    assert upper == set(script_constants(vars(module))), upper ^ set(script_constants(vars(module)))


def _settings_with_comments(script: str) -> list[tuple[str, str]]:
    out = []
    for line in open(os.path.join(ROOT, script + ".py")):
        name, sep, rest = line.partition(" = ")
        if sep and name.isupper() and name.isidentifier() and not name.startswith("_") and "  # " in rest:
            out.append((name, rest.split("  # ", 1)[1].strip()))
    return out


# settings whose meaning is components.trainer's, not a script's: one comment, word for word, in both
SAME_COMMENT = ("SKIP_BAD_SAMPLES", "GRAD_ACCUM", "SEED", "MAX_GRAD_NORM", "LORA_ALPHA", "LORA_DROPOUT", "LORA_INIT",
                "LORA_EXPORT_MERGED", "PRECISION", "TF32", "EXPORT_DTYPE", "DP_REPLICATE", "RESHARD_AFTER_FORWARD",
                "CPU_OFFLOAD", "PREFETCH", "COMPILE", "MAX_BAD_STEPS", "COLLECTIVE_TIMEOUT_S", "SAVE_EVERY",
                "KEEP_LAST", "ASYNC_SAVE", "RESUME", "LOG_EVERY", "REPORT_TO", "WANDB_PROJECT", "WANDB_RUN_NAME",
                "SAMPLE_EVERY")


def test_shared_settings_are_in_the_same_order_with_one_comment():
    dmd, kontext = (_settings_with_comments(s) for s in ("train_dmd", "train_flux_kontext"))
    shared = [n for n, _ in dmd if n in dict(kontext)]
    assert shared == [n for n, _ in kontext if n in dict(dmd)]
    assert len(shared) >= 35, shared
    for name in SAME_COMMENT:
        assert dict(dmd)[name] == dict(kontext)[name], name
