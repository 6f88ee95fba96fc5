"""The v2 embedded model's task generator: deterministic splits, answers the tokenizer can spell,
the mix of one-word, long and text-only requests the model card promises."""

from collections import Counter

import numpy as np
import pytest

from workbench.models.embedded.tokenizer import UNK_TOKEN
from workbench.models.embedded.v2 import tasks as S
from workbench.models.embedded.v2.model import build_v2_tokenizer


@pytest.fixture(scope="module")
def split():
    return S.make_split(123, 1500)


def test_same_seed_same_split_and_labels_never_change_the_draws():
    a, b = S.make_split(5, 40), S.make_split(5, 40)
    for (ia, qa, aa), (ib, qb, ab) in zip(a, b):
        assert (qa, aa) == (qb, ab) and (ia is None) == (ib is None)
        if ia is not None:
            assert np.array_equal(np.asarray(ia), np.asarray(ib))
    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
    for _ in range(40):
        plain, labelled = S.make_conversation(r1), S.make_conversation(r2, with_labels=True)
        assert plain[1] == labelled[1] and (plain[0] is None) == (labelled[0] is None)
        assert (labelled[2] is None) == (labelled[0] is None)


def test_every_question_and_answer_is_spelled_without_unknown_tokens(split):
    tok = build_v2_tokenizer()
    unk = tok.convert_tokens_to_ids(UNK_TOKEN)
    for _, question, answer in split:
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert unk not in ids and unk not in tok(question, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == answer  # the reference is what decoding the right tokens gives


def test_the_mixed_split_has_every_kind_text_only_requests_and_long_answers(split):
    kinds = Counter(S.question_kind(q) for _, q, _ in split)
    assert set(kinds) == set(S.QUESTION_KINDS)
    text_only = [S.question_kind(q) for img, q, _ in split if img is None]
    assert text_only and set(text_only) == set(S.TEXT_KINDS)
    assert np.mean([len(a.split()) for _, _, a in split]) >= 6
    lengths = {len(a.split()) for _, q, a in split if S.question_kind(q) == "describe"}
    assert lengths == {6, 13, 20}  # one, two, three objects


def test_image_only_split_has_no_text_only_request():
    assert all(img is not None for img, _, _ in S.make_split(3, 200, image_only=True))


def test_describe_lists_objects_left_to_right_with_their_columns():
    rng = np.random.default_rng(4)
    for _ in range(30):
        _, objects = S.make_scene(rng)
        columns = [c for _, _, c in objects]
        assert columns == sorted(set(columns))
        text = S.describe(objects)
        for shape, color, column in objects:
            assert f"a {color} {shape} {S.COLUMNS[column]}" in text


def test_text_answers_are_right():
    rng = np.random.default_rng(2)
    for _ in range(200):
        kind = S.TEXT_KINDS[rng.integers(3)]
        q, a = S.text_question(rng, kind)
        words = q.rstrip(".?").split()
        if kind == "arith":
            x, op, y = int(words[2]), words[3], int(words[4])
            assert a.replace(" ", "") == str(S.OPERATIONS[op](x, y)) and not a.startswith("-")
        elif kind == "reverse":
            assert a.split() == words[1:][::-1]
        else:
            assert a.split() == [str(i) for i in range(int(words[2]), int(words[4]) + 1)]


def test_digit_strip_labels_name_its_digits():
    for seed in range(10):
        _, digits, labels = S.make_digit_strip(np.random.default_rng(seed), with_labels=True)
        row = labels[list(S.LABEL_HEADS).index("digit")].max(axis=0)  # columns, left to right
        seen = [str(int(d) - 1) for d in row if d]
        assert set(seen) == set(digits) and seen[0] == digits[0] and seen[-1] == digits[-1]


def test_chance_is_one_over_the_valid_answers():
    assert S.CHANCE["color"] == 1 / len(S.COLORS) and S.CHANCE["exists"] == 0.5
    assert S.CHANCE["describe"] == 1 / (3 * 4 * 5 + 3 * 12 * 20 + 1 * 24 * 60)
    assert S.CHANCE["sequence"] == 1 / 36  # (start, stop) with start 0-7, stop start+2..9


def test_a_scaled_scene_is_the_same_request_with_four_times_the_visual_tokens():
    """Issue 39 §8: ``scale=2`` draws the same scenes 2x larger (same questions, answers and
    drawn shapes, 4x the merged visual tokens through the scaled processor); the default draws
    exactly the shipped demo images; labels follow the enlargement; bad scales get one line."""
    from pathlib import Path

    from PIL import Image

    from workbench.models.embedded.v2.model import TOKENS_PER_IMAGE, build_image_processor

    one, two = S.make_split(11, 12, image_only=True), S.make_split(11, 12, image_only=True, scale=2)
    for (i1, q1, a1), (i2, q2, a2) in zip(one, two):
        assert (q1, a1) == (q2, a2) and i1.size == (S.SCENE_SIZE,) * 2 and i2.size == (2 * S.SCENE_SIZE,) * 2
        a, b = np.asarray(i1, float), np.asarray(i2.reduce(2), float)
        assert np.mean(np.abs(a - b).max(axis=2) < 24) > 0.97  # the same picture, every pixel drawn 2x2
    grids = [build_image_processor(s)([im for im, _, _ in split], return_tensors="pt")["image_grid_thw"]
             for s, split in ((1, one), (2, two))]
    assert [int(g[0].prod()) // 4 for g in grids] == [TOKENS_PER_IMAGE, 4 * TOKENS_PER_IMAGE]
    demo = Path(__file__).resolve().parents[1] / "data" / "demo"
    for k, (im, _, _) in enumerate(S.make_demo(7777, 2)[:4]):  # the default scale is what shipped
        assert np.array_equal(np.asarray(im), np.asarray(Image.open(demo / f"scene_{k}.png").convert("RGB")))
    _, _, lab1 = S.make_scene(np.random.default_rng(3), with_labels=True)
    _, _, lab2 = S.make_scene(np.random.default_rng(3), with_labels=True, scale=2)
    assert lab2.shape[1:] == (2 * lab1.shape[1],) * 2 and np.array_equal(lab2[:, ::2, ::2], lab1) and lab1.any()
    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
    for _ in range(10):  # one scale: no extra draw, the training stream is what it was
        assert S.make_conversation(r1)[1] == S.make_conversation(r2, scales=(1,))[1]
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="scale must be a whole number from 1 to 4") as e:
            S.make_split(1, 1, scale=bad)
        assert "\n" not in str(e.value)
