"""Foveal's side of the throughput benchmark, against a stand-in LLM (no model)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import foveal
from foveal.bench.throughput import run_foveal
from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload, warmup_request
from foveal.errors import FovealError

VOCAB = PromptVocab((9, 12, 10), 12, tuple(range(14, 512)))


class StandInLLM:
    """Answers each prompt with max_tokens tokens; first token 0.1 s after the call."""

    instances: list["StandInLLM"] = []
    short_by = 0  # tokens each answer falls short of max_tokens

    def __init__(self, model: str, **kwargs) -> None:
        self.model, self.kwargs, self.calls = model, kwargs, []
        StandInLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        now = time.time()
        metrics = SimpleNamespace(arrival_time=now + 0.05, first_token_time=now + 0.1,
                                  finished_time=now + 0.1 + 0.01 * (params[0].max_tokens - 1))
        return [SimpleNamespace(
            request_id=str(i), error=None, num_cached_tokens=1, metrics=metrics,
            prompt_token_ids=list(prompt["prompt_token_ids"]) * 2,
            outputs=[SimpleNamespace(token_ids=[0] * (p.max_tokens - self.short_by),
                                     finish_reason="length")])
            for i, (prompt, p) in enumerate(zip(prompts, params))]


@pytest.fixture
def stand_in(monkeypatch):
    StandInLLM.instances.clear()
    monkeypatch.setattr(foveal, "LLM", StandInLLM)
    return StandInLLM


def workload():
    spec = WorkloadSpec(num_prompts=3, images_per_prompt=1, image_size=(32, 32), input_len=4,
                        output_len=5, output_len_range=0.0, seed=0)
    return build_workload(spec, VOCAB)


def test_warms_up_then_times_every_request_greedy_ignoring_eos(stand_in):
    requests = workload()
    result = run_foveal("/ckpt", requests, warmup_request(VOCAB), {"max_num_seqs": 2})
    llm = stand_in.instances[0]
    assert (llm.model, llm.kwargs) == ("/ckpt", {"max_num_seqs": 2})
    (warm_prompts, _), (prompts, params) = llm.calls
    assert len(warm_prompts) == 1 and len(prompts) == 3
    assert prompts[0]["multi_modal_data"]["image"] == requests[0].images
    assert all(p.ignore_eos and p.greedy and p.max_tokens == 5 for p in params)
    summary = result.summary()
    assert summary["output_tokens"] == 15 and summary["cached_prompt_tokens"] == 3
    assert summary["prompt_tokens"] == 2 * sum(len(r.prompt_token_ids) for r in requests)
    assert summary["ttft_median_s"] >= 0.1  # counted from submission, not arrival_time
    assert summary["tpot_median_s"] == pytest.approx(0.01)


def test_fewer_tokens_than_requested_is_an_error(stand_in, monkeypatch):
    monkeypatch.setattr(StandInLLM, "short_by", 1)
    with pytest.raises(FovealError, match="produced 4 tokens where 5"):
        run_foveal("/ckpt", workload(), warmup_request(VOCAB), {})


def test_cli_runs_workload_and_writes_json(stand_in, tmp_path, capsys):
    import json

    from foveal.entrypoints.cli import main
    from foveal.loader.presets import get_preset
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny-qwen2-vl")))
    out = tmp_path / "report.json"
    rc = main(["bench", "throughput", "--model", str(tmp_path), "--num-prompts", "4",
               "--images-per-prompt", "9", "--image-size", "40x30", "--output-len", "3",
               "--max-num-batched-tokens", "512", "--json", str(out)])
    assert rc == 0
    assert "foveal" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["results"][0]["num_requests"] == 4 and report["speedup_vs_hf"] is None
    assert report["workload"]["images_per_prompt"] == 9
    assert report["command_line"].startswith("foveal ")
    # the machine it ran on: which CPU and allocator a row came from
    from foveal.allocator import loaded_allocator
    from foveal.cpu_features import cpu_features

    assert report["machine"]["cpu_features"] == cpu_features().describe()
    assert report["machine"]["allocator"] == loaded_allocator()
    assert "load_average_1m" not in report["machine"]  # taken at the end: not the start's
    # the per-prompt image limit grows to the workload's images unless given
    assert stand_in.instances[0].kwargs["limit_mm_per_prompt"] == {"image": 9}
    assert stand_in.instances[0].kwargs["max_num_batched_tokens"] == 512


@pytest.mark.parametrize("argv", [
    ["--num-prompts", "2"],  # neither --model nor --dummy
    ["--model", "m", "--dummy", "tiny-qwen2-vl"],
    ["--model", "m", "--hf-batch-sizes", "1,0"],
    ["--model", "m", "--hf-batch-sizes", "one"],
    ["--model", "m", "--baseline", "vllm"]])
def test_cli_rejects_bad_arguments(argv):
    from foveal.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", *argv])


def test_cli_defaults_to_hf_batch_sizes_1_8_32():
    from foveal.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--dummy", "tiny-qwen2-vl"])
    assert args.hf_batch_sizes == (1, 8, 32) and args.baseline is None
