"""Data sources: a .jsonl, a .txt of prompts, a folder of images with .txt captions, or a Hugging
Face `datasets` table, detected from what the path points at; read into rows of canonical fields
and checked before any work (the image checks split over the ranks).

    python -m pytest tests/test_data.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import json
import os
import re

from core.dist import print0
from core.errors import ConfigError
from data.images import check_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")  # what the folder layouts read as images
# the names users bring for each field (JSONL keys, datasets columns), the canonical one first.
# "image" alone is ambiguous for pairs: this project's Kontext pairs (assets/kontext_blue) name the input so
# (beside "target"), ai-toolkit and diffusers' examples the edited result (beside "control").
ALIASES = {"control": ("control", "context", "source"), "target": ("target", "edited"),
           "prompt": ("prompt", "caption", "text", "instruction"), "image": ("image",)}


def match_fields(names, roles) -> tuple[dict[str, str], str]:
    """{role: the name holding it} among `names` (a row's keys or a table's columns) for the wanted
    `roles`, and a note ("" if none) when "image" had to be read as a pair's control or target.
    Two aliases of one role: ValueError."""
    names, found, note = set(names), {}, ""
    for role in roles:
        hits = [n for n in ALIASES[role] if n in names]
        if len(hits) > 1:
            raise ValueError(f"both {hits[0]!r} and {hits[1]!r} name the {role}: keep one")
        if hits:
            found[role] = hits[0]
    if "image" in names and "control" in roles and "image" not in roles:
        if "control" in found and "target" in found:
            raise ValueError(f"'image' beside {found['control']!r} and {found['target']!r}: which is it? remove one")
        if "control" in found:
            found["target"] = "image"
            note = (f"\"image\" read as the edited result (beside \"{found['control']}\", the ai-toolkit / diffusers "
                    "naming); name it \"target\" to silence this")
        else:  # beside "target" it can only be the input (this project's files, the shipped pairs)
            found["control"] = "image"
            if "target" not in found:
                note = ("\"image\" read as the input (context) image, as the shipped pairs name it; "
                        "name it \"control\" to silence this")
    return found, note


def source_kind(path: str, setting: str = "DATA_PATH") -> str:
    """What `path` is: "txt", "jsonl", "folder" (images and captions), "datasets" (a save_to_disk
    folder, parquet files or, when nothing local has the name, a hub dataset)."""
    if os.path.isfile(path):
        for ext, kind in ((".txt", "txt"), (".jsonl", "jsonl"), (".parquet", "datasets")):
            if path.endswith(ext):
                return kind
        raise ConfigError(f"{setting}={path}: not a .jsonl, .txt or .parquet file (nor a folder)")
    if os.path.isdir(path):
        names = os.listdir(path)
        if {"state.json", "dataset_dict.json"} & set(names) or any(n.endswith(".parquet") for n in names):
            return "datasets"
        return "folder"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path or "") and not path.startswith("."):
        return "datasets"  # a hub name: loaded by datasets where a network (or its cache) has it
    raise ConfigError(f"{setting}={path!r}: no such file or folder")


def read_rows(path: str, roles: tuple[str, ...], required: tuple[str, ...], *, skip_bad: bool,
              setting: str = "DATA_PATH", control_path: str = "", columns: dict | None = None,
              split: str = "train", size_of: str = "") -> tuple[list[dict], int]:
    """Rows {role: value} of `path` (any kind source_kind knows; a .txt gives prompts only):
    images as absolute paths (JSONL: relative to the file) or DatasetImage, prompts as strings
    ("" allowed). `required` roles must be present. Every image is opened and verified once, each
    rank checking its share (rows rank::world) and the results gathered, so all ranks agree; with
    `size_of` a role, each row also gets "size" = (h, w) of that image after EXIF orientation.
    A bad row -> ConfigError naming file:line (folder: the file; datasets: the row), or with
    skip_bad it is dropped and counted. Returns (rows, skipped)."""
    kind = source_kind(path, setting)
    if control_path and kind != "folder":
        raise ConfigError(f"CONTROL_PATH={control_path}: only a folder {setting} reads it; {path} is a {kind} source")
    images = [r for r in roles if r in ("control", "target", "image")]
    if kind == "txt":
        if set(required) - {"prompt"}:
            raise ConfigError(f"{setting}={path}: a .txt holds prompts only; this needs {', '.join(required)}")
        entries, notes = _txt_entries(path), set()
    elif kind == "jsonl":
        entries, notes = _jsonl_entries(path, roles, required, images)
    elif kind == "folder":
        entries, notes = _folder_entries(path, control_path, roles, required), set()
    else:
        entries, notes = _dataset_entries(path, roles, required, images, columns or {}, split, setting)
    for note in sorted(notes):
        print0(f"warning: {path}: {note}")
    checked = _check_share([row for _, row in entries if isinstance(row, dict)], images, size_of)
    rows, skipped, k = [], 0, 0
    for where, row in entries:
        if isinstance(row, dict):
            error, size = checked[k]
            k += 1
            row = ValueError(error) if error else row
            if size is not None:
                row["size"] = size
        if isinstance(row, ValueError):
            if not skip_bad:
                raise ConfigError(f"{where}: {row}")
            skipped += 1
            continue
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no usable samples ({skipped} skipped)")
    return rows, skipped


def _txt_entries(path):
    """(where, row) per non-blank line of a prompts file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [(f"{path}:{n}", {"prompt": line.strip()}) for n, line in enumerate(lines, 1) if line.strip()]


