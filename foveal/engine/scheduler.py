"""Continuous batching with one rule.

Each step, running requests (in admission order) and then waiting ones (FCFS)
get min(num_tokens - num_computed_tokens, tokens left in the step budget).
Prefill chunks, decodes, prefix hits and recompute after preemption all fall
out of that rule; there are no prefill and decode phases. Media items are
encoded in the step whose window first overlaps their placeholder range, if
the encoder compute budget and cache allow; otherwise the window ends before
the item and the request waits. Draft tokens (speculative decoding) are more
tokens to catch up with: a request's target is num_tokens + its drafts, and
the drafts a step rejects are rolled back (computed count and trailing KV
blocks) when its output comes back.

With a target inter-token latency (`target_itl_ms`), a step that carries decode
rows gives prompt tokens and vision encoding only what the step cost model says
fits beside them (foveal/engine/step_budget.py).

The scheduler owns no policy objects of its own making: the KV manager (with
its KV connector), the encoder budget and the encoder connector are passed in
(`build_scheduler` makes the default ones from the config).
"""
from __future__ import annotations

from collections import deque

from foveal.config import CacheConfig, SchedulerConfig
from foveal.engine.encoder_budget import EncoderBudget
from foveal.engine.encoder_connector import EncoderConnector
from foveal.engine.kv_groups import KVCacheGroups
from foveal.engine.kv_manager import KVCacheManager
from foveal.engine.kv_offload import OffloadTier
from foveal.engine.plan import CachedRequestData, ModelRunnerOutput, NewRequestData, StepPlan
from foveal.engine.request import EngineCoreOutput, Request, RequestStatus
from foveal.engine.stats import SchedulerStats
from foveal.engine.step_budget import StepBudget, is_decoding, step_budget
from foveal.engine.step_cost import StepCostModel
from foveal.engine.stop import append_tokens
from foveal.errors import ContextLengthError, InvalidRequestError


