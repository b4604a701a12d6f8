import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.image import load_image

LIMIT = 50_000_000


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but which holds no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = b""
    for kind, body in ((b"IHDR", ihdr), (b"IEND", b"")):
        chunks += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunks


def test_load_image_gives_same_pixels_from_every_source(tmp_path):
    image = random_image(37, 23)
    data = png_bytes(image)
    path = tmp_path / "picture name.png"
    path.write_bytes(data)
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [image, data, bytearray(data), path, str(path), path.as_uri(), data_url]
    for source in sources:
        loaded = load_image(source, LIMIT)
        assert loaded.mode == "RGB"
        assert np.array_equal(np.asarray(loaded), np.asarray(image)), type(source)


def test_load_image_composites_alpha_onto_white():
    pixels = np.array([[[10, 20, 30, 0], [10, 20, 30, 255]]], dtype=np.uint8)  # (1, 2, RGBA)
    loaded = load_image(Image.fromarray(pixels, mode="RGBA"), LIMIT)
    assert np.asarray(loaded).tolist() == [[[255, 255, 255], [10, 20, 30]]]


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "PA", "RGBA", "RGBX", "CMYK", "YCbCr", "HSV", "I;16", "I", "F"])
def test_load_image_converts_mode_like_transformers(mode):
    from transformers.image_transforms import convert_to_rgb

    base = random_image(19, 11, mode="RGBA", seed=3)
    image = base.convert(mode) if mode not in ("I;16", "I", "F") else base.convert("L").convert(mode)
    expected = convert_to_rgb(image, return_numpy=True)
    assert np.array_equal(np.asarray(load_image(image, LIMIT)), expected)


def test_load_image_converts_palette_transparency_like_transformers():
    from transformers.image_transforms import convert_to_rgb

    image = random_image(16, 16, mode="RGB", seed=5).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    image.info["transparency"] = 2
    reloaded = Image.open(io.BytesIO(png_bytes(image)))
    expected = convert_to_rgb(Image.open(io.BytesIO(png_bytes(image))), return_numpy=True)
    assert np.array_equal(np.asarray(load_image(reloaded, LIMIT)), expected)
    assert (expected == 255).all(axis=-1).any()


@pytest.mark.parametrize("mode", ["LAB", "La"])
def test_load_image_rejects_unconvertible_mode_naming_it(mode):
    with pytest.raises(MediaError, match=mode):
        load_image(Image.new(mode, (4, 4)), LIMIT)


def test_pixel_limit_error_says_size_and_limit():
    with pytest.raises(MediaLimitError) as info:
        load_image(png_header_only(9000, 9000), LIMIT)
    assert str(info.value) == "image is 9000x9000 = 81.0 MP; the limit is 50.0 MP (--max-image-pixels)"


def test_pixel_limit_is_checked_before_decoding():
    truncated = png_bytes(random_image(300, 300))[:200]
    with pytest.raises(MediaLimitError):
        load_image(truncated, max_image_pixels=300 * 300 - 1)


def test_pixel_limit_applies_to_pil_input():
    with pytest.raises(MediaLimitError, match="40x30 = 0.0012 MP; the limit is 0.001 MP"):
        load_image(random_image(40, 30), max_image_pixels=1000)


def test_truncated_image_raises_media_error():
    truncated = png_bytes(random_image(300, 300))[:2000]
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load_image(truncated, LIMIT)


def test_garbage_bytes_raise_media_error():
    with pytest.raises(MediaError, match="could not identify an image"):
        load_image(b"this is not an image at all", LIMIT)


def test_empty_image_raises_media_error():
    with pytest.raises(MediaError, match="no pixels"):
        load_image(Image.new("RGB", (0, 5)), LIMIT)


def test_bad_base64_raises_media_error():
    with pytest.raises(MediaError, match="base64"):
        load_image("data:image/png;base64,@@not-base64@@", LIMIT)


def test_non_image_data_url_raises_media_error():
    with pytest.raises(MediaError, match="not an image"):
        load_image("data:text/plain;base64,aGVsbG8=", LIMIT)


def test_non_base64_data_url_raises_media_error():
    with pytest.raises(MediaError, match="only base64"):
        load_image("data:image/png,rawbytes", LIMIT)


def test_missing_file_raises_media_error(tmp_path):
    missing = tmp_path / "nope.png"
    for source in (missing, str(missing), missing.as_uri()):
        with pytest.raises(MediaError, match="not found"):
            load_image(source, LIMIT)


def test_http_url_raises_media_error_pointing_to_server():
    with pytest.raises(MediaError, match="fetched by the server"):
        load_image("https://example.com/cat.png", LIMIT)


def test_unsupported_source_type_raises_media_error():
    with pytest.raises(MediaError, match="cannot load an image from a int"):
        load_image(42, LIMIT)