def _jsonl_entries(path, roles, required, images):
    """(where, row or ValueError) per non-blank line, and the notes of ambiguous keys."""
    base, entries, notes = os.path.dirname(os.path.abspath(path)), [], set()
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row, note = _jsonl_row(line, roles, required, images, base)
                notes.add(note)
            except ValueError as e:
                row = e
            entries.append((f"{path}:{n}", row))
    return entries, notes - {""}


def _jsonl_row(line, roles, required, images, base):
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    fields, note = match_fields(raw, roles)
    row = {}
    for role in roles:
        value = raw.get(fields.get(role, role))
        if value is None and role not in required:
            continue
        if role == "prompt" and isinstance(value, str):  # an empty prompt is a prompt
            row[role] = value
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"missing or empty {role!r}" + _aliases_hint(role))
        else:
            row[role] = os.path.join(base, value) if role in images else value
    return row, note


def _aliases_hint(role) -> str:
    others = ALIASES[role][1:] + (("image",) if role in ("control", "target") else ())
    return f" (or {', '.join(repr(a) for a in others)})" if others else ""


def _folder_entries(folder, control_path, roles, required):
    """A folder of images with same-stem .txt captions: a row per image (with "control": the
    same-stem image in control_path or folder/control/), or, when no image is wanted, a row per
    caption (with "image" when a same-stem image is beside it)."""
    files = _by_stem(folder)
    if "control" in roles:
        control_dir = control_path or os.path.join(folder, "control")
        if not os.path.isdir(control_dir):
            raise ConfigError(f"{folder}: a folder of targets needs its control images: CONTROL_PATH, or a "
                              f"control/ folder inside it ({control_dir} does not exist)")
        controls = _by_stem(control_dir)
    pivot = "target" if "target" in roles else "image" if "image" in required else "prompt"
    entries = []
    for stem in sorted(files):
        found = files[stem]
        where = found.get("txt") if pivot == "prompt" else found.get("image")
        if pivot != "prompt" and "image" not in found:
            continue  # a caption with no image beside it
        if pivot == "prompt" and "txt" not in found:
            continue
        try:
            entries.append((where, _folder_row(stem, found, pivot, roles, required,
                                               controls if "control" in roles else None)))
        except ValueError as e:
            entries.append((where, e))
    if not entries:
        raise ConfigError(f"{folder}: no {'images' if pivot != 'prompt' else '.txt captions'} "
                          f"({'/'.join(IMAGE_EXTENSIONS)}) in it")
    return entries


def _folder_row(stem, found, pivot, roles, required, controls):
    if found.get("duplicate"):
        raise ValueError(f"two images named {stem}.*: {', '.join(found['duplicate'])}; keep one")
    row = {}
    if pivot != "prompt" or "image" in found:
        row["target" if pivot == "target" else "image"] = found["image"]
    if "txt" in found:
        with open(found["txt"], encoding="utf-8") as f:
            row["prompt"] = f.read().strip()
    elif "prompt" in required:
        raise ValueError(f"no caption file {stem}.txt beside it")
    if controls is not None:
        if stem not in controls or "image" not in controls[stem]:
            raise ValueError(f"no control image {stem}.* ({'/'.join(IMAGE_EXTENSIONS)}) in the control folder")
        row["control"] = controls[stem]["image"]
    if "image" in required and "image" not in row:
        raise ValueError(f"no image {stem}.* beside the caption")
    return row


def _by_stem(folder) -> dict[str, dict]:
    """{stem: {"image": path, "txt": path, "duplicate": [names]}} of a folder's files (not recursive)."""
    out: dict[str, dict] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(os.path.abspath(folder), name)
        stem, ext = os.path.splitext(name)
        if not os.path.isfile(path):
            continue
        entry = out.setdefault(stem, {})
        if ext.lower() in IMAGE_EXTENSIONS:
            if "image" in entry:
                entry["duplicate"] = [os.path.basename(entry["image"]), name]
            entry["image"] = path
        elif ext.lower() == ".txt":
            entry["txt"] = path
    return out


