"""data/: data order as a function of (SEED, step), the same at any world size.
Record loading, images and grids are exercised through the scripts' tests.

    python -m pytest tests/test_data.py -q
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
import torch
from PIL import Image

from core.errors import ConfigError
from data.batches import global_batch_indices, rank_micro_batches, rank_slice
from data.images import check_image, exif_orientation, image_size, load_image
from data.prefetch import Prefetcher
from data.randomness import drop_captions, per_sample_draws
from data.sources import read_rows


def test_global_batch_indices_cover_epochs():
    seen = [i for s in range(5) for i in global_batch_indices(s, 4, 10, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert global_batch_indices(3, 4, 10, 3) == seen[12:16]


def test_rank_slices_partition_the_batch():
    batch = list(range(8))
    assert [x for r in range(4) for x in rank_slice(batch, r, 4)] == batch


def test_rank_micro_batches_lay_the_global_batch_out_by_micro_batch_then_rank():
    """Micro-batch m of every rank, ranks in order, then m + 1: the global batch of the step, each
    position paired with its dataset index."""
    step, n, batch, accum, world = 3, 10, 2, 3, 2
    whole = global_batch_indices(step, batch * world * accum, n, seed=5)
    shares = [rank_micro_batches(step, n, batch, accum, r, world, seed=5) for r in range(world)]
    laid = [(p, i) for m in range(accum) for r in range(world) for p, i in zip(*shares[r][m])]
    assert laid == list(enumerate(whole))


def test_per_sample_draws_do_not_depend_on_who_draws_them():
    """Each sample's numbers come from (seed, step, its global index): the whole batch drawn at once
    equals any split of it over ranks or micro-batches; other steps, samples and streams differ."""
    import torch

    def draw(g):
        return {"noise": torch.randn(3, 4, generator=g, device=g.device),
                "t": torch.randint(0, 1000, (), generator=g, device=g.device)}
    cpu = torch.device("cpu")
    whole = per_sample_draws(5, 7, range(8), cpu, draw)
    for world in (2, 4):
        parts = [per_sample_draws(5, 7, rank_slice(range(8), r, world), cpu, draw)
                 for r in range(world)]
        assert all(torch.equal(torch.cat([p[k] for p in parts]), whole[k]) for k in whole)
    assert whole["noise"].shape == (8, 3, 4) and whole["t"].shape == (8,)
    assert not torch.equal(whole["noise"][0], whole["noise"][1])  # samples differ
    assert not torch.equal(per_sample_draws(5, 8, range(8), cpu, draw)["noise"], whole["noise"])
    assert not torch.equal(per_sample_draws(5, 7, range(8), cpu, draw, stream=1)["noise"], whole["noise"])


def test_prefetcher_loads_the_next_step_while_this_one_runs():
    import threading
    import time

    import pytest
    import torch
    started, release = [], threading.Event()

    def load(step):
        started.append(step)
        if step == 3:
            release.wait(5)
        if step == 4:
            raise ValueError("bad row in step 4")
        return {"x": torch.full((2,), float(step)), "names": [f"s{step}"]}
    with Prefetcher(load, last_step=4, device=torch.device("cpu")) as prefetch:
        data, waited = prefetch.get(1)
        assert torch.equal(data["x"], torch.tensor([1.0, 1.0])) and data["names"] == ["s1"] and waited >= 0
        deadline = time.monotonic() + 5
        while started != [1, 2] and time.monotonic() < deadline:  # step 2 loads before anyone asks for it
            time.sleep(0.01)
        assert started == [1, 2]
        assert prefetch.get(2)[0]["names"] == ["s2"]  # ... and starts step 3, which blocks until released
        threading.Timer(0.3, release.set).start()
        data, waited = prefetch.get(3)
        assert data["names"] == ["s3"] and waited > 0.1  # the wait for step 3's data is measured
        with pytest.raises(ValueError, match="bad row in step 4"):  # a loader error surfaces at its step
            prefetch.get(4)
    assert started == [1, 2, 3, 4]  # nothing past last_step


# ----------------------------------------------------------------------------------------------
# data sources: JSONL aliases, folder layouts, datasets tables, EXIF, split checks,
# caption dropout; every bad input a one-line ConfigError naming the file (and line / row)


PAIR = ("control", "target", "prompt")


def _img(path, size=(32, 16), colour=(200, 30, 30), exif_orientation=None):
    """A tiny image file (w x h = size); with exif_orientation, that EXIF tag (JPEG/PNG/WEBP)."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    im = Image.new("RGB", size, colour)
    im.putpixel((0, 0), (0, 255, 0))  # a marked corner: rotation shows
    kwargs = {}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    im.save(str(path), **kwargs)
    return str(path)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_canonical_names_and_aliases(tmp_path, capsys):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png", colour=(0, 0, 200))
    canonical = _jsonl(tmp_path / "c.jsonl", [{"control": "a.png", "target": "b.png", "prompt": "p"}])
    aliases = _jsonl(tmp_path / "x.jsonl", [{"context": "a.png", "edited": "b.png", "instruction": "p"},
                                            {"source": "a.png", "target": "b.png", "caption": ""}])
    rows, _ = read_rows(canonical, PAIR, PAIR, skip_bad=False, size_of="target")
    assert rows == [{"control": str(tmp_path / "a.png"), "target": str(tmp_path / "b.png"), "prompt": "p",
                     "size": (16, 32)}]
    rows, _ = read_rows(aliases, PAIR, PAIR, skip_bad=False)
    assert [r["control"] for r in rows] == [str(tmp_path / "a.png")] * 2 and rows[1]["prompt"] == ""  # empty: allowed
    assert "warning" not in capsys.readouterr().out


