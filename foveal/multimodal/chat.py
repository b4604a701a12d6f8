"""OpenAI-style chat messages -> chat-template messages + media in order."""
from __future__ import annotations

from typing import Any

from foveal.errors import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool")


def _image_source(part: dict[str, Any]) -> Any:
    kind = part.get("type")
    value = part.get(kind) if kind else None
    if kind == "image_url":
        value = value.get("url") if isinstance(value, dict) else value
    if value is None:
        raise InvalidRequestError(f"content part of type {kind!r} has no {kind!r} field")
    return value


def _parse_content(content: Any, images: list) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError("message content is a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind in ("image_url", "image", "image_pil"):
            images.append(_image_source(part))
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(
                f"content part type {kind!r} is not supported; use 'text' or 'image_url'")
    return parts


def parse_chat_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list]:
    """Returns the messages the chat template renders (each image part becomes
    {"type": "image"}) and the image sources in the order they appear."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    images: list = []
    rendered = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise InvalidRequestError(f"message role {role!r} is not one of {_ROLES}")
        rendered.append({**message, "content": _parse_content(message.get("content"), images)})
    return rendered, images
