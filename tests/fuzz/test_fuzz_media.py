"""Fuzzing the media decoders: corrupt, truncated, empty and mutated files of every
format, decompression bombs, odd image modes, bad data URLs. Property: a decoder
returns a valid result or raises MediaError / MediaLimitError, nothing else.
Examples are derandomized and bounded, so CI sees the same inputs every run."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.audio import decode_audio, load_audio
from foveal.multimodal.media.data_url import decode_data_url
from foveal.multimodal.media.image import load_image
from foveal.multimodal.media.video import VideoSampling, load_video, probe_video
from foveal.stages.pdf import PdfItem, PdfStage
from tests.fuzz.media_samples import (animated, encode_image, gif_declaring, image_files,
                                      mp4_clip, odd_mode_files, pdf_file, png_declaring,
                                      video_files, wav_clip)

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_PIXELS = 1 << 16
TYPED = (MediaError, MediaLimitError)


@st.composite
def mutated(draw, files: dict[str, bytes]) -> bytes:
    """A valid file with a few random edits: flipped bytes, cuts, insertions."""
    data = bytearray(files[draw(st.sampled_from(sorted(files)))])
    for _ in range(draw(st.integers(1, 6))):
        edit = draw(st.sampled_from(("flip", "truncate", "insert", "delete")))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if edit == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif edit == "truncate":
            del data[at:]
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:at + draw(st.integers(1, 64))]
    return bytes(data)


def decoded_or_typed_error(decode):
    try:
        return decode()
    except TYPED:
        return None


@FUZZ
@given(mutated(image_files()))
def test_mutated_image_files_decode_to_rgb_or_raise_media_error(data):
    image = decoded_or_typed_error(lambda: load_image(data, MAX_PIXELS))
    if image is not None:
        assert image.mode == "RGB" and 0 < image.width * image.height <= MAX_PIXELS


@FUZZ
@given(st.sampled_from(sorted(image_files())), st.floats(0, 1))
def test_truncated_image_files_raise_media_error_or_decode(name, fraction):
    data = image_files()[name]
    image = decoded_or_typed_error(lambda: load_image(data[:int(len(data) * fraction)], MAX_PIXELS))
    assert image is None or image.mode == "RGB"


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_are_never_anything_but_a_media_error(data):
    for decode in (lambda: load_image(data, MAX_PIXELS), lambda: decode_audio(data),
                   lambda: probe_video(data, VideoSampling(), MAX_PIXELS)):
        decoded_or_typed_error(decode)


def test_zero_length_media_are_media_errors():
    with pytest.raises(MediaError, match="empty"):
        load_image(b"", MAX_PIXELS)
    with pytest.raises(MediaError, match="empty"):
        probe_video(b"", VideoSampling(), MAX_PIXELS)
    with pytest.raises(MediaError, match="0 bytes"):
        decode_audio(b"")
    with pytest.raises(MediaError, match="not a PDF"):
        PdfStage().process(PdfItem(b""))


# Sizes under Pillow's own bomb limit (~179 MP), which it refuses before any of our code runs.
under_pillow_limit = st.integers(1, 1 << 20).flatmap(
    lambda width: st.tuples(st.just(width), st.integers(1, 150_000_000 // width)))


@FUZZ
@given(under_pillow_limit)
def test_png_pixel_limit_is_checked_from_the_header_before_decoding(size):
    width, height = size
    loads = []
    original = ImageFile.ImageFile.load

    def recording_load(self):
        loads.append(self.size)
        return original(self)

    ImageFile.ImageFile.load = recording_load
    try:
        if width * height > MAX_PIXELS:
            with pytest.raises(MediaLimitError, match="--max-image-pixels"):
                load_image(png_declaring(width, height), MAX_PIXELS)
            assert loads == []  # refused before a single row was inflated
        else:
            decoded_or_typed_error(lambda: load_image(png_declaring(width, height), MAX_PIXELS))
    finally:
        ImageFile.ImageFile.load = original


@pytest.mark.parametrize("bomb", [png_declaring(100_000, 100_000), gif_declaring(65535, 65535)],
                         ids=["png", "gif"])
def test_pillow_decompression_bomb_error_is_a_media_limit_error(bomb):
    # A limit above Pillow's own: Pillow's DecompressionBombError speaks first.
    with pytest.raises(MediaLimitError, match="--max-image-pixels"):
        load_image(bomb, 10 ** 11)


@pytest.mark.parametrize("width,height", [(0, 10), (10, 0), (0, 0)])
def test_zero_dimension_images_are_media_errors(width, height):
    with pytest.raises(MediaError):
        load_image(png_declaring(width, height), MAX_PIXELS)
    with pytest.raises(MediaError):
        load_image(gif_declaring(width, height), MAX_PIXELS)


ODD_MODE_FILES = odd_mode_files()


@pytest.mark.parametrize("name", sorted(ODD_MODE_FILES))
def test_odd_image_modes_load_as_rgb_of_the_same_size(name):
    picture, data = ODD_MODE_FILES[name]
    image = load_image(data, MAX_PIXELS)
    assert image.mode == "RGB" and image.size == picture.size
    assert load_image(picture, MAX_PIXELS).size == picture.size


@pytest.mark.parametrize("image_format", ["GIF", "WEBP"])
def test_animated_images_give_their_first_frame(image_format):
    data = animated(image_format)
    with Image.open(io.BytesIO(data)) as source:
        assert source.n_frames == 3
        first = np.asarray(source.convert("RGB"))
        source.seek(1)
        second = np.asarray(source.convert("RGB"))
    loaded = np.asarray(load_image(data, MAX_PIXELS))
    assert np.array_equal(loaded, first) and not np.array_equal(loaded, second)


def test_formats_outside_the_accepted_list_are_refused():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    for data in (eps, encode_image(Image.new("RGB", (8, 8)), "PPM"),
                 encode_image(Image.new("RGB", (8, 8)), "ICO")):
        with pytest.raises(MediaError, match="could not identify an image"):
            load_image(data, MAX_PIXELS)


# Relative paths only, and no file: URLs: an absolute path could name a device file.
local_source_text = st.text(max_size=24).filter(
    lambda text: not text.startswith(("/", "~")) and "file" not in text.lower())


def load_every_kind(source) -> list:
    """What each loader makes of source: its result, or None for a typed error."""
    return [decoded_or_typed_error(decode) for decode in (
        lambda: load_image(source, MAX_PIXELS), lambda: load_audio(source),
        lambda: probe_video(source, VideoSampling(), MAX_PIXELS))]


@FUZZ
@given(local_source_text)
def test_source_strings_load_or_raise_media_error(source):
    load_every_kind(source)


@pytest.mark.parametrize("source", ["a\x00b", "\ud800.png", "file:///a%00b", "file://host/x.png",
                                    "http://127.0.0.1:1/x", "."])
def test_unreadable_paths_are_media_errors(source):
    assert load_every_kind(source) == [None, None, None]


data_url_text = st.one_of(
    st.text(max_size=40).map(lambda text: "data:" + text),
    st.tuples(st.sampled_from(["image/png", "video/mp4", "text/plain", "", "IMAGE/PNG;x=1"]),
              st.sampled_from([";base64", "", ";BASE64", ";charset=utf-8;base64"]),
              st.text(max_size=40)).map(lambda parts: f"data:{parts[0]}{parts[1]},{parts[2]}"))


@FUZZ
@given(data_url_text)
def test_data_urls_decode_or_raise_media_error(url):
    payload = decoded_or_typed_error(lambda: decode_data_url(url, ("image/",), "an image"))
    assert payload is None or isinstance(payload, bytes)


@FUZZ
@given(st.binary(max_size=64), st.lists(st.integers(0, 200), max_size=4))
def test_base64_payload_round_trips_with_whitespace_anywhere(data, breaks):
    encoded = base64.b64encode(data).decode()
    for at in sorted(breaks, reverse=True):
        encoded = encoded[:at] + "\n " + encoded[at:]
    assert decode_data_url("data:image/png;base64," + encoded, ("image/",), "an image") == data


@FUZZ
@given(mutated(video_files()))
def test_mutated_videos_probe_and_decode_or_raise_media_error(data):
    sampling = VideoSampling(fps=4.0, min_frames=2, max_frames=8)
    info = decoded_or_typed_error(lambda: probe_video(data, sampling, MAX_PIXELS))
    if info is None:
        return
    num_frames = sampling.num_frames(info.num_frames, info.fps)
    video = decoded_or_typed_error(lambda: load_video(data, info, num_frames, sampling))
    if video is not None:
        assert len(video.frames) == num_frames
        assert all(frame.shape == (info.height, info.width, 3) for frame in video.frames)


def test_video_frame_other_than_its_header_size_is_a_media_error(monkeypatch):
    import av

    from foveal.multimodal.media import video as video_media

    sampling = VideoSampling(fps=4.0, min_frames=2, max_frames=8)
    info = probe_video(mp4_clip(), sampling, MAX_PIXELS)
    outgrown = av.VideoFrame(info.width * 4, info.height * 4, "rgb24")
    monkeypatch.setattr(video_media, "_iter_frames", lambda source: iter([outgrown]))
    with pytest.raises(MediaError, match=f"header says {info.width}x{info.height}"):
        load_video(mp4_clip(), info, 2, sampling)


@FUZZ
@given(mutated({"wav": wav_clip(), "mp4": mp4_clip()}))
def test_mutated_audio_decodes_to_samples_or_raises_media_error(data):
    samples = decoded_or_typed_error(lambda: decode_audio(data, max_duration_s=5.0))
    if samples is not None:
        assert samples.dtype == np.float32 and samples.ndim == 1 and samples.size > 0


def test_audio_data_url_with_wrong_mime_is_a_media_error():
    with pytest.raises(MediaError, match="is not audio"):
        load_audio("data:image/png;base64," + base64.b64encode(wav_clip()).decode())


@FUZZ
@given(mutated({"pdf": pdf_file()}), st.sampled_from(["none", "all"]))
def test_mutated_pdfs_give_pages_or_raise_media_error(data, render):
    stage = PdfStage()
    result = decoded_or_typed_error(
        lambda: stage.process(PdfItem(data, render=render, max_pixels_per_page=20_000)))
    if result is not None:
        assert all(page.width * page.height <= 20_000 for page in result.pages)
