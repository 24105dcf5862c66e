"""Tests of demos/kontext_eval.py: the "make it blue" task data (and its shipped train split,
assets/kontext_blue), the pixel metrics on known inputs, and --lora's loading of a LoRA onto the
shipped tiny base (assets/kontext_base; no training).

    python -m pytest tests/test_kontext_eval.py -q
"""
import json
from pathlib import Path

import numpy as np
import pytest

from demos import kontext_eval as ke

SHIPPED_BASE = Path(__file__).resolve().parents[1] / "assets" / "kontext_base"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    """The first 16 held-out pairs written to disk, as load_rows returns them."""
    folder = tmp_path_factory.mktemp("task") / "heldout"
    return ke.load_rows(ke.write_pairs(folder, ke.task_scenes("heldout")[:16]))


def images(rows, key):
    return [ke.load_rgb(r[key]) for r in rows]


def test_splits_are_deterministic_disjoint_and_never_blue():
    train = ke.task_scenes("train")
    assert train == ke.task_scenes("train") and len(train) == ke.SPLITS["train"][0]
    key = lambda d: (d["shape"], d["colour"], d["background"], tuple(d["box"]))  # noqa: E731
    train_keys = {key(d) for d in train}
    for split in ("heldout", "retention"):
        scenes = ke.task_scenes(split)
        assert len(scenes) == ke.SPLITS[split][0]
        assert not train_keys & {key(d) for d in scenes}
    for d in train + ke.task_scenes("heldout"):
        assert d["prompt"] == ke.TASK_PROMPT and d["target_colour"] == ke.TASK_COLOUR
        assert ke.TASK_COLOUR not in (d["colour"], d["background"]) and d["colour"] != d["background"]
    for d in ke.task_scenes("retention"):
        assert d["target_colour"] not in (ke.TASK_COLOUR, d["colour"], d["background"])
        assert d["prompt"] == f"make it {d['target_colour']}"


def test_written_split_is_a_training_jsonl(heldout, tmp_path):
    path = ke.write_pairs(tmp_path, ke.task_scenes("heldout")[:3])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["image"] for r in rows] == ["context/00000.png", "context/00001.png", "context/00002.png"]
    assert all((tmp_path / r["target"]).is_file() and r["prompt"] == "make it blue" for r in rows)
    # Scene fields are recovered from pixels and prompt when a jsonl lacks them.
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({k: r[k] for k in ("image", "target", "prompt")}) + "\n" for r in rows))
    for full, inferred in zip(ke.load_rows(path), ke.load_rows(bare)):
        assert inferred["background"] == full["background"]
        assert inferred["target_colour"] == full["target_colour"] == "blue"


def test_named_colours_map_to_themselves():
    for name, rgb in ke.COLOURS.items():
        assert ke.nearest_colour(rgb) == name


def test_true_target_scores_perfectly(heldout):
    m = ke.score_images(images(heldout, "target"), heldout)
    assert m["colour_acc"] == 100.0 and m["bg_kept"] == 100.0 and m["success"] == 100.0
    assert m["iou"] == 1.0 and m["psnr"] == 100.0


def test_unedited_context_keeps_shape_but_misses_colour(heldout):
    m = ke.score_images(images(heldout, "image"), heldout)
    assert m["colour_acc"] == 0.0 and m["success"] == 0.0
    assert m["iou"] == 1.0 and m["bg_kept"] == 100.0


def test_noise_scores_badly(heldout):
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in heldout]
    m = ke.score_images(noise, heldout)
    assert m["success"] == 0.0 and m["bg_kept"] <= 20.0 and m["iou"] < 0.5 and m["psnr"] < 12


def test_wrong_place_and_blank_outputs(heldout):
    """The right colour in the wrong place loses IoU; an empty output has no colour."""
    row = heldout[0]
    target = ke.load_rgb(row["target"])
    shifted = np.roll(target, 20, axis=1)
    s = ke.score_edit(shifted, target, row["background"], row["target_colour"])
    assert s["colour_ok"] and s["iou"] < 0.6 and not s["success"]
    blank = np.broadcast_to(np.array(ke.COLOURS[row["background"]], np.uint8), target.shape).copy()
    s = ke.score_edit(blank, target, row["background"], row["target_colour"])
    assert s["colour"] is None and not s["colour_ok"] and s["iou"] == 0.0 and s["bg_ok"]


def test_blurred_target_still_scores(heldout):
    """A VAE-like blur of the target (3x3 box) keeps colour and background; IoU drops only at
    corners (small triangles lose most: about 0.78)."""
    ious = []
    for row in heldout:
        t = ke.load_rgb(row["target"]).astype(np.float64)
        p = np.pad(t, ((1, 1), (1, 1), (0, 0)), mode="edge")
        t = sum(p[dy:dy + 32, dx:dx + 32] for dy in range(3) for dx in range(3)) / 9
        s = ke.score_edit(t.round().astype(np.uint8), ke.load_rgb(row["target"]), row["background"],
                          row["target_colour"])
        assert s["success"] and s["iou"] >= 0.75
        ious.append(s["iou"])
    assert np.mean(ious) >= 0.85


