"""Engine-core counters, exported under Prometheus-style names."""
from __future__ import annotations

from dataclasses import dataclass, field

from foveal.engine.request import FINISH_REASONS


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    visual_tokens: int = 0
    encoder_items: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # tokens found
    encoder_cache_queries: int = 0  # media items a scheduled window needed
    encoder_cache_hits: int = 0  # of those, already encoded
    kv_offload_hits: int = 0  # blocks loaded back from the offload tier
    kv_offload_saves: int = 0  # blocks copied into it
    kv_offload_bytes: int = 0  # gauge: bytes it holds
    encoder_cache_entries: int = 0  # gauge: media embeddings the workers hold
    encoder_cache_held_entries: int = 0  # gauge: of those, referenced by unfinished requests
    num_preemptions: int = 0
    itl_capped_steps: int = 0  # steps whose prompt work was held to target_itl_ms
    computed_tokens: int = 0  # tokens the model ran: prompts, recomputes, outputs, drafts
    kv_imported_tokens: int = 0  # disaggregated decode: prompt tokens whose KV came in
    kv_exported_tokens: int = 0  # disaggregated prefill: prompt tokens whose KV went out
    num_drafts: int = 0  # verifications: steps x requests that carried drafts
    num_draft_tokens: int = 0  # speculative tokens verified
    num_draft_tokens_rejected: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts kept at i
    kv_cache_dtype: str = "auto"  # as stored: float32 | bfloat16 | float16 | int8 | int4 | fp8_e4m3
    kv_cache_capacity_tokens: int = 0  # the longest request the KV pool holds
    finished: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS.values(), 0))

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_draft_tokens_rejected += num_drafts - num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def _spec_decode(self) -> dict[str, float]:
        accepted = self.num_draft_tokens - self.num_draft_tokens_rejected
        stats: dict[str, float] = {
            "foveal:spec_decode_num_drafts_total": self.num_drafts,
            "foveal:spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "foveal:spec_decode_num_accepted_tokens_total": accepted,
            "foveal:spec_decode_acceptance_rate": accepted / max(self.num_draft_tokens, 1),
            # tokens per verification, the bonus token included (vLLM's definition)
            "foveal:spec_decode_mean_accepted_length":
                1 + accepted / self.num_drafts if self.num_drafts else 0.0,
        }
        for position, count in enumerate(self.accepted_per_position):
            key = f'foveal:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}}'
            stats[key] = count
        return stats

    def as_dict(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> dict:
        stats: dict[str, float] = {
            "foveal:prompt_tokens_total": self.prompt_tokens,
            "foveal:generation_tokens_total": self.generation_tokens,
            "foveal:visual_tokens_total": self.visual_tokens,
            "foveal:encoder_items_total": self.encoder_items,
            "foveal:prefix_cache_queries_total": self.prefix_cache_queries,
            "foveal:prefix_cache_hits_total": self.prefix_cache_hits,
            "foveal:encoder_cache_queries_total": self.encoder_cache_queries,
            "foveal:encoder_cache_hits_total": self.encoder_cache_hits,
            "foveal:kv_offload_hits_total": self.kv_offload_hits,
            "foveal:kv_offload_saves_total": self.kv_offload_saves,
            "foveal:kv_offload_bytes": self.kv_offload_bytes,
            "foveal:encoder_cache_entries": self.encoder_cache_entries,
            "foveal:encoder_cache_held_entries": self.encoder_cache_held_entries,
            "foveal:num_preemptions_total": self.num_preemptions,
            "foveal:itl_capped_steps_total": self.itl_capped_steps,
            "foveal:computed_tokens_total": self.computed_tokens,
            "foveal:kv_imported_tokens_total": self.kv_imported_tokens,
            "foveal:kv_exported_tokens_total": self.kv_exported_tokens,
            "foveal:kv_cache_usage_perc": kv_cache_usage,
            "foveal:kv_cache_capacity_tokens": self.kv_cache_capacity_tokens,
            f'foveal:kv_cache_info{{kv_cache_dtype="{self.kv_cache_dtype}"}}': 1,
            "foveal:num_requests_running": num_running,
            "foveal:num_requests_waiting": num_waiting,
        }
        stats.update(self._spec_decode())
        for reason, count in self.finished.items():
            stats[f'foveal:request_success_total{{finished_reason="{reason}"}}'] = count
        return stats
