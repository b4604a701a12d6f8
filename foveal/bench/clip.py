"""Seeded synthetic test clips for the video benchmark: moving shapes over a
drifting gradient, so every frame differs; encoded with PyAV."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from foveal.errors import ConfigError

NUM_SHAPES = 5


@dataclass(frozen=True)
class ClipSpec:
    seconds: float = 10.0
    width: int = 640
    height: int = 360
    fps: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seconds * self.fps < 1:
            raise ConfigError(f"the clip needs at least one frame; got --clip-seconds "
                              f"{self.seconds} at --clip-fps {self.fps}")
        if min(self.width, self.height) < 2 or self.width % 2 or self.height % 2:
            raise ConfigError(f"--clip-size must have even sides >= 2 (yuv420p), "
                              f"got {self.width}x{self.height}")

    @property
    def num_frames(self) -> int:
        return max(1, round(self.seconds * self.fps))


def clip_frames(spec: ClipSpec) -> Iterator[np.ndarray]:
    """The clip's frames, (H, W, 3) uint8: the same spec always gives the same frames."""
    rng = np.random.default_rng(spec.seed)
    colors = rng.integers(0, 256, (NUM_SHAPES, 3), dtype=np.uint8)
    radii = rng.uniform(0.06, 0.15, NUM_SHAPES) * min(spec.width, spec.height)
    starts = rng.uniform(0, 1, (NUM_SHAPES, 2))  # (x, y) as fractions of the frame
    velocities = rng.uniform(-0.4, 0.4, (NUM_SHAPES, 2))  # frame sides per second
    base = rng.integers(0, 256, 3)
    ys, xs = np.ogrid[:spec.height, :spec.width]
    ramp = xs / spec.width  # (1, W)
    for index in range(spec.num_frames):
        t = index / spec.fps
        shade = (base + 255 * ((ramp + 0.1 * t) % 1.0)[..., None]) % 256  # (1, W, 3)
        frame = np.broadcast_to(shade, (spec.height, spec.width, 3)).astype(np.uint8)
        for shape in range(NUM_SHAPES):
            cx, cy = ((starts[shape] + velocities[shape] * t) % 1.0) * (spec.width, spec.height)
            if shape % 2:
                inside = (np.abs(xs - cx) < radii[shape]) & (np.abs(ys - cy) < radii[shape])
            else:
                inside = (xs - cx) ** 2 + (ys - cy) ** 2 < radii[shape] ** 2  # (H, W)
            frame[inside] = colors[shape]
        yield frame


def write_clip(spec: ClipSpec, path: Path) -> Path:
    """Encode the clip as MPEG-4 in an .mp4 container."""
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.bit_rate = 4_000_000
        for frame in clip_frames(spec):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path
