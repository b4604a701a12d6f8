"""Load an image from any supported source into a decoded RGB `PIL.Image`.

Sources: a `PIL.Image`, raw bytes, a filesystem path (`str` or `pathlib.Path`),
a `file://` URL or a base64 `data:image/...` URL. http(s) URLs are fetched by the
server, not here.

Safety order: read the header, check the pixel count against the limit, and only
then decode (a 40 KB PNG can inflate to gigabytes). Decoding is forced here, so
corrupt or truncated bytes fail this request now rather than a worker later.
Only the formats in `IMAGE_FORMATS` are opened (Pillow's other plugins, EPS
through Ghostscript among them, never see request bytes). An animated GIF or
WebP gives its first frame.
"""
from __future__ import annotations

import io
import pathlib
import urllib.parse

from PIL import Image

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.data_url import decode_data_url as shared_decode_data_url
from foveal.multimodal.media.data_url import read_media_file

ImageSource = Image.Image | bytes | bytearray | memoryview | pathlib.Path | str

# Pillow's JPEG plugin also opens phones' multi-picture (MPO) JPEGs.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_FORMATS_HINT = "send PNG, JPEG, WebP, GIF, BMP or TIFF"

# Modes Pillow can turn into RGB, but not into the colours the picture shows:
# LAB's "A" band is a colour axis, not alpha; La is premultiplied and Pillow
# cannot convert it.
_UNCONVERTIBLE_MODES = frozenset({"LAB", "La"})


def load_image(source: ImageSource, max_image_pixels: int) -> Image.Image:
    """Return `source` as a fully decoded RGB image, or raise MediaError/MediaLimitError."""
    if isinstance(source, Image.Image):
        check_pixel_limit(source.width, source.height, max_image_pixels)
        _decode(source, max_image_pixels)
        return to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(source), max_image_pixels)
    if isinstance(source, pathlib.Path):
        return _open_path(source, max_image_pixels)
    if isinstance(source, str):
        return _open_str(source, max_image_pixels)
    raise MediaError(
        f"cannot load an image from a {type(source).__name__}; pass a PIL.Image, "
        "bytes, a file path, a file:// URL or a data:image/...;base64 URL"
    )


def check_pixel_limit(width: int, height: int, max_image_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels")
    num_pixels = width * height
    if num_pixels > max_image_pixels:
        size, limit = f"{num_pixels / 1e6:.1f} MP", f"{max_image_pixels / 1e6:.1f} MP"
        if size == limit:  # too close to tell apart at one decimal
            size, limit = f"{num_pixels / 1e6:.6g} MP", f"{max_image_pixels / 1e6:.6g} MP"
        raise MediaLimitError(
            f"image is {width}x{height} = {size}; the limit is {limit} (--max-image-pixels)")


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB as transformers' Qwen2-VL processor does.

    Images with an alpha band or a transparency key are composited onto white;
    every other mode goes through `Image.convert("RGB")`.
    """
    if image.mode in _UNCONVERTIBLE_MODES:
        raise MediaError(
            f"image mode {image.mode!r} cannot be converted to RGB; "
            "send an RGB, RGBA, grayscale or palette image"
        )
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if image.mode == "RGB" and not has_alpha:
        return image
    try:
        if not has_alpha:
            return image.convert("RGB")
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    except ValueError as exc:
        raise MediaError(
            f"image mode {image.mode!r} cannot be converted to RGB ({exc}); "
            "send an RGB, RGBA, grayscale or palette image"
        ) from exc


def _open_str(source: str, max_image_pixels: int) -> Image.Image:
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme in ("http", "https"):
        raise MediaError(
            "http(s) image URLs are fetched by the server; pass the bytes, a file "
            "path or a data: URL to the engine"
        )
    if scheme == "data":
        return _open_bytes(decode_data_url(source), max_image_pixels)
    if scheme == "file":
        return _open_path(_file_url_path(source), max_image_pixels)
    return _open_path(pathlib.Path(source), max_image_pixels)


def decode_data_url(url: str) -> bytes:
    return shared_decode_data_url(url, ("image/",), "an image")


def _file_url_path(url: str) -> pathlib.Path:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URL {url!r} names host {parsed.netloc!r}; only local files are supported")
    return pathlib.Path(urllib.parse.unquote(parsed.path))


def _open_path(path: pathlib.Path, max_image_pixels: int) -> Image.Image:
    return _open_bytes(read_media_file(path, "image"), max_image_pixels)


def _open_bytes(data: bytes, max_image_pixels: int) -> Image.Image:
    if not data:
        raise MediaError(f"the image is empty (0 bytes); {_FORMATS_HINT}")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise _bomb_error(exc, max_image_pixels) from exc
    except Image.UnidentifiedImageError as exc:
        raise MediaError(f"could not identify an image in {len(data)} bytes; {_FORMATS_HINT}") \
            from exc
    except Exception as exc:  # Pillow raises many types on garbage headers
        raise MediaError(
            f"could not identify an image in {len(data)} bytes ({type(exc).__name__}: {exc}); "
            f"{_FORMATS_HINT}") from exc
    check_pixel_limit(image.width, image.height, max_image_pixels)
    _decode(image, max_image_pixels)
    return to_rgb(image)


def _bomb_error(exc: Exception, max_image_pixels: int) -> MediaLimitError:
    return MediaLimitError(f"the image declares more pixels than Pillow decodes ({exc}); the limit "
                           f"is {max_image_pixels / 1e6:.1f} MP (--max-image-pixels)")


def _decode(image: Image.Image, max_image_pixels: int) -> None:
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise _bomb_error(exc, max_image_pixels) from exc
    except Exception as exc:  # corrupt streams surface as OSError, SyntaxError, struct.error, ...
        raise MediaError(
            f"could not decode the {image.format or image.mode} image "
            f"({type(exc).__name__}: {exc}); the file is corrupt or truncated"
        ) from exc
