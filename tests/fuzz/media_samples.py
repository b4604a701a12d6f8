"""Small valid media files built in the test (the fuzzers mutate them), odd
image modes, and decompression bombs: headers that declare huge pictures."""
from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image


def _gradient(size: tuple[int, int]) -> Image.Image:
    width, height = size
    ramp = np.add.outer(np.arange(height) * 7, np.arange(width) * 3) % 256  # (H, W)
    return Image.fromarray(np.stack([ramp, ramp[::-1], ramp[:, ::-1]], -1).astype(np.uint8))


def encode_image(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def animated(image_format: str, num_frames: int = 3) -> bytes:
    frames = [_gradient((24, 16)).rotate(90 * index) for index in range(num_frames)]
    return encode_image(frames[0], image_format, save_all=True, append_images=frames[1:],
                        duration=100, loop=0)


@functools.cache
def image_files() -> dict[str, bytes]:
    """One small valid file per image format the loader accepts."""
    picture = _gradient((24, 16))
    return {
        "png": encode_image(picture, "PNG"),
        "jpeg": encode_image(picture, "JPEG", quality=80),
        "gif": animated("GIF"),
        "webp": animated("WEBP"),
        "bmp": encode_image(picture, "BMP"),
        "tiff": encode_image(picture, "TIFF"),
    }


def odd_mode_images() -> dict[str, Image.Image]:
    """Images whose mode is not RGB; each must load as RGB of the same size."""
    picture = _gradient((20, 12))
    palette = picture.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    sixteen = Image.fromarray((np.arange(240, dtype=np.uint16).reshape(12, 20) * 257))
    return {"CMYK": picture.convert("CMYK"), "I;16": sixteen, "P+transparency": palette,
            "LA": picture.convert("LA"), "RGBA": picture.convert("RGBA"), "1": picture.convert("1"),
            "L": picture.convert("L"), "I": picture.convert("I"), "F": picture.convert("F"),
            "YCbCr": picture.convert("YCbCr")}


def odd_mode_files() -> dict[str, tuple[Image.Image, bytes]]:
    """"MODE as FORMAT" -> (picture, file) for each odd mode each format can store."""
    files = {}
    for mode, picture in odd_mode_images().items():
        for image_format in ("PNG", "TIFF", "WEBP", "JPEG", "GIF", "BMP"):
            try:
                files[f"{mode} as {image_format}"] = (picture, encode_image(picture, image_format))
            except (OSError, ValueError, KeyError):
                continue  # Pillow cannot write this mode in this format
    return files


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + \
        struct.pack(">I", zlib.crc32(kind + payload))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and whose data is a few bytes."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    rows = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", rows) + \
        _png_chunk(b"IEND", b"")


def gif_declaring(width: int, height: int) -> bytes:
    """A one-frame GIF whose screen and frame declare width x height (16-bit fields)."""
    data = bytearray(encode_image(Image.new("P", (2, 2)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)  # logical screen
    frame = data.index(b"\x2c")  # image descriptor: 0x2C, left, top, width, height
    data[frame + 5:frame + 9] = struct.pack("<HH", width, height)
    return bytes(data)


@functools.cache
def mp4_clip(num_frames: int = 6, size: tuple[int, int] = (32, 24), container: str = "mp4",
             codec: str = "mpeg4") -> bytes:
    import av

    buffer = io.BytesIO()
    # bitexact: no muxing date, so every run fuzzes the same bytes
    with av.open(buffer, "w", format=container, options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for index in range(num_frames):
            frame = np.asarray(_gradient(size).rotate(30 * index))
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def video_files() -> dict[str, bytes]:
    """The same clip in the containers the video loader names in its errors."""
    return {"mp4": mp4_clip(), "mkv": mp4_clip(container="matroska"),
            "avi": mp4_clip(container="avi"), "mov": mp4_clip(container="mov"),
            "webm": mp4_clip(container="webm", codec="libvpx")}


@functools.cache
def wav_clip(seconds: float = 0.25) -> bytes:
    from foveal.multimodal.media.audio import encode_wav

    samples = np.sin(np.arange(int(16_000 * seconds)) * 0.05).astype(np.float32) * 0.5
    return encode_wav(samples)


@functools.cache
def pdf_file() -> bytes:
    """Two pages of text, with a fixed creation date so every run fuzzes the same bytes."""
    import datetime

    from fpdf import FPDF

    pdf = FPDF(format=(60, 30))
    pdf.set_creation_date(datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc))
    for text in ("Page one", "Page two"):
        pdf.add_page()
        pdf.set_font("Helvetica", size=12)
        pdf.cell(0, 9, text)
    return bytes(pdf.output())
