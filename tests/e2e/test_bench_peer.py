"""`foveal bench peer`: llama.cpp runs the GGUF export of the same checkpoint on the same
requests, and at f32 it produces Foveal's greedy tokens from the same visual tokens, which
shows the export (names, qkv split, patch kernels, M-RoPE sections, vocabulary) is right."""
from __future__ import annotations

import json

import pytest

from foveal.bench.gguf_export import export_gguf
from foveal.bench.peer import LlamaCpp
from foveal.bench.throughput import run_foveal
from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload, warmup_request
from foveal.entrypoints.cli import main
from foveal.errors import ConfigError
from foveal.loader.tiny_model import ensure_tiny_checkpoint


def _qwen2_5_vl_with_llama_cpp_window(folder):
    """The tiny Qwen2.5-VL with the 112-pixel attention window real checkpoints have and
    llama.cpp assumes (the window is configuration, not weights)."""
    model = ensure_tiny_checkpoint(folder, "tiny-qwen2.5-vl")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"]["window_size"] = 112
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_llama_cpp_on_the_f32_export_gives_foveals_greedy_tokens(tmp_path, preset):
    model = (ensure_tiny_checkpoint(tmp_path / "m", preset) if preset == "tiny-qwen2-vl"
             else _qwen2_5_vl_with_llama_cpp_window(tmp_path / "m"))
    vocab = PromptVocab.from_model_dir(model)
    # sides are multiples of 28, so neither system resizes: llama.cpp's bicubic resize
    # is its own, and on a random-weight model a few changed pixels change the tokens
    spec = WorkloadSpec(num_prompts=3, images_per_prompt=1, image_size=(112, 84),
                        image_size_range=0, input_len=8, output_len=8, output_len_range=0,
                        seed=3)
    requests = build_workload(spec, vocab)
    foveal = run_foveal(model, requests, warmup_request(vocab), {"dtype": "float32"},
                        one_at_a_time=True)
    runner = LlamaCpp(export_gguf(model, tmp_path / "gguf", "f32"), vocab, n_ctx=1024, threads=2,
                      kv_f32=True)
    try:
        outputs = [runner.generate(request) for request in requests]
        # the same prompt again: nothing of the previous request is left behind
        assert runner.generate(requests[0])[0] == outputs[0][0]
    finally:
        runner.close()
    assert [tokens for tokens, _ in outputs] == foveal.token_ids
    # llama.cpp cut each image into as many visual tokens as Foveal did
    assert [record.prompt_len for _, record in outputs] == \
        [record.prompt_len for record in foveal.records]
    assert all(record.output_len == 8 and record.ttft_s > 0 for _, record in outputs)


def test_bench_peer_reports_every_system_side_by_side(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path / "cache"))
    report_path = tmp_path / "peer.json"
    rc = main(["bench", "peer", "--dummy", "tiny-qwen2-vl", "--num-prompts", "2",
               "--images-per-prompt", "1", "--image-size", "84x84", "--image-size-range", "0",
               "--input-len", "6", "--output-len", "5", "--output-len-range", "0",
               "--weights", "f32,q8_0", "--gguf-dir", str(tmp_path / "gguf"),
               "--json", str(report_path)])
    assert rc == 0
    assert "llama.cpp q8_0" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    systems = [row["system"] for row in report["results"]]
    assert systems == ["foveal fp32", "llama.cpp f32", "foveal int8", "llama.cpp q8_0", "hf"]
    assert len({row["prompt_tokens"] for row in report["results"]}) == 1
    assert all(row["output_tokens"] == 10 for row in report["results"])
    f32, q8_0 = report["comparisons"]
    assert (f32["foveal"], f32["peer"], f32["same_greedy_tokens"]) == \
        ("foveal fp32", "llama.cpp f32", "2/2")
    assert q8_0["foveal"] == "foveal int8" and q8_0["tpot_ratio"] > 0
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == \
        ["mmproj-f16.gguf", "mmproj-f32.gguf", "model-f32.gguf", "model-q8_0.gguf"]


def test_prompts_llama_cpp_cannot_take_are_refused(tmp_path):
    model = ensure_tiny_checkpoint(tmp_path / "m", "tiny-qwen2-vl")
    vocab = PromptVocab.from_model_dir(model)
    spec = WorkloadSpec(num_prompts=1, images_per_prompt=1, image_size=(56, 56), input_len=0,
                        output_len=2, output_len_range=0)
    request = build_workload(spec, vocab)[0]
    runner = LlamaCpp(export_gguf(model, tmp_path / "gguf", "f32"), vocab, n_ctx=512, threads=1)
    try:
        request.images = request.images * 2
        with pytest.raises(ConfigError, match="one image placeholder per image"):
            runner.generate(request)
        request.images = request.images[:1]
        request.prompt_token_ids = request.prompt_token_ids[1:] + [vocab.text_token_ids[0]]
        with pytest.raises(ConfigError, match="wrapped"):
            runner.generate(request)
        # the runner still serves a well-formed prompt afterwards
        spec = WorkloadSpec(num_prompts=1, images_per_prompt=1, image_size=(56, 56), input_len=2,
                            output_len=3, output_len_range=0)
        assert len(runner.generate(build_workload(spec, vocab)[0])[0]) == 3
    finally:
        runner.close()


def test_extra_buffer_types_are_switched_only_while_a_model_loads():
    """On AMX CPUs llama.cpp's AMX weight buffers fault, so the runner loads without them;
    the switch lasts only as long as the load."""
    from llama_cpp import llama_cpp

    from foveal.bench.peer import _extra_buffer_types

    with _extra_buffer_types(False):
        assert llama_cpp.llama_model_default_params().use_extra_bufts is False
    with _extra_buffer_types(True):
        assert llama_cpp.llama_model_default_params().use_extra_bufts is True
    assert llama_cpp.llama_model_default_params().use_extra_bufts is True
