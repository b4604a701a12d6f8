#!/usr/bin/env bash
# GPU checks, for a machine with NVIDIA GPUs (run from the repository root; ~5 min):
#   1. the demo model on CUDA: `foveal demo` and a greedy batch against the CPU's tokens
#   2. speculative decoding on CUDA: an EAGLE-3 head trained on the GPU, then
#      scripts/bench_spec_decode.py (none / n-gram / EAGLE-3)
#   3. with >= 2 GPUs: tensor parallelism over NCCL (TP=2 against TP=1, both executors'
#      default, mp) and the throughput benchmark at TP=1 and TP=2
set -euo pipefail
out="${OUT:-/tmp/foveal-gpu-check}"
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
if [ "$gpus" -lt 1 ]; then echo "no CUDA device; nothing to check"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.csv"

foveal demo | tee "$out/demo.txt"  # device auto: CUDA here

python - <<'PY' | tee "$out/cuda_vs_cpu.txt"
from foveal import LLM, SamplingParams
from foveal.demo_model import DEMO_MODEL_DIR
from foveal.demo_model.tasks import make_sample

chats = [make_sample("eval", i).messages() for i in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=16)
tokens = {}
for device in ("cpu", "cuda"):
    llm = LLM(model=str(DEMO_MODEL_DIR), device=device, kv_cache_memory_bytes=256 << 20)
    tokens[device] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    llm.shutdown()
same = sum(a == b for a, b in zip(tokens["cpu"], tokens["cuda"]))
print(f"greedy answers equal on CPU and CUDA: {same} of {len(chats)}")
PY

foveal train-eagle --target foveal/assets/demo_model --out "$out/eagle" --device cuda \
  --num-prompts 128 --steps 300 2>&1 | tr '\r' '\n' | grep -E "^step|wrote" | tee "$out/eagle.txt"
python scripts/bench_spec_decode.py --model foveal/assets/demo_model --eagle "$out/eagle" \
  --json "$out/spec.json" 2>&1 | grep -v INFO | tail -16 | tee "$out/spec.txt"

if [ "$gpus" -ge 2 ]; then
  python - <<'PY' | tee "$out/tp.txt"
from foveal import LLM, SamplingParams
from foveal.demo_model import DEMO_MODEL_DIR
from foveal.demo_model.tasks import make_sample

chats = [make_sample("eval", i).messages() for i in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=16)
tokens = {}
for tp in (1, 2):
    llm = LLM(model=str(DEMO_MODEL_DIR), device="cuda", tensor_parallel_size=tp,
              kv_cache_memory_bytes=256 << 20)
    tokens[tp] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    llm.shutdown()
print(f"TP=2 greedy answers equal to TP=1: {sum(a == b for a, b in zip(tokens[1], tokens[2]))}"
      f" of {len(chats)}")
PY
  for tp in 1 2; do
    foveal bench throughput --dummy small --device cuda -tp "$tp" --num-prompts 32 \
      --images-per-prompt 1 --image-size 448x448 --output-len 64 2>&1 | grep -v INFO \
      | tail -3 | tee "$out/throughput_tp$tp.txt"
  done
else
  echo "one GPU: the tensor-parallel checks need two" | tee "$out/tp.txt"
fi
