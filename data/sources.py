"""Data sources: a .jsonl, a .txt of prompts, a folder of images with .txt captions, or a Hugging
Face `datasets` table, detected from what the path points at; read into rows of canonical fields
and checked before any work (the image checks split over the ranks).

    python -m pytest tests/test_data.py tests/test_fault_tolerance.py -q
"""
from __future__ import annotations

import json
import os
import re

from core.dist import map_shared, print0
from core.errors import ConfigError
from data.images import check_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")  # what the folder layouts read as images
# the names users bring for each field (JSONL keys, datasets columns), the canonical one first.
# "image" alone is ambiguous for pairs: this project's Kontext pairs (assets/kontext_blue) name the input so
# (beside "target"), ai-toolkit and diffusers' examples the edited result (beside "control").
# musubi-tuner's image JSONL: "image_path" (the edited result), "control_path" or "control_path_0", "_1", ...
# (the references, in number order), "caption"
ALIASES = {"control": ("control", "context", "source", "control_path"), "target": ("target", "edited", "image_path"),
           "prompt": ("prompt", "caption", "text", "instruction"), "image": ("image",)}
NUMBERED_CONTROL = re.compile(r"control_path_(\d+)")  # musubi-tuner's numbered references


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
    if "image" in names and "target" in roles and "target" not in found and not {"control", "image"} & set(roles):
        found["target"] = "image"  # beside no reference the image is the picture itself (text-to-image rows)
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


def has_reference(names) -> bool:
    """Whether a row's keys (or a table's columns) name a reference image: a control alias, numbered ones
    (control_path_0, control_1, ...), or "image" beside a target (the shipped pairs' input)."""
    names = set(names)
    return (any(re.fullmatch(re.escape(a) + r"(_\d+)?", n) for a in ALIASES["control"] for n in names)
            or "image" in names and any(t in names for t in ALIASES["target"]))


def text_to_image_source(path: str, *, control_path="", columns: dict | None = None, split: str = "train",
                         setting: str = "DATA_PATH") -> bool:
    """Whether `path` holds text-to-image rows, an image ("image" or "target") and its prompt but no reference: a
    .jsonl none of whose rows names one, a folder without CONTROL_PATH or a control/ folder, a table without a
    control column (or CONTROL_COLUMN). A .jsonl mixing both kinds: ConfigError naming the first row of the
    rarer kind's file:line (a run trains one kind)."""
    kind = source_kind(path, setting)
    if kind == "txt":
        return False  # prompts alone: no image to train on (read_rows says so where one is needed)
    if kind == "folder":
        return not control_folders(control_path) and not os.path.isdir(os.path.join(path, "control"))
    if kind == "datasets":
        return not (columns or {}).get("control") and not has_reference(load_table(path, split, setting).column_names)
    first = {}  # text to image? -> the first line of that kind
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                raw = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                raw = None  # read_rows names it
            if isinstance(raw, dict):
                first.setdefault(not has_reference(raw), n)
    if len(first) == 2:
        line, other = max(first.values()), min(first.values())
        t2i = first[True] == line
        raise ConfigError(f"{path}:{line}: a row {'without' if t2i else 'with'} a reference image among rows "
                          f"{'with' if t2i else 'without'} one (line {other}): a run trains edits or text to image, "
                          "not both; split them into two sources")
    return first.get(True) is not None