def test_jsonl_image_key_is_read_by_its_neighbour_with_one_warning(tmp_path, capsys):
    """"image" beside "target" can only be the input (the shipped pairs, older files): read so,
    silently; beside "control" it is the edited result (ai-toolkit, diffusers): read so, with one
    warning per file."""
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png")
    legacy = _jsonl(tmp_path / "old.jsonl", [{"image": "a.png", "target": "b.png", "prompt": "p"}] * 3)
    rows, _ = read_rows(legacy, PAIR, PAIR, skip_bad=False)
    assert rows[0]["control"] == str(tmp_path / "a.png") and rows[0]["target"] == str(tmp_path / "b.png")
    assert "warning" not in capsys.readouterr().out
    toolkit = _jsonl(tmp_path / "tk.jsonl", [{"control": "a.png", "image": "b.png", "prompt": "p"}] * 3)
    rows, _ = read_rows(toolkit, PAIR, PAIR, skip_bad=False)
    assert rows[0]["control"] == str(tmp_path / "a.png") and rows[0]["target"] == str(tmp_path / "b.png")
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "read as the edited result" in warned[0] and "tk.jsonl" in warned[0]


@pytest.mark.parametrize("row,message", [
    ({"image": "a.png", "control": "a.png", "target": "a.png", "prompt": "p"}, "'image' beside 'control' and 'target'"),
    ({"control": "a.png", "context": "a.png", "target": "a.png", "prompt": "p"}, "both 'control' and 'context'"),
    ({"control": "a.png", "target": "a.png"}, "missing or empty 'prompt'"),
    ({"control": "a.png", "prompt": "p"}, "missing or empty 'target'"),
    ({"control": "gone.png", "target": "a.png", "prompt": "p"}, "image .*gone.png not found")])
def test_jsonl_bad_rows_are_named_by_file_and_line(tmp_path, row, message):
    _img(tmp_path / "a.png")
    path = _jsonl(tmp_path / "d.jsonl", [{"control": "a.png", "target": "a.png", "prompt": "p"}, row])
    with pytest.raises(ConfigError, match=re.escape(path) + ":2: " + message):
        read_rows(path, PAIR, PAIR, skip_bad=False)
    assert len(read_rows(path, PAIR, PAIR, skip_bad=True)[0]) == 1


def _toolkit_folder(root, n=3, control_ext=".png"):
    """ai-toolkit's layout: targets with same-stem .txt captions, controls of the same names apart."""
    for i in range(n):
        _img(root / "targets" / f"{i:03d}.png", colour=(0, 0, 200))
        (root / "targets" / f"{i:03d}.txt").write_text(f"make it blue {i}\n")
        _img(root / "controls" / f"{i:03d}{control_ext}", colour=(200, 0, 0))
    return root / "targets", root / "controls"


