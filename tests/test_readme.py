"""README stays true: every setting of both scripts is documented, and the Quickstart has exactly
two commands.

    python -m pytest tests/test_readme.py -q
"""
import os
import re

from tests.conftest import ROOT


def constants(path):
    names = []
    for line in open(os.path.join(ROOT, path)):
        if line.startswith(("def ", "class ")):
            break
        m = re.match(r"^([A-Z][A-Z0-9_]*) = [^\n]*#", line)  # a setting: constant + its comment
        if m:
            names.append(m.group(1))
    return names


def test_every_constant_is_in_the_readme():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for script in ("train_dmd.py", "train_flux_kontext.py"):
        missing = [n for n in constants(script) if f"`{n}`" not in readme]
        assert not missing, f"{script}: constants missing from README.md: {missing}"


def test_constants_tables_are_generated_from_the_scripts():
    """Defaults and comments in README.md equal the scripts' (python tools/readme_constants.py)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "readme_constants.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_quickstart_has_two_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert quick.count("```bash") == 2
