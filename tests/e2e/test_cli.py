"""The `foveal` command line, run in-process through its entry point."""
from __future__ import annotations

import io
import json

import pytest

from foveal.entrypoints.cli import main
from foveal.entrypoints.demo import DEMO_IMAGE

ENGINE = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20)]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for command in ("demo", "generate", "chat", "bench", "tiny-model"):
        assert command in text


def test_tiny_model_writes_a_loadable_hf_folder(tmp_path):
    out = tmp_path / "tiny"
    assert main(["tiny-model", "--arch", "qwen2_5_vl", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]


def test_demo_with_a_preset_builds_the_checkpoint_once_and_answers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path))
    assert main(["demo", "--preset", "tiny-qwen2-vl", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "answer:" in out and "generated: 4" in out
    built = tmp_path / "tiny-qwen2-vl" / "model.safetensors"
    stamp = built.stat().st_mtime_ns
    assert main(["demo", "--preset", "tiny-qwen2-vl", "--max-tokens", "2"]) == 0
    assert built.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_generate_with_an_image_prints_the_answer(tiny_checkpoints, capsys):
    path = tiny_checkpoints("tiny-qwen2-vl")
    code = main(["generate", "--model", path, "--image", str(DEMO_IMAGE), "--max-tokens", "3",
                 *ENGINE, "What is this?"])
    assert code == 0
    assert capsys.readouterr().out.endswith("\n")


def test_generate_reports_bad_input_as_an_error_exit(tiny_checkpoints, tmp_path, capsys):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    code = main(["generate", "--model", tiny_checkpoints("tiny-qwen2-vl"), "--image", str(bad),
                 *ENGINE, "What is this?"])
    assert code == 2
    assert "foveal: error:" in capsys.readouterr().err


def test_chat_reads_turns_from_stdin_and_attaches_images(tiny_checkpoints, monkeypatch,
                                                         capsys):
    from foveal.llm import LLM

    calls = []
    real_chat = LLM.chat

    def recording_chat(self, messages, *args, **kwargs):
        calls.append([dict(m) for m in messages])
        return real_chat(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLM, "chat", recording_chat)
    script = f"/image {DEMO_IMAGE}\nWhat is in the picture?\nAnd now?\n/exit\nnever sent\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", "--model", tiny_checkpoints("tiny-qwen2-vl"), "--max-tokens", "3",
                 *ENGINE]) == 0
    assert capsys.readouterr().out.startswith("Type a message.")
    assert len(calls) == 2
    first_turn = calls[1][0]["content"]
    assert first_turn[0]["image_url"]["url"] == str(DEMO_IMAGE)
    assert [m["role"] for m in calls[1]] == ["user", "assistant", "user"]
    assert calls[1][2]["content"][-1]["text"] == "And now?"