def test_grid_and_table(heldout, tmp_path):
    ctx, tgt = images(heldout, "image"), images(heldout, "target")
    path = ke.save_grid([ctx, tgt, tgt], tmp_path / "g.png", rows=4)
    assert ke.load_rgb(path).shape == (4 * 32, 3 * 32, 3)
    big = ke.load_rgb(ke.save_grid([ctx, tgt], tmp_path / "g3.png", rows=2, scale=3))
    assert big.shape == (2 * 96, 2 * 96 + 2, 3) and (big[:96, :96] == np.repeat(np.repeat(ctx[0], 3, 0), 3, 1)).all()
    m = ke.summarize([ke.score_edit(t, t, r["background"], r["target_colour"]) for t, r in zip(tgt, heldout)])
    table = ke.markdown_table({"target": {"heldout": m}})
    assert "| target | heldout | 16 | 100.0 % | 1.000 | 100.0 % | 100.0 % |" in table


def _files(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_shipped_train_split_is_what_make_data_writes(tmp_path):
    """assets/kontext_blue (train_flux_kontext.py's default data, demo_kontext.sh's training data) is
    byte for byte the train split of --make_data, jsonl named train.jsonl: rows and PNGs."""
    shipped = _files(ke.SHIPPED_TRAIN.parent)
    assert ke.SHIPPED_TRAIN.name == "train.jsonl" and len(shipped) == 1 + 2 * ke.SPLITS["train"][0]
    generated = _files(Path(ke.ensure_task_data(tmp_path / "task")["train"]).parent)
    generated["train.jsonl"] = generated.pop("data.jsonl")
    assert shipped.keys() == generated.keys()
    assert [k for k in shipped if shipped[k] != generated[k]] == []
    rows = [json.loads(line) for line in shipped["train.jsonl"].decode().splitlines()]
    assert rows == [{"image": f"context/{i:05d}.png", "target": f"target/{i:05d}.png", **d}
                    for i, d in enumerate(ke.task_scenes("train"))]
    # --make_train writes the same files again
    assert ke.main([f"--make_train={tmp_path / 'again'}"]) == 0
    assert _files(tmp_path / "again") == shipped


def test_task_data_is_built_once(tmp_path):
    paths = ke.ensure_task_data(tmp_path / "task")
    marker = tmp_path / "task" / "READY"
    assert marker.read_text() == f"kontext task v{ke.TASK_VERSION}\n"
    mtime = marker.stat().st_mtime_ns
    assert ke.ensure_task_data(tmp_path / "task") == paths and marker.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task", "task.lock"]  # no temp folder left
    (tmp_path / "half").mkdir()  # a folder without the marker was not written by ensure_task_data
    with pytest.raises(RuntimeError, match="no READY marker"):
        ke.ensure_task_data(tmp_path / "half")


def test_lora_option_needs_a_known_model_name():
    """--lora NAME=PATH names one of the models; a bare PATH is only allowed with one model."""
    for argv in (["--compare", "a=x", "b=y", "--lora", "c=z"], ["--compare", "a=x", "b=y", "--lora", "z"]):
        with pytest.raises(SystemExit) as e:
            ke.main(argv)
        assert e.value.code == 2


def test_load_pipeline_with_lora_is_the_adapted_model(tmp_path):
    """load_pipeline(base, lora=folder) = the base + FluxKontextPipeline.load_lora_weights: the
    transformer computes what the adapted model that saved the LoRA computed (alpha included)."""
    import torch
    from diffusers import FluxKontextPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    base_dir = str(SHIPPED_BASE)
    adapted = ke.load_pipeline(base_dir).transformer
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "proj_mlp"], init_lora_weights="gaussian")
    adapted.add_adapter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:  # peft starts B at 0 (no change); make the adapters do something
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    FluxKontextPipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(adapted),
                                          transformer_lora_adapter_metadata=config.to_dict())
    loaded = ke.load_pipeline(base_dir, lora=str(tmp_path)).transformer
    plain = ke.load_pipeline(base_dir).transformer
    c = adapted.config
    n, s = 16, 8
    inputs = dict(hidden_states=torch.randn(1, n, c.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(1, s, c.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([1.0]),
                  img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(s, 3), return_dict=False)
    with torch.no_grad():
        want, got, before = (m(**inputs)[0] for m in (adapted, loaded, plain))
    assert (want - before).abs().max() > 1e-2  # the LoRA changes the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
