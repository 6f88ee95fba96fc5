"""Deterministic generator of synthetic visual-question-answering scenes.

Each scene is a ``SCENE_SIZE`` x ``SCENE_SIZE`` RGB image (pixels, uint8) made of a
large, *uninformative* textured background (noise, stripes, checkerboard or
gradient, always in muted low-saturation tones) and 1-3 small (22-36 px),
*informative* saturated objects. Every object has a distinct shape and a distinct colour, so
questions about "the circle" or "the blue shape" are never ambiguous.

Questions have single-word answers and come in four kinds (see ``QUESTION_KINDS``):

* ``color``  - "what color is the circle?"  -> one of ``COLORS``       (chance 1/5)
* ``shape``  - "what shape is blue?"        -> one of ``SHAPES``       (chance 1/4)
* ``count``  - "how many shapes?"           -> one of ``COUNT_WORDS``  (chance 1/3)
* ``exists`` - "is there a triangle?"       -> "yes" / "no" (balanced) (chance 1/2)

Determinism invariant: every random draw goes through the ``numpy.random.Generator``
passed in, so ``make_split(seed, n)`` returns identical images, questions and
answers for the same ``(seed, n)`` on every machine (only numpy + PIL are used).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

SCENE_SIZE = 128
"""Side of every generated image, in pixels."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 190, 40),
    "blue": (30, 60, 225),
    "yellow": (235, 220, 30),
    "white": (250, 250, 250),
}
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three")
YES_NO: tuple[str, ...] = ("yes", "no")
BACKGROUNDS: tuple[str, ...] = ("noise", "stripes", "checker", "gradient")
QUESTION_KINDS: tuple[str, ...] = ("color", "shape", "count", "exists")

CHANCE: dict[str, float] = {
    "color": 1 / len(COLORS),
    "shape": 1 / len(SHAPES),
    "count": 1 / len(COUNT_WORDS),
    "exists": 1 / len(YES_NO),
}
"""Accuracy of a uniform random guess over the valid answers of each question kind."""

# Every word a question or an answer can contain (used to build the tokenizer vocabulary).
QUESTION_WORDS: tuple[str, ...] = ("what", "color", "is", "the", "shape", "how", "many", "shapes", "there", "a")
VOCAB_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys((*QUESTION_WORDS, *SHAPES, *COLORS, *COUNT_WORDS, *YES_NO))
)

OBJECT_MIN_SIZE, OBJECT_MAX_SIZE = 22, 36
"""Range of an object's bounding-box side, pixels (inclusive)."""
_MARGIN = 4  # minimum gap between object boxes and between a box and the border, pixels


def _muted_color(rng: np.random.Generator) -> np.ndarray:
    """A low-saturation mid-luminance colour (float RGB in [40, 175]) for backgrounds."""
    gray = rng.uniform(60, 150)
    return np.clip(gray + rng.uniform(-25, 25, size=3), 40, 175)


