"""tools/identity.py, the fingerprint of what the scripts produce: what it compares and what it leaves
out (timings, run ids, per-process files), on files written here.

    python -m pytest tests/test_identity.py -q
"""
import json

from tools import identity


def test_metrics_lose_their_timings_and_keep_the_numbers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 2, "loss_dm": 0.25, "grad_norm_g": 1.5, "step_ms": 812.0, "mfu": 0.1,
                                "peak_mem_gib": 3.0, "lr": 1e-5}) + "\n")
    assert identity._metrics(str(path)) == [{"step": 2, "loss_dm": 0.25, "grad_norm_g": 1.5, "lr": 1e-5}]


def test_a_changed_number_or_file_is_a_difference(tmp_path):
    ckpt = tmp_path / "out" / "checkpoints" / "step_000002"
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "ab12", "saved_at": 1.0}))
    (ckpt / "__0_0.distcp").write_bytes(b"\x00\x01")
    (ckpt / "rng" / "rank_0.pt").write_bytes(b"seeded differently")
    (tmp_path / "out" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 0.5}) + "\n")
    before = identity.fingerprint(str(tmp_path / "out"), str(tmp_path))

    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "cd34", "saved_at": 2.0}))
    (ckpt / "rng" / "rank_0.pt").write_bytes(b"another process")
    assert identity.differences(before, identity.fingerprint(str(tmp_path / "out"), str(tmp_path))) == []

    (ckpt / "__0_0.distcp").write_bytes(b"\x00\x02")
    (tmp_path / "out" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 0.51}) + "\n")
    diff = identity.differences(before, identity.fingerprint(str(tmp_path / "out"), str(tmp_path)))
    assert len(diff) == 2 and diff[0].startswith("/checkpoints/step_000002/__0_0.distcp") and "0.51" in diff[1]


def test_a_checkpoints_config_differs_by_setting_name(tmp_path):
    ckpt = tmp_path / "out" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (tmp_path / "out" / "metrics.jsonl").write_text("")
    (ckpt / "config.json").write_text(json.dumps({"LR": 1e-4, "OUTPUT_DIR": str(tmp_path / "out")}))
    before = identity.fingerprint(str(tmp_path / "out"), str(tmp_path))
    assert before["checkpoints"]["step_000002/config.json"] == {"LR": 1e-4, "OUTPUT_DIR": "$WORK/out"}
    (ckpt / "config.json").write_text(json.dumps({"LR": 1e-4, "OUTPUT_DIR": str(tmp_path / "out"), "SHIFT": "1"}))
    diff = identity.differences(before, identity.fingerprint(str(tmp_path / "out"), str(tmp_path)))
    assert diff == ["/checkpoints/step_000002/config.json/SHIFT: None != '1'"]