def test_folder_layout_with_control_path_or_a_control_subfolder(tmp_path):
    targets, controls = _toolkit_folder(tmp_path)
    rows, _ = read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    assert [r["prompt"] for r in rows] == ["make it blue 0", "make it blue 1", "make it blue 2"]
    assert rows[1]["target"] == str(targets / "001.png") and rows[1]["control"] == str(controls / "001.png")
    # musubi-style: the controls in DATA_PATH/control/, matched by stem whatever the extension
    folder = tmp_path / "musubi"
    for i, ext in enumerate((".jpg", ".jpeg", ".webp")):
        _img(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text("")  # an empty caption is allowed
        _img(folder / "control" / f"{i}{ext}")
    rows, _ = read_rows(str(folder), PAIR, PAIR, skip_bad=False)
    assert [os.path.basename(r["control"]) for r in rows] == ["0.jpg", "1.jpeg", "2.webp"]
    assert all(r["prompt"] == "" for r in rows)


def test_folder_layout_bad_inputs_name_the_file(tmp_path):
    targets, controls = _toolkit_folder(tmp_path)
    os.remove(controls / "001.png")
    with pytest.raises(ConfigError, match=re.escape(str(targets / "001.png")) + ": no control image 001"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    rows, skipped = read_rows(str(targets), PAIR, PAIR, skip_bad=True, control_path=str(controls))
    assert len(rows) == 2 and skipped == 1
    _img(controls / "001.png")
    os.remove(targets / "002.txt")
    with pytest.raises(ConfigError, match=re.escape(str(targets / "002.png")) + ": no caption file 002.txt"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    _img(targets / "000.jpg")
    with pytest.raises(ConfigError, match=re.escape(str(targets / "000.png")) + ": two images named 000"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    with pytest.raises(ConfigError, match="needs its control images: CONTROL_PATH, or a control/ folder"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False)
    (controls / "003.png").write_bytes(b"not an image")
    _img(targets / "003.png")
    (targets / "003.txt").write_text("x")
    with pytest.raises(ConfigError, match="two images named 000"):  # the first bad file, in name order
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    os.remove(targets / "000.jpg")
    (targets / "002.txt").write_text("y")
    with pytest.raises(ConfigError, match=re.escape(str(targets / "003.png")) + r": image .*003.png is unreadable"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    with pytest.raises(ConfigError, match="CONTROL_PATH=.*only a folder DATA_PATH reads it"):
        read_rows(_jsonl(tmp_path / "d.jsonl", [{}]), PAIR, PAIR, skip_bad=False, control_path=str(controls))
    with pytest.raises(ConfigError, match="no such file or folder"):
        read_rows(str(tmp_path / "nope"), PAIR, PAIR, skip_bad=False)
    with pytest.raises(ConfigError, match="a .txt holds prompts only"):
        read_rows(str(targets / "003.txt"), PAIR, PAIR, skip_bad=False)


def _saved_dataset(path, n=4, names=("control", "image", "prompt")):
    """A datasets table saved with save_to_disk, with Image columns (diffusers/ai-toolkit naming:
    "image" is the edited result beside "control")."""
    datasets = pytest.importorskip("datasets")
    cols = {names[0]: [_img(path.parent / "src" / f"c{i}.png", colour=(i * 40, 0, 0)) for i in range(n)],
            names[1]: [_img(path.parent / "src" / f"t{i}.png", size=(16, 32)) for i in range(n)],
            names[2]: [f"edit {i}" for i in range(n)]}
    features = datasets.Features(
        {names[0]: datasets.Image(), names[1]: datasets.Image(), names[2]: datasets.Value("string")}
    )
    datasets.Dataset.from_dict(cols, features=features).save_to_disk(str(path))
    return cols


def test_datasets_folder_and_parquet_read_as_pairs(tmp_path):
    cols = _saved_dataset(tmp_path / "ds")
    rows, _ = read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False, size_of="target")
    assert [r["prompt"] for r in rows] == ["edit 0", "edit 1", "edit 2", "edit 3"]
    assert rows[2]["size"] == (32, 16)  # the target's (h, w), read from the stored bytes
    expected = load_image(cols["control"][2], 8, 8)
    assert torch.equal(load_image(rows[2]["control"], 8, 8), expected)  # images stay in the table
    import datasets
    datasets.load_from_disk(str(tmp_path / "ds")).to_parquet(str(tmp_path / "pairs.parquet"))
    rows_pq, _ = read_rows(str(tmp_path / "pairs.parquet"), PAIR, PAIR, skip_bad=False)
    assert torch.equal(load_image(rows_pq[2]["control"], 8, 8), expected)


def test_text_to_image_sources_read_their_image_as_the_target_and_a_mixed_jsonl_is_refused(tmp_path):
    """No reference anywhere (a .jsonl of "image" or "target" with "prompt", a caption folder without control/, a
    table of image and prompt columns): text-to-image rows, "image" read as the target. A .jsonl mixing rows with
    and without references: one line naming the first row of the later kind."""
    from data.sources import text_to_image_source
    _img(tmp_path / "a.png")
    t2i = _jsonl(tmp_path / "t.jsonl", [{"image": "a.png", "prompt": "p"}, {"target": "a.png", "caption": "q"}])
    assert text_to_image_source(t2i) and not text_to_image_source(_jsonl(tmp_path / "e.jsonl", [
        {"image": "a.png", "target": "a.png", "prompt": "p"}, {"control_path_0": "a.png", "image_path": "a.png"}]))
    rows, _ = read_rows(t2i, ("target", "prompt"), ("target", "prompt"), skip_bad=False, size_of="target")
    assert rows == [{"target": str(tmp_path / "a.png"), "prompt": p, "size": (16, 32)} for p in "pq"]
    mixed = _jsonl(tmp_path / "m.jsonl", [{"target": "a.png", "prompt": "p"}, {"control": "a.png", "target": "a.png",
                                                                                "prompt": "p"}, "{not json"])
    with pytest.raises(ConfigError, match=re.escape(mixed) + ":2: a row with a reference image among rows without"):
        text_to_image_source(mixed)
    _img(tmp_path / "f" / "0.png")
    (tmp_path / "f" / "0.txt").write_text("a cat")
    assert text_to_image_source(str(tmp_path / "f"))
    assert not text_to_image_source(str(tmp_path / "f"), control_path=str(tmp_path))
    _saved_dataset(tmp_path / "ds", names=("image", "other", "prompt"))
    assert text_to_image_source(str(tmp_path / "ds")) and not text_to_image_source(str(tmp_path / "ds"),
                                                                                   columns={"control": "image"})
    rows, _ = read_rows(str(tmp_path / "ds"), ("target", "prompt"), ("target", "prompt"), skip_bad=False)
    assert [load_image(r["target"], 8, 8).shape for r in rows] == [(3, 8, 8)] * 4


def test_datasets_column_settings_and_errors(tmp_path, monkeypatch):
    _saved_dataset(tmp_path / "ds", names=("before", "after", "edit_text"))
    with pytest.raises(ConfigError, match="no control column among after, before, edit_text|no control column"):
        read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False)
    columns = {"control": "before", "target": "after", "prompt": "edit_text"}
    rows, _ = read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False, columns=columns)
    assert rows[3]["prompt"] == "edit 3"
    with pytest.raises(ConfigError, match="no column 'nope' \\(CONTROL_COLUMN\\)"):
        read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False, columns={**columns, "control": "nope"})
    with pytest.raises(ConfigError, match="no split 'test'"):
        from datasets import DatasetDict, load_from_disk
        DatasetDict({"train": load_from_disk(str(tmp_path / "ds"))}).save_to_disk(str(tmp_path / "dd"))
        read_rows(str(tmp_path / "dd"), PAIR, PAIR, skip_bad=False, columns=columns, split="test")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: one line, before any work
    with pytest.raises(ConfigError, match=r"needs the datasets package \(pip install datasets\)$"):
        read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False)


