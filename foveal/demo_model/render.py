"""Drawing primitives for the synthetic visual tasks: shapes in named colours and
small rendered text on a light, slightly tinted background (Pillow only)."""
from __future__ import annotations

import math
import random

from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle", "diamond", "star")
COLORS = {
    "red": (215, 38, 38),
    "green": (38, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 195, 25),
    "purple": (135, 55, 185),
    "orange": (240, 125, 20),
}
COLOR_NAMES = tuple(COLORS)


def canvas(width: int, height: int, rng: random.Random) -> Image.Image:
    """A light background with a random faint tint."""
    base = rng.randint(228, 250)
    tint = tuple(min(255, base + rng.randint(-6, 6)) for _ in range(3))
    return Image.new("RGB", (width, height), tint)


def jitter_color(name: str, rng: random.Random) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-18, 18))) for c in COLORS[name])


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, size: float,
               fill: tuple[int, int, int]) -> None:
    """Draw `shape` centred at (cx, cy) inside a size x size box."""
    r = size / 2
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.88
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)], fill=fill)
    elif shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        draw.polygon(points, fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's bundled scalable font (no system fonts needed)."""
    return ImageFont.load_default(size=size)


def draw_text(draw: ImageDraw.ImageDraw, text: str, x: float, y: float, size: int,
              fill: tuple[int, int, int]) -> None:
    draw.text((x, y), text, font=font(size), fill=fill)


def text_size(text: str, size: int) -> tuple[int, int]:
    left, top, right, bottom = font(size).getbbox(text)
    return right - left, bottom - top
