"""Chat templates: the texts checkpoints publish, and rendering them as transformers does.

Template text must equal what the checkpoint ships byte for byte: the rendered
prompt is what the model was trained on. Rendering uses transformers' jinja2
setup (sandbox, trim_blocks/lstrip_blocks, loopcontrols, `{% generation %}`,
raise_exception, strftime_now, tojson) and its input cleaning, so
`Tokenizer.apply_chat_template` equals transformers' `tokenize=False` output.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import numpy as np
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from foveal.errors import InvalidRequestError

# Qwen2-VL-*-Instruct (also Qwen2.5-VL): an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>; the processor later repeats
# <|image_pad|> once per visual token.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Older names of a message's reasoning; templates read "reasoning_content"
# (gpt-oss templates read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(template: str, messages: list[Any], tools: list[dict] | None,
                         add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> str:
    """Renders one conversation. A template's raise_exception, a syntax error or
    a bad message is an InvalidRequestError naming the cause."""
    if not messages:
        raise InvalidRequestError("the conversation is empty; pass at least one message")
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise InvalidRequestError("tools must be JSON-schema dicts")
    chat = _alias_reasoning_fields(_template_data(_drop_none_fields(messages)))
    try:
        return _compile(template).render(
            messages=chat, tools=_template_data(tools), documents=None,
            add_generation_prompt=add_generation_prompt, **_template_data(template_kwargs))
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc


def _drop_none_fields(messages: list[Any]) -> list[dict]:
    # APIs send content=None or tool_calls=None; templates handle a missing key
    # but may render None as text.
    if not isinstance(messages, list):
        raise InvalidRequestError(f"messages must be a list of dicts, got {type(messages).__name__}")
    cleaned = []
    for message in messages:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"each message must be a dict, got {message!r}")
        cleaned.append({key: value for key, value in message.items() if value is not None})
    return cleaned


def _template_data(value: Any) -> Any:
    """A copy made of plain JSON types only: media objects (PIL images, arrays)
    become an inert "<TypeName>" string, since the sandbox cannot vet their
    methods and templates only test whether a media key is present."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses such as enums carry methods; keep the base value
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_template_data(key): _template_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_template_data(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _template_data(value.model_dump())
    if isinstance(value, np.generic):  # np.bool_(False) must stay falsy
        return _template_data(value.item())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so a template cannot reach
    Python internals through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace; rename {name!r}")


class _TemplateDict:
    # dict() and dict.fromkeys() without exposing the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(
            f"the chat template does not compile (line {exc.lineno}: {exc.message}); fix the template") from exc
