"""OpenAI-style chat messages -> chat-template messages + media in order.

Parts: "text"; "image_url" ({"url", "detail": "auto"|"low"|"high"}), "image",
"image_pil"; "video_url" ({"url"}: a data:video/... URL, a file:// URL or a
path; a server fetches http(s) into bytes first), "video" (any source
`load_video` takes, e.g. a list of frames).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from foveal.errors import InvalidRequestError
from foveal.multimodal.budget import DETAILS

_ROLES = ("system", "user", "assistant", "tool")
_IMAGE_PARTS = ("image_url", "image", "image_pil")
_VIDEO_PARTS = ("video_url", "video")


@dataclass
class ChatConversation:
    messages: list[dict[str, Any]]  # what the chat template renders
    images: list = field(default_factory=list)  # sources, or {"image": src, "detail": d}
    videos: list = field(default_factory=list)  # sources

    def multi_modal_data(self) -> dict[str, list]:
        """The prompt dict's multi_modal_data (only the modalities present)."""
        return {name: items for name, items in (("image", self.images), ("video", self.videos)) if items}


def _part_value(part: dict[str, Any]) -> Any:
    kind = part.get("type")
    value = part.get(kind) if kind else None
    if kind in ("image_url", "video_url"):
        value = value.get("url") if isinstance(value, dict) else value
    if value is None:
        raise InvalidRequestError(f"content part of type {kind!r} has no {kind!r} field")
    return value


def image_item(part: dict[str, Any]) -> Any:
    """An image part -> its source, or {"image": source, "detail": d} when detail is not "auto"."""
    source = _part_value(part)
    options = part.get("image_url") if part.get("type") == "image_url" else None
    detail = (options.get("detail") if isinstance(options, dict) else None) or "auto"
    if detail not in DETAILS:
        raise InvalidRequestError(f"image_url detail {detail!r} is not one of {list(DETAILS)}")
    return source if detail == "auto" else {"image": source, "detail": detail}


def video_source(part: dict[str, Any]) -> Any:
    """A video part -> its source (for video_url: the URL string)."""
    return _part_value(part)


def _parse_content(content: Any, conversation: ChatConversation) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError("message content is a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text", ""), str):
                raise InvalidRequestError(f"a text part's 'text' is a string, got "
                                          f"{type(part['text']).__name__}")
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind in _IMAGE_PARTS:
            conversation.images.append(image_item(part))
            parts.append({"type": "image"})
        elif kind in _VIDEO_PARTS:
            conversation.videos.append(video_source(part))
            parts.append({"type": "video"})
        else:
            raise InvalidRequestError(f"content part type {kind!r} is not supported; "
                                      "use 'text', 'image_url' or 'video_url'")
    return parts


def parse_chat_conversation(messages: list[dict[str, Any]]) -> ChatConversation:
    """Template messages (each media part becomes {"type": "image"|"video"})
    and the media sources in the order they appear."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    conversation = ChatConversation(messages=[])
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise InvalidRequestError(f"message role {role!r} is not one of {_ROLES}")
        content = _parse_content(message.get("content"), conversation)
        conversation.messages.append({**message, "content": content})
    return conversation
