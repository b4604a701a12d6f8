"""`foveal demo-data`: write a split of the synthetic tasks to disk.

OUT/<split>.jsonl has one record per sample (id, task, question, answer,
image paths, or a clip's frame paths and fps); media go under OUT/<split>/ as
PNG (lossless, so the files equal what training and evaluation generate in
memory). The train and eval splits are disjoint: every sample is seeded by
its split name and index."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from foveal.demo_model.tasks import make_sample
from foveal.errors import ConfigError


def write_split(out_dir: str | Path, split: str, num: int, start: int = 0) -> Path:
    """Write samples start .. start+num-1 of `split`; returns the jsonl path."""
    if num < 1:
        raise ConfigError(f"--num must be at least 1, got {num}")
    out_dir = Path(out_dir)
    media = out_dir / split
    media.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    with path.open("w", encoding="utf-8") as jsonl:
        for index in range(start, start + num):
            sample = make_sample(split, index)
            record = {"id": sample.uid, "task": sample.task, "question": sample.question,
                      "answer": sample.answer, "images": []}
            for k, image in enumerate(sample.images):
                name = f"{sample.uid}_image{k}.png"
                image.save(media / name)
                record["images"].append(f"{split}/{name}")
            if sample.video is not None:
                frames = []
                for k, frame in enumerate(sample.video):
                    name = f"{sample.uid}_frame{k}.png"
                    Image.fromarray(frame).save(media / name)
                    frames.append(f"{split}/{name}")
                record["video"] = {"frames": frames, "fps": sample.video_fps}
            jsonl.write(json.dumps(record) + "\n")
    return path

