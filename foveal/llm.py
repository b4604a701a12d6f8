"""Offline inference API, shaped like vLLM's `LLM`."""
from __future__ import annotations

from typing import Any, Sequence

from foveal.engine.output import RequestOutput
from foveal.engine_args import EngineArgs
from foveal.errors import InvalidRequestError
from foveal.input_processor import PromptType
from foveal.multimodal.chat import parse_chat_conversation
from foveal.sampling_params import SamplingParams


class LLM:
    """Load a model once, then `generate()` or `chat()` over batches of prompts.

    >>> llm = LLM(model="/path/to/Qwen2-VL-2B-Instruct")
    >>> out = llm.generate({"prompt": ..., "multi_modal_data": {"image": img}})
    """

    def __init__(self, model: str, *, stages: Any = None, **kwargs: Any) -> None:
        """stages: preprocessing stage config (StagesConfig, or "ocr=2,asr=1"), or a
        StagePools to share (its creator closes it); pools start on the first
        request with a PDF, audio, OCR or a video with sound."""
        from foveal.llm_engine import LLMEngine

        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args.create_engine_config())
        self._stages_config = stages
        self._stage_pools = None
        self._owns_stage_pools = False
        self._mm_plans: dict[str, list] = {}

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Every prompt is validated before any starts: a bad one raises an
        InvalidRequestError naming its index, and nothing is left queued.
        A video's speech is transcribed by the "asr" stage and its transcript
        put right after the video (mm_processor_kwargs transcribe_audio=false: not).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(len(prompts), sampling_params)
        request_ids = self._add_all(prompts, params)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """OpenAI-style messages (or a list of conversations) -> outputs.

        Content parts: text, image_url (data: URL or path), video_url, file (a
        PDF as a data URL) and input_audio; PDFs, audio and videos' audio tracks
        go through the preprocessing stages (options pdf_mode / ocr /
        transcribe_audio ride in mm_processor_kwargs).
        """
        from foveal.stages.assembly import split_preprocess_options

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        preprocess_options, mm_processor_kwargs = split_preprocess_options(mm_processor_kwargs)
        prompts = []
        for conversation in conversations:
            conversation = self._preprocess(conversation, preprocess_options)
            parsed = parse_chat_conversation(conversation)
            text = self.get_tokenizer().apply_chat_template(
                parsed.messages, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
            prompt: dict[str, Any] = {"prompt": text}
            if parsed.images or parsed.videos:
                prompt["multi_modal_data"] = parsed.multi_modal_data()
            if mm_processor_kwargs:
                prompt["mm_processor_kwargs"] = mm_processor_kwargs
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, float]:
        metrics = self.llm_engine.get_metrics()
        if self._stage_pools is not None:
            metrics.update(self._stage_pools.get_metrics())
        return metrics

    def _preprocess(self, conversation: list[dict], options: dict) -> list[dict]:
        from foveal.stages.assembly import expand_preprocessed_parts_sync, needs_stages

        if not needs_stages(conversation, options):
            return conversation
        return expand_preprocessed_parts_sync(conversation, self._stages(), options)

    def _video_transcripts(self, prompt: PromptType) -> list[str | None] | None:
        """Transcripts of the prompt's videos' audio tracks, from the "asr" stage;
        the stage is not reached for videos without sound."""
        speech = self.llm_engine.input_processor.video_speech(prompt)
        if not speech or not any(speech):
            return None
        from foveal.stages.assembly import video_transcripts_sync

        return video_transcripts_sync(self._stages(), speech)

    def _stages(self):
        if self._stage_pools is None:
            from foveal.stages.service import stage_pools_for

            self._stage_pools, self._owns_stage_pools = stage_pools_for(self._stages_config)
        return self._stage_pools

    def shutdown(self) -> None:
        if self._stage_pools is not None and self._owns_stage_pools:
            self._stage_pools.close()
        self._stage_pools = None
        self.llm_engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """Used when generate()/chat() get none: the checkpoint's
        generation_config.json sampling fields over SamplingParams' defaults."""
        from foveal.loader.hf_config import default_sampling_overrides

        return SamplingParams(**default_sampling_overrides(self.llm_engine.config.model.path))

    def _params_per_prompt(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidRequestError(
                f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def _add_all(self, prompts: Sequence[PromptType], params: list[SamplingParams]) -> list[str]:
        engine = self.llm_engine
        processed = []
        for index, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                transcripts = self._video_transcripts(prompt)
                item = engine.input_processor.process(engine.new_request_id(), prompt, sp,
                                                      transcripts)
                engine.core.scheduler.check_request(item.request)
                processed.append(item)
            except InvalidRequestError as error:
                raise type(error)(f"prompt {index}: {error}") from error
        for item in processed:
            request = item.request
            engine.core.add_request(request)
            engine.output_processor.add_request(request.request_id, item.text,
                                                request.prompt_token_ids,
                                                request.sampling_params, request.arrival_time)
            self._mm_plans[request.request_id] = item.mm_plan
        return [item.request.request_id for item in processed]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        output.mm_plan = self._mm_plans.pop(output.request_id, [])
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