# Hugging Face datasets: an optional dependency, imported only here

class DatasetImage:
    """An image held in a datasets table (row `index` of `column`: bytes, or a path), opened when
    needed: what rows hold instead of a path for datasets sources."""

    def __init__(self, table, index: int, column: str, base: str):
        self.table, self.index, self.column, self.base = table, index, column, base

    def open(self):
        import io
        value = self.table[self.index][self.column]
        if isinstance(value, dict) and value.get("bytes"):
            return io.BytesIO(value["bytes"])
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise ValueError(f"column {self.column!r} holds no image")
        return os.path.join(self.base, path)

    def __str__(self):
        return f"in column {self.column!r}"


def load_table(path: str, split: str, setting: str = "DATA_PATH"):
    """A datasets.Dataset: a save_to_disk folder (a DatasetDict: its `split`), parquet files (a
    file or a folder of them), or a hub name. A missing package or a failed load: one ConfigError."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{setting}={path}: a Hugging Face dataset needs the datasets package "
                          "(pip install datasets)") from None
    datasets.disable_progress_bars()  # the run's log has its own lines
    try:
        if os.path.isdir(path) and not any(n.endswith(".parquet") for n in os.listdir(path)):
            table = datasets.load_from_disk(path)
        elif os.path.exists(path):
            files = [path] if os.path.isfile(path) else sorted(
                os.path.join(path, n) for n in os.listdir(path) if n.endswith(".parquet"))
            table = datasets.load_dataset("parquet", data_files=files, split="train")
        else:
            table = datasets.load_dataset(path, split=split)
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's path or network
        raise ConfigError(f"{setting}={path}: datasets could not load it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(table, datasets.DatasetDict):
        if split not in table:
            raise ConfigError(f"{setting}={path}: no split {split!r} (DATASET_SPLIT); it has {', '.join(table)}")
        table = table[split]
    return table


def _dataset_entries(path, roles, required, images, columns, split, setting):
    """(where, row or ValueError) per table row; images stay in the table (DatasetImage)."""
    table = load_table(path, split, setting)
    import datasets
    try:
        fields, note = match_fields(table.column_names, roles)
    except ValueError as e:
        raise ConfigError(f"{setting}={path}: columns {table.column_names}: {e}") from None
    fields.update({role: c for role, c in columns.items() if c and role in roles})
    for role in roles:
        col = fields.get(role)
        if col is not None and col not in table.column_names:
            raise ConfigError(f"{setting}={path}: no column {col!r} ({role.upper()}_COLUMN); it has "
                              f"{', '.join(table.column_names)}")
        if col is None and role in required:
            raise ConfigError(f"{setting}={path}: no {role} column among {', '.join(table.column_names)}: name it "
                              f"{' / '.join(ALIASES[role])}, or set {role.upper()}_COLUMN")
    for role in images:
        if role in fields and isinstance(table.features[fields[role]], datasets.Image):
            table = table.cast_column(fields[role], datasets.Image(decode=False))  # bytes, decoded when read
    base = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    prompts = list(table[fields["prompt"]]) if "prompt" in fields else None
    entries = []
    for i in range(len(table)):
        row = {role: DatasetImage(table, i, fields[role], base) for role in images if role in fields}
        if prompts is not None:
            if not isinstance(prompts[i], str):
                entries.append((f"{path} row {i}", ValueError(f"column {fields['prompt']!r} is not text")))
                continue
            row["prompt"] = prompts[i]
        entries.append((f"{path} row {i}", row))
    return entries, {note} - {""}


# the image checks, split over the ranks

def _check_share(rows: list[dict], images, size_of) -> list[tuple[str | None, tuple | None]]:
    """(error or None, size or None) per row, each rank checking rows rank::world and every rank
    getting all results (one all_gather of small tuples)."""
    from core.dist import all_gather_objects, rank, world_size
    me, world = rank(), world_size()
    mine = {}
    for k in range(me, len(rows), world):
        error, size = None, None
        for role in images:
            if role in rows[k]:
                try:
                    shape = check_image(rows[k][role])
                except ValueError as e:
                    error = str(e)
                    break
                size = shape if role == size_of else size
        mine[k] = (error, size)
    merged = {}
    for part in all_gather_objects(mine):
        merged.update(part)
    return [merged[k] for k in range(len(rows))]
