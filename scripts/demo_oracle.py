"""Diagnostic for the demo model's training recipe: train the `demo` preset's text
decoder alone, fed perfect visual tokens, on the image tasks (shapes, position,
count, compare, read).

Each visual token is replaced by a fixed random embedding of its cell's colour
class (read off the pixels) plus one of its shape class (from the objects the
generator drew) plus one per text slot (--text: `slots`, the characters whose
centres fall in its cell, encode.char_targets; `run`, the whole word or number
it holds glyphs of, encode.run_targets); positions stay the real M-RoPE ones. If the decoder cannot
learn to bind a question's words to the right token from these, no vision tower
will make the full model learn faster. Prints the training loss and
teacher-forced held-out exact match (--eval-samples per task) every 50 steps.

    python scripts/demo_oracle.py --lr 1e-3 --follow-ups 3 --seconds 600 [--question-first]
    python scripts/demo_oracle.py --tasks read --text run --seconds 600
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
import tempfile

import torch

from foveal.demo_model.encode import (
    CHAR_SLOTS, RUN_SLOTS, Augment, SampleEncoder, batch_char_targets, batch_run_targets, collate,
)
from foveal.demo_model.tasks import Sample, make_sample
from foveal.demo_model.train import VisualTokenProbe, answer_loss, build_hf_model, write_model_folder

TASKS = ("shapes", "position", "count", "compare", "read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=0, help="steps of linear lr warmup")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--follow-ups", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every", type=int, default=50, help="steps between evals")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help="comma-separated tasks to train on (evaluation covers all five)")
    parser.add_argument("--text", choices=("slots", "run"), default="slots",
                        help="what a token's text embedding names: the characters in its cell, "
                             "or the whole word or number")
    parser.add_argument("--eval-samples", type=int, default=24, help="held-out samples per task")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the token tables")
    parser.add_argument("--question-first", action="store_true",
                        help="put the question before the images in the user turn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train_tasks = args.tasks.split(",")
    if unknown := set(train_tasks) - set(TASKS):
        parser.error(f"unknown tasks {sorted(unknown)}; choose from {', '.join(TASKS)}")
    torch.manual_seed(args.seed)
    if args.question_first:
        media_first = Sample.messages
        Sample.messages = lambda self, detail="auto": [
            {"role": "user", "content": (parts := media_first(self, detail)[0]["content"])[-1:] + parts[:-1]}]
    folder = Path(tempfile.mkdtemp(prefix="demo-oracle-"))
    hf_config = write_model_folder(folder)
    encoder = SampleEncoder(folder, hf_config)
    model = build_hf_model(hf_config, seed=args.seed)
    hidden = hf_config["text_config"]["hidden_size"]
    probe = VisualTokenProbe(hidden, encoder.images.image_mean, encoder.images.image_std)
    slots = CHAR_SLOTS if args.text == "slots" else RUN_SLOTS
    tables = (torch.randn(probe.NUM_CLASSES, hidden) / 16, torch.randn(6, hidden) / 16,
              torch.randn(slots, probe.CHAR_CLASSES, hidden) / 16)
    decoder = model.model.language_model
    params = [p for name, p in model.named_parameters() if "visual" not in name]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05)
    augment = Augment(lowres_prob=0, fewer_frames_prob=0, max_follow_ups=args.follow_ups)

    def forward(samples, rng=None, aug=None):
        items = [encoder.encode(s, rng, aug) for s in samples]
        batch = collate(items, pad_id=0)
        colours = probe.targets(batch["pixel_values"])
        shapes = torch.cat([t for item in items for t in item.image_shape_targets])
        text = (batch_char_targets if args.text == "slots" else batch_run_targets)(items).clamp(min=0)
        letters = sum(tables[2][k][text[:, k]] for k in range(slots))
        embeds = decoder.embed_tokens(batch["input_ids"])
        visual = batch["input_ids"] == hf_config["image_token_id"]
        embeds = embeds.masked_scatter(visual[..., None], tables[0][colours] + tables[1][shapes] + letters)
        positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                  batch["image_grid_thw"], None, batch["attention_mask"])
        hidden_states = decoder(inputs_embeds=embeds, position_ids=positions,
                                attention_mask=batch["attention_mask"]).last_hidden_state
        return model.lm_head(hidden_states), batch["labels"]

    @torch.no_grad()
    def evaluate(per_task: int = args.eval_samples) -> dict[str, float]:
        scores = {}
        for task in TASKS:
            logits, labels = forward([make_sample("eval", i, task=task) for i in range(per_task)])
            predicted, targets = logits[:, :-1].argmax(-1), labels[:, 1:]
            mask = targets != -100
            scores[task] = round(float(((predicted == targets) | ~mask).all(1).float().mean()), 2)
        return scores

    start = time.time()
    step = 0
    while time.time() - start < args.seconds:
        step += 1
        rng = random.Random(step)
        samples = [make_sample("train", step * args.batch_size + i, task=rng.choice(train_tasks))
                   for i in range(args.batch_size)]
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = answer_loss(*forward(samples, rng, augment))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % args.every == 0:
            print(step, f"{time.time() - start:.0f}s", f"loss {loss.item():.3f}", evaluate(), flush=True)


if __name__ == "__main__":
    main()
