"""Tests of demos/qwen_edit_eval.py: the two-reference task data (deterministic, disjoint splits,
rows train_flux_kontext.py reads with two references), its scoring of known outputs, the
one-reference rows, and one generation through QwenImageEditPlusPipeline on the shipped base
(assets/qwen_edit_base) with the pipeline's areas restored after it; the same task at 64 px through
Flux2KleinPipeline on assets/flux2_edit_base (demos/flux2_edit_eval.py).

    python -m pytest tests/test_qwen_edit_eval.py -q
"""
from pathlib import Path

import numpy as np
import pytest

from demos import kontext_eval as ke
from demos import qwen_edit_eval as qe

SHIPPED_BASE = Path(__file__).resolve().parents[1] / "assets" / "qwen_edit_base"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    folder = tmp_path_factory.mktemp("task") / "heldout"
    return qe.write_edits(folder, qe.task_scenes("heldout")[:8])


def test_splits_are_deterministic_and_disjoint():
    train = qe.task_scenes("train")
    assert train == qe.task_scenes("train") and len(train) == qe.SPLITS["train"][0]
    keys = {qe.scene_key(d) for d in train}
    for split in ("heldout", "retention"):
        scenes = qe.task_scenes(split)
        assert len(scenes) == qe.SPLITS[split][0] and not keys & {qe.scene_key(d) for d in scenes}
    for d in train + qe.task_scenes("heldout"):
        assert d["swatch"] == d["target_colour"] not in (d["colour"], d["background"])
        assert d["prompt"] == f"make the {d['shape']} the colour of picture 2"
    retention = qe.task_scenes("retention")
    assert all("swatch" not in d and d["prompt"] == f"make it {d['target_colour']}" for d in retention)


def test_rows_hold_both_pictures_and_the_train_reader_takes_them(heldout):
    from data.sources import read_rows
    rows = qe.load_rows(heldout)
    assert all(len(r["control"]) == 2 for r in rows)
    swatch = ke.load_rgb(rows[0]["control"][1])
    assert (swatch == np.array(qe.COLOURS[rows[0]["swatch"]], dtype=np.uint8)).all()
    assert all(len(r["control"]) == 1 for r in qe.load_rows(heldout, references=1))
    roles = ("control", "target", "prompt")
    read, skipped = read_rows(str(heldout), roles, roles, skip_bad=False, max_references=2)
    assert skipped == 0 and [len(r["controls"]) for r in read] == [2] * len(rows)


def test_scores_of_known_outputs(heldout):
    rows = qe.load_rows(heldout)
    perfect = ke.score_images([ke.load_rgb(r["target"]) for r in rows], rows)
    assert perfect["success"] == 100.0 and perfect["iou"] == 1.0
    unedited = ke.score_images([ke.load_rgb(r["control"][0]) for r in rows], rows)
    assert unedited["colour_acc"] == 0.0 and unedited["iou"] == 1.0 and unedited["success"] == 0.0


@pytest.mark.skipif(not (SHIPPED_BASE / "model_index.json").exists(), reason="assets/qwen_edit_base not built")
def test_pipeline_generates_at_the_demo_areas(heldout):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    before = plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE
    rows = qe.load_rows(heldout)[:2]
    metrics, outputs = qe.evaluate(str(SHIPPED_BASE), rows, steps=2)
    assert [o.shape for o in outputs] == [(qe.IMAGE_SIZE, qe.IMAGE_SIZE, 3)] * 2 and metrics["n"] == 2
    assert (plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE) == before


FLUX2_BASE = SHIPPED_BASE.parent / "flux2_edit_base"


def test_flux2_task_is_the_same_edit_at_64_px(tmp_path):
    """demos/flux2_edit_eval.py's splits: qwen_edit_eval's edits drawn at 64 px (the pipeline's smallest reference),
    held-out scenes never in train."""
    from demos import flux2_edit_eval as fe
    train = qe.task_scenes("train", size=fe.IMAGE_SIZE)
    assert not {qe.scene_key(d) for d in train} & {qe.scene_key(d) for d in qe.task_scenes("heldout", size=64)}
    assert max(max(d["box"]) for d in train) > qe.IMAGE_SIZE  # drawn on the 64 px canvas
    rows = qe.load_rows(qe.write_edits(tmp_path / "h", qe.task_scenes("heldout", size=64)[:2], size=64))
    assert {ke.load_rgb(c).shape for r in rows for c in [*r["control"], r["target"]]} == {(64, 64, 3)}


@pytest.mark.skipif(not (FLUX2_BASE / "model_index.json").exists(), reason="assets/flux2_edit_base not built")
def test_flux2_pipeline_generates_the_task(tmp_path):
    from demos import flux2_edit_eval as fe
    rows = qe.load_rows(qe.write_edits(tmp_path / "h", qe.task_scenes("heldout", size=64)[:2], size=64))
    metrics, outputs = fe.evaluate(str(FLUX2_BASE), rows, steps=2)
    assert [o.shape for o in outputs] == [(64, 64, 3)] * 2 and metrics["n"] == 2
