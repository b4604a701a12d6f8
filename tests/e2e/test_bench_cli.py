"""`foveal bench throughput` end to end on the tiny preset, with the transformers baseline."""
from __future__ import annotations

import json

from foveal.entrypoints.cli import main


def test_bench_throughput_dummy_preset_with_hf_baseline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path / "cache"))
    report_path = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--dummy", "tiny-qwen2-vl", "--num-prompts", "5",
               "--images-per-prompt", "2", "--image-size", "96x64", "--input-len", "8",
               "--output-len", "6", "--output-len-range", "0.5", "--seed", "1",
               "--baseline", "hf", "--hf-batch-sizes", "1,3", "--max-num-seqs", "4",
               "--json", str(report_path)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "hf (batch 3)" in stdout and "foveal / hf output tokens/s" in stdout

    report = json.loads(report_path.read_text())
    assert (tmp_path / "cache" / "tiny-qwen2-vl" / "config.json").exists()
    assert report["workload"]["num_prompts"] == 5 and report["workload"]["seed"] == 1
    assert report["engine_kwargs"]["max_num_seqs"] == 4
    foveal, hf_1, hf_3 = report["results"]
    assert (foveal["system"], hf_1["batch_size"], hf_3["batch_size"]) == ("foveal", 1, 3)
    # Same workload, same checkpoint: both systems expand the same visual tokens
    # and produce every requested token (EOS ignored).
    for row in (hf_1, hf_3):
        assert row["prompt_tokens"] == foveal["prompt_tokens"]
        assert row["output_tokens"] == foveal["output_tokens"]
    assert foveal["num_requests"] == 5 and foveal["ttft_median_s"] > 0
    assert report["speedup_vs_hf"] > 0
    assert report["best_hf_batch_size"] in (1, 3)


def test_bench_throughput_on_checkpoint_saved_by_transformers(tmp_path, capsys):
    from tests.models.hf_checkpoint import write_hf_tiny_qwen2_vl

    # Its generation_config lists every token as EOS: both systems must ignore EOS.
    model_dir = write_hf_tiny_qwen2_vl(tmp_path / "ckpt")
    report_path = tmp_path / "bench.json"
    rc = main(["bench", "throughput", "--model", str(model_dir), "--num-prompts", "4",
               "--images-per-prompt", "1", "--image-size", "80x60", "--input-len", "5",
               "--output-len", "4", "--baseline", "hf", "--hf-batch-sizes", "2",
               "--json", str(report_path)])
    assert rc == 0
    foveal, hf = json.loads(report_path.read_text())["results"]
    assert foveal["output_tokens"] == hf["output_tokens"] == 16
    assert foveal["prompt_tokens"] == hf["prompt_tokens"]


def test_bench_kv_cache_compares_dtypes_at_one_pool_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path / "cache"))
    report_path = tmp_path / "kv.json"
    rc = main(["bench", "kv-cache", "--dummy", "tiny-qwen2-vl", "--kv-dtypes", "float32,int8,int4",
               "--num-prompts", "8", "--images-per-prompt", "1", "--image-size", "112x84",
               "--output-len", "24", "--output-len-range", "0", "--max-model-len", "128",
               "--kv-cache-memory-bytes", str(12 * 8192), "--long-context", "300",
               "--decode-tokens", "4", "--accuracy-prompts", "1", "--accuracy-tokens", "8",
               "--json", str(report_path)])
    assert rc == 0
    assert "| int4 |" in capsys.readouterr().out
    rows = {row["kv_cache_dtype"]: row for row in json.loads(report_path.read_text())["rows"]}
    # tiny preset: head_dim 16, so a float16 scale per 16 values costs more than at real sizes
    assert rows["float32"]["capacity_tokens"] == 12 * 16
    assert rows["int8"]["capacity_tokens"] >= 3.5 * rows["float32"]["capacity_tokens"]
    assert rows["int4"]["capacity_tokens"] >= 6 * rows["float32"]["capacity_tokens"]
    assert rows["float32"]["preemptions"] > rows["int4"]["preemptions"]
    assert rows["float32"]["peak_running_before_preemption"] < \
        rows["int4"]["peak_running_before_preemption"]
    assert rows["float32"]["top1_agreement"] == 1.0 and rows["int8"]["positions"] == 8
    assert all(row["decode_ms_per_token"] > 0 for row in rows.values())


def test_bench_kv_cache_compares_sliding_window_layouts(tmp_path, monkeypatch, capsys):
    """Gemma 3's sliding layers in their own blocks (hybrid) against every layer in
    every block (plain), at one pool size: longer requests fit, more run at once."""
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path / "cache"))
    report_path = tmp_path / "kv.json"
    rc = main(["bench", "kv-cache", "--dummy", "tiny-gemma3", "--kv-dtypes", "float32",
               "--kv-layouts", "plain,hybrid", "--num-prompts", "12", "--images-per-prompt", "1",
               "--image-size", "112x112", "--input-len", "80", "--output-len", "8",
               "--output-len-range", "0", "--max-model-len", "256",
               "--max-num-batched-tokens", "32", "--block-size", "4",
               "--kv-cache-memory-bytes", str(320 * 1024), "--long-context", "0",
               "--json", str(report_path)])
    assert rc == 0
    assert "| float32 | hybrid |" in capsys.readouterr().out
    rows = {row["kv_layout"]: row for row in json.loads(report_path.read_text())["rows"]}
    assert rows["plain"]["kv_groups"] == "one group"
    assert rows["hybrid"]["kv_groups"].startswith("2 KV groups of 2 layers")
    # a page holds 2 of the 4 layers: about twice the tokens, less one window
    assert rows["hybrid"]["longest_request_tokens"] > 1.7 * rows["plain"]["longest_request_tokens"]
    assert rows["hybrid"]["peak_running_before_preemption"] > \
        rows["plain"]["peak_running_before_preemption"]
    assert rows["hybrid"]["preemptions"] < rows["plain"]["preemptions"]
