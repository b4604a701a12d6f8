#!/usr/bin/env bash
# Inter-token latency under Poisson arrivals of image requests, against `foveal serve`
# started fresh for each server option set (so no run hits another's caches):
#   plain            every step fills --max-num-batched-tokens (2048)
#   target-<MS>      --target-itl-ms MS
#   chunk-<N>        --max-num-batched-tokens N (the static way to smaller prompt chunks)
# Usage: scripts/bench_itl_target.sh MODEL_DIR [OUT_DIR] [SET ...]
#   SET: plain | target:MS | chunk:N (default: plain target:300 chunk:128)
# Workload (env): NUM_PROMPTS (12), RATE (0.25 requests/s), OUTPUT_LEN (64), IMAGE_SIZE
# (448x448), PORT (8031). Each server first answers WARMUP (4) requests one at a time (other
# images, 8 tokens), so that the measured run meets a server whose step cost fit (which
# needs a few prompt steps) is in place. Writes OUT_DIR/<set>.json (`foveal bench serve
# --save-result`); ROUND (empty) is appended to the file names.
set -euo pipefail
model=$1
out=${2:-bench_itl_target}
shift 2 || shift $#
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(plain target:300 chunk:128)
port=${PORT:-8031}
mkdir -p "$out"
workload=(--num-prompts "${NUM_PROMPTS:-12}" --request-rate "${RATE:-0.25}" --input-len 15
          --output-len "${OUTPUT_LEN:-64}" --image-size "${IMAGE_SIZE:-448x448}"
          --image-size-range 0 --seed 0)
for set in "${sets[@]}"; do
  case $set in
    plain) options=(); name=plain ;;
    target:*) options=(--target-itl-ms "${set#*:}"); name=target-${set#*:} ;;
    chunk:*) options=(--max-num-batched-tokens "${set#*:}"); name=chunk-${set#*:} ;;
    *) echo "unknown set $set" >&2; exit 2 ;;
  esac
  foveal serve "$model" --port "$port" --max-model-len 2048 --preprocess-workers 1 \
    "${options[@]}" > "$out/$name${ROUND:-}.server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break
    kill -0 $server 2> /dev/null || { cat "$out/$name${ROUND:-}.server.log" >&2; exit 1; }
    sleep 1
  done
  foveal bench serve --base-url "http://127.0.0.1:$port" --num-prompts "${WARMUP:-4}" \
    --max-concurrency 1 --input-len 15 --output-len 8 --image-size "${IMAGE_SIZE:-448x448}" \
    --image-size-range 0 --seed 1 > "$out/$name${ROUND:-}.warmup.log"
  echo "== $name${ROUND:-}"
  foveal bench serve --base-url "http://127.0.0.1:$port" "${workload[@]}" \
    --save-result "$out/$name${ROUND:-}.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^foveal:(itl_capped_steps|num_preemptions)" \
    || true
  kill $server
  wait $server 2> /dev/null || true
done