def test_datasets_bad_image_is_named_by_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    good = open(_img(tmp_path / "a.png"), "rb").read()
    table = {"control": [{"bytes": good, "path": None}] * 3, "target": [{"bytes": good, "path": None},
             {"bytes": b"broken", "path": None}, {"bytes": good, "path": None}], "prompt": ["a", "b", "c"]}
    feats = datasets.Features(
        {"control": datasets.Image(), "target": datasets.Image(), "prompt": datasets.Value("string")}
    )
    datasets.Dataset.from_dict(table, features=feats).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(
        ConfigError, match=re.escape(str(tmp_path / "ds")) + " row 1: image in column 'target' is unreadable"
    ):
        read_rows(str(tmp_path / "ds"), PAIR, PAIR, skip_bad=False)


@pytest.mark.parametrize("ext", ["jpg", "png", "webp"])
def test_exif_orientation_is_applied_when_loading_and_bucketing(tmp_path, ext):
    """A phone photo stored 32 x 16 (w x h) with orientation 6 (turn 90° clockwise) shows 16 x 32."""
    stored = _img(tmp_path / f"stored.{ext}", size=(32, 16))
    rotated = _img(tmp_path / f"rotated.{ext}", size=(32, 16), exif_orientation=6)
    assert image_size(rotated) == (32, 16) and image_size(stored) == (16, 32)
    assert check_image(rotated) == (32, 16)
    upright = Image.open(stored).convert("RGB").transpose(Image.Transpose.ROTATE_270)
    expected = torch.from_numpy(__import__("numpy").asarray(upright).copy()).permute(2, 0, 1).float() / 127.5 - 1
    torch.testing.assert_close(load_image(rotated, 32, 16), expected)
    from data import buckets as db
    buckets = db.make_buckets(32, [0.5, 1.0, 2.0], 16)
    assert [buckets[b] for b in db.assign_buckets([{"target": rotated}, {"target": stored}], buckets)] == \
        [(48, 16), (16, 48)]  # tall vs wide


def test_a_plain_png_is_not_decoded_to_read_its_orientation(tmp_path):
    with Image.open(_img(tmp_path / "a.png")) as im:
        assert exif_orientation(im) == 1 and im._im is None  # header only


# ----------------------------------------------------------------------------------------------
# multi-reference rows (Qwen-Image-Edit-2509/2511): lists in JSONL, musubi-tuner's numbered
# controls, ai-toolkit's control folder per reference, datasets list / numbered columns


def test_jsonl_control_lists(tmp_path):
    """One reference stays the single-control row of today (a one-element list reads the same);
    with max_references > 1 every row holds "controls" (in order), their sizes and "control"
    (the first); an empty list, too many references or a missing one stops at file:line."""
    a, b, c = (_img(tmp_path / f"{n}.png", size=(16 * (i + 1), 16)) for i, n in enumerate("abc"))
    one = _jsonl(tmp_path / "one.jsonl", [{"control": "a.png", "target": "b.png", "prompt": "p"},
                                          {"control": ["a.png"], "target": "b.png", "prompt": "p"}])
    rows, _ = read_rows(one, PAIR, PAIR, skip_bad=False, size_of="target")
    assert rows[0] == rows[1] == {"control": a, "target": b, "prompt": "p", "size": (16, 32)}
    with pytest.raises(ConfigError, match=re.escape(one) + ":1: 2 reference images; this model takes 1$"):
        read_rows(_jsonl(tmp_path / "one.jsonl", [{"control": ["a.png", "c.png"], "target": "b.png", "prompt": "p"}]),
                  PAIR, PAIR, skip_bad=False)
    multi = _jsonl(tmp_path / "multi.jsonl", [{"control": ["c.png", "a.png"], "target": "b.png", "prompt": "p"},
                                              {"control": "a.png", "target": "b.png", "prompt": "q"}])
    rows, _ = read_rows(multi, PAIR, PAIR, skip_bad=False, size_of="target", max_references=3)
    assert rows[0] == {"control": c, "controls": [c, a], "control_sizes": [(16, 48), (16, 16)], "target": b,
                       "prompt": "p", "size": (16, 32)}
    assert rows[1]["controls"] == [a] and rows[1]["control_sizes"] == [(16, 16)]
    good = {"control": ["a.png"], "target": "b.png", "prompt": "p"}
    for bad, message in [({**good, "control": []}, "an empty 'control' list: give one image or more"),
                         ({**good, "control": ["a.png", 3]}, r"'control' list \['a.png', 3\]: every entry must be"),
                         ({**good, "control": ["a.png"] * 4}, "4 reference images; at most MAX_REFERENCES=3$"),
                         ({**good, "control": ["a.png", "gone.png"]}, "image .*gone.png not found$")]:
        path = _jsonl(tmp_path / "bad.jsonl", [good, bad])
        with pytest.raises(ConfigError, match=re.escape(path) + ":2: " + message):
            read_rows(path, PAIR, PAIR, skip_bad=False, max_references=3)
        assert read_rows(path, PAIR, PAIR, skip_bad=True, max_references=3)[1] == 1  # skipped and counted


