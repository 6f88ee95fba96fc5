"""Deterministic generator of the embedded model's tasks: scenes, digit strips and text puzzles.

Three families of requests, each a ``(image | None, question, answer)`` triple:

* **shape scenes** (``SCENE_SIZE`` x ``SCENE_SIZE`` RGB): a muted, uninformative background
  (noise or gradient) and 1-3 saturated objects, at most one per column (left, middle,
  right); every object has a distinct shape and a distinct colour, so "the circle" and
  "the blue shape" are never ambiguous. Question kinds:

  - ``color``    "what color is the circle?"   -> ``red``                      (1 token)
  - ``shape``    "what shape is blue?"         -> ``square``                   (1 token)
  - ``count``    "how many shapes?"            -> ``three``                    (1 token)
  - ``exists``   "is there a triangle?"        -> ``yes`` / ``no`` (balanced)  (1 token)
  - ``describe`` "describe the scene."         -> ``a red circle on the left , a blue square
    in the middle and a green cross on the right`` (objects left to right; 6, 13 or 20 tokens)

* **digit strips**: a number of 4-8 digits drawn in a 5x7 bitmap font on a muted background.
  Kind ``read`` "read the number." -> ``4 0 7 1 9`` (one token per digit).

* **text only** (no image):

  - ``arith``    "what is 7 times 8?"          -> ``5 6``   (single-digit plus, minus, times)
  - ``reverse``  "reverse red 4 circle blue."  -> ``blue circle 4 red``  (3-8 items)
  - ``sequence`` "count from 3 to 9."          -> ``3 4 5 6 7 8 9``      (3-10 numbers)

Numbers are written digit by digit: the tokenizer splits "56" into "5", "6", and decoding
joins tokens with single spaces, so every reference answer is written with spaces between
its tokens and compared to the decoded text exactly.

:func:`make_split` draws a request *family* first (``FAMILY_WEIGHTS``: short visual
questions, descriptions, digit strips, text puzzles) and then a kind uniformly inside it,
so that a split is a realistic *mix* of one-word answers, long answers and text-only
requests; the same mix is the held-out evaluation set.

Determinism invariant: every random draw goes through the ``numpy.random.Generator`` passed
in, so ``make_split(seed, n)`` returns identical images, questions and answers for the same
``(seed, n)`` on every machine (only numpy + PIL drawing of polygons, no fonts).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

SCENE_SIZE = 128
"""Side of every generated image at ``scale = 1`` (the default; the model's training size), pixels."""
SCALES = (1, 4)
"""Inclusive range of the ``scale`` of a generated image: the same scene drawn ``scale`` times
larger (``scale * SCENE_SIZE`` px, every object over ``scale**2`` times the patches)."""


def check_scale(scale) -> int:
    """``scale`` as an int in :data:`SCALES`, or ``ValueError`` in one line."""
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or not SCALES[0] <= scale <= SCALES[1]:
        raise ValueError(f"scale must be a whole number from {SCALES[0]} to {SCALES[1]} (the scene drawn that many "
                         f"times larger, {SCENE_SIZE}-{SCALES[1] * SCENE_SIZE} px), not {scale!r}")
    return int(scale)

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
DIGITS: tuple[str, ...] = tuple("0123456789")
COLUMNS: tuple[str, ...] = ("on the left", "in the middle", "on the right")
"""Where an object in each of the three columns is said to be (``describe`` answers)."""
OPERATIONS: dict[str, object] = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b,
                                 "times": lambda a, b: a * b}

SHORT_KINDS: tuple[str, ...] = ("color", "shape", "count", "exists")
SCENE_KINDS: tuple[str, ...] = (*SHORT_KINDS, "describe")
TEXT_KINDS: tuple[str, ...] = ("arith", "reverse", "sequence")
QUESTION_KINDS: tuple[str, ...] = (*SCENE_KINDS, "read", *TEXT_KINDS)
"""Every task kind, in the order reports list them."""
IMAGE_KINDS: frozenset[str] = frozenset((*SCENE_KINDS, "read"))
"""Kinds whose requests carry an image; the others are text only."""

