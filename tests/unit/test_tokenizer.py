import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from foveal.errors import CheckpointError, InvalidRequestError
from foveal.loader.tiny_tokenizer import write_tiny_tokenizer
from foveal.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "naïve café — 東京タワー 🙂👍🏽 Ωμέγα ñ",
    "中文测试：你好，世界！",
    "Look <|vision_start|><|image_pad|><|vision_end|> here<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  \n\n\ttab",
    "def f(x):\n    return x ** 2  # 3.14",
    "e\u0301 decomposed and \u00e9 composed",
    "",
]

CONVERSATIONS = {
    "text_only": [{"role": "user", "content": "What is the capital of France?"}],
    "image_parts": [{"role": "user", "content": [
        {"type": "image", "image": "file:///demo.png"},
        {"type": "text", "text": "Describe this image."}]}],
    "image_url_and_video": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "video", "video": "clip.mp4"},
        {"type": "text", "text": "Compare them."}]}],
    "multi_turn_with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)


def _copy_of(tiny_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, text, skip_special_tokens):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    expected = hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_token_text_encodes_to_its_single_id(tokenizer):
    assert tokenizer.encode("a<|image_pad|>b") == [*tokenizer.encode("a"), 12, *tokenizer.encode("b")]


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_decode_round_trips_nfc_text(tokenizer, text):
    import unicodedata

    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_decode_stream_chunks_join_to_decode(tokenizer):
    ids = tokenizer.encode("emoji 🙂 and 東京<|im_end|> end")
    stream = tokenizer.decode_stream()
    chunks = [stream.step(token_id) for token_id in ids]
    assert "".join(chunk for chunk in chunks if chunk) == tokenizer.decode(ids)


def test_special_ids_and_sizes_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id == 0
    assert tokenizer.bos_token_id is None
    assert set(tokenizer.all_special_ids) == set(hf_tokenizer.all_special_ids)
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.token_to_id("<|video_pad|>") == 13
    assert tokenizer.id_to_token(13) == "<|video_pad|>"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_add_vision_id_numbers_pictures_like_transformers(tokenizer, hf_tokenizer):
    messages = CONVERSATIONS["multi_turn_with_system"]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, add_vision_id=True)
    rendered = tokenizer.apply_chat_template(messages, add_vision_id=True)
    assert rendered == expected
    assert "Picture 2: " in rendered


def test_media_objects_and_none_fields_render_like_transformers(tokenizer, hf_tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (4, 4))},
                                     {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A square.", "tool_calls": None}]
    template = "{% for m in messages %}{{ m | tojson }}|{{ m.content[0].image if m.content is not string }}{% endfor %}"
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=False) == expected
    assert "<Image>" in expected


def test_template_globals_match_transformers(tokenizer, hf_tokenizer):
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.role }}:{{ m.content }}{% endgeneration %}\n"
        "  {% endfor %}{{ ns.n }} {{ eos_token }} {{ tools | tojson }} {{ dict(a=1) | tojson }}"
        "{{ strftime_now('%Y')[:2] }}")
    messages = [{"role": "user", "content": "é<b>"}] * 3
    tools = [{"type": "function", "function": {"name": "f", "description": "<&>"}}]
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=template)
    assert tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                         add_generation_prompt=False) == expected


def test_template_raise_exception_is_invalid_request_error(tokenizer):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="system first"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


def test_template_syntax_error_is_invalid_request_error(tokenizer):
    with pytest.raises(InvalidRequestError, match="does not compile"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")


def test_empty_conversation_is_invalid_request_error(tokenizer):
    with pytest.raises(InvalidRequestError, match="empty"):
        tokenizer.apply_chat_template([])


def test_chat_template_jinja_wins_over_json_and_config(tiny_dir, tmp_path):
    folder = _copy_of(tiny_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "config"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    (folder / "chat_template.jinja").write_text("jinja")
    assert Tokenizer.from_pretrained(folder).get_chat_template() == "jinja"
    (folder / "chat_template.jinja").unlink()
    assert Tokenizer.from_pretrained(folder).get_chat_template() == "json"
    (folder / "chat_template.json").unlink()
    assert Tokenizer.from_pretrained(folder).get_chat_template() == "config"


def test_named_templates_pick_tool_use_when_tools_are_given(tiny_dir, tmp_path):
    folder = _copy_of(tiny_dir, tmp_path)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain"},
                               {"name": "tool_use", "template": "tools"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("rag")
    tokenizer = Tokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == "plain"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "tools"
    assert tokenizer.apply_chat_template(messages, chat_template="rag") == "rag"


def test_model_without_chat_template_gives_clear_error(tiny_dir, tmp_path):
    folder = _copy_of(tiny_dir, tmp_path)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.encode("still encodes")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_checkpoint_error_naming_it(tiny_dir, tmp_path, missing):
    folder = _copy_of(tiny_dir, tmp_path)
    (folder / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        Tokenizer.from_pretrained(folder)


def test_added_token_only_in_config_is_added(tiny_dir, tmp_path):
    folder = _copy_of(tiny_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    size = Tokenizer.from_pretrained(folder).vocab_size
    config["added_tokens_decoder"][str(size)] = {"content": "<|extra|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.encode("a<|extra|>") == [*tokenizer.encode("a"), size]
    assert size in tokenizer.all_special_ids


def test_added_token_id_disagreeing_with_tokenizer_json_is_checkpoint_error(tiny_dir, tmp_path):
    folder = _copy_of(tiny_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["5"]["content"] = "<|im_end|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="different tokenizers"):
        Tokenizer.from_pretrained(folder)
