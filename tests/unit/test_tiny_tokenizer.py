import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from foveal.errors import ConfigError
from foveal.loader.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from foveal.loader.tiny_tokenizer import QWEN_SPECIAL_TOKENS, write_tiny_tokenizer

_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)


def test_special_tokens_take_ids_0_to_13_in_qwen_order(tmp_path):
    token_ids = write_tiny_tokenizer(tmp_path)
    assert list(token_ids) == list(QWEN_SPECIAL_TOKENS)
    assert list(token_ids.values()) == list(range(14))
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert all(vocab[token] == token_id for token, token_id in token_ids.items())


def test_vocab_size_is_at_most_the_requested_size(tmp_path):
    write_tiny_tokenizer(tmp_path, vocab_size=300)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert 14 + 256 <= len(vocab) <= 300


def test_vocab_size_below_bytes_plus_specials_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size=100"):
        write_tiny_tokenizer(tmp_path, vocab_size=100)


def test_same_call_twice_writes_identical_files(tmp_path):
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    for name in _FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_other_process_writes_identical_files(tmp_path, tiny_dir):
    # Hash seeds differ per process; training must not depend on them.
    code = f"from foveal.loader.tiny_tokenizer import write_tiny_tokenizer; write_tiny_tokenizer({str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    for name in _FILES:
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()


def test_config_declares_qwen2_special_tokens_and_template(tiny_dir):
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["chat_template"] == QWEN2_VL_CHAT_TEMPLATE
    assert (tiny_dir / "chat_template.jinja").read_text() == QWEN2_VL_CHAT_TEMPLATE
    assert {entry["content"] for entry in config["added_tokens_decoder"].values()} == set(QWEN_SPECIAL_TOKENS)


def test_transformers_loads_folder_as_qwen2_tokenizer(hf_tokenizer):
    assert type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    assert hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.pad_token_id == 0
    assert hf_tokenizer.bos_token is None
    assert hf_tokenizer.convert_tokens_to_ids("<|image_pad|>") == 12


@pytest.mark.parametrize("text", [
    "The picture shows a red circle.",
    "naïve café — 東京 🙂👍🏽 Ωμέγα",
    "tabs\tand\nnew lines\r\n  spaced   out",
    "\x00\x7f\u200b control bytes",
])
def test_any_text_encodes_and_decodes_back(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text


def test_corpus_words_merge_into_fewer_tokens_than_bytes(hf_tokenizer):
    text = "The picture shows a helpful assistant."
    assert len(hf_tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) // 2


def test_chat_template_renders_qwen2_vl_prompt(hf_tokenizer):
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is here?"}]}]
    prompt = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, add_vision_id=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>What is here?<|im_end|>\n"
        "<|im_start|>assistant\n")
