"""`foveal train-demo` and `foveal demo-data` (parsers only; the work is
imported when a command runs)."""
from __future__ import annotations

import argparse

_TASK_NAMES = "shapes, count, position, read, compare, motion"


def _task_weights(text: str) -> dict[str, float]:
    """"shapes=3,count=0" -> {"shapes": 3.0, "count": 0.0} (names checked by TrainConfig)."""
    weights = {}
    for item in text.split(","):
        task, _, value = item.partition("=")
        try:
            weights[task.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected TASK=WEIGHT[,TASK=WEIGHT...], got {item!r}") from None
    return weights


def _train(args: argparse.Namespace) -> int:
    from foveal.demo_model.train import TrainConfig, train

    names = ("read_steps", "vision_steps", "steps", "joint_steps", "batch_size", "pages_per_batch",
             "char_weight", "run_weight", "shape_weight", "centre_weight", "colour_weight", "read_lr",
             "vision_lr", "lr", "joint_lr", "seed", "eval_every", "device", "data_workers",
             "task_weights")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    cfg = TrainConfig(**given, bf16={"auto": None, "on": True, "off": False}[args.bf16])
    folder = train(args.out, cfg)
    print(f"wrote the trained checkpoint to {folder}")
    return 0


def _write(args: argparse.Namespace) -> int:
    from foveal.demo_model.dataset import write_split

    path = write_split(args.out, args.split, args.num, args.start)
    print(f"wrote {args.num} {args.split} samples to {path}")
    return 0


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train-demo", help="train the demo model on the synthetic visual tasks (CPU or CUDA, resumable)",
        description="Train the `demo` preset (an ~8M parameter Qwen2-VL) from scratch on the "
                    f"synthetic tasks ({_TASK_NAMES}). Rerun the same command to resume from "
                    "OUT/train_state.pt. Writes OUT/model, an HF checkpoint folder.")
    train.add_argument("out", help="working folder (state, logs, the final OUT/model)")
    train.add_argument("--read-steps", type=int,
                       help="stage 0: steps training the vision tower on pages of text, the "
                            "character (and run) heads only (default 0: none)")
    train.add_argument("--vision-steps", type=int,
                       help="stage 1: steps training the vision tower on dense per-token targets "
                            "(default 1800)")
    train.add_argument("--steps", type=int,
                       help="stage 2: steps training the text decoder on the frozen tower (default 2400)")
    train.add_argument("--joint-steps", type=int,
                       help="stage 3: steps training the whole model on the answers, from where "
                            "stage 2 ended (default 0)")
    train.add_argument("--joint-lr", type=float, help="stage 3 peak learning rate (default 5e-5)")
    train.add_argument("--batch-size", type=int, help="samples per step (default 16)")
    train.add_argument("--pages-per-batch", type=int,
                       help="stage 1: pages of text read per step besides the samples (default 0)")
    train.add_argument("--char-weight", type=float,
                       help="stage 1: weight of the per-token character loss (default 0: off)")
    train.add_argument("--run-weight", type=float,
                       help="stages 0-1: weight of a per-token loss naming the whole word or number "
                            "a token holds text of (default 0: off)")
    train.add_argument("--shape-weight", type=float,
                       help="stage 1: weight of an extra shape loss on the cells a shape covers "
                            "(default 0: off)")
    train.add_argument("--centre-weight", type=float,
                       help="stage 1: weight of a per-token loss naming how many shapes have their "
                            "centre in the token's cell, so that counting is a sum over tokens "
                            "(default 0: off)")
    train.add_argument("--colour-weight", type=float,
                       help="stage 1: weight of an extra colour loss on the cells that show a "
                            "colour, which the background cells otherwise outweigh (default 0: off)")
    train.add_argument("--read-lr", type=float,
                       help="stage 0 peak learning rate (default: the stage 1 one)")
    train.add_argument("--vision-lr", type=float, help="stage 1 peak learning rate (default 1e-3)")
    train.add_argument("--lr", type=float, help="stage 2 peak learning rate (default 3e-4)")
    train.add_argument("--seed", type=int, help="weight init seed (default 0)")
    train.add_argument("--eval-every", type=int,
                       help="steps between teacher-forced evals on held-out samples (default 300)")
    train.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                       help="bf16 autocast (auto: on CUDA, or when the CPU has native bf16)")
    train.add_argument("--device", help="cpu (default) or cuda[:N]")
    train.add_argument("--data-workers", type=int,
                       help="processes rendering and encoding batches ahead of the step "
                            "(default 0: the training process; the batches are the same either way)")
    train.add_argument("--task-weights", type=_task_weights, metavar="TASK=W[,TASK=W...]",
                       help="the training mix: relative weights for the tasks named, the rest "
                            "keep the default mix (foveal/demo_model/tasks.py TRAIN_WEIGHTS); "
                            "0 leaves a task out")
    train.set_defaults(func=_train)

    data = subparsers.add_parser(
        "demo-data", help="write synthetic visual QA samples (the demo model's tasks) to disk",
        description=f"Deterministic, offline: images, short clips and question/answer pairs for "
                    f"the tasks {_TASK_NAMES}, as PNG files and a jsonl. The eval split is held "
                    "out from training (its own seeds).")
    data.add_argument("out", help="output folder")
    data.add_argument("--split", choices=["train", "eval"], default="eval")
    data.add_argument("--num", type=int, default=600)
    data.add_argument("--start", type=int, default=0, help="first sample index")
    data.set_defaults(func=_write)
