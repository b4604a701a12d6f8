"""Everything that crosses between the API process and the engine core process.

Plain dataclasses, pickled (torch tensors in `MMFeature.data` pickle as they
are). The sockets live in a private temporary folder (mode 0700), so only this
user's processes can send pickles to the core.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Union

from foveal.engine.request import EngineCoreOutput, Request, RequestStatus


@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequests:
    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass
class MetricsQuery:
    query_id: int


@dataclass
class Shutdown:
    pass


@dataclass
class Ping:
    """Sent when the core has been silent a while; its loop answers with Pong."""


CoreInput = Union[AddRequest, AbortRequests, MetricsQuery, Shutdown, Ping]


@dataclass
class CoreReady:
    num_blocks: int


@dataclass
class CoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)


@dataclass
class RequestRejected:
    """Admission failed for one request; the engine holds nothing of it.

    error_type is the InvalidRequestError subclass raised in the core, so the
    API process raises the same type.
    """

    request_id: str
    error_type: type
    message: str


@dataclass
class MetricsReply:
    query_id: int
    metrics: dict[str, float]


@dataclass
class CoreFailed:
    """The core loop (or its startup) raised; the process exits after this."""

    error_type: type
    message: str


@dataclass
class Pong:
    """The core loop is alive (an answer to Ping)."""


CoreMessage = Union[CoreReady, CoreOutputs, RequestRejected, MetricsReply, CoreFailed, Pong]


def encode(message: CoreInput | CoreMessage) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> CoreInput | CoreMessage:
    return pickle.loads(frame)
