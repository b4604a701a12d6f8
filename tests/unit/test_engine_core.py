from __future__ import annotations

import pytest
from test_scheduler import FakeExecutor, make_request, make_scheduler

from foveal.engine.core import EngineCore
from foveal.engine.request import RequestStatus


def test_step_loop_runs_requests_to_completion():
    core = EngineCore(make_scheduler(), FakeExecutor(4))
    core.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    core.add_request(make_request("b", [4, 5], max_tokens=2))
    finished = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output.finish_reason
    assert finished == {"a": "length", "b": "length"}
    assert core.get_stats()["foveal:generation_tokens_total"] == 5
    assert core.get_stats()["foveal:prompt_tokens_total"] == 5


def test_step_with_nothing_to_do_skips_the_executor():
    executor = FakeExecutor(4)
    core = EngineCore(make_scheduler(), executor)
    assert core.step() == [] and executor.plans == []


def test_abort_with_stop_status_counts_as_stop():
    core = EngineCore(make_scheduler(), FakeExecutor(4))
    core.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    core.step()
    core.abort_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert not core.has_unfinished_requests()
    assert core.get_stats()['foveal:request_success_total{finished_reason="stop"}'] == 1


def test_executor_error_for_whole_batch_propagates():
    class Broken:
        def execute(self, plan, mm_payloads):
            raise RuntimeError("worker died")

    core = EngineCore(make_scheduler(), Broken())
    core.add_request(make_request("a", [1, 2, 3]))
    with pytest.raises(RuntimeError, match="worker died"):
        core.step()


def test_stats_have_the_exported_names():
    core = EngineCore(make_scheduler(), FakeExecutor(4))
    assert set(core.get_stats()) == {
        "foveal:prompt_tokens_total", "foveal:generation_tokens_total",
        "foveal:visual_tokens_total", "foveal:encoder_items_total",
        "foveal:prefix_cache_queries_total", "foveal:prefix_cache_hits_total",
        "foveal:kv_imported_tokens_total", "foveal:kv_exported_tokens_total",
        "foveal:encoder_cache_queries_total", "foveal:encoder_cache_hits_total",
        "foveal:encoder_cache_entries", "foveal:encoder_cache_held_entries",
        "foveal:kv_offload_hits_total", "foveal:kv_offload_saves_total", "foveal:kv_offload_bytes",
        "foveal:num_preemptions_total", "foveal:itl_capped_steps_total",
        "foveal:computed_tokens_total", "foveal:kv_cache_usage_perc",
        "foveal:kv_cache_capacity_tokens", 'foveal:kv_cache_info{kv_cache_dtype="auto"}',
        "foveal:spec_decode_num_drafts_total", "foveal:spec_decode_num_draft_tokens_total",
        "foveal:spec_decode_num_accepted_tokens_total", "foveal:spec_decode_acceptance_rate",
        "foveal:spec_decode_mean_accepted_length",
        "foveal:num_requests_running", "foveal:num_requests_waiting",
        *(f'foveal:request_success_total{{finished_reason="{r}"}}'
          for r in ("stop", "length", "abort", "error")),
    }
