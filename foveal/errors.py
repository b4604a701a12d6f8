"""Typed errors. Each message says what was wrong and what to change.

Errors raised for one request (bad media, too long a prompt, ...) derive from
`InvalidRequestError`: the engine fails that request alone and keeps serving.
"""


class FovealError(Exception):
    """Base class of every error Foveal raises on purpose."""


class ConfigError(FovealError):
    """An engine or model option is invalid or unsupported."""


class CheckpointError(FovealError):
    """A checkpoint folder is missing files or holds unexpected weights."""


class InvalidRequestError(FovealError, ValueError):
    """One request is invalid; it fails alone and costs the engine nothing."""


class MediaError(InvalidRequestError):
    """Media bytes could not be fetched or decoded, or are not supported."""


class MediaLimitError(InvalidRequestError):
    """Media exceeds a configured limit (pixels, bytes, items per prompt)."""


class ContextLengthError(InvalidRequestError):
    """The prompt (after placeholder expansion) does not fit max_model_len."""


class PlaceholderMismatchError(InvalidRequestError):
    """The prompt's media placeholders do not match the media passed."""


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class EngineDeadError(FovealError):
    """The engine loop stopped; no request can be served."""


class EngineOverloadedError(FovealError):
    """Too many requests are in flight; retry later (HTTP 503) or raise the limit."""


class StageError(FovealError):
    """A preprocessing stage (PDF, OCR, ASR) could not serve an item: its
    worker died twice, or every endpoint of a remote stage is down."""


class StageOverloadedError(StageError):
    """A stage's queue is full; retry later or add workers (the server answers 503)."""


class StageTimeoutError(StageError):
    """A stage item ran past its timeout; its worker was killed and replaced."""


class TransferError(FovealError):
    """A KV or embedding transfer between disaggregated workers failed: the
    peer is unreachable or timed out, or the data was corrupt, truncated,
    too large, expired or did not match this engine (HTTP 503)."""
