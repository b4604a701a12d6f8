"""Diagnostic for the demo model's reading: from a `foveal train-demo` state, freeze
the vision tower and train the text decoder on `read` samples alone. Prints the
training loss and teacher-forced exact match on 48 held-out `read` samples every
--every steps: how much a tower's character and run heads' progress is worth to a
decoder that reads, before a whole run is spent on it.

    python scripts/demo_read_decoder.py OUT [--state OUT/train_state.pt] --steps 600
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from foveal.demo_model.encode import Augment, SampleEncoder, collate
from foveal.demo_model.tasks import make_sample
from foveal.demo_model.train import answer_loss, build_hf_model, teacher_forced_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a train-demo working folder (scaffold/, train_state.pt)")
    parser.add_argument("--state", help="a training state (default OUT/train_state.pt)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-4, help="peak lr, after 100 warmup steps")
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    out = Path(args.out)
    hf_config = json.loads((out / "scaffold" / "config.json").read_text())
    encoder = SampleEncoder(out / "scaffold", hf_config)
    model = build_hf_model(hf_config, seed=0)
    state = torch.load(args.state or out / "train_state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    print(f"training state at step {state['step']}", flush=True)
    for name, param in model.named_parameters():  # the tower stays frozen
        param.requires_grad_("visual" not in name.split(".")[:2])
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    augment = Augment(lowres_prob=0, fewer_frames_prob=0)
    start = time.time()
    for step in range(1, args.steps + 1):
        rng = random.Random(step)
        items = [encoder.encode(make_sample("train", 10**7 + step * 16 + i, task="read"), rng, augment)
                 for i in range(16)]
        batch = collate(items, pad_id=0)
        labels = batch.pop("labels")
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 100)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = answer_loss(model(**batch).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % args.every == 0:
            read = teacher_forced_accuracy(model, encoder, 48, bf16=True, task="read")["read"]
            print(f"{step} {time.time() - start:.0f}s loss {loss.item():.3f} read {read:.3f}", flush=True)


if __name__ == "__main__":
    main()
