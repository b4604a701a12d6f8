#!/usr/bin/env bash
# GPU checks, for a machine with NVIDIA GPUs (run from the repository root; ~5 min on one H200):
#   1. tests/gpu: the compiled Triton kernels, the Triton backend against SDPA, and per
#      model family decode steps replayed from CUDA graphs against eager CUDA and the CPU
#      (images, padding to a bucket, chunked prefill, preemption, prefix cache, sampling)
#   2. the demo model on CUDA: `foveal demo`, and greedy answers on CUDA (graphs and eager)
#      against the CPU's at float32
#   3. scripts/bench_gpu.py: decode against the HBM roofline (graphs and eager), prefill
#      against the bf16 GEMM peak, image requests; `small` and `qwen2.5-vl-7b`
#   4. FOVEAL_GPU_EAGLE=1: an EAGLE-3 head trained on the GPU, then scripts/bench_spec_decode.py
#   5. with >= 2 GPUs: tensor parallelism over NCCL (TP=2 against TP=1)
# Each part runs even if an earlier one failed; the exit status says whether all passed.
# FOVEAL_GPU_PRESETS overrides the benchmark's presets.
set -uo pipefail
out="${OUT:-/tmp/foveal-gpu-check}"
mkdir -p "$out"
status=0
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
if [ "$gpus" -lt 1 ]; then echo "no CUDA device; nothing to check"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.csv"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "[${SECONDS}s] tests/gpu"
python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" \
  || status=1

echo "[${SECONDS}s] demo"
python3 -m foveal demo 2>&1 | grep -v INFO | tee "$out/demo.txt" || status=1

echo "[${SECONDS}s] CUDA against CPU"
python3 - <<'PY' 2>&1 | grep -v INFO | tee "$out/cuda_vs_cpu.txt" || status=1
from foveal import LLM, SamplingParams
from foveal.demo_model import DEMO_MODEL_DIR
from foveal.demo_model.tasks import make_sample

chats = [make_sample("eval", i).messages() for i in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=16)
tokens = {}
for name, kwargs in {"cpu": {"device": "cpu"},
                     "cuda graphs": {"device": "cuda"},
                     "cuda eager": {"device": "cuda", "enforce_eager": True}}.items():
    llm = LLM(model=str(DEMO_MODEL_DIR), dtype="float32", kv_cache_memory_bytes=256 << 20,
              **kwargs)
    tokens[name] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    llm.shutdown()
for name in ("cuda graphs", "cuda eager"):
    same = sum(a == b for a, b in zip(tokens["cpu"], tokens[name]))
    print(f"float32 greedy answers equal on CPU and {name}: {same} of {len(chats)}")
if tokens["cpu"] != tokens["cuda graphs"]:
    raise SystemExit(1)
PY

echo "[${SECONDS}s] benchmark"
python3 scripts/bench_gpu.py --presets "${FOVEAL_GPU_PRESETS:-small,qwen2.5-vl-7b}" \
  --json "$out/bench_gpu.json" 2>&1 | grep -v INFO | tee "$out/bench_gpu.txt" || status=1

if [ "${FOVEAL_GPU_EAGLE:-0}" = 1 ]; then  # a few more minutes: EAGLE-3 trained on the GPU
  echo "[${SECONDS}s] EAGLE"
  python3 -m foveal train-eagle --target foveal/assets/demo_model --out "$out/eagle" --device cuda \
    --num-prompts 128 --steps 300 2>&1 | tr '\r' '\n' | grep -E "^step|wrote" | tee "$out/eagle.txt" \
    || status=1
  python3 scripts/bench_spec_decode.py --model foveal/assets/demo_model --eagle "$out/eagle" \
    --json "$out/spec.json" 2>&1 | grep -v INFO | tail -16 | tee "$out/spec.txt" || status=1
fi

if [ "$gpus" -ge 2 ]; then
  python3 - <<'PY' 2>&1 | grep -v INFO | tee "$out/tp.txt" || status=1
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
else
  echo "one GPU: the tensor-parallel checks need two" | tee "$out/tp.txt"
fi
echo "[${SECONDS}s] done, status $status"
exit $status
