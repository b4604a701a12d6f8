"""Runtime tokenizer: a checkpoint's tokenizer.json, special tokens and chat template.

transformers is not imported here. Files are read the way transformers reads
them, and chat templates render in the same sandboxed jinja2 setup, so a prompt
built here equals transformers' `apply_chat_template(..., tokenize=False)`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from foveal.errors import CheckpointError, InvalidRequestError
from foveal.loader.chat_templates import render_chat_template

# The named special tokens transformers passes to every chat template.
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class TokenStream:
    """Incremental detokenization: feed one generated id at a time, get the
    text it completes (None while a multi-byte character is still partial)."""

    def __init__(self, backend: BackendTokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._backend, token_id)


class Tokenizer:
    """Encodes and decodes text and renders chat prompts for one checkpoint."""

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str],
                 chat_templates: dict[str, str], path: str = "") -> None:
        self._backend = backend
        self.special_tokens = special_tokens  # e.g. {"eos_token": "<|im_end|>", ...}
        self.chat_templates = chat_templates  # name -> jinja text; "default" first choice
        self.path = path
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, token in added.items() if token.special)
        # Ids this tokenizer can produce (base + added); a model's embedding may be padded larger.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._named_token_id("eos_token")
        self.pad_token_id = self._named_token_id("pad_token")
        self.bos_token_id = self._named_token_id("bos_token")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Loads tokenizer.json, tokenizer_config.json and any chat template files
        (chat_template.jinja > chat_template.json > tokenizer_config.json)."""
        folder = Path(path)
        config = _read_json(folder / "tokenizer_config.json")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{folder} has no tokenizer.json; Foveal needs a fast (tokenizers) tokenizer file "
                "there (save one with transformers' tokenizer.save_pretrained)")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        _add_missing_tokens(backend, config.get("added_tokens_decoder", {}), folder)
        special_tokens = {
            name: content for name in _NAMED_SPECIAL_TOKENS
            if (content := _token_content(config.get(name))) is not None
        }
        return cls(backend, special_tokens, _load_chat_templates(folder, config), str(folder))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in text (e.g. "<|image_pad|>") encode to their one id."""
        if not isinstance(text, str) or not text.isascii():
            _check_unicode(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> TokenStream:
        return TokenStream(self._backend, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def __len__(self) -> int:
        return self.vocab_size

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: the named one, the given text, "tool_use" when
        tools are passed and the checkpoint has it, else "default"."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise InvalidRequestError(
                f"the tokenizer at {self.path} has several chat templates and no default; "
                f"pass chat_template= one of {sorted(self.chat_templates)}")
        raise InvalidRequestError(
            f"the model at {self.path} has no chat template (no chat_template.jinja, "
            "chat_template.json or 'chat_template' in tokenizer_config.json); use generate() "
            "with a formatted prompt, or pass chat_template= a jinja template")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """Renders messages to the prompt text; extra kwargs (e.g. add_vision_id=True)
        reach the template as variables."""
        template = self.get_chat_template(chat_template, tools)
        template_kwargs = {**self.special_tokens, **kwargs}
        return render_chat_template(template, messages, tools, add_generation_prompt, template_kwargs)

    def _named_token_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self._backend.token_to_id(content)


def _check_unicode(text: Any) -> None:
    # The backend raises a bare TypeError on these; JSON can carry lone surrogates.
    if not isinstance(text, str):
        raise InvalidRequestError(f"a prompt is text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"the prompt holds a lone surrogate {text[exc.start]!r} at character {exc.start}; "
            "send valid Unicode text") from None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {path.name}; copy it from the original checkpoint")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-download or re-save it") from exc


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _add_missing_tokens(backend: BackendTokenizer, added_tokens_decoder: dict[str, dict],
                        folder: Path) -> None:
    """Adds tokens that tokenizer_config.json declares but tokenizer.json lacks,
    and checks each one has the id the config gives it."""
    for token_id, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        content = entry["content"]
        if backend.token_to_id(content) is None:
            token = AddedToken(content, single_word=entry.get("single_word", False),
                               lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                               normalized=entry.get("normalized", False),
                               special=entry.get("special", False))
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
        if backend.token_to_id(content) != int(token_id):
            raise CheckpointError(
                f"{folder}/tokenizer_config.json gives {content!r} id {token_id} but tokenizer.json "
                f"gives it {backend.token_to_id(content)}; the two files come from different tokenizers")


def _load_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """name -> template text, with transformers' precedence for the default:
    chat_template.jinja over chat_template.json over tokenizer_config.json."""
    templates: dict[str, str] = {}
    in_config = config.get("chat_template")
    if isinstance(in_config, str):
        templates["default"] = in_config
    elif isinstance(in_config, list):
        templates.update({entry["name"]: entry["template"] for entry in in_config})
    if (folder / "chat_template.json").is_file():
        templates["default"] = _read_json(folder / "chat_template.json")["chat_template"]
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    return templates
