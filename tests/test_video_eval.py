"""The video task's scorer (demos/video_eval.py) on clips its own renderer draws: right ones pass, a wrong colour, a
static clip, a backwards one and a flickering one fail; the held-out split (no model; well under a second).

    python -m pytest tests/test_video_eval.py -q
"""
import numpy as np

from demos import video_eval as ve

PROMPT = "a red square moving left"


def test_splits_hold_out_32_prompts_that_train_every_word():
    train, held_out = ve.splits()
    assert len(train) == 64 and len(held_out) == 32 and not set(train) & set(held_out)
    for i in range(3):
        assert {ve.parse_prompt(p)[i] for p in train} == {ve.parse_prompt(p)[i] for p in held_out}


def test_rendered_clips_score_valid_moving_consistent_and_varied():
    prompts = [p for p in ve.splits()[1][::4] for _ in range(3)]
    scores = ve.score_clips(ve.render_batch(prompts, np.random.default_rng(0)), prompts)
    assert scores["valid"] == scores["motion"] == scores["consistent"] == 100.0
    assert scores["variety"] > 3.0


def test_wrong_colour_static_backwards_and_flicker_fail():
    rng = np.random.default_rng(1)
    clip = ve.render(PROMPT, ve.random_start(rng, "left"))
    assert all(ve.score_clip(clip, PROMPT)[k] for k in ("valid", "motion", "consistent"))
    wrong = ve.score_clip(clip, "a blue square moving left")
    assert not wrong["valid"] and wrong["frame_valid"] == 0.0
    assert not ve.score_clip(np.repeat(clip[:1], ve.FRAMES, axis=0), PROMPT)["motion"]  # static
    assert not ve.score_clip(clip[::-1], PROMPT)["motion"]  # moving right
    flicker = clip.copy()
    flicker[4] = ve.render("a blue circle moving left", (10.0, 10.0))[4]
    result = ve.score_clip(flicker, PROMPT)
    assert not result["valid"] and not result["consistent"] and result["frame_valid"] == 8 / 9


def test_variety_is_the_mean_pairwise_start_distance():
    assert ve.variety({"p": [np.array([0.0, 0.0]), np.array([3.0, 4.0])], "q": [np.array([1.0, 1.0])]}) == 5.0
    assert ve.variety({"p": [np.array([2.0, 2.0])] * 4}) == 0.0