def _musubi_folder(root, controls):
    """Targets 000..00n with captions, and the control folder's files (name -> size)."""
    for i in range(3):
        _img(root / f"{i:03d}.png")
        (root / f"{i:03d}.txt").write_text(f"edit {i}")
    for name, size in controls.items():
        _img(root / "control" / name, size=size)
    return root


def test_musubi_numbered_control_folder(tmp_path):
    """musubi-tuner's control_directory: {stem}_0.*, {stem}_1.*, ... (any zero padding, from 0 or
    1) in number order, or a plain {stem}.*; a control whose stem is another target's is that
    target's."""
    folder = _musubi_folder(tmp_path / "m", {"000_1.png": (16, 32), "000_0.jpg": (32, 16), "001_0001.png": (16, 16),
                                             "001_0002.webp": (16, 16), "002.png": (48, 16)})
    _img(folder / "002_0.png")  # a target named like a reference of 002: its control is its own
    (folder / "002_0.txt").write_text("own")
    _img(folder / "control" / "002_0.png")
    rows, _ = read_rows(str(folder), PAIR, PAIR, skip_bad=False, max_references=3)
    control = str(folder / "control")
    assert [[os.path.relpath(c, control) for c in r["controls"]] for r in rows] == \
        [["000_0.jpg", "000_1.png"], ["001_0001.png", "001_0002.webp"], ["002.png"], ["002_0.png"]]
    assert rows[0]["control_sizes"] == [(16, 32), (32, 16)] and rows[0]["control"] == os.path.join(control, "000_0.jpg")
    assert [r["prompt"] for r in rows] == ["edit 0", "edit 1", "edit 2", "own"]


@pytest.mark.parametrize("controls,message", [
    ({"000_0.png": (16, 16), "000_2.png": (16, 16)}, "control images 000_0.png, 000_2.png: reference 000_1.* is "
                                                     "missing"),
    ({"000.png": (16, 16), "000_0.png": (16, 16)}, "both 000.png and 000_0.png in the control folder: number them"),
    ({"000_0.png": (16, 16), "000_00.png": (16, 16)}, "control images 000_0.png, 000_00.png are all reference 0"),
    ({"000_0.png": (16, 16), "000_0.jpg": (16, 16)}, "two control images named 000_0.*: 000_0.jpg, 000_0.png"),
    ({f"000_{n}.png": (16, 16) for n in range(4)}, "4 reference images; at most MAX_REFERENCES=3$"),
    ({"001_0.png": (16, 16)}, r"no control image 000.\* or 000_0.\*, 000_1.\*, ... "),
])
def test_musubi_numbered_control_folder_bad_rows(tmp_path, controls, message):
    """A reference missing, ambiguous or too many: one line naming the target, or skipped and counted."""
    folder = _musubi_folder(tmp_path / "m", {**controls, "001_0.png": (16, 16), "002_0.png": (16, 16)})
    with pytest.raises(ConfigError, match=re.escape(str(folder / "000.png")) + ": " + message):
        read_rows(str(folder), PAIR, PAIR, skip_bad=False, max_references=3)
    rows, skipped = read_rows(str(folder), PAIR, PAIR, skip_bad=True, max_references=3)
    assert [os.path.basename(r["target"]) for r in rows] == ["001.png", "002.png"] and skipped == 1


def test_musubi_jsonl_keys(tmp_path):
    """musubi-tuner's image JSONL: "image_path" the edited result, "control_path" or control_path_0, _1, ... the
    references in number order (relative paths from the file's folder), "caption" the prompt; a reference
    number missing, or both kinds of key, stop in one line naming file:line."""
    for name in ("t.png", "a.png", "b.png"):
        _img(tmp_path / name)
    lines = [{"image_path": "t.png", "control_path_1": "b.png", "control_path_0": "a.png", "caption": "swap"},
             {"image_path": "t.png", "control_path": "a.png", "caption": "one"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows, _ = read_rows(str(tmp_path / "m.jsonl"), PAIR, PAIR, skip_bad=False, max_references=3)
    a, b, t = (str(tmp_path / n) for n in ("a.png", "b.png", "t.png"))
    assert [r["controls"] for r in rows] == [[a, b], [a]]
    assert [(r["target"], r["prompt"]) for r in rows] == [(t, "swap"), (t, "one")]
    one, _ = read_rows(str(tmp_path / "m.jsonl"), PAIR, PAIR, skip_bad=True, max_references=1)
    assert [r["control"] for r in one] == [a]  # Kontext: the two-reference row is too many
    for bad, message in (({"control_path_0": "a.png", "control_path_2": "b.png"},
                          "control_path_0, control_path_2: reference control_path_1 is missing"),
                         ({"control_path": "a.png", "control_path_0": "b.png"},
                          "both 'control_path' and 'control_path_0' name references")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"image_path": "t.png", "caption": "x", **bad}) + "\n")
        with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'bad.jsonl'}:1: {message}")):
            read_rows(str(tmp_path / "bad.jsonl"), PAIR, PAIR, skip_bad=False, max_references=3)


def test_numbered_controls_are_not_read_for_a_single_reference_model(tmp_path):
    """FLUX Kontext (one reference) reads the control folder as before: {stem}.* only."""
    folder = _musubi_folder(tmp_path / "m", {"000_0.png": (16, 16), "001.png": (16, 16), "002.png": (16, 16)})
    with pytest.raises(ConfigError, match=re.escape(str(folder / "000.png")) + r": no control image 000.\* "):
        read_rows(str(folder), PAIR, PAIR, skip_bad=False)


