"""Each engine step's scheduled tokens, encoder tokens, measured time and the step cost
fit's prediction for it (made before the step ran), under staggered image requests.

    python scripts/probe_step_cost.py MODEL_DIR [--target-itl-ms MS] [--requests N]
        [--every STEPS] [--max-tokens N] [--image-size 448] [--no-correction]

A request arrives every --every steps, so prefill steps land among decode steps; with
--target-itl-ms the steps sized to the target (marked `sized`, with the correction the
scheduler divided the target by) show how close the fit keeps them to it, and a last
line sums them up. --no-correction holds the correction at 1 (the fit's line alone).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.multimodal.chat import parse_chat_conversation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--target-itl-ms", type=float)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--every", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--no-correction", action="store_true")
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=2048, target_itl_ms=args.target_itl_ms)
    engine = llm.llm_engine
    scheduler, executor = engine.core.scheduler, engine.core.executor
    if args.no_correction:
        type(scheduler.step_cost).correction = 1.0
    execute, rows = executor.execute, []

    def timed(plan, payloads):
        predicted = scheduler.step_cost.predict(plan.total_num_scheduled_tokens,
                                                plan.num_encoder_tokens)
        correction = scheduler.step_cost.correction
        started = time.perf_counter()
        output = execute(plan, payloads)
        rows.append((plan.total_num_scheduled_tokens, plan.num_encoder_tokens,
                     time.perf_counter() - started, predicted,
                     correction if plan.sized_to_target else None))
        return output

    executor.execute = timed
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    added = step = 0
    while added < args.requests or engine.has_unfinished_requests():
        if added < args.requests and step % args.every == 0:
            pixels = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
            parsed = parse_chat_conversation([{"role": "user", "content": [
                {"type": "image_pil", "image_pil": Image.fromarray(pixels)},
                {"type": "text", "text": f"Describe picture {added}."}]}])
            text = llm.get_tokenizer().apply_chat_template(parsed.messages,
                                                           add_generation_prompt=True)
            engine.add_request(str(added), {"prompt": text,
                                            "multi_modal_data": parsed.multi_modal_data()}, params)
            added += 1
        engine.step()
        step += 1
    print("tokens  encoder_tokens  ms  predicted_ms  [sized correction]")
    for tokens, encoder_tokens, seconds, predicted, correction in rows:
        shown = "-" if predicted is None else f"{predicted * 1000:.0f}"
        sized = "" if correction is None else f"  sized {correction:.2f}"
        print(f"{tokens}  {encoder_tokens}  {seconds * 1000:.0f}  {shown}{sized}")
    print("fit (base s, s per token, s per encoder token):", scheduler.step_cost.coefficients)
    sized = np.array([seconds * 1000 for *_, seconds, _, c in rows if c is not None])
    if len(sized) and args.target_itl_ms:
        print(f"sized steps: {len(sized)}, ms median {np.median(sized):.0f}, p90 "
              f"{np.percentile(sized, 90):.0f}, max {sized.max():.0f}; over the target by more "
              f"than 10%: {int((sized > 1.1 * args.target_itl_ms).sum())}")


if __name__ == "__main__":
    main()
