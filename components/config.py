"""Settings: the UPPER_CASE constants at the top of a script, overridden as --name=value, their
--help and the printed config.

    python -m pytest tests/test_components.py -q
"""
from __future__ import annotations

import difflib
import json
import os
import re

from core.dist import print0
from core.errors import ConfigError

CONFIG_TYPES = (bool, int, float, str, list)


def script_constants(namespace: dict) -> dict:
    """The settings of a script: its UPPER_CASE module constants of plain types."""
    return {k: v for k, v in namespace.items()
            if k.isupper() and not k.startswith("_") and isinstance(v, CONFIG_TYPES)}


def _parse_value(name: str, raw: str, default):
    kind = type(default)
    try:
        if kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is list:
            text = raw.strip()
            items = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
            if not isinstance(items, list):
                raise ValueError
            return [_parse_value(name, str(v), default[0]) for v in items] if default else items
        return raw
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"--{name.lower()}={raw!r}: expected {kind.__name__}") from None


def apply_overrides(namespace: dict, argv: list[str]) -> dict:
    """Apply `--name=value` overrides (case-insensitive, type-checked) to a script's constants,
    in place in `namespace`. Returns the final config dict. Unknown names suggest close matches."""
    consts = script_constants(namespace)
    by_lower = {k.lower(): k for k in consts}
    if "--help" in argv or "-h" in argv:
        print0(settings_help(namespace.get("__file__", ""), consts))
        raise SystemExit(0)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"argument {arg!r}: write settings as --name=value")
        key, raw = arg[2:].split("=", 1)
        name = by_lower.get(key.lower().replace("-", "_"))
        if name is None:
            close = difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown setting --{key}{hint}")
        namespace[name] = _parse_value(name, raw, consts[name])
    return script_constants(namespace)


def settings_help(script: str, consts: dict) -> str:
    """--help: every setting of `script` as --name=default (type) and its comment, under the group
    comments of the script's header, in the script's order."""
    out = [f"usage: torchrun --nproc_per_node=N {os.path.basename(script)} [--name=value ...]  "
           "(or python, one process); settings:"]
    group = None
    for line in open(script, encoding="utf-8") if script else ():
        if line.startswith(("def ", "class ")):
            break
        m = re.match(r"^([A-Z][A-Z0-9_]*) = .*?\s+#\s*(.*)$", line.rstrip("\n"))
        if m and m.group(1) in consts:
            if group:
                out.append(f"\n{group}")
                group = None
            name, value = m.group(1), consts[m.group(1)]
            out.append(f"  --{name.lower()}={json.dumps(value)} ({type(value).__name__}): {m.group(2)}")
        elif line.startswith("# ") and not line.startswith("# ---"):
            group = line[2:].strip()
    return "\n".join(out)


def format_config(config: dict) -> str:
    width = max(len(k) for k in config)
    return "\n".join(f"  {k.ljust(width)} = {v!r}" for k, v in config.items())


def check_settings(checks: dict[str, bool]) -> None:
    """{requirement: holds?} -> one ConfigError listing every requirement that does not hold."""
    failed = [k for k, ok in checks.items() if not ok]
    if failed:
        raise ConfigError(f"invalid settings: need {'; '.join(failed)}")