def build_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                    num_blocks: int, block_bytes: int = 0,
                    encoder_connector: EncoderConnector | None = None,
                    kv_groups: KVCacheGroups | None = None) -> "Scheduler":
    """A scheduler with the default KV manager, offload tier and encoder budget.

    block_bytes: KV bytes of one block (all layers), sizes the offload tier.
    kv_groups: how the workers' pool lays layers over pages (None: one group).
    """
    offload = (OffloadTier(cache_config.kv_offload_bytes // max(block_bytes, 1), block_bytes)
               if cache_config.kv_offload else None)
    kv = KVCacheManager(num_blocks, cache_config.block_size,
                        cache_config.enable_prefix_caching, offload, kv_groups)
    scheduler = Scheduler(scheduler_config, kv, EncoderBudget(cache_config.encoder_cache_size),
                          encoder_connector)
    scheduler.stats.kv_cache_dtype = cache_config.kv_cache_dtype
    return scheduler


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv: KVCacheManager,
                 encoder: EncoderBudget, encoder_connector: EncoderConnector | None = None):
        """kv: the KV block manager, with its KV connector (offload tier or a
        remote peer) if any. encoder_connector: a second source of encoder
        outputs keyed by mm_hash; an item it holds is loaded, not encoded."""
        self.config = scheduler_config
        self.kv = kv
        self.offload = kv.offload
        self.encoder = encoder
        self.encoder_connector = encoder_connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # the longest request the pool holds: its blocks in every group
        self.stats = SchedulerStats(kv_cache_capacity_tokens=kv.longest_request(
            scheduler_config.max_num_batched_tokens))
        self._finished_ids: set[str] = set()
        # Per request: how many leading blocks of its table the workers hold, and
        # how many trailing blocks they hold that were given back since (rejected
        # drafts) and must drop before taking new ones.
        self._num_blocks_sent: dict[str, int] = {}
        self._num_blocks_to_trim: dict[str, int] = {}
        # What steps cost here (the engine core feeds it each step's time), and
        # whether the next step is a progress step (target_itl_ms; None: not) taking
        # this many tokens (0: the whole budget).
        self.step_cost = StepCostModel()
        self._progress_window: int | None = None

    def add_request(self, request: Request) -> None:
        """Admission control: a request that can never run is an error now."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use; "
                                      "send a unique request id")
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise if the request can never run here (used before admitting a batch)."""
        max_len = self.config.max_model_len
        if request.num_prompt_tokens > max_len:
            raise ContextLengthError(
                f"prompt has {request.num_prompt_tokens} tokens (placeholders expanded) but "
                f"max_model_len is {max_len}; shorten the prompt, use fewer or smaller "
                f"images, or raise --max-model-len")
        max_tokens = request.sampling_params.max_tokens
        num_kv_tokens = max_len if max_tokens is None else min(
            max_len, request.num_prompt_tokens + max_tokens)
        num_blocks = self.kv.pages_needed(num_kv_tokens, self.config.max_num_batched_tokens)
        if num_blocks > self.kv.num_usable_blocks:
            raise InvalidRequestError(
                f"request needs up to {num_blocks} KV blocks ({num_kv_tokens} tokens) but the "
                f"pool has {self.kv.num_usable_blocks}; raise --kv-cache-memory-bytes or lower "
                f"max_tokens / --max-model-len")
        for feature in request.mm_features:
            self.encoder.check_fits(feature, self.config.encoder_compute_budget)
            longest = max((end - start for start, end in feature.bidirectional_spans), default=0)
            if longest > self.config.max_num_batched_tokens:
                raise InvalidRequestError(
                    f"a {feature.modality} needs its {longest} tokens computed in one step but a "
                    f"step holds {self.config.max_num_batched_tokens}; raise "
                    f"--max-num-batched-tokens")

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED
                       ) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def fail_request(self, request_id: str, message: str) -> EngineCoreOutput | None:
        """Finish one request with FINISHED_ERROR; the others keep running."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.error_message = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request_id, [], "error", None,
                                num_cached_tokens=max(request.num_cached_tokens, 0), error=message)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> dict:
        if self.offload is not None:
            self.stats.kv_offload_hits = self.offload.num_hits
            self.stats.kv_offload_saves = self.offload.num_saves
            self.stats.kv_offload_bytes = self.offload.num_bytes_stored
        self.stats.encoder_cache_entries = self.encoder.num_entries
        self.stats.encoder_cache_held_entries = self.encoder.num_held_entries
        return self.stats.as_dict(len(self.running), len(self.waiting), self.kv.usage)

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        progress_window, self._progress_window = self._progress_window, None
        budget = step_budget(self.config, self.running, self.step_cost, progress_window)
        self._schedule_running(plan, budget)
        if not budget.preempted:
            self._schedule_waiting(plan, budget)
        plan.num_encoder_tokens = self.config.encoder_compute_budget - budget.encoder_tokens_left
        plan.sized_to_target = budget.sized and budget.prefill_scheduled > 0
        if budget.held:
            self.stats.itl_capped_steps += 1
            stalled = budget.prefill_scheduled == 0 and (
                bool(self.waiting) or not all(map(is_decoding, self.running)))
            self._progress_window = budget.blocked_window if stalled else None
        plan.freed_mm_hashes = self.encoder.take_freed()
        if self.offload is not None and not plan.is_empty:
            # Copies wait for a plan the workers run; no forward overwrites a
            # block in between, so a late save still reads the evicted KV.
            plan.kv_transfer = self.offload.take_transfers() or None
        if self.encoder_connector is not None:
            plan.encoder_transfer = self.encoder_connector.take_transfers() or None
        return plan

    def _schedule_running(self, plan: StepPlan, budget: StepBudget) -> None:
        index = 0
        while index < len(self.running) and budget.tokens_left > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens,
                          budget.tokens_left,
                          self.config.max_model_len - request.num_computed_tokens)
            if not is_decoding(request):
                num_new = min(num_new, budget.prefill_room)
            if not self._allocate_or_preempt(request, num_new, plan, budget):
                break  # the request preempted itself: it was the last one
            index += 1
            num_new, encoder_inputs = self._schedule_encoder(request, num_new, budget)
            if num_new == 0:
                continue
            plan.cached_requests.append(self._cached_request_data(request))
            self._record(plan, budget, request, num_new, encoder_inputs)
            self._record_drafts(plan, request, num_new)

    def _cached_request_data(self, request: Request) -> CachedRequestData:
        """What the workers must change in their copy of the block table."""
        tables = self.kv.group_block_ids(request.request_id)
        kept = self._num_blocks_sent[request.request_id]
        num_trimmed = self._num_blocks_to_trim.pop(request.request_id, 0)
        self._num_blocks_sent[request.request_id] = len(tables[0])
        return CachedRequestData(request.request_id, [table[kept:] for table in tables],
                                 request.num_computed_tokens, num_trimmed)

    def _record_drafts(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """The drafts among this step's tokens: those past the known tokens."""
        num_drafts = request.num_computed_tokens + num_new - request.num_tokens
        if num_drafts > 0:
            plan.scheduled_spec_decode_tokens[request.request_id] = \
                request.spec_token_ids[:num_drafts]

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan,
                             budget: StepBudget) -> bool:
        """Make room by preempting the last admitted requests; False if `request` went."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, plan)
            budget.preempted = True
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: drop its KV and encoder refs, requeue it first."""
        self.kv.free(request)
        self.encoder.release_all(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)
        self._num_blocks_to_trim.pop(request.request_id, None)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1
        # Workers drop its state now; it comes back as a new request.
        plan.finished_request_ids.add(request.request_id)

    def _schedule_waiting(self, plan: StepPlan, budget: StepBudget) -> None:
        while (self.waiting and budget.prefill_room > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_imported = self._num_importable(request, num_hit)
            num_new = min(request.num_tokens - num_hit - num_imported, budget.prefill_room)
            if self.kv.allocate_slots(request, num_imported + num_new, computed_blocks) is None:
                break
            request.num_computed_tokens = num_hit + num_imported
            num_new, encoder_inputs = self._schedule_encoder(request, num_new, budget)
            if num_new == 0:
                self.kv.free(request)
                request.num_computed_tokens = 0
                break  # FCFS: nobody overtakes a request waiting for the encoder
            self.waiting.popleft()
            self._admit(request, num_hit)
            if num_imported:
                plan.kv_imports[request.request_id] = self._import_pairs(request, num_hit)
                self.stats.kv_imported_tokens += num_imported
            tables = self.kv.group_block_ids(request.request_id)
            self._num_blocks_sent[request.request_id] = len(tables[0])
            plan.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids),
                [feature.without_payload() for feature in request.mm_features],
                request.sampling_params, tables, request.num_computed_tokens))
            self._record(plan, budget, request, num_new, encoder_inputs)

    def _import_pairs(self, request: Request, num_hit: int) -> list[tuple[int, int]]:
        """(index among the imported blocks, pool block) for the blocks past the
        prefix hit that the next token reads. The import holds each group's blocks
        one after another; a sliding group's blocks behind the window are given
        back first, unwritten, so they never enter the prefix cache."""
        self.kv.release_outside_windows(request)
        tables = self.kv.group_block_ids(request.request_id)
        per_group = self.kv.blocks_needed(request.kv_import.num_tokens)
        end = self.kv.blocks_needed(request.num_computed_tokens)
        return [(group * per_group + i, table[i]) for group, table in enumerate(tables)
                for i in range(num_hit // self.kv.block_size, end)
                if table[i] != self.kv.null_block]

    def _num_importable(self, request: Request, num_hit: int) -> int:
        """Tokens past the local prefix hit whose KV came with the request from a
        prefill worker; the last known token is always computed here (its logits)."""
        if request.kv_import is None:
            return 0
        return max(0, min(request.kv_import.num_tokens, request.num_tokens - 1) - num_hit)

    def _admit(self, request: Request, num_hit: int) -> None:
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            self.stats.prompt_tokens += request.num_prompt_tokens
            self.stats.visual_tokens += request.num_visual_tokens

    def _schedule_encoder(self, request: Request, num_new: int, budget: StepBudget
                          ) -> tuple[int, list[int]]:
        """Reference the media items the window overlaps; encode the missing ones.

        Returns the (possibly cut) token count and the feature indices to encode.
        """
        start = request.num_computed_tokens
        num_new = _without_split_spans(request, start, num_new)
        to_encode: list[int] = []
        for index, feature in enumerate(request.mm_features):
            placeholder = feature.placeholder
            if placeholder.offset >= start + num_new:
                break
            if placeholder.end <= start or self.encoder.holds(request.request_id,
                                                              feature.mm_hash):
                continue
            cached = self.encoder.has(feature.mm_hash)
            if not cached:
                remote = (self.encoder_connector is not None
                          and self.encoder_connector.contains(feature.mm_hash))
                free = remote or feature.is_encoded  # loaded, or encoded by an encode worker
                compute_left = budget.encoder_tokens_left if not free else feature.num_encoder_tokens
                if not self.encoder.can_allocate(feature, compute_left):
                    return max(0, placeholder.offset - start), to_encode
                if remote:
                    self.encoder_connector.load(feature.mm_hash)
                elif feature.is_encoded:  # its embeddings travel like pixels, cost no compute
                    to_encode.append(index)
                else:
                    if not budget.take_encoding(feature, start):
                        return max(0, placeholder.offset - start), to_encode
                    if budget.held:  # the encoding took room from the window
                        num_new = _without_split_spans(request, start,
                                                       min(num_new, budget.prefill_room))
                    budget.encoder_tokens_left -= feature.num_encoder_tokens
                    to_encode.append(index)
                    if self.encoder_connector is not None:
                        self.encoder_connector.on_encode(feature.mm_hash)
            self.encoder.allocate(request.request_id, feature)
            self.stats.encoder_cache_queries += 1
            self.stats.encoder_cache_hits += cached
            request.encoder_cache_queries += 1
            request.encoder_cache_hits += cached
        return num_new, to_encode

    def _record(self, plan: StepPlan, budget: StepBudget, request: Request, num_new: int,
                encoder_inputs: list[int]) -> None:
        plan.num_scheduled_tokens[request.request_id] = num_new
        budget.take_tokens(request, num_new)
        self.stats.computed_tokens += num_new
        if request.export_kv and request.num_output_tokens == 0 \
                and request.num_computed_tokens + num_new == request.num_tokens:
            plan.kv_exports[request.request_id] = request.num_tokens
        if encoder_inputs:
            plan.scheduled_encoder_inputs[request.request_id] = encoder_inputs

    def update_from_output(self, plan: StepPlan, runner_output: ModelRunnerOutput
                           ) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, finish stopped requests."""
        outputs = [self.fail_request(rid, message)
                   for rid, message in runner_output.failed_requests.items()
                   if rid in self.requests]
        self.stats.encoder_items += runner_output.num_encoder_items_run
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or failed since the plan was made
            token_ids = runner_output.sampled_token_ids.get(request_id, [])
            request.num_computed_tokens += num_new
            self._roll_back_drafts(request, plan.scheduled_spec_decode_tokens.get(request_id),
                                   token_ids)
            kept, status = append_tokens(request, token_ids, self.config.max_model_len)
            # After the append: accepted drafts are known tokens now, so their
            # blocks hash; before finishing: a finished request's blocks stay cached.
            self.kv.cache_full_blocks(request)
            self._release_consumed_items(request)
            if token_ids:
                outputs.append(self._emit(request, kept, status, runner_output))
                outputs[-1].kv_export = runner_output.kv_exports.get(request_id)
                if outputs[-1].kv_export is not None:
                    self.stats.kv_exported_tokens += plan.kv_exports[request_id]
            if request.status == RequestStatus.RUNNING:
                self._take_drafts(request, runner_output.spec_token_ids.get(request_id))
        return outputs

    def _take_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """Keep the proposer's guesses for next step, no more than can still be
        emitted: the run they start ends with one more token, within max_tokens."""
        if not drafts:
            return
        max_tokens = request.sampling_params.max_tokens
        room = len(drafts) if max_tokens is None else max_tokens - request.num_output_tokens - 1
        request.spec_token_ids = drafts[:max(0, room)]

    def _roll_back_drafts(self, request: Request, drafts: list[int] | None,
                          token_ids: list[int]) -> None:
        """Forget the KV of rejected drafts: a run of n tokens accepts n - 1 drafts."""
        request.spec_token_ids = []
        if not drafts:
            return
        num_accepted = max(0, len(token_ids) - 1)
        num_rejected = len(drafts) - num_accepted
        if num_rejected > 0:
            request.num_computed_tokens -= num_rejected
            num_freed = self.kv.trim(request, request.num_computed_tokens)
            if num_freed:  # the workers hold them until the next plan says so
                rid = request.request_id
                self._num_blocks_sent[rid] -= num_freed
                self._num_blocks_to_trim[rid] = self._num_blocks_to_trim.get(rid, 0) + num_freed
        self.stats.record_verification(len(drafts), num_accepted)

    def _release_consumed_items(self, request: Request) -> None:
        # The same media may appear twice in a prompt: keep it while still needed.
        computed = request.num_computed_tokens
        still_needed = {f.mm_hash for f in request.mm_features if f.placeholder.end > computed}
        for feature in request.mm_features:
            if feature.placeholder.end <= computed and feature.mm_hash not in still_needed:
                self.encoder.release(request.request_id, feature.mm_hash)

    def _emit(self, request: Request, kept: list[int], status: RequestStatus | None,
              runner_output: ModelRunnerOutput) -> EngineCoreOutput:
        self.stats.generation_tokens += len(kept)
        if status is not None:
            self._finish(request, status)
        logprobs = runner_output.logprobs.get(request.request_id, [])[:len(kept)]
        return EngineCoreOutput(request.request_id, kept, request.status.finish_reason,
                                request.stop_reason, logprobs, request.num_cached_tokens,
                                encoder_cache_queries=request.encoder_cache_queries,
                                encoder_cache_hits=request.encoder_cache_hits)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """End a request and return everything it held."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.encoder.release_all(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)
        self._num_blocks_to_trim.pop(request.request_id, None)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self.stats.finished[status.finish_reason] += 1


def _without_split_spans(request: Request, start: int, num_new: int) -> int:
    """The window [start, start + num_new) cut so that it never ends inside a
    bidirectional span (its tokens must see each other, so they are computed in one
    step): it ends before the span, or is empty when it starts inside one."""
    end = start + num_new
    for feature in request.mm_features:
        for span_start, span_end in feature.bidirectional_spans:
            if span_start < end < span_end:
                return max(0, span_start - start)
    return num_new
