"""Speech-to-text stage and audio decoding, on speech made with espeak-ng (and sox)."""
from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from stage_documents import edit_distance

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.audio import SAMPLE_RATE, load_audio
from foveal.stages.assembly import expand_preprocessed_parts_sync

SENTENCES = [
    "The weather is cold today.", "Please open the front door.", "My sister bought a new car.",
    "We will meet at the train station.", "The children are playing in the park.",
    "He drinks coffee every morning.", "This book is about the history of music.",
    "Turn left at the next corner.", "The meeting starts after lunch.",
    "I would like a glass of water.", "The garden is full of red flowers.",
    "Our team won the game last night.",
]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; the speech tests need it: apt-get install -y espeak-ng sox")
    return path


def _speak(text: str, path) -> None:
    subprocess.run([_tool("espeak-ng"), "-s", "150", "-w", str(path), text], check=True)


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def _audio_part(data: bytes, audio_format: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format}}


def test_transcripts_of_espeak_speech_have_at_most_20_percent_wer(real_stages, tmp_path):
    half = len(SENTENCES) // 2
    _speak(" ".join(SENTENCES[:half]), tmp_path / "first.wav")
    _speak(" ".join(SENTENCES[half:]), tmp_path / "second.wav")
    subprocess.run([_tool("sox"), str(tmp_path / "second.wav"), str(tmp_path / "second.ogg")], check=True)
    messages = [{"role": "user", "content": [
        _audio_part((tmp_path / "first.wav").read_bytes(), "wav"),
        _audio_part((tmp_path / "second.ogg").read_bytes(), "ogg"),
        {"type": "text", "text": "What was said?"}]}]
    parts = expand_preprocessed_parts_sync(messages, real_stages)[0]["content"]
    first, second = parts[0]["text"], parts[1]["text"]
    assert re.match(r"\[Transcript of audio 1 00:00-00:0\d\] ", first)
    assert re.match(r"\[Transcript of audio 2 00:00-00:0\d\] ", second)
    hypothesis = re.sub(r"\[Transcript of audio \d [\d:]+-[\d:]+\]", " ", first + second)
    reference = _words(" ".join(SENTENCES))
    wer = edit_distance(reference, _words(hypothesis)) / len(reference)
    print(f"ASR WER over {len(SENTENCES)} sentences: {wer:.4f}")
    assert wer <= 0.20


def test_transcribers_take_samples_and_return_start_end_text_segments(real_stages, tmp_path):
    from foveal.multimodal.transcriber import get_transcriber
    from foveal.stages import stage_names
    from foveal.stages.asr import StageTranscriber

    assert "asr" in stage_names()
    _speak("Please open the front door.", tmp_path / "door.wav")
    samples = load_audio(tmp_path / "door.wav")
    for transcriber in (get_transcriber("whisper"), StageTranscriber(real_stages)):
        [segment] = transcriber.transcribe(samples, SAMPLE_RATE)
        assert 0.0 <= segment.start < segment.end
        assert _words(segment.text) == ["please", "open", "the", "front", "door"]


def test_audio_of_any_rate_and_layout_decodes_to_16k_mono_float32(tmp_path):
    stereo = tmp_path / "tone.flac"
    subprocess.run([_tool("sox"), "-n", "-r", "44100", "-c", "2", str(stereo), "synth", "0.5", "sine", "440"],
                   check=True)
    samples = load_audio("data:audio/flac;base64," + base64.b64encode(stereo.read_bytes()).decode())
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.size - SAMPLE_RATE // 2) <= 64
    assert 0.3 < np.abs(samples).max() <= 1.0


def test_corrupt_or_too_long_audio_is_a_clear_error(tmp_path):
    with pytest.raises(MediaError, match="could not open 11 bytes as audio"):
        load_audio(b"not a sound")
    _speak("This sentence is longer than one second.", tmp_path / "long.wav")
    with pytest.raises(MediaLimitError, match="the limit is 1 s"):
        load_audio(tmp_path / "long.wav", max_duration_s=1.0)


def test_audio_without_transcription_is_an_invalid_request(real_stages):
    from foveal.errors import InvalidRequestError

    messages = [{"role": "user", "content": [_audio_part(b"RIFF", "wav")]}]
    with pytest.raises(InvalidRequestError, match="set transcribe_audio=true"):
        expand_preprocessed_parts_sync(messages, real_stages, {"transcribe_audio": False})


def test_whisper_transcriber_needs_no_import_of_foveal_stages_first():
    code = ("import sys\nfrom foveal.multimodal.transcriber import get_transcriber\n"
            "assert 'foveal.stages' not in sys.modules\nprint(get_transcriber('whisper').name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "whisper"
