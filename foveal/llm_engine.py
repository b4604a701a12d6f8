"""In-process engine: input processor -> EngineCore -> output processor.

The synchronous loop behind `LLM`; the async server wraps the same pieces.
"""
from __future__ import annotations

import itertools
from typing import Any

from foveal.config import EngineConfig
from foveal.engine.core import EngineCore
from foveal.engine.output import OutputProcessor, RequestOutput
from foveal.engine.request import RequestStatus
from foveal.input_processor import InputProcessor, PromptType
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        """core: an engine core built elsewhere (e.g. with injected connectors);
        by default one is built from the config."""
        from foveal.executor import build_engine_core

        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model.path)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.core = core or build_engine_core(config)
        self.executor = self.core.executor
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validate and enqueue; raises InvalidRequestError and holds nothing on failure."""
        processed = self.input_processor.process(request_id, prompt, params)
        self.core.add_request(processed.request)
        self.output_processor.add_request(request_id, processed.text,
                                          processed.request.prompt_token_ids,
                                          processed.request.sampling_params,
                                          processed.request.arrival_time)

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.output_processor.process(self.core.step())
        if to_abort:  # stop strings found by the detokenizer
            self.core.abort_requests(to_abort, status=RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_metrics(self) -> dict[str, Any]:
        return {**self.core.get_stats(), **self.input_processor.get_metrics()}

    def shutdown(self) -> None:
        self.executor.shutdown()
