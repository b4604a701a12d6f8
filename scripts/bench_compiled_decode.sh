#!/usr/bin/env bash
# Batch-1 decode with and without --compile-decode, interleaved, REPEATS times per
# precision, on three one-image requests run one at a time (the issue-15 batch-1
# workload; TTFT here includes the queue, so only TPOT is reported), then the medians:
#
#   scripts/bench_compiled_decode.sh MODEL_DIR OUT_DIR [REPEATS] [PRECISIONS]
#
# PRECISIONS: comma-separated from fp32, bf16, int8 (default fp32,int8). Each run is
# `foveal bench throughput` with its JSON in OUT_DIR; the table goes to stdout.
set -euo pipefail
model=$1 out=$2 repeats=${3:-3} precisions=${4:-fp32,int8}
mkdir -p "$out"
for rep in $(seq 1 "$repeats"); do
  for precision in ${precisions//,/ }; do
    case $precision in
      fp32) options=(--dtype float32) ;;
      bf16) options=(--dtype bfloat16) ;;
      int8) options=(--dtype float32 --quantization int8) ;;
      *) echo "unknown precision $precision" >&2; exit 2 ;;
    esac
    for mode in eager compiled; do
      extra=()
      [ "$mode" = compiled ] && extra=(--compile-decode)
      foveal bench throughput --model "$model" --num-prompts 3 --images-per-prompt 1 \
        --image-size 448x448 --image-size-range 0 --input-len 15 --output-len 64 \
        --output-len-range 0 --max-num-seqs 1 "${options[@]}" "${extra[@]}" \
        --json "$out/$precision-$mode-$rep.json" > "$out/$precision-$mode-$rep.log" 2>&1
    done
  done
done
python - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
rows = {}
for path in Path(sys.argv[1]).glob("*.json"):
    precision, mode, _ = path.stem.split("-")
    result = next(r for r in json.loads(path.read_text())["results"] if r["system"] == "foveal")
    rows.setdefault((precision, mode), []).append(result["tpot_median_s"] * 1000)
print("| precision | mode | TPOT median ms | per run |")
print("|---|---|---|---|")
for (precision, mode), values in sorted(rows.items()):
    runs = ", ".join(f"{v:.1f}" for v in values)
    print(f"| {precision} | {mode} | {statistics.median(values):.1f} | {runs} |")
EOF
