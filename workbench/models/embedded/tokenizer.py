"""Word-level tokenizer with Qwen-style special tokens and chat template.

The vocabulary is closed: the special tokens, ``[UNK]``, a newline token, a few
punctuation marks, the chat role names and every word the scene generator
(:mod:`workbench.models.embedded.v2.tasks`) can emit. Text is lower-cased and split
into words, single punctuation characters and ``"\\n"``; spaces are dropped.
Decoding joins tokens with single spaces, so a generated answer such as
``["yes", "<|im_end|>"]`` decodes to ``"yes"`` with ``skip_special_tokens=True``.

Token-id invariant: the ids below (``SPECIAL_TOKENS`` order, starting at 0) never
change, so ``IMAGE_TOKEN_ID`` etc. can be written straight into the model config.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from .v2.tasks import VOCAB_WORDS

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
UNK_TOKEN = "[UNK]"

SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
PAD_TOKEN_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(7)
EOS_TOKEN_ID = IM_END_ID  # generation stops at <|im_end|>, as in Qwen chat models

ROLE_WORDS: tuple[str, ...] = ("system", "user", "assistant")
PUNCTUATION: tuple[str, ...] = ("?", ".", ",", "!", "'", ":")

# Qwen2/3-VL chat format, restricted to what this model understands (text + image/video slots).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def build_vocab(words: tuple[str, ...] = VOCAB_WORDS) -> dict[str, int]:
    """Return the full token -> id mapping (special tokens first, ids contiguous from 0) for a
    model whose tasks use ``words`` (default: the shipped model's)."""
    tokens = [*SPECIAL_TOKENS, UNK_TOKEN, "\n", *PUNCTUATION, *ROLE_WORDS, *words]
    tokens = list(dict.fromkeys(tokens))
    return {tok: i for i, tok in enumerate(tokens)}


def build_backend(words: tuple[str, ...] = VOCAB_WORDS, split_digits: bool = True) -> Tokenizer:
    """Build the raw ``tokenizers.Tokenizer`` (WordLevel model, lowercase, word/punct/newline split).

    ``split_digits`` makes every digit a token of its own ("56" -> "5", "6"), so that any number
    is spelled with ten tokens (the shipped model's tasks); False keeps whole words (the first
    embedded model's tokenizer, retired)."""
    tok = Tokenizer(WordLevel(vocab=build_vocab(words), unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    # Keep only the matches (words, single punctuation chars, newlines); drop spaces/tabs.
    pattern = r"\d|[^\W\d]+|\n|[^\w\s]" if split_digits else r"\w+|\n|[^\w\s]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_tokenizer(words: tuple[str, ...] = VOCAB_WORDS, split_digits: bool = True) -> PreTrainedTokenizerFast:
    """Return the transformers tokenizer (with chat template) of an embedded model whose tasks
    use ``words`` (:func:`build_backend`; the defaults are the shipped model's)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(words, split_digits),
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        extra_special_tokens={
            "image_token": IMAGE_PAD,
            "video_token": VIDEO_PAD,
            "vision_start_token": VISION_START,
            "vision_end_token": VISION_END,
        },
        model_max_length=512,
        padding_side="left",  # left padding is what batched generation needs
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    _check_ids(tokenizer)
    return tokenizer


def _check_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    """Assert the token-id invariant documented in the module docstring."""
    expected = dict(zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))))
    got = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    if got != expected:
        raise AssertionError(f"special token ids drifted: {got} != {expected}")