def _background(rng: np.random.Generator) -> np.ndarray:
    """Return a ``(SCENE_SIZE, SCENE_SIZE, 3)`` uint8 texture with no task information."""
    n = SCENE_SIZE
    kind = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
    a, b = _muted_color(rng), _muted_color(rng)
    if kind == "noise":
        base = a + rng.normal(0.0, 18.0, size=(n, n, 1))  # luminance noise
        img = base + rng.normal(0.0, 6.0, size=(n, n, 3))  # faint chroma noise
    elif kind == "stripes":
        angle = rng.uniform(0, math.pi)
        period = rng.uniform(6, 20)
        phase = (xx * math.cos(angle) + yy * math.sin(angle)) / period
        mask = (np.floor(phase) % 2)[..., None]
        img = a * mask + b * (1 - mask)
    elif kind == "checker":
        cell = int(rng.integers(6, 20))
        mask = (((yy // cell) + (xx // cell)) % 2)[..., None]
        img = a * mask + b * (1 - mask)
    else:  # gradient
        angle = rng.uniform(0, 2 * math.pi)
        t = xx * math.cos(angle) + yy * math.sin(angle)
        t = ((t - t.min()) / (t.max() - t.min() + 1e-6))[..., None]
        img = a * t + b * (1 - t)
    img = img + rng.normal(0.0, 3.0, size=(n, n, 3))  # sensor-like grain everywhere
    return np.clip(img, 0, 255).astype(np.uint8)


def _place_boxes(rng: np.random.Generator, k: int) -> list[tuple[int, int, int]]:
    """Sample ``k`` non-overlapping square boxes ``(x0, y0, side)`` inside the canvas."""
    boxes: list[tuple[int, int, int]] = []
    while len(boxes) < k:
        side = int(rng.integers(OBJECT_MIN_SIZE, OBJECT_MAX_SIZE + 1))
        x0 = int(rng.integers(_MARGIN, SCENE_SIZE - side - _MARGIN))
        y0 = int(rng.integers(_MARGIN, SCENE_SIZE - side - _MARGIN))
        if all(
            x0 + side + _MARGIN <= bx or bx + bs + _MARGIN <= x0 or y0 + side + _MARGIN <= by or by + bs + _MARGIN <= y0
            for bx, by, bs in boxes
        ):
            boxes.append((x0, y0, side))
    return boxes


def _draw_object(draw: ImageDraw.ImageDraw, shape: str, rgb: tuple[int, int, int], box: tuple[int, int, int]) -> None:
    """Draw a filled ``shape`` of colour ``rgb`` inside ``box = (x0, y0, side)``."""
    x0, y0, s = box
    x1, y1 = x0 + s - 1, y0 + s - 1
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=rgb)
    elif shape == "square":
        inset = s // 8  # squares look as large as circles this way
        draw.rectangle((x0 + inset, y0 + inset, x1 - inset, y1 - inset), fill=rgb)
    elif shape == "triangle":
        draw.polygon([(x0 + s / 2, y0), (x1, y1), (x0, y1)], fill=rgb)
    elif shape == "cross":
        t = max(3, s // 3)
        c0 = x0 + (s - t) // 2
        r0 = y0 + (s - t) // 2
        draw.rectangle((c0, y0, c0 + t - 1, y1), fill=rgb)
        draw.rectangle((x0, r0, x1, r0 + t - 1), fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Perturb a canonical colour by up to +-15 per channel (colour names stay unambiguous)."""
    return tuple(int(np.clip(c + rng.integers(-15, 16), 0, 255)) for c in rgb)  # type: ignore[return-value]


def make_scene(rng: np.random.Generator) -> tuple[Image.Image, list[tuple[str, str]]]:
    """Render one scene; return the image and its objects as ``(shape, color)`` pairs.

    Invariants: 1-3 objects, all shapes distinct, all colours distinct, no overlaps.
    """
    k = int(rng.integers(1, 4))
    shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:k]]
    color_names = list(COLORS)
    colors = [color_names[i] for i in rng.permutation(len(color_names))[:k]]
    image = Image.fromarray(_background(rng))
    draw = ImageDraw.Draw(image)
    for shape, color, box in zip(shapes, colors, _place_boxes(rng, k)):
        _draw_object(draw, shape, _jitter(rng, COLORS[color]), box)
    return image, list(zip(shapes, colors))


def _question(rng: np.random.Generator, objects: list[tuple[str, str]]) -> tuple[str, str]:
    """Draw a question kind uniformly and return ``(question, answer)`` about ``objects``."""
    kind = QUESTION_KINDS[rng.integers(len(QUESTION_KINDS))]
    shape, color = objects[rng.integers(len(objects))]
    if kind == "color":
        return f"what color is the {shape}?", color
    if kind == "shape":
        return f"what shape is {color}?", shape
    if kind == "count":
        return "how many shapes?", COUNT_WORDS[len(objects) - 1]
    present = {s for s, _ in objects}
    if rng.random() < 0.5:
        return f"is there a {shape}?", "yes"
    absent = [s for s in SHAPES if s not in present]  # never empty: at most 3 of 4 shapes are present
    return f"is there a {absent[rng.integers(len(absent))]}?", "no"


def make_conversation(rng: np.random.Generator, max_questions: int = 4) -> tuple[Image.Image, list[tuple[str, str]]]:
    """One scene plus 1-``max_questions`` question/answer pairs about it (a multi-turn chat).

    At most one question per kind, in random order. To keep earlier turns from giving
    away later answers, each present object is the subject of at most one question
    (``color``, ``shape`` or ``exists``-yes); ``count`` and ``exists``-no questions
    name no present object. Once every object has been talked about, remaining
    non-count kinds are skipped (so ``exists`` answers stay 50/50 yes/no).
    """
    image, objects = make_scene(rng)
    unused = [objects[i] for i in rng.permutation(len(objects))]  # objects not yet talked about
    present = {shape for shape, _ in objects}
    turns: list[tuple[str, str]] = []
    for kind in (QUESTION_KINDS[i] for i in rng.permutation(len(QUESTION_KINDS))[:max_questions]):
        if kind == "count":
            turns.append(("how many shapes?", COUNT_WORDS[len(objects) - 1]))
        elif not unused:
            continue  # no subject left (for "exists" too, so that its yes/no stays balanced)
        elif kind == "exists" and rng.random() < 0.5:
            absent = [s for s in SHAPES if s not in present]
            turns.append((f"is there a {absent[rng.integers(len(absent))]}?", "no"))
        else:
            shape, color = unused.pop()
            if kind == "color":
                turns.append((f"what color is the {shape}?", color))
            elif kind == "shape":
                turns.append((f"what shape is {color}?", shape))
            else:
                turns.append((f"is there a {shape}?", "yes"))
    return image, turns


def question_kind(question: str) -> str:
    """Classify a generated question into one of ``QUESTION_KINDS``."""
    if question.startswith("what color"):
        return "color"
    if question.startswith("what shape"):
        return "shape"
    if question.startswith("how many"):
        return "count"
    if question.startswith("is there"):
        return "exists"
    raise ValueError(f"not a generated question: {question!r}")


def make_example(rng: np.random.Generator) -> tuple[Image.Image, str, str]:
    """Generate one ``(image, question, answer)`` triple; the answer is a single lowercase word."""
    image, objects = make_scene(rng)
    question, answer = _question(rng, objects)
    return image, question, answer


def make_split(seed: int, n: int) -> list[tuple[Image.Image, str, str]]:
    """Generate ``n`` examples from ``numpy.random.default_rng(seed)`` (same seed -> same split)."""
    rng = np.random.default_rng(seed)
    return [make_example(rng) for _ in range(n)]
