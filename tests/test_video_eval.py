"""The video task's scorer (demos/video_eval.py) on clips its own renderer draws: right ones pass in either colour; a
colour outside the pair, the pair's mean, a switch of colour, a static clip, a backwards one and a flickering one
fail; the held-out split (no model; about a second).

    python -m pytest tests/test_video_eval.py -q
"""
import json

import numpy as np

from demos import video_eval as ve

PROMPT = "a red or blue square moving left"


def test_splits_hold_out_24_prompts_that_train_every_word():
    train, held_out = ve.splits()
    assert len(train) == 48 and len(held_out) == 24 and not set(train) & set(held_out)
    for i in range(3):
        assert {ve.parse_prompt(p)[i] for p in train} == {ve.parse_prompt(p)[i] for p in held_out}
    assert ve.parse_prompt(PROMPT) == (("red", "blue"), "square", "left")


def test_rendered_clips_score_valid_moving_consistent_and_varied():
    prompts = [p for p in ve.splits()[1][::3] for _ in range(4)]
    scores = ve.score_clips(ve.render_batch(prompts, np.random.default_rng(0)), prompts)
    assert scores["valid"] == scores["motion"] == scores["consistent"] == 100.0
    assert scores["variety"] > 3.0 and scores["colour_entropy"] > 0.5


def test_other_colour_mean_colour_switch_static_backwards_and_flicker_fail():
    rng = np.random.default_rng(1)
    start = ve.random_start(rng, "left")
    red, blue = ve.render(PROMPT, start, "red"), ve.render(PROMPT, start, "blue")
    for clip in (red, blue):
        assert all(ve.score_clip(clip, PROMPT)[k] for k in ("valid", "motion", "consistent"))
    other = ve.score_clip(ve.render(PROMPT, start, "green"), PROMPT)
    assert not other["valid"] and other["frame_valid"] == 0.0
    mean = ((red.astype(float) + blue) / 2).round().astype(np.uint8)  # what a sampler averaging the two paints
    assert ve.score_clip(mean, PROMPT)["frame_valid"] == 0.0
    switch = np.concatenate([red[:4], blue[4:]])
    result = ve.score_clip(switch, PROMPT)
    assert result["frame_valid"] == 1.0 and not result["valid"] and not result["consistent"]
    assert not ve.score_clip(np.repeat(red[:1], ve.FRAMES, axis=0), PROMPT)["motion"]  # static
    assert not ve.score_clip(red[::-1], PROMPT)["motion"]  # moving right
    flicker = red.copy()
    flicker[4] = ve.render("a red or blue circle moving left", (10.0, 10.0), "red")[4]
    result = ve.score_clip(flicker, PROMPT)
    assert not result["valid"] and not result["consistent"] and result["frame_valid"] == 8 / 9


def test_variety_is_the_mean_pairwise_start_distance_and_colour_entropy_the_mean_bits():
    assert ve.variety({"p": [np.array([0.0, 0.0]), np.array([3.0, 4.0])], "q": [np.array([1.0, 1.0])]}) == 5.0
    assert ve.variety({"p": [np.array([2.0, 2.0])] * 4}) == 0.0
    assert ve.colour_entropy({"p": ["red", "blue", None], "q": ["red"] * 3, "r": [None, "blue"]}) == 0.5


def test_real_clips_are_the_training_prompts_answers_as_the_wan_room_reads_them(tmp_path):
    """--real_clips: every training prompt's clips, as rows of the jsonl the GAN reads; a third of them (every third
    row), read back through families/wan's clip reader, each score valid and moving for its prompt (the GIF keeps the
    renderer's colours), in every colour of the palette."""
    from families.wan.room import load_clip
    ve.make_data(tmp_path, real_clips=1)
    rows = [json.loads(line) for line in (tmp_path / "train_real.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ve.splits()[0]
    seen = set()
    for row in rows[::3]:
        clip = load_clip(str(tmp_path / row["target"]), (ve.SIZE, ve.SIZE), ve.FRAMES)
        score = ve.score_clip(((clip.permute(1, 2, 3, 0) + 1) * 127.5).round().byte().numpy(), row["prompt"])
        assert score["valid"] and score["motion"], (row, score)
        seen.add(score["colour"])
    assert seen == set(ve.COLOURS)
