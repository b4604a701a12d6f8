#!/usr/bin/env bash
# Each model family's real-shape preset (random weights, built once into the cache) against
# transformers on the same checkpoint folder and workload, one family after another:
#   batch1.json      Foveal on one request alone: TTFT and decode
#   throughput.json  Foveal (continuous batching) and transformers' generate() at static
#                    batch sizes 1 and N over the same N requests
# Usage: [DTYPE=bfloat16] [NUM_PROMPTS=N] [KV_BYTES=B] scripts/bench_families.sh [OUT_DIR] [PRESET:IMAGE_SIZE ...]
# The defaults fit a 24 GiB, 2-core machine and take about an hour on 2 cores.
# DTYPE=bfloat16 stores the random weights in bf16 (OUT_DIR/models/PRESET) and runs both
# systems in bf16: 7B / 8B presets fit in 24 GiB that way, one system at a time.
# KV_BYTES sets Foveal's KV pool (LLaVA-1.5-7B's 4,096-token context needs 2 GiB).
set -euo pipefail
out=${1:-bench_families}
shift || true
entries=("$@")
if [ ${#entries[@]} -eq 0 ]; then
  entries=(smolvlm-256m:512x512 qwen3-vl-2b:448x448 llava-onevision-0.5b:384x384)
fi
num_prompts=${NUM_PROMPTS:-8}
mkdir -p "$out"
for entry in "${entries[@]}"; do
  preset=${entry%%:*}
  size=${entry#*:}
  if [ -n "${DTYPE:-}" ]; then
    model="$out/models/$preset"
    [ -f "$model/config.json" ] || foveal tiny-model "$model" --preset "$preset" --dtype "$DTYPE"
    source=(--model "$model" --dtype "$DTYPE")
  else
    source=(--dummy "$preset")
  fi
  if [ -n "${KV_BYTES:-}" ]; then
    source+=(--kv-cache-memory-bytes "$KV_BYTES")
  fi
  common=("${source[@]}" --images-per-prompt 1 --image-size "$size" --image-size-range 0
          --input-len 32 --output-len 32 --max-model-len 4096)
  echo "== $preset ($size)"
  foveal bench throughput "${common[@]}" --num-prompts 1 --json "$out/$preset-batch1.json"
  foveal bench throughput "${common[@]}" --num-prompts "$num_prompts" \
    --baseline hf --hf-batch-sizes "1,$num_prompts" --json "$out/$preset-throughput.json"
done
