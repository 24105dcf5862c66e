"""Regenerate docs/settings.md's "Every constant" tables from the scripts' headers (each UPPER_CASE
setting with its default and its one-line comment), so the docs cannot drift from the code.

    python tools/readme_constants.py          # rewrite the tables in docs/settings.md
    python tools/readme_constants.py --check  # exit 1 if docs/settings.md is out of date (tests do this)
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train_dmd.py", "train_flux_kontext.py")
SETTING = re.compile(r"^([A-Z][A-Z0-9_]*) = (.*?)\s+#\s*(.*)$")


def settings(script: str) -> list[tuple[str, str, str]]:
    """(name, default as written, comment) of every setting in the script's header."""
    rows = []
    for line in open(os.path.join(ROOT, script), encoding="utf-8"):
        if line.startswith(("def ", "class ")):
            break
        m = SETTING.match(line.rstrip("\n"))
        if m:
            rows.append(m.groups())
    return rows


def table(script: str) -> str:
    lines = ["| constant | default | meaning |", "|---|---|---|"]
    for name, default, comment in settings(script):
        lines.append(f"| `{name}` | `{default}` | {comment.replace('|', '/')} |")
    return "\n".join(lines)


def render(readme: str) -> str:
    """The settings doc with each script's table (the one after the line "`SCRIPT`") replaced."""
    for script in SCRIPTS:
        pattern = re.compile(rf"(`{re.escape(script)}`\n\n)\| constant \| default \| meaning \|\n(?:\|.*\n)+")
        if not pattern.search(readme):
            raise SystemExit(f"docs/settings.md: no constants table after `{script}`")
        readme = pattern.sub(lambda m: m.group(1) + table(script) + "\n", readme, count=1)
    return readme


def main(argv: list[str]) -> int:
    path = os.path.join(ROOT, "docs", "settings.md")
    old = open(path, encoding="utf-8").read()
    new = render(old)
    if "--check" in argv:
        if new != old:
            print("docs/settings.md constants tables are out of date: run python tools/readme_constants.py")
            return 1
        return 0
    if new != old:
        open(path, "w", encoding="utf-8").write(new)
        print("docs/settings.md: constants tables updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