def read_rows(path: str, roles: tuple[str, ...], required: tuple[str, ...], *, skip_bad: bool,
              setting: str = "DATA_PATH", control_path: str | list[str] = "", columns: dict | None = None,
              split: str = "train", size_of: str = "", max_references: int = 1) -> tuple[list[dict], int]:
    """Rows {role: value} of `path` (any kind source_kind knows; a .txt gives prompts only):
    images as absolute paths (JSONL: relative to the file) or DatasetImage, prompts as strings
    ("" allowed). `required` roles must be present. Every image is opened and verified once, each
    rank checking its share (rows rank::world) and the results gathered, so all ranks agree; with
    `size_of` a role, each row also gets "size" = (h, w) of that image after EXIF orientation.
    With max_references > 1 a row holds 1..max_references reference images: "controls" (their
    list, in order), "control_sizes" (their (h, w) as shown) and "control" (the first); with 1,
    "control" is one image as before. `control_path`: one folder, or a list (comma-separated) of
    folders, one per reference. A bad row -> ConfigError naming file:line (folder: the file;
    datasets: the row), or with skip_bad it is dropped and counted. Returns (rows, skipped)."""
    kind = source_kind(path, setting)
    dirs = control_folders(control_path)
    if dirs and kind != "folder":
        raise ConfigError(f"CONTROL_PATH={','.join(dirs)}: only a folder {setting} reads it; {path} is a {kind} source")
    if len(dirs) > max_references:
        raise ConfigError(f"CONTROL_PATH names {len(dirs)} folders, one per reference image; this model takes at "
                          f"most {max_references} (MAX_REFERENCES)")
    images = [r for r in roles if r in ("control", "target", "image")]
    if kind == "txt":
        if set(required) - {"prompt"}:
            raise ConfigError(f"{setting}={path}: a .txt holds prompts only; this needs {', '.join(required)}")
        entries, notes = _txt_entries(path), set()
    elif kind == "jsonl":
        entries, notes = _jsonl_entries(path, roles, required, images, max_references)
    elif kind == "folder":
        entries, notes = _folder_entries(path, dirs, roles, required, max_references), set()
    else:
        entries, notes = _dataset_entries(path, roles, required, images, columns or {}, split, setting,
                                          max_references)
    for note in sorted(notes):
        print0(f"warning: {path}: {note}")
    checked = _check_share([row for _, row in entries if isinstance(row, dict)], images, size_of)
    rows, skipped, k = [], 0, 0
    for where, row in entries:
        if isinstance(row, dict):
            error, size, reference_sizes = checked[k]
            k += 1
            row = ValueError(error) if error else row
            if size is not None:
                row["size"] = size
            if reference_sizes is not None and not error:
                row["control_sizes"] = reference_sizes
        if isinstance(row, ValueError):
            if not skip_bad:
                raise ConfigError(f"{where}: {row}")
            skipped += 1
            continue
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no usable samples ({skipped} skipped)")
    return rows, skipped


def control_folders(control_path) -> list[str]:
    """The control folders CONTROL_PATH names: "" -> [], a folder -> [it], a list or a
    comma-separated string of folders -> them in order (a folder whose own name holds a comma
    stays one)."""
    if not control_path:
        return []
    if isinstance(control_path, (list, tuple)):
        return [str(p) for p in control_path]
    if "," in control_path and not os.path.isdir(control_path):
        return [p.strip() for p in control_path.split(",") if p.strip()]
    return [control_path]


def _too_many(n, max_references) -> str:
    return f"{n} reference images; " + (f"at most MAX_REFERENCES={max_references}" if max_references > 1
                                         else "this model takes 1")


