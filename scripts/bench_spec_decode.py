"""Speculative decoding: decode speed and acceptance, without / n-gram / EAGLE-3.

    python scripts/bench_spec_decode.py --model DIR --eagle HEAD [--repeats 3]

Workloads, each at batch 1 (requests one after another) and batch 8:
  image-qa  the demo tasks' eval split (images, two-image comparisons, clips),
            greedy answers of --max-tokens tokens (ignore_eos: the answers the
            head was trained on run past EOS the same way)
  doc-qa    a passage of text in the prompt and a request to repeat it
            (where n-gram lookup can draft from the prompt)
Reports output tokens/s (median of --repeats runs, run side by side in one
process), the ratio to no speculation, acceptance rate, mean accepted length
(tokens per verification, bonus included) and whether every greedy output is
token-identical to the run without speculation.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from foveal import LLM, SamplingParams
from foveal.bench.machine import machine_info
from foveal.demo_model.tasks import make_sample

PASSAGE = ("The red circle is left of the blue square. The green triangle is above them. "
           "Count the shapes: three. The word on the card reads MOVE 42. ")


def workloads(num: int) -> dict[str, list[list[dict]]]:
    image_qa = [make_sample("eval", i).messages() for i in range(num)]
    doc_qa = [[{"role": "user", "content": f"{PASSAGE * 2}Repeat the text above. ({i})"}]
              for i in range(num)]
    return {"image-qa": image_qa, "doc-qa": doc_qa}


def run(llm: LLM, conversations, params: SamplingParams, batch: int):
    started = time.perf_counter()
    if batch == 1:
        outputs = [llm.chat([c], params, use_tqdm=False)[0] for c in conversations]
    else:
        outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--eagle", required=True, help="EAGLE-3 head folder")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    methods = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
               "eagle3": {"method": "eagle3", "num_speculative_tokens": args.k,
                          "model": args.eagle}}
    engines = {name: LLM(model=args.model, speculative_config=spec,
                         kv_cache_memory_bytes=256 << 20, max_model_len=args.max_model_len)
               for name, spec in methods.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for workload, conversations in workloads(8).items():
        for batch in (1, 8):
            convs = conversations[:4] if batch == 1 else conversations
            speeds = {name: [] for name in methods}
            outputs = {}
            for name, llm in engines.items():
                run(llm, convs[:1], params, 1)  # warm-up
            before = {name: llm.get_metrics() for name, llm in engines.items()}
            for _ in range(args.repeats):
                for name, llm in engines.items():  # interleaved: the machine is noisy
                    speed, outputs[name] = run(llm, convs, params, batch)
                    speeds[name].append(speed)
            base = statistics.median(speeds["none"])
            for name, llm in engines.items():
                after = llm.get_metrics()
                drafts = _delta(after, before[name], "spec_decode_num_drafts_total")
                drafted = _delta(after, before[name], "spec_decode_num_draft_tokens_total")
                accepted = _delta(after, before[name], "spec_decode_num_accepted_tokens_total")
                speed = statistics.median(speeds[name])
                rows.append({"workload": workload, "batch": batch, "method": name,
                             "tok_s": round(speed, 1), "ratio": round(speed / base, 2),
                             "acceptance": round(accepted / drafted, 3) if drafted else None,
                             "mean_accepted_length": round(1 + accepted / drafts, 2)
                             if drafts else None,
                             "identical": outputs[name] == outputs["none"]})
                print(json.dumps(rows[-1]), flush=True)
    info = machine_info()
    print(f"\nCPU: {info.get('cpu_model')}; {args.repeats} repeats, medians; k={args.k}, "
          f"{args.max_tokens} tokens per answer")
    print("| workload | batch | method | tok/s | vs none | acceptance | mean accepted length "
          "| identical |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']} | {r['ratio']} | "
              f"{r['acceptance'] if r['acceptance'] is not None else '-'} | "
              f"{r['mean_accepted_length'] or '-'} | {'yes' if r['identical'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=2)


def _delta(after: dict, before: dict, name: str) -> float:
    key = f"foveal:{name}"
    return after.get(key, 0) - before.get(key, 0)


if __name__ == "__main__":
    main()
