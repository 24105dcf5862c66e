"""The house's layout, checked: at most 8 Python files at the root, imports that go one way through
the tiers (scripts -> train_common -> checkpoint -> parallel/ -> fsdp_utils, data_utils -> run_utils,
precision, algorithms), no import cycle, tools/ never importing demos/, and the two scripts'
settings: every UPPER_CASE constant overridable, the shared ones in the same order with the same
comment.

    python -m pytest tests/test_layout.py -q
"""
from __future__ import annotations

import ast
import glob
import importlib
import os

import pytest

from tests.conftest import ROOT

# lower number = lower tier; a module may import its own tier's modules (acyclically) and lower ones
TIERS = {"run_utils": 0, "precision": 0, "algorithms": 0, "fsdp_utils": 1, "data_utils": 1, "parallel": 2,
         "checkpoint": 3, "train_common": 4, "train_dmd": 5, "train_flux_kontext": 5}
PROJECT = ("run_utils", "fsdp_utils", "parallel", "precision", "data_utils", "algorithms", "checkpoint",
           "train_common", "train_dmd", "train_flux_kontext", "tools", "demos", "tests")


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
    for folder in ("parallel", "algorithms", "tools", "demos"):
        files += glob.glob(os.path.join(ROOT, folder, "*.py"))
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


def test_root_holds_at_most_eight_python_files():
    root_py = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "*.py")))
    assert len(root_py) <= 8, root_py
    for name in ("train_dmd.py", "train_flux_kontext.py", "fsdp_utils.py", "precision.py", "checkpoint.py",
                 "run_utils.py", "data_utils.py"):
        assert name in root_py


def test_imports_follow_the_tiers():
    for module, deps in _graph().items():
        top = module.split(".")[0]
        if top not in TIERS:
            continue
        for dep in deps:
            dep_top = dep.split(".")[0]
            assert dep_top in TIERS, f"{module} imports {dep}: the training code never imports tools/ or demos/"
            assert TIERS[dep_top] < TIERS[top] or dep_top == top, \
                f"{module} (tier {TIERS[top]}) imports {dep} (tier {TIERS[dep_top]}): imports go one way"


def test_no_import_cycle_and_tools_never_import_demos():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("tools"):
            assert not any(d.startswith("demos") for d in deps), f"{module} imports {deps}: demos may import tools, not the reverse"
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
    import run_utils
    module = importlib.import_module(script)
    upper = {k for k, v in vars(module).items() if k.isupper() and not k.startswith("_") and not callable(v)}
    assert upper == set(run_utils.script_constants(vars(module))), upper ^ set(run_utils.script_constants(vars(module)))


def _settings_with_comments(script: str) -> list[tuple[str, str]]:
    out = []
    for line in open(os.path.join(ROOT, script + ".py")):
        name, sep, rest = line.partition(" = ")
        if sep and name.isupper() and name.isidentifier() and not name.startswith("_") and "  # " in rest:
            out.append((name, rest.split("  # ", 1)[1].strip()))
    return out


# settings whose meaning is train_common's, not a script's: one comment, word for word, in both
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