def _txt_entries(path):
    """(where, row) per non-blank line of a prompts file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [(f"{path}:{n}", {"prompt": line.strip()}) for n, line in enumerate(lines, 1) if line.strip()]


def _jsonl_entries(path, roles, required, images, max_references):
    """(where, row or ValueError) per non-blank line, and the notes of ambiguous keys."""
    base, entries, notes = os.path.dirname(os.path.abspath(path)), [], set()
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row, note = _jsonl_row(line, roles, required, images, base, max_references)
                notes.add(note)
            except ValueError as e:
                row = e
            entries.append((f"{path}:{n}", row))
    return entries, notes - {""}


def _jsonl_row(line, roles, required, images, base, max_references):
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    raw = _numbered_references(raw) if "control" in roles else raw
    fields, note = match_fields(raw, roles)
    row = {}
    for role in roles:
        value = raw.get(fields.get(role, role))
        if value is None and role not in required:
            continue
        if role == "prompt" and isinstance(value, str):  # an empty prompt is a prompt
            row[role] = value
        elif role == "control" and isinstance(value, list):
            row.update(_reference_list([os.path.join(base, v) for v in _path_list(value)], max_references))
        elif role == "control" and max_references > 1 and isinstance(value, str) and value.strip():
            row.update(_reference_list([os.path.join(base, value)], max_references))
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"missing or empty {role!r}" + _aliases_hint(role))
        else:
            row[role] = os.path.join(base, value) if role in images else value
    return row, note


def _numbered_references(raw: dict) -> dict:
    """musubi-tuner's control_path_0, control_path_1, ... keys as one "control" list, in number order
    (numbered from 0, none missing, not beside another reference key)."""
    numbered = sorted((int(m.group(1)), k) for k in raw if (m := NUMBERED_CONTROL.fullmatch(k)))
    if not numbered:
        return raw
    plain = [k for k in ALIASES["control"] if k in raw]
    if plain:
        raise ValueError(f"both {plain[0]!r} and {numbered[0][1]!r} name references: keep one kind")
    missing = [n for n in range(numbered[-1][0] + 1) if n not in dict(numbered)]
    if missing:
        raise ValueError(f"{', '.join(k for _, k in numbered)}: reference control_path_{missing[0]} is missing")
    keys = [k for _, k in numbered]
    return {**{k: v for k, v in raw.items() if k not in keys}, "control": [raw[k] for k in keys]}


def _path_list(value) -> list[str]:
    if not value:
        raise ValueError("an empty 'control' list: give one image or more")
    if not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"'control' list {value}: every entry must be an image path")
    return value


def _reference_list(references, max_references) -> dict:
    """A row's reference fields: "control" alone where one reference is taken (as a single
    control), else "control" (the first) and "controls" (all, in order)."""
    if len(references) > max_references:
        raise ValueError(_too_many(len(references), max_references))
    if max_references == 1:
        return {"control": references[0]}
    return {"control": references[0], "controls": references}


def _aliases_hint(role) -> str:
    others = ALIASES[role][1:] + (("image",) if role in ("control", "target") else ())
    return f" (or {', '.join(repr(a) for a in others)})" if others else ""


def _folder_entries(folder, dirs, roles, required, max_references):
    """A folder of images with same-stem .txt captions: a row per image (with "control": the
    same-stem image in the control folder, CONTROL_PATH or folder/control/, or the references of
    _references), or, when no image is wanted, a row per caption (with "image" when a same-stem
    image is beside it)."""
    files = _by_stem(folder)
    if "control" in roles:
        dirs = dirs or [os.path.join(folder, "control")]
        for d in dirs:
            if not os.path.isdir(d):
                raise ConfigError(f"{folder}: a folder of targets needs its control images: CONTROL_PATH, or a "
                                  f"control/ folder inside it ({d} does not exist)")
        controls = [_by_stem(d) for d in dirs]
        numbered = _numbered_stems(controls[0], set(files)) if len(dirs) == 1 and max_references > 1 else {}
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
            row = _folder_row(stem, found, pivot, roles, required)
            if "control" in roles:
                row.update(_reference_list(_references(stem, controls, dirs, numbered, max_references),
                                           max_references))
            entries.append((where, row))
        except ValueError as e:
            entries.append((where, e))
    if not entries:
        raise ConfigError(f"{folder}: no {'images' if pivot != 'prompt' else '.txt captions'} "
                          f"({'/'.join(IMAGE_EXTENSIONS)}) in it")
    return entries


def _folder_row(stem, found, pivot, roles, required):
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
    if "image" in required and "image" not in row:
        raise ValueError(f"no image {stem}.* beside the caption")
    return row


def _references(stem, controls, dirs, numbered, max_references) -> list[str]:
    """The reference images of target `stem`. Several control folders (ai-toolkit's control_path
    list): the same-stem image of each, in folder order, none missing. One folder: the same-stem
    image, or (max_references > 1) musubi-tuner's numbered {stem}_0.*, {stem}_1.*, ... in number
    order, none missing (numbering from 0 or 1, any zero padding)."""
    exts = "/".join(IMAGE_EXTENSIONS)
    if len(controls) > 1:
        for k, (found, d) in enumerate(zip(controls, dirs), 1):
            if "image" not in found.get(stem, {}):
                raise ValueError(f"no control image {stem}.* ({exts}) in {d} (reference {k} of {len(dirs)} folders)")
        return [_one_image(found[stem]) for found in controls]
    if max_references == 1:
        if "image" not in controls[0].get(stem, {}):
            raise ValueError(f"no control image {stem}.* ({exts}) in the control folder")
        return [controls[0][stem]["image"]]
    by_number = numbered.get(stem, {})
    if "image" in controls[0].get(stem, {}):
        if by_number:
            first = os.path.basename(by_number[min(by_number)][0]["image"])
            raise ValueError(f"both {os.path.basename(controls[0][stem]['image'])} and {first} in the control "
                             f"folder: number them all ({stem}_0, {stem}_1, ...) or keep one")
        return [_one_image(controls[0][stem])]
    if not by_number:
        raise ValueError(f"no control image {stem}.* or {stem}_0.*, {stem}_1.*, ... ({exts}) in the control folder")
    for n, found in sorted(by_number.items()):
        if len(found) > 1:
            raise ValueError(f"control images {', '.join(os.path.basename(e['image']) for e in found)} are all "
                             f"reference {n}; keep one")
    numbers = sorted(by_number)
    missing = [n for n in range(0 if numbers[0] == 0 else 1, numbers[-1] + 1) if n not in by_number]
    if missing:
        names = ", ".join(os.path.basename(by_number[n][0]["image"]) for n in numbers)
        raise ValueError(f"control images {names}: reference {stem}_{missing[0]}.* is missing")
    return [_one_image(by_number[n][0]) for n in numbers]


def _one_image(entry) -> str:
    """The image of a _by_stem entry; two images of one stem: ValueError."""
    if entry.get("duplicate"):
        stem = os.path.splitext(entry["duplicate"][0])[0]
        raise ValueError(f"two control images named {stem}.*: {', '.join(entry['duplicate'])}; keep one")
    return entry["image"]


def _numbered_stems(controls, targets) -> dict[str, dict[int, list[dict]]]:
    """{target stem: {number: [_by_stem entries]}} of the control folder's images named
    {stem}_{digits}; an image whose own stem is a target's (a_1.png beside target a_1) belongs to
    that target."""
    out: dict[str, dict[int, list[dict]]] = {}
    for name, entry in controls.items():
        match = re.fullmatch(r"(.+)_(\d+)", name)
        if match and name not in targets and "image" in entry:
            out.setdefault(match.group(1), {}).setdefault(int(match.group(2)), []).append(entry)
    return out


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

    def __init__(self, table, index: int, column: str, base: str, item: int | None = None):
        self.table, self.index, self.column, self.base, self.item = table, index, column, base, item

    def open(self):
        import io
        value = self.table[self.index][self.column]
        if self.item is not None:  # a list column: one of the row's images
            value = value[self.item] if isinstance(value, list) and self.item < len(value) else None
        if isinstance(value, dict) and value.get("bytes"):
            return io.BytesIO(value["bytes"])
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise ValueError(f"column {self.column!r} holds no image")
        return os.path.join(self.base, path)

    def __str__(self):
        return f"in column {self.column!r}" + (f" (item {self.item})" if self.item is not None else "")


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


def _dataset_entries(path, roles, required, images, columns, split, setting, max_references):
    """(where, row or ValueError) per table row; images stay in the table (DatasetImage)."""
    table = load_table(path, split, setting)
    import datasets
    numbered = _numbered_columns(table.column_names) if "control" in roles and max_references > 1 \
        and not columns.get("control") else []
    try:
        fields, note = match_fields(set(table.column_names) | ({"control"} if numbered else set()), roles)
    except ValueError as e:
        raise ConfigError(f"{setting}={path}: columns {table.column_names}: {e}") from None
    if numbered:
        plain = [n for n in ALIASES["control"] if n in table.column_names]
        if plain:
            raise ConfigError(f"{setting}={path}: both column {plain[0]!r} and {', '.join(numbered)} hold references: "
                              "keep one kind, or set CONTROL_COLUMN")
        fields["control"] = numbered[0]
    fields.update({role: c for role, c in columns.items() if c and role in roles})
    for role in roles:
        col = fields.get(role)
        if col is not None and col not in table.column_names:
            raise ConfigError(f"{setting}={path}: no column {col!r} ({role.upper()}_COLUMN); it has "
                              f"{', '.join(table.column_names)}")
        if col is None and role in required:
            raise ConfigError(f"{setting}={path}: no {role} column among {', '.join(table.column_names)}: name it "
                              f"{' / '.join(ALIASES[role])}, or set {role.upper()}_COLUMN")
    for col in [fields[role] for role in images if role in fields] + numbered[1:]:
        feature = table.features[col]
        if isinstance(feature, datasets.Image):
            table = table.cast_column(col, datasets.Image(decode=False))  # bytes, decoded when read
        elif isinstance(getattr(feature, "feature", None), datasets.Image):  # a list of images
            table = table.cast_column(col, type(feature)(datasets.Image(decode=False)))
    base = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    prompts = list(table[fields["prompt"]]) if "prompt" in fields else None
    counts = _reference_counts(table, fields["control"], numbered) if max_references > 1 and "control" in fields \
        else None
    entries = []
    for i in range(len(table)):
        where = f"{path} row {i}"
        row = {role: DatasetImage(table, i, fields[role], base) for role in images if role in fields}
        if prompts is not None:
            if not isinstance(prompts[i], str):
                entries.append((where, ValueError(f"column {fields['prompt']!r} is not text")))
                continue
            row["prompt"] = prompts[i]
        if counts is not None:
            try:
                row.update(_reference_list(_dataset_references(table, i, fields["control"], numbered, base,
                                                               counts[i]), max_references))
            except ValueError as e:
                entries.append((where, e))
                continue
        entries.append((where, row))
    return entries, {note} - {""}


def _numbered_columns(names) -> list[str]:
    """control_0 / control_1 / ... columns in number order (or the first alias's that has any:
    context_1, ...)."""
    for alias in ALIASES["control"]:
        found = sorted((int(m.group(1)), n) for n in names if (m := re.fullmatch(re.escape(alias) + r"_(\d+)", n)))
        if found:
            return [n for _, n in found]
    return []


def _reference_counts(table, column, numbered) -> list:
    """Per row: a list column's length (None where null), or with numbered columns the null mask of
    each (read from the Arrow table: no image is decoded or copied)."""
    import pyarrow.compute as pc
    arrow = table.with_format("arrow")
    if numbered:
        nulls = [pc.is_null(arrow[c]).to_pylist() for c in numbered]
        return [tuple(m[i] for m in nulls) for i in range(len(table))]
    if not _is_list(table.features[column]):
        return [1] * len(table)  # one image per row in a plain column
    return pc.list_value_length(arrow[column]).to_pylist()


def _is_list(feature) -> bool:
    return isinstance(feature, list) or type(feature).__name__ in ("List", "LargeList", "Sequence")


def _dataset_references(table, i, column, numbered, base, count) -> list:
    """Row i's reference images: the items of a list column, or the filled numbered columns (empty
    ones only at the end)."""
    if numbered:
        filled = [not null for null in count]
        if not any(filled):
            raise ValueError(f"no reference image in {', '.join(numbered)}")
        n = filled.index(False) if False in filled else len(filled)
        if any(filled[n:]):
            raise ValueError(f"column {numbered[n]!r} is empty but {numbered[filled.index(True, n)]!r} is not: "
                             "fill the reference columns in order")
        return [DatasetImage(table, i, c, base) for c in numbered[:n]]
    if count is None or count == 0:
        raise ValueError(f"column {column!r} holds no reference image")
    if not _is_list(table.features[column]):
        return [DatasetImage(table, i, column, base)]
    return [DatasetImage(table, i, column, base, item) for item in range(count)]


# the image checks, split over the ranks

def _check_share(rows: list[dict], images, size_of) -> list[tuple[str | None, tuple | None, list | None]]:
    """(error or None, size or None, the references' sizes or None) per row, each rank checking rows
    rank::world and every rank getting all results (core.dist.map_shared)."""
    def check(row):
        error, size, reference_sizes = None, None, None
        try:
            for role in images:
                if role == "control" and "controls" in row:
                    reference_sizes = [check_image(source) for source in row["controls"]]
                    size = reference_sizes[0] if role == size_of else size
                elif role in row:
                    shape = check_image(row[role])
                    size = shape if role == size_of else size
        except ValueError as e:
            error = str(e)
        return error, size, reference_sizes
    return map_shared(check, rows)