FAMILY_WEIGHTS: dict[tuple[str, ...], float] = {
    SHORT_KINDS: 0.2,  # one-word answers about a scene
    ("describe",): 0.3,
    ("read",): 0.2,
    TEXT_KINDS: 0.3,
}
"""Share of each request family in a split; kinds inside a family are drawn uniformly."""

READ_DIGITS = (4, 8)
"""Inclusive range of digits in a ``read`` strip."""
REVERSE_ITEMS = (3, 8)
"""Inclusive range of items in a ``reverse`` puzzle."""


def _valid_answers(kind: str) -> int:
    """How many different answers a request of ``kind`` can have (the uniform-guess denominator)."""
    k_cols = len(COLUMNS)
    counts = {
        "color": len(COLORS), "shape": len(SHAPES), "count": len(COUNT_WORDS), "exists": len(YES_NO),
        # k objects: which columns x ordered distinct shapes x ordered distinct colours
        "describe": sum(math.comb(k_cols, k) * math.perm(len(SHAPES), k) * math.perm(len(COLORS), k)
                        for k in range(1, k_cols + 1)),
        "read": sum(10**n for n in range(READ_DIGITS[0], READ_DIGITS[1] + 1)),
        "arith": len({f(a, b) for f in OPERATIONS.values() for a in range(10) for b in range(10) if f(a, b) >= 0}),
        "reverse": sum((len(COLORS) + len(SHAPES) + len(DIGITS)) ** n
                       for n in range(REVERSE_ITEMS[0], REVERSE_ITEMS[1] + 1)),
        "sequence": sum(8 - start for start in range(8)),  # start 0-7, stop start+2..9
    }
    return counts[kind]


CHANCE: dict[str, float] = {kind: 1 / _valid_answers(kind) for kind in QUESTION_KINDS}
"""Exact-match accuracy of a uniform random guess over the valid answers of each kind."""

# Every word a question or an answer can contain (the tokenizer's vocabulary is built from it).
QUESTION_WORDS: tuple[str, ...] = (
    "what", "color", "is", "the", "shape", "how", "many", "shapes", "there", "a", "describe", "scene",
    "read", "number", "reverse", "count", "from", "to", "on", "in", "left", "middle", "right", "and",
)
VOCAB_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys((*QUESTION_WORDS, *SHAPES, *COLORS, *COUNT_WORDS, *YES_NO, *DIGITS, *OPERATIONS))
)

OBJECT_MIN_SIZE, OBJECT_MAX_SIZE = 28, 38
"""Range of an object's bounding-box side, pixels (inclusive); a column is 42 px wide."""
_MARGIN = 2  # minimum gap between an object box and its column's / the canvas's border, pixels

# 5x7 bitmap digits (rows top to bottom, "#" = ink); drawn 2x wide and 3x tall.
_FONT: dict[str, tuple[str, ...]] = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
}
_GLYPH_SCALE = (2, 3)  # (x, y) pixels per font dot: a digit is 10 x 21 px
_GLYPH_GAP = 3  # pixels between digits

Example = tuple[Optional[Image.Image], str, str]
"""``(image or None for text-only requests, question, reference answer)``."""


# --------------------------------------------------------------------------- drawing


def _muted_color(rng: np.random.Generator) -> np.ndarray:
    """A low-saturation mid-luminance colour (float RGB in [40, 175]) for backgrounds."""
    gray = rng.uniform(60, 150)
    return np.clip(gray + rng.uniform(-25, 25, size=3), 40, 175)


def _background(rng: np.random.Generator) -> np.ndarray:
    """Return a ``(SCENE_SIZE, SCENE_SIZE, 3)`` uint8 background with no task information."""
    n = SCENE_SIZE
    a, b = _muted_color(rng), _muted_color(rng)
    if rng.random() < 0.5:  # luminance noise
        img = a + rng.normal(0.0, 10.0, size=(n, n, 1))
    else:  # linear gradient between two muted colours
        yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
        angle = rng.uniform(0, 2 * math.pi)
        t = xx * math.cos(angle) + yy * math.sin(angle)
        t = ((t - t.min()) / (t.max() - t.min() + 1e-6))[..., None]
        img = a * t + b * (1 - t)
    img = img + rng.normal(0.0, 3.0, size=(n, n, 3))  # sensor-like grain everywhere
    return np.clip(img, 0, 255).astype(np.uint8)


