"""Diagnostic for the demo model's vision tower: can it learn a per-token target
alone? Continues a `foveal train-demo` run's tower (OUT/train_state.pt, or a fresh
one with --fresh) with one linear head on the merged visual tokens, on one kind of
target from training's stage 1:

  chars   `read` samples; each token names the characters whose centres fall in
          its 28 px cell, left to right (encode.char_targets, 0: none). Chance ~1/36.
  shapes  `shapes`, `count` and `position` samples; each token names the shape
          covering its cell (encode.shape_targets, 0: none). Chance 1/5.

Prints held-out accuracy on the tokens that hold something (the non-empty
character slots, the cells a shape covers) every 100 steps; empty targets weigh
--empty-weight in the loss.

    python scripts/demo_tower_probe.py OUT --seconds 600 [--fresh] [--target shapes]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from foveal.demo_model.encode import (
    CHAR_SLOTS, TEXT_CHARS, SampleEncoder, batch_char_targets, batch_shape_targets, collate,
)
from foveal.demo_model.render import SHAPES
from foveal.demo_model.tasks import make_sample
from foveal.demo_model.probe import run_vision_tower
from foveal.demo_model.train import build_hf_model

SHAPE_TASKS = ("shapes", "count", "position")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a train-demo working folder (scaffold/, train_state.pt)")
    parser.add_argument("--target", choices=("chars", "shapes"), default="chars")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--empty-weight", type=float, default=0.1)
    parser.add_argument("--fresh", action="store_true", help="start from a random tower")
    args = parser.parse_args()
    out = Path(args.out)
    hf_config = json.loads((out / "scaffold" / "config.json").read_text())
    encoder = SampleEncoder(out / "scaffold", hf_config)
    model = build_hf_model(hf_config, seed=0)
    if not args.fresh:
        model.load_state_dict(torch.load(out / "train_state.pt", weights_only=False)["model"])
    tower = model.model.visual
    slots, classes = (CHAR_SLOTS, len(TEXT_CHARS) + 1) if args.target == "chars" else (1, len(SHAPES) + 1)
    head = torch.nn.Linear(hf_config["text_config"]["hidden_size"], slots * classes)
    merged: list[torch.Tensor] = []
    tower.merger.register_forward_hook(lambda _m, _i, output: merged.append(output))
    optimizer = torch.optim.AdamW([*tower.parameters(), *head.parameters()], lr=args.lr,
                                  weight_decay=0.05)

    def batch(split: str, start: int, n: int = 16):
        tasks = ("read",) if args.target == "chars" else SHAPE_TASKS
        samples = [make_sample(split, start + i, task=tasks[i % len(tasks)]) for i in range(n)]
        items = [encoder.encode(s) for s in samples]
        targets = batch_char_targets(items) if args.target == "chars" else \
            torch.cat(batch_shape_targets(items))
        return collate(items, pad_id=0), targets.view(-1, slots)

    def logits(inputs) -> torch.Tensor:
        merged.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run_vision_tower(model, inputs)
        return head(torch.cat(merged).float()).view(-1, slots, classes)

    @torch.no_grad()
    def accuracy() -> float:
        tower.eval()
        hits = total = 0
        for k in range(3):
            inputs, targets = batch("eval", k * 96)
            known = targets > 0
            hits += int((logits(inputs).argmax(-1)[known] == targets[known]).sum())
            total += int(known.sum())
        tower.train()
        return hits / max(1, total)

    start, step = time.time(), 0
    print(f"start: accuracy {accuracy():.3f}", flush=True)
    while time.time() - start < args.seconds:
        inputs, targets = batch("train", 10**7 + step * 16)
        weight = torch.where(targets > 0, 1.0, args.empty_weight).view(-1)
        scores = logits(inputs)
        loss = (torch.nn.functional.cross_entropy(scores.view(-1, classes), targets.view(-1),
                                                  reduction="none") * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 100 == 0:
            print(f"{step} {time.time() - start:.0f}s loss {loss.item():.3f} accuracy {accuracy():.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