def test_toolkit_control_folder_per_reference(tmp_path):
    """ai-toolkit's control_path list: one folder per reference, the target's stem in each; a
    missing one names the target and the folder; more folders than references: one line before
    any work."""
    targets, first = _toolkit_folder(tmp_path)
    second = tmp_path / "second"
    for i in range(3):
        _img(second / f"{i:03d}.webp", size=(16, 48))
    for control_path in ([str(first), str(second)], f"{first},{second}"):
        rows, _ = read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=control_path, max_references=3)
        assert rows[2]["controls"] == [str(first / "002.png"), str(second / "002.webp")]
        assert rows[2]["control_sizes"] == [(16, 32), (48, 16)] and rows[2]["prompt"] == "make it blue 2"
    os.remove(second / "001.webp")
    with pytest.raises(ConfigError, match=re.escape(str(targets / "001.png")) + ": no control image 001.* "
                       r"\(\.jpg.*\) in " + re.escape(str(second)) + r" \(reference 2 of 2 folders\)$"):
        read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=[first, second], max_references=3)
    rows, skipped = read_rows(str(targets), PAIR, PAIR, skip_bad=True, control_path=[first, second], max_references=3)
    assert len(rows) == 2 and skipped == 1
    for max_references, limit in ((2, "at most 2"), (1, "at most 1")):
        with pytest.raises(ConfigError, match=f"CONTROL_PATH names 3 folders, one per reference image; this model "
                                              f"takes {limit} \\(MAX_REFERENCES\\)$"):
            read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=[first, second, first],
                      max_references=max_references)
    comma = tmp_path / "a,b"  # a folder whose name holds a comma stays one folder
    shutil.copytree(first, comma)
    rows, _ = read_rows(str(targets), PAIR, PAIR, skip_bad=False, control_path=str(comma))
    assert rows[0]["control"] == str(comma / "000.png")


def test_datasets_reference_list_and_numbered_columns(tmp_path):
    """A list-of-images column, or control_1 / control_2 columns (empty ones only at the end)."""
    datasets = pytest.importorskip("datasets")
    paths = [_img(tmp_path / "src" / f"r{i}.png", size=(16, 16 * (i + 1)), colour=(i * 60, 0, 0)) for i in range(3)]
    target = _img(tmp_path / "src" / "t.png")
    as_image = [{"bytes": open(p, "rb").read(), "path": None} for p in paths]
    feats = {"target": datasets.Image(), "prompt": datasets.Value("string")}
    table = {"target": [target] * 3, "prompt": ["a", "b", "c"]}
    datasets.Dataset.from_dict({**table, "control": [as_image[:2], as_image[2:], as_image]}, features=datasets.Features(
        {**feats, "control": datasets.List(datasets.Image())})).save_to_disk(str(tmp_path / "list"))
    rows, _ = read_rows(str(tmp_path / "list"), PAIR, PAIR, skip_bad=False, max_references=3)
    assert [len(r["controls"]) for r in rows] == [2, 1, 3] and rows[0]["control_sizes"] == [(16, 16), (32, 16)]
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "list")) + " row 2: 3 reference images; at most "
                                          "MAX_REFERENCES=2$"):
        read_rows(str(tmp_path / "list"), PAIR, PAIR, skip_bad=False, max_references=2)
    assert torch.equal(load_image(rows[0]["controls"][1], 8, 8), load_image(paths[1], 8, 8))
    assert torch.equal(load_image(rows[1]["control"], 8, 8), load_image(paths[2], 8, 8))
    columns = {"control_1": [paths[0], paths[0], None], "control_2": [paths[1], None, paths[1]]}
    features = datasets.Features({**feats, "control_1": datasets.Image(), "control_2": datasets.Image()})
    datasets.Dataset.from_dict({"target": [target] * 3, "prompt": ["a", "b", "c"], **columns},
                               features=features).save_to_disk(str(tmp_path / "num"))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "num")) + " row 2: column 'control_1' is empty "
                                          "but 'control_2' is not: fill the reference columns in order$"):
        read_rows(str(tmp_path / "num"), PAIR, PAIR, skip_bad=False, max_references=3)
    rows, skipped = read_rows(str(tmp_path / "num"), PAIR, PAIR, skip_bad=True, max_references=3)
    assert [len(r["controls"]) for r in rows] == [2, 1] and skipped == 1
    assert torch.equal(load_image(rows[0]["controls"][1], 8, 8), load_image(paths[1], 8, 8))


def test_single_control_rows_are_unchanged_by_max_references_1(tmp_path):
    """Where a model takes one reference (the default), rows hold "control" alone, whatever the
    source: no "controls", no "control_sizes"."""
    targets, controls = _toolkit_folder(tmp_path)
    jsonl = _jsonl(tmp_path / "d.jsonl", [{"control": "controls/000.png", "target": "targets/000.png", "prompt": "p"}])
    for path, kwargs in ((jsonl, {}), (str(targets), {"control_path": str(controls)})):
        rows, _ = read_rows(path, PAIR, PAIR, skip_bad=False, size_of="target", **kwargs)
        assert set(rows[0]) == {"control", "target", "prompt", "size"}
        assert rows[0]["control"] == str(controls / "000.png")


