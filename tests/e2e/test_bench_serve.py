"""`foveal bench serve` against a live OpenAI-compatible server (the tiny model)."""
from __future__ import annotations

import argparse
import json

import pytest


from foveal.bench.serve import build_chat_requests, register_serve  # noqa: E402
from foveal.bench.workload import WorkloadSpec  # noqa: E402
from foveal.errors import ConfigError  # noqa: E402
from tests.e2e.test_openai_server import (checkpoint, media_root, server,  # noqa: E402,F401
                                          shared_engine)


def bench_main(argv: list[str]) -> int:
    """What `foveal bench serve ARGS` runs (the same parser registration)."""
    parser = argparse.ArgumentParser(prog="foveal bench")
    register_serve(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["serve", *argv])
    return args.func(args)


def _spec(seed: int) -> WorkloadSpec:
    return WorkloadSpec(num_prompts=3, images_per_prompt=2, image_size=(64, 48), input_len=5,
                        output_len=4, output_len_range=0.0, seed=seed)


def test_chat_workload_is_determined_by_its_seed():
    first, again, other = (build_chat_requests(_spec(seed)) for seed in (7, 7, 8))
    assert [r.messages for r in first] == [r.messages for r in again]
    assert [r.messages for r in first] != [r.messages for r in other]
    parts = first[0].messages[0]["content"]
    assert [part["type"] for part in parts] == ["image_url", "image_url", "text"]
    assert len(parts[2]["text"].split()) == 5


def test_bench_serve_runs_a_short_workload_against_the_live_server(server, tmp_path, capsys):
    result_path = tmp_path / "serve.json"
    rc = bench_main(["--base-url", server.base_url, "--num-prompts", "6",
                     "--images-per-prompt", "1", "--image-size", "64x48", "--input-len", "8",
                     "--output-len", "5", "--request-rate", "50", "--max-concurrency", "4",
                     "--seed", "2", "--goodput", "ttft:600000", "e2el:600000",
                     "--save-result", str(result_path)])
    assert rc == 0
    stdout = capsys.readouterr().out
    for line in ("request throughput", "output token throughput", "median TTFT",
                 "p99 TPOT", "mean ITL", "median E2E latency", "goodput"):
        assert line in stdout
    result = json.loads(result_path.read_text())
    assert result["model"] == "tiny"  # resolved from /v1/models
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_tokens"] == 6 * 5  # EOS ignored: every requested token
    assert result["prompt_tokens"] > 6 * 8
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # SLOs loose
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["mean"] > 0


def test_bench_serve_goodput_counts_only_requests_within_the_slos(server, tmp_path):
    result_path = tmp_path / "serve.json"
    rc = bench_main(["--base-url", server.base_url, "--model", "tiny", "--num-prompts", "2",
                     "--images-per-prompt", "0", "--input-len", "4", "--output-len", "3",
                     "--goodput", "ttft:0.000001", "--save-result", str(result_path)])
    assert rc == 0
    assert json.loads(result_path.read_text())["goodput"] == 0


def test_bench_serve_reports_failed_requests(server, tmp_path, capsys):
    rc = bench_main(["--base-url", server.base_url, "--model", "not-served", "--num-prompts",
                     "2", "--images-per-prompt", "0", "--input-len", "2", "--output-len", "2"])
    assert rc == 1
    assert "HTTP 400" in capsys.readouterr().out


def test_bench_serve_rejects_a_malformed_goodput():
    with pytest.raises(ConfigError, match="KEY:MS"):
        bench_main(["--base-url", "http://127.0.0.1:9", "--goodput", "ttft=5"])
