"""The model runner: StepPlan in, sampled tokens out.

Generic over architectures: it holds each request's token ids, block ids and
prompt positions (from the model's position rule), builds the flattened batch
(T new tokens from B requests) with numpy, merges vision embeddings into the
text embeddings, runs the LLM inside `forward_context` and samples the
requests that reached their last known token.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np
import torch

from foveal.config import EngineConfig
from foveal.engine.plan import ModelRunnerOutput, NewRequestData, StepPlan, kv_payload_key
from foveal.forward_context import (AttentionMetadata, block_table_array, forward_context,
                                    layer_metadata)
from foveal.layers.attention.kv_spec import KVCaches
from foveal.logger import init_logger
from foveal.multimodal.inputs import ENCODED_KEY, MMFeature
from foveal.sampling_params import SamplingParams
from foveal.worker.compiled_decode import CompiledDecode, compile_applies
from foveal.worker.cuda_graphs import DecodeGraphs, graphs_apply
from foveal.worker.device import torch_dtype
from foveal.worker.encoder_connector import EncoderConnectorWorker
from foveal.worker.encoder_runner import EncoderCache
from foveal.worker.kv_offload import KVOffloadWorker
from foveal.worker.sampler import Sampler, request_generator
from foveal.worker.spec_decode.eagle import EagleProposer
from foveal.worker.step_sampling import StepSampling

logger = init_logger(__name__)


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group; group 0 attends to the full context
    mm_features: list[MMFeature]
    sampling_params: SamplingParams
    prompt_positions: np.ndarray  # (num_axes, num_prompt_tokens) int64
    position_delta: int  # position of token i >= num_prompt_tokens is i + delta
    generator: torch.Generator | None
    num_computed_tokens: int

    @property
    def num_prompt_positions(self) -> int:
        return self.prompt_positions.shape[1]


@dataclass
class ScheduledRequest:
    state: RequestState
    num_new_tokens: int
    # (row offset within this request's new tokens, encoder rows to put there)
    mm_rows: list[tuple[int, torch.Tensor]]
    drafts: list[int] = field(default_factory=list)  # the last len(drafts) new tokens


@dataclass
class Batch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (num_axes, T) int64, or (T,) for one axis
    attn_metadata: AttentionMetadata  # over group 0's block tables
    # per KV cache group, the layout over its tables ([0] is attn_metadata)
    group_metadata: list[AttentionMetadata]
    logits_indices: torch.Tensor  # (N,) int64: rows to sample: each sampled request's
    # last known token and its drafts
    sampled: list[ScheduledRequest]
    # every row a generated token or a draft, none a prompt token (decode and verify steps)
    generated_rows: bool = False


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model: torch.nn.Module,
                 kv_caches: KVCaches, kv_offload: KVOffloadWorker | None = None,
                 encoder_connector: EncoderConnectorWorker | None = None,
                 draft_head: torch.nn.Module | None = None) -> None:
        """draft_head: the EAGLE head the worker loaded when the engine speculates with one."""
        self.config = engine_config
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = kv_caches.spec.block_size
        self.device = torch.device(engine_config.device)
        self.position_rule = model.position_rule(engine_config.model)
        self.requests: dict[str, RequestState] = {}
        self.encoder_cache = EncoderCache()
        self.kv_offload = kv_offload
        self.encoder_connector = encoder_connector
        self.sampling = StepSampling(model, Sampler(engine_config.seed, self.device),
                                     engine_config.speculative,
                                     with_token_proposer=draft_head is None)
        self.decode_graphs: DecodeGraphs | None = None
        if torch.device(engine_config.device).type == "cuda":
            why_not = graphs_apply(engine_config, kv_caches, draft_head is not None)
            if why_not is None:
                self.decode_graphs = DecodeGraphs(engine_config, model, kv_caches,
                                                  self.position_rule.num_axes)
                self.decode_graphs.capture_all()
            else:
                logger.info("decode steps run eagerly: %s", why_not)
        self.compiled_decode: CompiledDecode | None = None
        if engine_config.compile_decode:
            why_not = compile_applies(engine_config, draft_head is not None)
            if why_not is None:
                compiled = CompiledDecode(
                    model, engine_config.model.text.hidden_size, torch_dtype(engine_config.dtype),
                    self.position_rule.num_axes)
                why_not = compiled.warm_up(kv_caches.by_layer[0])
                if why_not is None:
                    self.compiled_decode = compiled
                    self.sampling.compute_logits = compiled.compute_logits
            if why_not is not None:
                logger.warning("decode steps run eagerly, not compiled: %s", why_not)
        self.drafter = None
        if draft_head is not None:
            self.drafter = EagleProposer(
                engine_config.speculative, draft_head, model, kv_caches.num_blocks,
                self.block_size, engine_config.scheduler.max_num_seqs, self.device,
                torch_dtype(engine_config.dtype))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, mm_payloads: dict[str, dict] | None = None
                ) -> ModelRunnerOutput:
        """mm_payloads: mm_hash -> array data (pixels) of the items encoded this step."""
        payloads = mm_payloads or {}
        self._update_states(plan)
        self.encoder_cache.drop(plan.freed_mm_hashes)
        if plan.kv_transfer:
            self.kv_offload.apply(plan.kv_transfer)  # before the forward reads or overwrites
        imports_failed = self._import_kv(plan.kv_imports, payloads)
        if plan.encoder_transfer:
            self.encoder_connector.load(plan.encoder_transfer, self.encoder_cache, self.device)
        encoded = self.encoder_cache.encode(self.model, [
            (request_id, self._with_payload(request_id, index, payloads))
            for request_id, indices in plan.scheduled_encoder_inputs.items()
            for index in indices])
        if plan.encoder_transfer:
            self.encoder_connector.save(plan.encoder_transfer, self.encoder_cache)
        output = ModelRunnerOutput(num_encoder_items_run=encoded.num_items_run,
                                   failed_requests={**imports_failed, **encoded.failed_requests})
        scheduled = self._select_requests(plan, output.failed_requests)
        if not scheduled:
            return output
        batch = self._prepare_batch(scheduled)
        inputs_embeds = self._embed(batch, scheduled)  # (T, hidden)
        hidden_states, features = self._forward(batch, inputs_embeds)
        for item in scheduled:
            item.state.num_computed_tokens += item.num_new_tokens
        if batch.sampled:
            self.sampling.sample(hidden_states[batch.logits_indices], batch.sampled, output)
        if self.drafter is not None:
            self.drafter.propose(batch, scheduled, features, output)
        self._export_kv(plan.kv_exports, output)
        return output

    def _forward(self, batch: Batch, inputs_embeds: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (T, hidden), features): a decode step through its CUDA graph
        where one was captured; features are EAGLE-3's layer inputs (T, 3 * hidden)
        when a head reads them, else the hidden states."""
        aux_layers = self.drafter.aux_layers if self.drafter is not None else ()
        if self.decode_graphs is not None and not aux_layers:
            hidden_states = self.decode_graphs.run(inputs_embeds, batch.positions,
                                                   batch.group_metadata)
            if hidden_states is not None:
                return hidden_states, hidden_states
        caches, scales = self.kv_caches.by_layer
        with forward_context(batch.attn_metadata, caches, scales,
                             layer_metadata=layer_metadata(self.kv_caches.spec.layer_groups,
                                                           batch.group_metadata),
                             generated_rows=batch.generated_rows):
            if self.compiled_decode is not None and not aux_layers:
                hidden_states = self.compiled_decode.run(inputs_embeds, batch.positions)
                if hidden_states is not None:
                    return hidden_states, hidden_states
            if aux_layers:
                return self.model(inputs_embeds, batch.positions, aux_layers)
            hidden_states = self.model(inputs_embeds, batch.positions)  # (T, hidden)
        return hidden_states, hidden_states

    def _import_kv(self, kv_imports: dict[str, list[tuple[int, int]]],
                   payloads: dict[str, dict]) -> dict[str, str]:
        """Write the prompt KV that came from a prefill worker into the
        requests' blocks; a request whose blocks do not fit this pool fails alone."""
        failed = {}
        for request_id, pairs in kv_imports.items():
            blocks = payloads[kv_payload_key(request_id)]
            indices = torch.tensor([index for index, _ in pairs])
            try:
                self.kv_caches.write_stacked([block_id for _, block_id in pairs],
                                             {name: t.index_select(2, indices)
                                              for name, t in blocks.items()})
            except (ValueError, IndexError, RuntimeError) as error:
                failed[request_id] = f"the imported KV blocks do not fit this engine: {error}"
        return failed

    def _export_kv(self, kv_exports: dict[str, int], output: ModelRunnerOutput) -> None:
        """Host copies of the prompt KV of requests a decode worker continues: with
        KV cache groups, each group's blocks one after another (a sliding group's
        blocks behind its window are the null block's zeros)."""
        for request_id, num_tokens in kv_exports.items():
            if request_id in output.failed_requests or request_id not in self.requests:
                continue
            num_blocks = -(-num_tokens // self.block_size)
            block_ids = [block_id for table in self.requests[request_id].block_ids
                         for block_id in table[:num_blocks]]
            output.kv_exports[request_id] = self.kv_caches.read_stacked(block_ids)

    def _update_states(self, plan: StepPlan) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new_request in plan.new_requests:
            self._add_request(new_request)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            for table, new_block_ids in zip(state.block_ids, cached.new_block_ids):
                if cached.num_trimmed_blocks:
                    del table[-cached.num_trimmed_blocks:]
                table.extend(new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _with_payload(self, request_id: str, index: int,
                      mm_payloads: dict[str, dict]) -> MMFeature:
        """The scheduled item with its pixels, which the plan does not carry."""
        feature = self.requests[request_id].mm_features[index]
        payload = mm_payloads.get(feature.mm_hash, {})
        if ENCODED_KEY in payload:  # imported embeddings: straight into the encoder cache
            payload = {ENCODED_KEY: payload[ENCODED_KEY].to(self.device)}
        return feature.with_payload(payload)

    def _add_request(self, new: NewRequestData) -> None:
        # A resumed (preempted) request keeps its generator: it has drawn one
        # sample per output token, exactly as if it had never been preempted.
        previous = self.requests.get(new.request_id)
        generator = (previous.generator if previous is not None
                     else request_generator(new.sampling_params, self.device))
        positions, delta = self.position_rule.prompt_positions(new.token_ids, new.mm_features)
        self.requests[new.request_id] = RequestState(
            request_id=new.request_id, token_ids=list(new.token_ids),
            block_ids=[list(table) for table in new.block_ids], mm_features=new.mm_features,
            sampling_params=new.sampling_params, prompt_positions=positions,
            position_delta=delta, generator=generator,
            num_computed_tokens=new.num_computed_tokens)

    def _select_requests(self, plan: StepPlan,
                         failed: dict[str, str]) -> list[ScheduledRequest]:
        scheduled = []
        for request_id, num_new_tokens in plan.num_scheduled_tokens.items():
            if request_id in failed:
                continue
            state = self.requests[request_id]
            mm_rows = self._mm_rows(state, num_new_tokens, failed)
            if mm_rows is not None:
                drafts = plan.scheduled_spec_decode_tokens.get(request_id, [])
                scheduled.append(ScheduledRequest(state, num_new_tokens, mm_rows, drafts))
        return scheduled

    def _mm_rows(self, state: RequestState, num_new_tokens: int,
                 failed: dict[str, str]) -> list[tuple[int, torch.Tensor]] | None:
        """Encoder rows for the part of each placeholder range that this
        step's tokens [start, end) cover; None (and a failure) if one is missing."""
        start = state.num_computed_tokens
        end = start + num_new_tokens
        mm_rows = []
        for feature in state.mm_features:
            lo = max(start, feature.placeholder.offset)
            hi = min(end, feature.placeholder.end)
            if lo >= hi:
                continue
            if feature.mm_hash not in self.encoder_cache:
                failed[state.request_id] = (
                    f"{feature.modality} item {feature.mm_hash} is needed for tokens "
                    f"[{lo}, {hi}) but was never encoded (or already freed)")
                return None
            offset = feature.placeholder.offset
            mm_rows.append((lo - start,
                            self.encoder_cache.rows(feature.mm_hash, lo - offset, hi - offset)))
        return mm_rows

    def _prepare_batch(self, scheduled: list[ScheduledRequest]) -> Batch:
        states = [item.state for item in scheduled]
        num_new = np.array([item.num_new_tokens for item in scheduled], dtype=np.int64)  # (B,)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)  # (B,)
        seq_lens = starts + num_new  # (B,)
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)  # (B+1,)
        np.cumsum(num_new, out=query_start_loc[1:])
        # token_index[t]: index of batch row t within its own request's tokens
        row_starts = np.repeat(starts - query_start_loc[:-1], num_new)  # (T,)
        token_index = np.arange(query_start_loc[-1]) + row_starts  # (T,)
        request_index = np.repeat(np.arange(len(states)), num_new)  # (T,)
        spans = [[span for f in s.mm_features for span in f.bidirectional_spans] for s in states]
        group_metadata = []
        for group in range(len(states[0].block_ids)):
            block_tables = block_table_array([s.block_ids[group] for s in states])  # (B, nb)
            slot_mapping = (block_tables[request_index, token_index // self.block_size]
                            .astype(np.int64) * self.block_size
                            + token_index % self.block_size)  # (T,)
            if not group_metadata:
                metadata = AttentionMetadata.from_arrays(
                    slot_mapping, query_start_loc, seq_lens, block_tables, self.block_size,
                    self.device)
                metadata.bidirectional_spans = spans if any(spans) else None
            else:  # the same batch layout over another group's tables
                metadata = replace(group_metadata[0], backend_cache={},
                                   slot_mapping=self._to_device(slot_mapping),
                                   block_tables=self._to_device(block_tables))
            group_metadata.append(metadata)
        input_ids = list(chain.from_iterable(
            _new_token_ids(item, a, b)
            for item, a, b in zip(scheduled, starts.tolist(), seq_lens.tolist())))
        known = np.array([len(s.token_ids) for s in states])  # (B,)
        sampled_mask = seq_lens >= known  # (B,): reached the last known token
        num_rows = seq_lens - known + 1  # (B,): that token's row and one per draft
        logits_indices = [np.arange(end - rows, end) for end, rows, m in zip(
            query_start_loc[1:], num_rows, sampled_mask) if m]
        return Batch(
            input_ids=self._to_device(np.array(input_ids, dtype=np.int64)),
            positions=self._to_device(self._positions(states, starts, num_new, token_index)),
            attn_metadata=group_metadata[0],
            group_metadata=group_metadata,
            logits_indices=self._to_device(np.concatenate(logits_indices or [np.zeros(0, int)])
                                           .astype(np.int64)),
            sampled=[item for item, m in zip(scheduled, sampled_mask.tolist()) if m],
            generated_rows=all(s.num_computed_tokens >= s.num_prompt_positions for s in states))

    def _positions(self, states: list[RequestState], starts: np.ndarray,
                   num_new: np.ndarray, token_index: np.ndarray) -> np.ndarray:
        """(A, T) positions: prompt tokens from the precomputed table, later
        tokens index + delta on every axis; (T,) when the rule has one axis."""
        num_axes = self.position_rule.num_axes
        deltas = np.array([s.position_delta for s in states], dtype=np.int64)  # (B,)
        positions = np.repeat((token_index + np.repeat(deltas, num_new))[None, :], num_axes,
                              axis=0)  # (A, T)
        row = 0
        for state, start, count in zip(states, starts.tolist(), num_new.tolist()):
            end = min(start + count, state.num_prompt_positions)
            if start < end:
                positions[:, row:row + end - start] = state.prompt_positions[:, start:end]
            row += count
        return positions[0] if num_axes == 1 else positions

    def _embed(self, batch: Batch, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        inputs_embeds = self.model.embed_input_ids(batch.input_ids)  # (T, hidden)
        # Encoder rows wider than hidden carry per-layer additions (Qwen3-VL
        # DeepStack) in the extra columns: text rows get zeros there.
        width = max((rows.shape[-1] for item in scheduled for _, rows in item.mm_rows),
                    default=inputs_embeds.shape[-1])
        if width > inputs_embeds.shape[-1]:
            inputs_embeds = torch.nn.functional.pad(inputs_embeds, (0, width - inputs_embeds.shape[-1]))
        query_start_loc = batch.attn_metadata.query_start_loc_cpu
        for i, item in enumerate(scheduled):
            for offset, rows in item.mm_rows:
                row = query_start_loc[i] + offset
                inputs_embeds[row:row + rows.shape[0]] = rows.to(inputs_embeds.dtype)
        return inputs_embeds

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _new_token_ids(item: ScheduledRequest, start: int, end: int) -> list[int]:
    """Tokens [start, end) of the request's known tokens followed by its drafts."""
    known = item.state.token_ids
    if end <= len(known):
        return known[start:end]
    return known[start:] + item.drafts[max(0, start - len(known)):end - len(known)]
