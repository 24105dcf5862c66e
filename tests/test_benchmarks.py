"""tools/benchmarks.py (the package tools/bench/) without running a benchmark: every name the CLI dispatches to
exists and is callable, the names its usage and docs/benchmarks.md give are the ones it accepts, and every attribute
the benchmark code reads from the project's modules (folders.X, memory_plan.X, tiny_models.X, ...) exists: a
benchmark calls those only minutes into a run, so a renamed helper would otherwise surface there.

    python -m pytest tests/test_benchmarks.py -q
"""
from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import subprocess
import sys
import types

from tests.conftest import ROOT
from tools.bench import cli

# the entry file and the package's modules
BENCH_FILES = [os.path.join(ROOT, "tools", "benchmarks.py"), *sorted(glob.glob(os.path.join(ROOT, "tools/bench/*.py")))]


def _project_module(name: str) -> bool:
    """Whether `name` (dotted) is one of the repository's modules, not a library's."""
    top = os.path.join(ROOT, name.split(".")[0])
    return os.path.isfile(top + ".py") or os.path.isfile(os.path.join(top, "__init__.py"))


class _Failed(str):
    """What an import could not bind."""


def _import_value(module: str, attr: str | None):
    """The object `from module import attr` (attr None: `import module`) binds, or _Failed saying why not."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return _Failed(f"import {module}: {e}")
    if attr is None:
        return mod
    if hasattr(mod, attr):
        return getattr(mod, attr)
    try:
        return importlib.import_module(f"{module}.{attr}")
    except ImportError:
        return _Failed(f"from {module} import {attr}: no such name")


class _Uses(ast.NodeVisitor):
    """Walks a module: the project names each import binds (per function scope, module-level ones seen
    everywhere), and every `name.attr` read off a bound project module. Collects what does not resolve."""

    def __init__(self, path: str):
        self.path, self.scopes, self.missing, self.checked = path, [{}], [], 0

    def _miss(self, what: str) -> None:
        if what not in self.missing:  # module-level imports are visited twice (_uses)
            self.missing.append(what)

    def _bind(self, node, local: str, value) -> None:
        if isinstance(value, _Failed):
            self._miss(f"{os.path.relpath(self.path, ROOT)}:{node.lineno}: {value}")
        else:
            self.scopes[-1][local] = value

    def visit_Import(self, node):
        for alias in node.names:
            if _project_module(alias.name):
                if alias.asname:
                    self._bind(node, alias.asname, _import_value(alias.name, None))
                else:
                    top = alias.name.split(".")[0]
                    self._bind(node, top, _import_value(top, None))
                    _import_value(alias.name, None)  # the submodule loaded: reachable as top.sub

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module and _project_module(node.module):
            for alias in node.names:
                self._bind(node, alias.asname or alias.name, _import_value(node.module, alias.name))

    def _function(self, node):
        self.scopes.append({})
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _resolve(self, node):
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
        return None

    def visit_Attribute(self, node):
        base = self._resolve(node.value)
        if isinstance(base, types.ModuleType) and _project_module(base.__name__):
            self.checked += 1
            if not hasattr(base, node.attr):
                self._miss(f"{os.path.relpath(self.path, ROOT)}:{node.lineno}: {base.__name__}.{node.attr} does not "
                           "exist")
        self.generic_visit(node)


def _uses(path: str) -> _Uses:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    uses = _Uses(path)
    # module-level imports first: a function defined above them still sees them when it runs
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            uses.visit(node)
    uses.visit(tree)
    return uses


def test_every_project_attribute_the_benchmarks_read_exists():
    missing, checked = [], 0
    for path in BENCH_FILES:
        uses = _uses(path)
        missing += uses.missing
        checked += uses.checked
    assert not missing, "\n".join(missing)
    assert checked > 10  # the walk found the benchmarks' uses of folders, memory_plan, tiny_models, ...


def test_the_walk_finds_a_missing_attribute(tmp_path):
    """The check itself: a function-local import of a tools module and a name it lacks is reported."""
    path = tmp_path / "bench.py"
    path.write_text("def f():\n    from tools.gpu import folders\n    return folders.no_such_builder(1)\n")
    assert any("tools.gpu.folders.no_such_builder does not exist" in m for m in _uses(str(path)).missing)


def test_every_benchmark_and_worker_main_dispatches_to_is_callable():
    assert cli.BENCHES and all(callable(f) for f in cli.BENCHES.values())
    assert cli.WORKERS and all(callable(f) for f in cli.WORKERS.values())
    # each worker a benchmark starts (_torchrun("<worker>", ...)) is one main runs
    started = set()
    for path in BENCH_FILES:
        with open(path) as f:
            started |= set(re.findall(r"_torchrun\(\"(\w+)\"", f.read()))
    assert started and started <= set(cli.WORKERS)


def test_the_names_in_the_usage_and_the_docs_are_the_cli_s():
    names = {*cli.BENCHES, "all"}
    listed = set(re.findall(r"python tools/benchmarks\.py (\w+)", cli.__doc__))
    assert listed == names
    docs = set()
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "docs", "families", "*.md"))
    for path in pages + [os.path.join(ROOT, "README.md")]:
        with open(path) as f:
            docs |= set(re.findall(r"python tools/benchmarks\.py\s+(\w+)", f.read()))
    assert docs and docs <= names, docs - names


def test_the_cli_answers_help_and_refuses_unknown_names(capsys):
    assert cli.main(["--help"]) == 0 and "usage: python tools/benchmarks.py" in capsys.readouterr().out
    assert cli.main(["no_such_benchmark"]) == 2
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "benchmarks.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nf4_width" in r.stdout, r.stderr[-2000:]