# ----------------------------------------------------------------------------------------------
# references: the pipeline's size rule, no shift against the target, batch keys


def _calculate_dimensions():
    """diffusers' calculate_dimensions, read from the installed pipeline's source (importing the
    pipeline would import transformers' Qwen2.5-VL)."""
    import ast
    import importlib.util
    import math
    spec = importlib.util.find_spec("diffusers")
    if spec is None:
        pytest.skip("diffusers not installed")
    path = os.path.join(spec.submodule_search_locations[0], "pipelines", "qwenimage", "pipeline_qwenimage_edit_plus.py")
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "calculate_dimensions")
    scope = {"math": math}
    exec(compile(ast.Module([node], []), path, "exec"), scope)
    return scope["calculate_dimensions"]


def test_reference_size_is_the_pipelines_rule():
    from data.references import PIPELINE_MULTIPLE, VAE_REFERENCE_AREA, VL_REFERENCE_AREA, reference_size
    calculate = _calculate_dimensions()
    for h, w in [(1024, 1024), (720, 1280), (1280, 720), (333, 517), (4000, 3000), (100, 1500), (1, 1)]:
        for area in (VAE_REFERENCE_AREA, VL_REFERENCE_AREA):
            cw, ch = calculate(area, w / h)
            assert reference_size(h, w, area, PIPELINE_MULTIPLE) == (ch, cw), (h, w, area)
    assert reference_size(720, 1280, 1024 * 1024) == (768, 1376)  # by hand: w = sqrt(2^20 * 16/9) = 1365.3 -> 43 x 32
    assert reference_size(170, 300, 128 * 128, 16) == (96, 176)  # the latents' multiple (VAE factor 8 x 2)
    assert reference_size(10, 10000, 64 * 64, 16) == (16, 2016)  # h never below one multiple; w = 2023.9 -> 126 x 16


def pixels(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images back to their uint8 values (either scaling: x / 127.5 - 1 or 2 (x / 255) - 1)."""
    return ((x + 1) * 127.5).round().to(torch.uint8)


def test_images_load_as_the_editing_pipelines_read_them(tmp_path):
    """stretch: resized to exactly the size, as FluxKontextPipeline and QwenImageEditPlusPipeline read an
    image for the VAE (diffusers' VaeImageProcessor.preprocess of the PIL image): the same pixels, for a 2:1
    and a 1:2 image; mirrored first, the pixels of the mirror image."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import ImageOps
    g = np.random.default_rng(0)
    processor = VaeImageProcessor(vae_scale_factor=16)
    for (h, w), (th, tw) in (((170, 300), (96, 176)), ((300, 150), (176, 96))):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / "a.png")
        shown = Image.open(tmp_path / "a.png").convert("RGB")
        ours = load_image(str(tmp_path / "a.png"), th, tw, stretch=True)
        assert torch.equal(pixels(ours), pixels(processor.preprocess(shown, th, tw)[0]))
        mirrored = load_image(str(tmp_path / "a.png"), th, tw, stretch=True, mirror=True)
        assert torch.equal(pixels(mirrored), pixels(processor.preprocess(ImageOps.mirror(shown), th, tw)[0]))
        assert not torch.equal(pixels(load_image(str(tmp_path / "a.png"), th, tw)), pixels(ours))  # not the crop


def test_caption_dropout_is_a_function_of_seed_step_and_sample():
    prompts = [f"p{i}" for i in range(400)]
    dropped = drop_captions(prompts, 3, 7, range(400), 0.25)
    assert 60 < dropped.count("") < 140 and all(d in ("", p) for d, p in zip(dropped, prompts))
    halves = drop_captions(prompts[:200], 3, 7, range(200), 0.25) + \
        drop_captions(prompts[200:], 3, 7, range(200, 400), 0.25)
    assert halves == dropped  # any split over ranks or micro-batches draws the same
    assert drop_captions(prompts, 3, 8, range(400), 0.25) != dropped  # other steps differ
    assert drop_captions(prompts, 3, 7, range(400), 0.0) == prompts  # off: nothing drawn
    spaced = drop_captions(prompts, 3, 7, range(400), 0.25, " ")  # a family's own unconditional text
    assert spaced == [" " if d == "" else d for d in dropped]


def test_fine_tuning_drops_captions_to_the_familys_unconditional_text(tmp_path):
    """train_flux_kontext.py's step trains the room's UNCONDITIONAL_PROMPT where it drops a caption (Qwen-Image-Edit:
    " ", the negative its pipeline's true CFG feeds; FLUX.1 Kontext: ""), and asks the cache for that text."""
    import train_flux_kontext as ft
    from families import flux, qwen_image
    assert (qwen_image.UNCONDITIONAL_PROMPT, flux.UNCONDITIONAL_PROMPT) == (" ", "")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"control": str(tmp_path / "a.png"), "target": str(tmp_path / "a.png"), "prompt": "make it blue"}] * 4
    seen = []

    class Room:
        UNCONDITIONAL_PROMPT = " "
        load_text = staticmethod(lambda texts, *a: seen.extend(p for p, _ in texts))
    ft.load_step(1, Room, rows, [[0, 1, 2, 3]], [(0, 0)], [((8, 8), ((8, 8),))], 4, 4, 0, 1, 1, 0, False, "", "",
                 caption_dropout=0.999999)
    assert seen == [" "] * 4