def _canvas(rng: np.random.Generator, scale: int) -> Image.Image:
    """The background of :func:`_background` (the same draws at every scale), enlarged
    ``scale`` times (bicubic) when ``scale > 1``."""
    image = Image.fromarray(_background(rng))
    return image if scale == 1 else image.resize((SCENE_SIZE * scale,) * 2, Image.Resampling.BICUBIC)


def _draw_object(draw: ImageDraw.ImageDraw, shape: str, rgb: tuple[int, int, int], box: tuple[int, int, int],
                 scale: int = 1) -> None:
    """Draw a filled ``shape`` of colour ``rgb`` inside ``box = (x0, y0, side)`` (base-size
    pixels) on a canvas ``scale`` times the base size: every base pixel the shape covers becomes
    ``scale × scale`` pixels (``scale = 1`` draws exactly the base scene)."""
    x0, y0, s = box
    x1, y1 = x0 + s - 1, y0 + s - 1

    def rect(a: float, b: float, c: float, d: float) -> tuple[float, float, float, float]:
        """Inclusive base-pixel box -> the inclusive box of the same pixels on the scaled canvas."""
        return (a * scale, b * scale, (c + 1) * scale - 1, (d + 1) * scale - 1)

    if shape == "circle":
        draw.ellipse(rect(x0, y0, x1, y1), fill=rgb)
    elif shape == "square":
        inset = s // 8  # squares look as large as circles this way
        draw.rectangle(rect(x0 + inset, y0 + inset, x1 - inset, y1 - inset), fill=rgb)
    elif shape == "triangle":
        a, b, c, d = rect(x0, y0, x1, y1)
        draw.polygon([(a + s * scale / 2, b), (c, d), (a, d)], fill=rgb)
    elif shape == "cross":
        t = max(3, s // 3)
        c0 = x0 + (s - t) // 2
        r0 = y0 + (s - t) // 2
        draw.rectangle(rect(c0, y0, c0 + t - 1, y1), fill=rgb)
        draw.rectangle(rect(x0, r0, x1, r0 + t - 1), fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Perturb a canonical colour by up to +-15 per channel (colour names stay unambiguous)."""
    return tuple(int(np.clip(c + rng.integers(-15, 16), 0, 255)) for c in rgb)  # type: ignore[return-value]


LABEL_CELL = 8
"""Side of a label cell, pixels: one vision patch of the embedded model, so a scene has
``(SCENE_SIZE // LABEL_CELL) ** 2`` = 256 cells (a digit is 10 px wide, so 8 px cells keep
neighbouring digits apart)."""
LABEL_HEADS: dict[str, int] = {"shape": len(SHAPES) + 1, "color": len(COLORS) + 1, "digit": len(DIGITS) + 1}
"""Classes of each per-cell label (class 0 = nothing there)."""


def _cells(mask: Image.Image) -> np.ndarray:
    """Share of each ``LABEL_CELL`` cell that a binary ``L`` mask covers, ``(rows, cols)`` in [0, 1]."""
    n = SCENE_SIZE // LABEL_CELL
    a = np.asarray(mask, dtype=np.float32) / 255.0
    return a.reshape(n, LABEL_CELL, n, LABEL_CELL).mean(axis=(1, 3))


def _label_cells(layers: list[tuple[Image.Image, dict[str, int]]]) -> np.ndarray:
    """``(3, rows, cols)`` int labels (shape, colour, digit; 0 = none): each cell takes the
    classes of the item that covers most of it, if that item covers at least 15 % of it."""
    n = SCENE_SIZE // LABEL_CELL
    labels = np.zeros((len(LABEL_HEADS), n, n), dtype=np.int64)
    if not layers:
        return labels
    cover = np.stack([_cells(mask) for mask, _ in layers])
    best = cover.argmax(axis=0)
    on = cover.max(axis=0) >= 0.15
    for h, head in enumerate(LABEL_HEADS):
        classes = np.array([cls.get(head, 0) for _, cls in layers])
        labels[h] = np.where(on, classes[best], 0)
    return labels


def _scaled_labels(labels: np.ndarray, scale: int) -> np.ndarray:
    """Per-cell labels of a scene drawn ``scale`` times larger: each base cell becomes
    ``scale x scale`` cells of the same ``LABEL_CELL`` side (the drawing is an exact enlargement)."""
    return labels if scale == 1 else labels.repeat(scale, axis=1).repeat(scale, axis=2)


def make_scene(rng: np.random.Generator, with_labels: bool = False, scale: int = 1):
    """Render one shape scene; return the image and its objects as ``(shape, color, column)``
    (and, with ``with_labels``, the per-cell labels of :func:`_label_cells`). ``scale`` draws the
    same scene (the same draws from ``rng``) ``scale`` times larger, its labels on the larger grid.

    Invariants: 1-3 objects, sorted left to right, at most one per column, all shapes
    distinct, all colours distinct, every object inside its column (no overlaps). The labels
    draw nothing from ``rng``, so they never change the scene.
    """
    k = int(rng.integers(1, 4))
    columns = sorted(int(c) for c in rng.permutation(len(COLUMNS))[:k])
    shapes = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:k]]
    color_names = list(COLORS)
    colors = [color_names[i] for i in rng.permutation(len(color_names))[:k]]
    scale = check_scale(scale)
    image = _canvas(rng, scale)
    draw = ImageDraw.Draw(image)
    width = SCENE_SIZE / len(COLUMNS)
    layers = []
    for shape, color, column in zip(shapes, colors, columns):
        side = int(rng.integers(OBJECT_MIN_SIZE, OBJECT_MAX_SIZE + 1))
        left = math.ceil(column * width) + _MARGIN
        right = math.floor((column + 1) * width) - _MARGIN - side
        x0 = int(rng.integers(left, max(left, right) + 1))
        y0 = int(rng.integers(_MARGIN + 2, SCENE_SIZE - side - _MARGIN - 2 + 1))
        _draw_object(draw, shape, _jitter(rng, COLORS[color]), (x0, y0, side), scale)
        if with_labels:
            mask = Image.new("L", (SCENE_SIZE, SCENE_SIZE), 0)
            _draw_object(ImageDraw.Draw(mask), shape, 255, (x0, y0, side))
            layers.append((mask, {"shape": SHAPES.index(shape) + 1, "color": list(COLORS).index(color) + 1}))
    objects = list(zip(shapes, colors, columns))
    return (image, objects, _scaled_labels(_label_cells(layers), scale)) if with_labels else (image, objects)


def make_digit_strip(rng: np.random.Generator, with_labels: bool = False, scale: int = 1):
    """Render a row of 4-8 digits on a muted background; return the image and the digits (and,
    with ``with_labels``, the per-cell labels of :func:`_label_cells`; nothing drawn from ``rng``).
    ``scale`` draws the same strip ``scale`` times larger, its labels on the larger grid."""
    scale = check_scale(scale)
    n = int(rng.integers(READ_DIGITS[0], READ_DIGITS[1] + 1))
    digits = "".join(DIGITS[i] for i in rng.integers(0, 10, size=n))
    sx, sy = _GLYPH_SCALE
    glyph_w, glyph_h = 5 * sx, 7 * sy
    width = n * glyph_w + (n - 1) * _GLYPH_GAP
    x0 = int(rng.integers(4, SCENE_SIZE - width - 4 + 1))
    y0 = int(rng.integers(4, SCENE_SIZE - glyph_h - 4 + 1))
    rgb = _jitter(rng, COLORS[list(COLORS)[rng.integers(len(COLORS))]])
    image = _canvas(rng, scale)
    draw = ImageDraw.Draw(image)
    layers = []
    for i, digit in enumerate(digits):
        gx = x0 + i * (glyph_w + _GLYPH_GAP)
        for row, line in enumerate(_FONT[digit]):
            for col, dot in enumerate(line):
                if dot == "#":
                    x, y = gx + col * sx, y0 + row * sy
                    draw.rectangle((x * scale, y * scale, (x + sx) * scale - 1, (y + sy) * scale - 1), fill=rgb)
        if with_labels:  # the glyph's box, not its ink: a cell "has" a digit where the digit is
            mask = Image.new("L", (SCENE_SIZE, SCENE_SIZE), 0)
            ImageDraw.Draw(mask).rectangle((gx, y0, gx + glyph_w - 1, y0 + glyph_h - 1), fill=255)
            layers.append((mask, {"digit": int(digit) + 1}))
    return (image, digits, _scaled_labels(_label_cells(layers), scale)) if with_labels else (image, digits)


# --------------------------------------------------------------------------- questions


def spaced(text: str) -> str:
    """``"407"`` -> ``"4 0 7"``: a number as the model writes it (one token per digit)."""
    return " ".join(text)


def describe(objects: list[tuple[str, str, int]]) -> str:
    """The ``describe`` answer: objects left to right, joined by "," and a final "and"."""
    phrases = [f"a {color} {shape} {COLUMNS[column]}" for shape, color, column in objects]
    if len(phrases) == 1:
        return phrases[0]
    return " , ".join(phrases[:-1]) + " and " + phrases[-1]


def scene_question(rng: np.random.Generator, kind: str, objects: list[tuple[str, str, int]],
                   subject: tuple[str, str, int] | None = None) -> tuple[str, str]:
    """``(question, answer)`` of ``kind`` about a shape scene; ``subject`` picks the object asked about."""
    shape, color, _ = subject if subject is not None else objects[rng.integers(len(objects))]
    if kind == "color":
        return f"what color is the {shape}?", color
    if kind == "shape":
        return f"what shape is {color}?", shape
    if kind == "count":
        return "how many shapes?", COUNT_WORDS[len(objects) - 1]
    if kind == "describe":
        return "describe the scene.", describe(objects)
    if kind == "exists":
        if rng.random() < 0.5:
            return f"is there a {shape}?", "yes"
        absent = [s for s in SHAPES if s not in {o[0] for o in objects}]  # never empty: <= 3 of 4 present
        return f"is there a {absent[rng.integers(len(absent))]}?", "no"
    raise ValueError(f"not a scene question kind: {kind!r}")


def text_question(rng: np.random.Generator, kind: str) -> tuple[str, str]:
    """A text-only ``(question, answer)`` of ``kind`` (see the module docstring)."""
    if kind == "arith":
        op = list(OPERATIONS)[rng.integers(len(OPERATIONS))]
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        if op == "minus" and b > a:
            a, b = b, a  # answers stay non-negative
        return f"what is {a} {op} {b}?", spaced(str(OPERATIONS[op](a, b)))
    if kind == "reverse":
        pool = (*COLORS, *SHAPES, *DIGITS)
        n = int(rng.integers(REVERSE_ITEMS[0], REVERSE_ITEMS[1] + 1))
        items = [pool[i] for i in rng.integers(0, len(pool), size=n)]
        return f"reverse {' '.join(items)}.", " ".join(reversed(items))
    if kind == "sequence":
        start = int(rng.integers(0, 8))
        stop = int(rng.integers(start + 2, 10))
        return f"count from {start} to {stop}.", " ".join(str(i) for i in range(start, stop + 1))
    raise ValueError(f"not a text question kind: {kind!r}")


def question_kind(question: str) -> str:
    """Classify a generated question into one of ``QUESTION_KINDS``."""
    for prefix, kind in (("what color", "color"), ("what shape", "shape"), ("how many", "count"),
                         ("is there", "exists"), ("describe", "describe"), ("read", "read"),
                         ("what is", "arith"), ("reverse", "reverse"), ("count from", "sequence")):
        if question.startswith(prefix):
            return kind
    raise ValueError(f"not a generated question: {question!r}")


def draw_kind(rng: np.random.Generator, weights: dict[tuple[str, ...], float] | None = None) -> str:
    """A task kind: a family by ``weights`` (default ``FAMILY_WEIGHTS``), then a kind uniformly."""
    weights = FAMILY_WEIGHTS if weights is None else weights
    families = list(weights)
    p = np.array(list(weights.values()), dtype=float)
    family = families[rng.choice(len(families), p=p / p.sum())]
    return family[rng.integers(len(family))]


def make_example(rng: np.random.Generator, kind: str | None = None, scale: int = 1) -> Example:
    """One ``(image | None, question, answer)`` request, of ``kind`` or drawn by :func:`draw_kind`
    (its image drawn ``scale`` times larger: the same draws, so the same request)."""
    kind = draw_kind(rng) if kind is None else kind
    if kind == "read":
        image, digits = make_digit_strip(rng, scale=scale)
        return image, "read the number.", spaced(digits)
    if kind in TEXT_KINDS:
        return (None, *text_question(rng, kind))
    image, objects = make_scene(rng, scale=scale)
    return (image, *scene_question(rng, kind, objects))


IMAGE_FAMILY_WEIGHTS = {family: w for family, w in FAMILY_WEIGHTS.items() if family != TEXT_KINDS}
"""``FAMILY_WEIGHTS`` without the text-only family (renormalised when drawn)."""


def make_split(seed: int, n: int, *, image_only: bool = False, scale: int = 1) -> list[Example]:
    """Generate ``n`` requests from ``numpy.random.default_rng(seed)`` (same seed -> same split).

    ``image_only`` draws from the image families only (shape scenes and digit strips, in
    their ``FAMILY_WEIGHTS`` proportions): the split of studies about visual tokens. ``scale``
    draws every image that many times larger (``scale * SCENE_SIZE`` px): the same requests
    (questions, answers, object positions and colours) with ``scale**2`` times the patches.
    """
    scale = check_scale(scale)
    rng = np.random.default_rng(seed)
    weights = IMAGE_FAMILY_WEIGHTS if image_only else FAMILY_WEIGHTS
    return [make_example(rng, draw_kind(rng, weights), scale) for _ in range(n)]


def make_demo(seed: int, per_kind: int = 1) -> list[Example]:
    """``per_kind`` requests of every kind, in ``QUESTION_KINDS`` order (the demo menu)."""
    rng = np.random.default_rng(seed)
    return [make_example(rng, kind) for kind in QUESTION_KINDS for _ in range(per_kind)]


def make_conversation(rng: np.random.Generator, max_turns: int = 5,
                      weights: dict[tuple[str, ...], float] | None = None, with_labels: bool = False,
                      scales: tuple[int, ...] = (1,)):
    """A training chat: one request family (drawn by ``weights``), 1-``max_turns`` turns;
    ``(image | None, turns)``, plus the image's per-cell labels (None without an image) when
    ``with_labels`` (the same draws either way).

    A ``describe`` chat is that one turn, as the held-out split asks it (after other turns it
    could copy their answers). Other shape-scene chats get up to one question per short kind
    (``max_turns`` of them), in random order; each present object is the subject of at most
    one ``color``/``shape``/``exists``-yes question, so earlier turns never give later answers
    away. Digit strips get one ``read`` turn; text-only chats get 1-``max_turns`` independent
    puzzles.

    ``scales``: the image is drawn at one of them, chosen with one more draw from ``rng`` only
    when there are several (so ``(1,)`` draws exactly what it always drew).
    """
    kind = draw_kind(rng, weights)
    scale = check_scale(scales[int(rng.integers(len(scales)))] if len(scales) > 1 else scales[0])
    if kind == "read":
        image, digits, *labels = make_digit_strip(rng, with_labels, scale)
        return (image, [("read the number.", spaced(digits))], *labels)
    if kind in TEXT_KINDS:
        turns = [text_question(rng, kind)]
        turns += [text_question(rng, TEXT_KINDS[rng.integers(len(TEXT_KINDS))])
                  for _ in range(int(rng.integers(0, max_turns)))]
        return (None, turns, None) if with_labels else (None, turns)
    image, objects, *labels = make_scene(rng, with_labels, scale)
    if kind == "describe":
        return (image, [scene_question(rng, kind, objects)], *labels)
    unused = [objects[i] for i in rng.permutation(len(objects))]
    kinds = [kind] + [k for k in (SHORT_KINDS[i] for i in rng.permutation(len(SHORT_KINDS))) if k != kind]
    turns: list[tuple[str, str]] = []
    for k in kinds[:max_turns]:
        if k == "count":
            turns.append(scene_question(rng, k, objects))
        elif unused:
            turns.append(scene_question(rng, k, objects, subject=unused.pop()))
    return (image, turns, *labels)
