"""Decode steps through torch.compile, on CPU (`--compile-decode`).

An eager decode step of one sequence runs some seventy small ops per decoder layer
between its weight reads (norms, residual adds, rotary, the SwiGLU product, views),
each a Python call and a dispatch: on the `small` preset about a quarter of the
step. And oneDNN's GEMV streams fp32 weights at ~23 GB/s where the machine reads
~30-40 GB/s.

With `--compile-decode`, a step of at most `MAX_ROWS` new tokens runs the text
decoder's forward as one Inductor graph: the elementwise ops fuse into a few loops
around the weight reads. In a one-token step each fp32 linear layer becomes a
reduction Inductor writes itself (linear.py `_compiled_linear`), which streams the
weight faster than oneDNN's GEMV; bf16 layers and fp32 steps of 2-4 tokens run the
native decode GEMV (foveal/kernels) behind `foveal::decode_gemv`, int8 layers on the
exact kernel are traced around the native int8 GEMV, FBGEMM's behind
`foveal::linear`. Attention stays the eager backend behind `foveal::attention` (it
reads the paged cache and the batch layout from the forward context; a pure decode
step there is one native call). Larger steps (prefill chunks, larger decode
batches) run eagerly. For fp32 and bf16 layers the engine keeps the dense weights
beside the blocked ones: their weight memory doubles.

Two graphs per engine: one for a single token, one for 2..MAX_ROWS tokens (a
dynamic row count); the same two for the LM head of the sampled rows. They compile
at start (`warm_up`): ~15-70 s on 2 cores the first time, a few seconds once
Inductor's on-disk cache holds them. Tokens equal the eager engine's up to fp32
summation order (the parity tests in tests/unit/test_compiled_decode.py compare them).
"""
from __future__ import annotations

import shutil
import time

import torch

from foveal.config import EngineConfig
from foveal.forward_context import forward_context
from foveal.layers.linear import register_compiled_linears
from foveal.logger import init_logger

logger = init_logger(__name__)

# Steps of up to this many tokens run compiled: decode of 1-4 requests, or a prompt's
# last few tokens after a prefix-cache hit; larger ones gain little from fusion.
MAX_ROWS = 4


def compile_applies(config: EngineConfig, has_draft_head: bool) -> str | None:
    """None when decode steps can be compiled; else why not (logged, the engine
    then runs them eagerly)."""
    if torch.device(config.device).type != "cpu":
        return "compiled decode steps are CPU only (CUDA replays CUDA graphs)"
    if config.transfer.role == "encode":
        return "an encode worker has no decoder"
    if has_draft_head:
        return "an EAGLE head reads per-layer features"
    if config.parallel.tensor_parallel_size > 1:
        return "tensor parallelism (the all-reduce is not a compiled op yet)"
    if config.model.text.num_experts:
        return "MoE layers route tokens on the host"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler for Inductor's kernels (apt-get install g++)"
    return None


def _fits_graph(*row_dims: tuple[torch.Tensor, int]) -> bool:
    """Whether a step's rows (the given dim of each tensor, all equal) fit the graphs;
    2..MAX_ROWS rows are marked dynamic, so they share the second graph."""
    first, dim = row_dims[0]
    rows = first.shape[dim]
    if rows > MAX_ROWS:
        return False
    if rows > 1:
        for tensor, dim in row_dims:
            torch._dynamo.mark_dynamic(tensor, dim, min=2, max=MAX_ROWS)
    return True


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, hidden_size: int, dtype: torch.dtype,
                 num_axes: int) -> None:
        """num_axes: the position rule's axes (3 for M-RoPE, 1 for plain RoPE)."""
        register_compiled_linears(model)
        self.hidden_size, self.dtype, self.num_axes = hidden_size, dtype, num_axes
        # Each engine's model is a new guard target: two graphs per engine.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # Inductor inlines an elementwise producer into the loop that reads it when its
        # expression is short: a layer's RMSNorm would then be recomputed for every
        # weight row of the reduction that follows. A low threshold stores it once, so
        # the loop reads only the weight (fp32 steps 0.67-0.81x eager against
        # 0.75-0.85x with the default; docs/benchmarks.md).
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=False,
                                     options={"realize_opcount_threshold": 4})
        # the LM head of the sampled rows: on real vocabularies one of the largest weights
        self.eager_logits = model.compute_logits
        self.compiled_logits = torch.compile(model.compute_logits, fullgraph=True, dynamic=False)
        self.steps = 0  # steps run through the graphs (warm-up excluded)

    def run(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The decoder's hidden states (T, hidden) of a step of T <= MAX_ROWS tokens,
        inside the caller's forward context; None for larger steps."""
        if not _fits_graph((inputs_embeds, 0), (positions, positions.dim() - 1)):
            return None
        self.steps += 1
        return self.forward(inputs_embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits, through a graph for N <= MAX_ROWS."""
        if not _fits_graph((hidden_states, 0)):
            return self.eager_logits(hidden_states)
        return self.compiled_logits(hidden_states)

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[torch.Tensor]) -> str | None:
        """Compile both graphs now, on inputs without a batch layout (attention then
        runs on the rows alone and writes no cache). Returns None, or why the model
        did not compile (the caller then runs every step eagerly)."""
        started = time.perf_counter()
        try:
            for rows in (1, 2):
                embeds = torch.zeros(rows, self.hidden_size, dtype=self.dtype)
                positions = torch.zeros((self.num_axes, rows) if self.num_axes > 1 else (rows,),
                                        dtype=torch.int64)
                with forward_context(None, kv_caches):
                    self.run(embeds, positions)
                self.compute_logits(embeds)
        except Exception as error:  # noqa: BLE001 - any compile failure: run eagerly
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.steps = 0
        logger.info("compiled the decode step for 1 and 2-%d tokens in %.1f s", MAX_ROWS,
                    time.perf_counter() - started)
        return None