def test_a_flipped_step_reads_its_mirrored_text_entry(tmp_path):
    """RANDOM_FLIP: the rows train_flux_kontext.py's step asks the text cache for carry "mirror" exactly
    where the step's flips mirror the sample's images (a family whose text encoder reads them keys them so)."""
    import numpy as np

    import train_flux_kontext as ft
    from data.buckets import step_flips
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    rows = [{"control": str(tmp_path / "a.png"), "target": str(tmp_path / "a.png"), "prompt": "p"}] * 8
    seen = []

    class Room:
        UNCONDITIONAL_PROMPT = ""
        load_text = staticmethod(lambda texts, *a: seen.extend(bool(r.get("mirror")) for _, r in texts))
    data = ft.load_step(3, Room, rows, [list(range(8))], [(0, 0)] * 3, [((8, 8), ((8, 8),))], 8, 8, 0, 1, 1, 0,
                        True, "", "")
    flips = step_flips(0, 3, 8, True).tolist()
    assert seen == flips and 0 < sum(flips) < 8
    refs = data["batches"][0]["references"][0]
    plain = load_image(str(tmp_path / "a.png"), 8, 8, stretch=True)
    assert all(torch.equal(r, plain.flip(-1) if f else plain) for r, f in zip(refs, flips))


def _checks_on_two_ranks(rank, world, folder):
    from data import sources  # read_rows looks check_image up there
    calls = []
    real = sources.check_image
    sources.check_image = lambda source: calls.append(source) or real(source)
    with pytest.raises(ConfigError) as info:
        read_rows(folder, ("prompt", "image"), ("prompt", "image"), skip_bad=False)
    assert str(info.value) == f"{folder}/00005.png: image {folder}/00005.png is unreadable (UnidentifiedImageError)"
    assert len(calls) == 4, calls  # 8 images: each rank opened only its half
    rows, skipped = read_rows(folder, ("prompt", "image"), ("prompt", "image"), skip_bad=True)
    assert len(rows) == 6 and skipped == 2  # both ranks drop the same rows


@pytest.mark.slow
def test_image_checks_are_split_over_ranks_and_agree(tmp_path):
    from tests.conftest import run_ranks
    for i in range(8):
        _img(tmp_path / f"{i:05d}.png")
        (tmp_path / f"{i:05d}.txt").write_text(f"caption {i}")
    (tmp_path / "00005.png").write_bytes(b"broken")  # rank 1's share
    (tmp_path / "00006.png").write_bytes(b"broken")  # rank 0's share: the first bad one is reported
    run_ranks(_checks_on_two_ranks, 2, str(tmp_path))


# ----------------------------------------------------------------------------------------------
# cache fills in rounds (data/text_cache.fill_in_rounds): a collective after every few items

def test_a_fill_in_rounds_works_through_each_share_in_equal_rounds(monkeypatch):
    """Ranks 0..2 of 3 (simulated one after the other) each work through exactly their share
    items[rank::3], at most `round_size` items between two collectives, and all make the same number
    of collectives, also the rank whose share is shorter (it works on empty chunks)."""
    import data.text_cache as tc
    items, round_size, world = list(range(11)), 2, 3  # shares of 4, 4 and 3 items: 2 rounds each
    calls = {}
    for r in range(world):
        chunks = []

        def work(chunk):
            chunks.append(list(chunk))
            return sum(chunk)
        monkeypatch.setattr(tc, "rank", lambda r=r: r)
        monkeypatch.setattr(tc, "world_size", lambda: world)
        monkeypatch.setattr(tc, "all_gather_objects", lambda obj: [obj] * world)
        rounds = tc.fill_in_rounds(items, work, round_size)
        assert [x for c in chunks for x in c] == items[r::world] and all(len(c) <= round_size for c in chunks)
        assert [shares[0] for shares in rounds] == [sum(c) for c in chunks]
        calls[r] = len(rounds)
    assert set(calls.values()) == {2}
    assert tc.fill_in_rounds([], lambda chunk: 1 / 0, round_size) == []  # nothing to fill: no collective


FILL_TIMEOUT_S, FILL_ITEM_S = 3.0, 0.5  # the test's collective timeout; rank 1's time per item


def _fill_longer_than_the_timeout(rank, world):
    """Rank 1 computes every item of its share (FILL_ITEM_S each, 4 s in all), rank 0 finds its own
    share cached; their collectives time out after FILL_TIMEOUT_S. Rounds of 2 items keep each wait
    of rank 0 near 1 s, so the fill ends; one collective at the end would have waited 4 s."""
    import datetime
    import time

    import torch.distributed as dist

    import data.text_cache as tc
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FILL_TIMEOUT_S))
    real = dist.all_gather_object
    dist.all_gather_object = lambda out, obj: real(out, obj, group=group)

    def work(chunk):
        if rank == 1:
            time.sleep(FILL_ITEM_S * len(chunk))
        return len(chunk) if rank == 1 else 0
    try:
        rounds = tc.fill_in_rounds(list(range(16)), work, 2)
    finally:
        dist.all_gather_object = real
    assert len(rounds) == 4 and sum(shares[1] for shares in rounds) == 8 and FILL_ITEM_S * 8 > FILL_TIMEOUT_S


@pytest.mark.slow
def test_a_fill_longer_than_the_collective_timeout_ends_in_rounds():
    from tests.conftest import run_ranks
    run_ranks(_fill_longer_than_the_timeout, 2)
