"""Video loading (PyAV), frame sampling, the Qwen2-VL video processor, the
audio track and the transcript hook, on clips made in the test."""
from __future__ import annotations

import base64
import tracemalloc

import numpy as np
import pytest
import torch
from PIL import Image

av = pytest.importorskip("av")

from foveal.errors import ConfigError, InvalidRequestError, MediaError, MediaLimitError  # noqa: E402
from foveal.multimodal.media.audio_track import extract_audio  # noqa: E402
from foveal.multimodal.media.video import VideoSampling, load_video, probe_video  # noqa: E402
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor  # noqa: E402
from foveal.multimodal.processors.qwen2_vl_video import Qwen2VLVideoProcessor  # noqa: E402
from foveal.multimodal.transcriber import (  # noqa: E402
    TranscriptSegment, get_transcriber, insert_transcripts, register_transcriber, transcribe_video)

SAMPLING = VideoSampling()
BIG = 10 ** 9


def make_clip(path, num_frames: int, fps: int, width: int = 64, height: int = 48,
              audio_seconds: float = 0.0, container: str = "mp4") -> str:
    """Frame i is filled with value 5 * i % 256 (so lossless frames name their index)."""
    codec, pix_fmt = ("mpeg4", "yuv420p") if container == "mp4" else ("ffv1", "yuv444p")
    with av.open(str(path), "w", format="matroska" if container == "mkv" else container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        audio = out.add_stream("aac", rate=44100) if audio_seconds else None
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 5 * i % 256, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
        if audio is not None:
            _write_tone(out, audio, audio_seconds)
    return str(path)


def _write_tone(out, stream, seconds: float) -> None:
    t = np.arange(int(44100 * seconds)) / 44100
    samples = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    for start in range(0, len(samples), 1024):
        frame = av.AudioFrame.from_ndarray(samples[None, start:start + 1024], format="fltp", layout="mono")
        frame.sample_rate = 44100
        out.mux(stream.encode(frame))
    out.mux(stream.encode())


def decode(source, sampling=SAMPLING):
    info = probe_video(source, sampling, BIG)
    return load_video(source, info, sampling.num_frames(info.num_frames, info.fps), sampling)


@pytest.mark.parametrize("num_frames,fps,expected", [
    (40, 10, 8),     # 4 s at 2 fps
    (30, 30, 4),     # 1 s: min_frames
    (9, 10, 4),      # 0.9 s: min_frames
    (5, 25, 4),      # fewer frames than min_frames*..: floored to even, capped by the clip
    (3, 10, 2),      # a 3-frame clip: floored to the temporal patch size
    (1, 10, 1),      # a single frame is kept (the processor repeats it)
])
def test_sampled_frame_count_follows_fps_min_and_temporal_rounding(tmp_path, num_frames, fps, expected):
    video = decode(make_clip(tmp_path / "c.mp4", num_frames, fps))
    assert len(video.frames) == expected


def test_frames_spread_evenly_with_timestamps_from_the_first_frame(tmp_path):
    video = decode(make_clip(tmp_path / "c.mkv", 40, 10, container="mkv"))  # lossless
    indices = [i * 40 // 8 for i in range(8)]  # 0, 5, 10, ...
    assert video.timestamps == pytest.approx([i / 10 for i in indices], abs=1e-6)
    assert [round(float(f.mean()) / 5) for f in video.frames] == indices


def test_max_frames_caps_long_clips(tmp_path):
    sampling = VideoSampling(fps=2.0, max_frames=6)
    video = decode(make_clip(tmp_path / "c.mp4", 100, 10), sampling)
    assert len(video.frames) == 6


def test_odd_dimensions_and_header_without_frame_count(tmp_path):
    path = make_clip(tmp_path / "c.mkv", 20, 10, width=63, height=47, container="mkv")
    video = decode(path)
    assert video.frames[0].shape == (47, 63, 3) and len(video.frames) == 4


def test_every_encoded_source_decodes_to_the_same_frames(tmp_path):
    path = make_clip(tmp_path / "c.mp4", 20, 10)
    data = open(path, "rb").read()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    hashes = {decode(s).content_hash for s in (path, f"file://{path}", data, url)}
    assert len(hashes) == 1


def test_frame_lists_arrays_and_fps_dicts_are_videos():
    frames = [np.full((30, 40, 3), i, np.uint8) for i in range(12)]
    as_list = decode(frames)  # fps defaults to the sampling fps: already sampled
    assert len(as_list.frames) == 12 and as_list.timestamps[1] == pytest.approx(0.5)
    as_array = decode(np.stack(frames))
    assert as_array.content_hash == as_list.content_hash
    at_6fps = decode({"frames": [Image.fromarray(f) for f in frames], "fps": 6})
    assert len(at_6fps.frames) == 4  # 2 s at 2 fps


@pytest.mark.parametrize("make_source", [
    lambda p: b"",
    lambda p: b"\x00\x01garbage" * 100,
    lambda p: (p / "empty.mp4").write_bytes(b"") or str(p / "empty.mp4"),
    lambda p: (p / "notes.txt").write_text("not a video") or str(p / "notes.txt"),
    lambda p: str(p / "missing.mp4"),
    lambda p: "data:image/png;base64,AAAA",
    lambda p: [],
    lambda p: [np.zeros((4, 4), np.float32)],
])
def test_bad_videos_raise_media_error(tmp_path, make_source):
    with pytest.raises(MediaError):
        decode(make_source(tmp_path))


def test_truncated_file_raises_media_error(tmp_path):
    data = open(make_clip(tmp_path / "c.mp4", 40, 10), "rb").read()
    with pytest.raises(MediaError):
        decode(data[: len(data) // 3])


def test_frame_pixel_and_length_limits_raise_media_limit_error(tmp_path):
    path = make_clip(tmp_path / "c.mp4", 20, 10)
    with pytest.raises(MediaLimitError, match="MP"):
        probe_video(path, SAMPLING, max_frame_pixels=64 * 47)
    with pytest.raises(MediaLimitError, match="frames"):
        probe_video(path, SAMPLING, BIG, max_source_frames=10)


def test_decoding_a_long_clip_keeps_memory_bounded(tmp_path):
    path = make_clip(tmp_path / "long.mp4", 600, 30, width=160, height=120)
    decoded_size = 600 * 160 * 120 * 3
    tracemalloc.start()
    video = decode(path, VideoSampling(fps=0.5))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(video.frames) == 10
    assert peak < decoded_size / 10


def test_one_frame_video_repeats_its_frame_and_equals_the_image_processor():
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    video_processor = Qwen2VLVideoProcessor(frame=image_processor)
    frame = np.random.RandomState(0).randint(0, 256, (70, 100, 3), dtype=np.uint8)
    video = video_processor.process(decode([frame]))
    image = image_processor.process(Image.fromarray(frame))
    assert video.grid_thw == image.grid_thw
    torch.testing.assert_close(video.pixel_values_videos, image.pixel_values, rtol=0, atol=0)


def test_video_patches_follow_transformers_layout():
    """Oracle: transformers' Qwen2VLVideoProcessor.patchify reshape, on (F, C, H, W)."""
    processor = Qwen2VLVideoProcessor(frame=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 84))
    frames = [np.random.RandomState(i).randint(0, 256, (56, 84, 3), dtype=np.uint8) for i in range(4)]
    out = processor.process(decode({"frames": frames, "fps": 2}))
    pixels = np.stack([processor.frame.normalize(f) for f in frames])
    videos = torch.from_numpy(pixels).permute(0, 3, 1, 2)[None]  # (1, F, C, H, W)
    patches = videos.reshape(1, 2, 2, 3, 2, 2, 14, 3, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    assert out.grid_thw == (2, 4, 6)
    torch.testing.assert_close(out.pixel_values_videos, patches.reshape(48, 1176), rtol=0, atol=0)


def test_video_mm_hash_covers_sampling_and_resolution():
    frames = [np.full((56, 56, 3), i * 20, np.uint8) for i in range(8)]
    processor = Qwen2VLVideoProcessor(frame=Qwen2VLImageProcessor())
    base = processor.process(decode(frames)).mm_hash
    assert processor.process(decode(frames)).mm_hash == base
    assert processor.process(decode({"frames": frames, "fps": 4})).mm_hash != base
    assert processor.with_max_pixels(28 * 28).process(decode(frames)).mm_hash != base
    assert processor.process(decode(frames[:4])).mm_hash != base


def test_video_processor_reads_video_defaults_and_checks_overrides():
    processor = Qwen2VLVideoProcessor.from_config({})
    assert (processor.frame.min_pixels, processor.frame.max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    assert processor.with_overrides({"fps": 1, "max_frames": 8}).sampling == VideoSampling(1.0, 4, 8, 2)
    with pytest.raises(InvalidRequestError, match="frames_per_minute"):
        processor.with_overrides({"frames_per_minute": 3})


def test_audio_track_is_16khz_mono_float32(tmp_path):
    track = extract_audio(make_clip(tmp_path / "a.mp4", 20, 10, audio_seconds=2.0))
    assert track.sample_rate == 16000 and track.samples.dtype == np.float32
    assert track.duration == pytest.approx(2.0, abs=0.1)
    assert 0.3 < float(np.abs(track.samples).max()) <= 1.0


def test_clip_without_audio_has_no_track(tmp_path):
    assert extract_audio(make_clip(tmp_path / "c.mp4", 20, 10)) is None
    assert extract_audio([np.zeros((8, 8, 3), np.uint8)]) is None


class FixedTranscriber:
    name = "fixed"

    def transcribe(self, samples, sample_rate):
        return [TranscriptSegment(0.0, len(samples) / sample_rate, "a tone")]


def test_transcript_is_marked_with_source_and_timestamps(tmp_path):
    text = transcribe_video(FixedTranscriber(), make_clip(tmp_path / "a.mp4", 20, 10, audio_seconds=1.0), 1)
    assert "[Transcript of video 1 audio (asr: fixed)]" in text
    assert "[0.0s-1.0s] a tone" in text


def test_transcript_goes_right_after_its_video():
    VIDEO, END = 13, 10
    ids = [1, 9, VIDEO, END, 2, 9, VIDEO, 3]
    assert insert_transcripts(ids, [[70, 71], [80]], VIDEO, END) == [1, 9, VIDEO, END, 70, 71, 2, 9, VIDEO, 80, 3]


def test_transcriber_registry():
    register_transcriber("fixed-test", FixedTranscriber)
    assert get_transcriber("fixed-test").name == "fixed"
    with pytest.raises(ConfigError, match="registered"):
        get_transcriber("nope")
