"""`foveal train-eagle` (parser only; the work is imported when it runs)."""
from __future__ import annotations

import argparse


def _train(args: argparse.Namespace) -> int:
    from foveal.eagle_train.train import EagleTrainConfig, train_eagle

    names = ("num_prompts", "max_tokens", "steps", "batch_size", "unroll", "lr",
             "draft_vocab_size", "intermediate_size", "seed", "device", "prompts")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.stop_at_eos:
        given["ignore_eos"] = False
    folder = train_eagle(args.target, args.out, EagleTrainConfig(**given))
    print(f"wrote the EAGLE-3 head to {folder}; serve it with --speculative-config "
          f"'{{\"method\": \"eagle3\", \"model\": \"{folder}\", \"num_speculative_tokens\": 3}}'")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-eagle", help="train an EAGLE-3 draft head for a target on its own answers",
        description="Generate the target's greedy answers to image and video prompts (the demo "
                    "tasks' train split), record its features from Foveal's forward, and train "
                    "an EAGLE-3 head with training-time test. OUT gets config.json + "
                    "model.safetensors in the layout vLLM and SGLang load; OUT/sequences.pt "
                    "keeps the generated data, so a rerun skips generation.")
    parser.add_argument("--target", required=True, help="the target checkpoint folder")
    parser.add_argument("--out", required=True, help="folder for the head")
    parser.add_argument("--prompts", metavar="JSONL",
                        help='your prompts, one per line: {"messages": [chat messages, images '
                             'included]} or {"prompt": "text"} (default: the demo tasks)')
    parser.add_argument("--num-prompts", type=int,
                        help="prompts to answer (default 256; with --prompts, the first N)")
    parser.add_argument("--max-tokens", type=int, help="answer tokens per prompt (default 48)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="end answers at EOS (default: keep generating to --max-tokens)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 600)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default 8)")
    parser.add_argument("--unroll", type=int,
                        help="training-time-test depth: drafts per chain (default 3)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    parser.add_argument("--draft-vocab-size", type=int,
                        help="draft vocabulary: the target's most written tokens (default 4096)")
    parser.add_argument("--intermediate-size", type=int,
                        help="the head's MLP width (default: the target's)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", help="where the head trains (default: cuda when present, "
                                         "else cpu); the target runs on the engine's device")
    parser.set_defaults(func=_train)
