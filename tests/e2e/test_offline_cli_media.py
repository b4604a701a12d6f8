"""`foveal generate --file/--audio` and `foveal chat` with /file: PDFs and speech reach
the prompt through LLM.chat and the preprocessing stages, on the tiny checkpoint."""
from __future__ import annotations

import io
import shutil
import subprocess

import pytest

from foveal.entrypoints.cli import main
from tests.stages.stage_documents import make_text_pdf

ENGINE_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(16 << 20),
                "--max-tokens", "2"]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.fail("espeak-ng is not installed; the speech tests need it: apt-get install -y espeak-ng")
    root = tmp_path_factory.mktemp("documents")
    (root / "note.pdf").write_bytes(make_text_pdf([["The secret word is banana."]]))
    subprocess.run([espeak, "-s", "150", "-w", str(root / "door.wav"),
                    "Please open the front door."], check=True)
    return root


def test_generate_with_file_and_audio_puts_pdf_text_and_transcript_in_the_prompt(
        tiny_checkpoints, documents, chat_prompts, capsys):
    code = main(["generate", "--model", tiny_checkpoints("tiny-qwen2-vl"), *ENGINE_FLAGS,
                 "--file", str(documents / "note.pdf"), "--audio", str(documents / "door.wav"),
                 "--stage-workers", "pdf=1,asr=1", "What do they say?"])
    assert code == 0
    [prompt] = chat_prompts
    assert '[PDF "note.pdf" page 1 text]\nThe secret word is banana.' in prompt
    assert "[Transcript of audio 00:00-" in prompt and "front door" in prompt.lower()
    assert prompt.index("banana") < prompt.index("What do they say?")
    assert capsys.readouterr().out.strip() != ""


def test_chat_attaches_a_pdf_with_the_file_command(tiny_checkpoints, documents, chat_prompts,
                                                    monkeypatch, capsys):
    lines = f"/file {documents / 'note.pdf'}\nWhat is the word?\nAnd again?\n/exit\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["chat", "--model", tiny_checkpoints("tiny-qwen2-vl"), *ENGINE_FLAGS])
    assert code == 0
    first, second = chat_prompts
    assert "The secret word is banana." in first
    assert second.count("The secret word is banana.") == 1  # attached to one message only
    assert capsys.readouterr().out.count("\n") >= 3


def test_missing_file_is_an_error_that_names_it(tiny_checkpoints, tmp_path, capsys):
    code = main(["generate", "--model", tiny_checkpoints("tiny-qwen2-vl"), *ENGINE_FLAGS,
                 "--file", str(tmp_path / "absent.pdf"), "Hi"])
    assert code == 2
    assert "cannot read PDF" in capsys.readouterr().err
