"""A tiny Qwen2-VL-shaped tokenizer, trained in-process, for offline checkpoints.

Tests and the demo model need a tokenizer folder without a hub download. This
one is a byte-level BPE with Qwen2's pre-tokenizer, NFC normalization and the
Qwen2-VL special tokens at ids 0..13, so any text encodes and transformers'
AutoTokenizer loads the folder as a Qwen2Tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from foveal.errors import ConfigError
from foveal.loader.chat_templates import QWEN2_VL_CHAT_TEMPLATE

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's split rule: contractions, letter runs, single digits, punctuation
# runs, newlines, then whitespace.
_QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_MODEL_MAX_LENGTH = 32768

_CORPUS = """\
The picture shows a red circle, a blue square and a green triangle on a white
background. Describe the image in one sentence. What color is the square? The
square is blue. How many shapes are there in the picture? There are three shapes.
A cat is sitting on the window and looking at the birds in the garden. The dog
runs across the field to catch the ball, and the children laugh and clap.
Vision language models read images and text together. An image is cut into
patches, each patch becomes a token, and the language model answers a question
about what it sees. The answer should be short, clear and correct.
In the morning the sun rises over the hills, the sky turns orange and then blue,
and the city slowly wakes up. People walk to work, buses stop at the corner, and
the smell of fresh bread comes from the bakery on the main street.
Please read the text in the image and write it down. The sign says: "Open from
9 to 5, Monday to Friday." The price of the coffee is 3.50 and the tea is 2.75.
You are a helpful assistant. Answer the user's question as well as you can. If
you do not know the answer, say that you do not know. Don't guess; it's better
to be honest. We'll look at the next example, and they're ready to help.
The video shows a person who opens a door, walks into the room and sits down at
a table. Then the person picks up a book, reads a few pages and smiles.
A train leaves the station at 10:30 and arrives at 12:45. How long is the trip?
The trip takes two hours and fifteen minutes. Numbers: 0 1 2 3 4 5 6 7 8 9 10
100 1000 2024 3.14 42. Punctuation: (a), [b], {c}, <d>, "e", 'f', a-b, a/b, a*b.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor
jugs. How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
The weather today is sunny with a light wind from the west. Tomorrow there may
be rain in the afternoon, so take an umbrella when you go out. The forest is
quiet, the river is cold, and the mountain is covered with snow in the winter.
The chart has four bars. The first bar is the tallest and the last bar is the
shortest. The title of the chart is "Sales by year", and the values grow from
left to right until the third year, when they fall again.
Question: What is written on the red sign? Answer: STOP.
Question: Where is the ball? Answer: The ball is under the chair.
Question: Is the light on or off? Answer: The light is on.
"""


def _build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tokenizer


def _train(vocab_size: int, extra_corpus: str = "") -> Tokenizer:
    tokenizer = _build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = (_CORPUS + extra_corpus).splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _added_tokens_decoder(token_ids: dict[str, int]) -> dict[str, dict]:
    return {
        str(token_id): {
            "content": token, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        }
        for token, token_id in token_ids.items()
    }


def _tokenizer_config(token_ids: dict[str, int]) -> dict:
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(token_ids),
        "additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512,
                         extra_corpus: str = "") -> dict[str, int]:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja
    into out_dir; returns special token -> id (ids 0..13, QWEN_SPECIAL_TOKENS order).

    vocab_size is an upper bound: 14 special tokens + 256 byte symbols + as
    many merges as the embedded corpus supports. Output is byte-identical
    across calls. `extra_corpus` is text the merges should also fit (the demo
    model's task vocabulary).
    """
    minimum = len(QWEN_SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ConfigError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use >= {minimum}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(vocab_size, extra_corpus)
    token_ids = {token: tokenizer.token_to_id(token) for token in QWEN_SPECIAL_TOKENS}
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config_text = json.dumps(_tokenizer_config(token_ids), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE, encoding="utf-8")
    return token_ids
