"""Decode steps replayed from CUDA graphs.

A decode step of a small batch spends most of its time launching kernels
(hundreds per step, a few microseconds each), not running them. At start the
runner captures the decoder's forward once per batch-size bucket over static
input buffers; a step whose every request brings one token copies its inputs
into the buffers of the smallest bucket that holds it and replays that graph.

Rows past the batch are padding: slot -1 (the KV write skips it) and context
length 0 (the decode kernel returns zeros), so they touch no request's cache.
The attention backend must read every per-step value from device tensors
(triton_backend.py does for `max_query_len == 1`); quantized KV caches, EAGLE
heads (they read per-layer features), tensor parallelism and caches the Triton
kernels cannot tile run eagerly (`graphs_apply`). The forward runs with
`static_shapes` set, so MoE layers take their fixed-shape dispatch (one weight
copy per token and expert slot): MoE decoders are captured for batches of at
most num_experts / top_k tokens, larger ones run eagerly.

`capture=False` runs the same static-buffer forward eagerly: on CPU, with the
Triton kernels interpreted, it checks the buffers and padding without a GPU.
"""
from __future__ import annotations

import torch

from foveal.config import EngineConfig
from foveal.forward_context import AttentionMetadata, forward_context, layer_metadata
from foveal.layers.attention.kv_spec import KVCaches
from foveal.logger import init_logger

logger = init_logger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_num_seqs: int, max_size: int | None = None) -> list[int]:
    """Batch sizes to capture: the buckets up to max_num_seqs (at most 256, and at most
    max_size), and that top size."""
    top = min(max_num_seqs, _BUCKETS[-1], max_size or _BUCKETS[-1])
    return sorted({size for size in _BUCKETS if size < top} | {top})


def largest_graphed_batch(config: EngineConfig) -> int | None:
    """MoE decoders: the most tokens whose fixed-shape dispatch copies no more expert
    weights than the layer holds (num_experts // top_k); None: no limit."""
    text = config.model.text
    if not text.num_experts:
        return None
    return max(1, text.num_experts // text.num_experts_per_tok)


def graphs_apply(config: EngineConfig, kv_caches: KVCaches, has_draft_head: bool) -> str | None:
    """None when decode steps can be graphed; else why not (logged)."""
    from foveal.layers.attention import default_backend_name
    from foveal.layers.attention.triton_backend import kernel_fits

    if config.enforce_eager:
        return "--enforce-eager"
    if default_backend_name(torch.device(config.device).type) != "triton":
        return "the attention backend is not triton"
    if kv_caches.spec.quantization is not None:
        return f"{kv_caches.spec.quantization} KV cache"
    if has_draft_head:
        return "an EAGLE head reads per-layer features"
    if config.parallel.tensor_parallel_size > 1:
        return "tensor parallelism"
    if config.transfer.role == "encode":
        return "an encode worker has no decoder"
    if not kv_caches.layers or not kernel_fits(kv_caches.layers[0]):
        return "the KV block shape does not fit the Triton kernels"
    return None


class DecodeGraphs:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, kv_caches: KVCaches,
                 num_axes: int, capture: bool = True) -> None:
        """num_axes: the position rule's axes (3 for M-RoPE, 1 for plain RoPE)."""
        from foveal.layers.attention.triton_decode import num_splits

        self.model, self.kv_caches, self.capture = model, kv_caches, capture
        self.sizes = capture_sizes(config.scheduler.max_num_seqs, largest_graphed_batch(config))
        device, top = torch.device(config.device), self.sizes[-1]
        spec = kv_caches.spec
        self.block_size = spec.block_size
        self.max_blocks = -(-config.scheduler.max_model_len // spec.block_size)
        hidden = config.model.text.hidden_size
        dtype = getattr(torch, config.dtype)
        self.inputs_embeds = torch.zeros(top, hidden, dtype=dtype, device=device)
        self.positions = torch.zeros((num_axes, top) if num_axes > 1 else (top,),
                                     dtype=torch.int64, device=device)
        # per KV cache group (kv_groups.py): its slots and block tables
        self.groups = spec.layer_groups
        num_groups = self.groups.num_groups
        self.slot_mapping = torch.full((num_groups, top), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(num_groups, top, self.max_blocks, dtype=torch.int32,
                                        device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.metadata = {size: [AttentionMetadata(
            slot_mapping=self.slot_mapping[group, :size],
            query_start_loc=query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[group, :size],
            max_query_len=1, max_seq_len=config.scheduler.max_model_len,
            block_size=spec.block_size,
            decode_splits=num_splits(size, spec.num_kv_heads, self.max_blocks))
            for group in range(num_groups)] for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        positions = self.positions[..., :size]
        metadata = self.metadata[size]
        caches, scales = self.kv_caches.by_layer
        with forward_context(metadata[0], caches, scales, static_shapes=True,
                             layer_metadata=layer_metadata(self.groups, metadata)):
            return self.model(self.inputs_embeds[:size], positions)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        if not self.capture:
            return
        pool = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for size in self.sizes:
                self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
            group_metadata: list[AttentionMetadata]) -> torch.Tensor | None:
        """The decoder's hidden states (B, hidden) of a decode-only step, or None
        when the step does not fit a bucket (then the caller runs it eagerly).
        group_metadata: the step's layout over each KV cache group's tables."""
        batch = inputs_embeds.shape[0]
        metadata = group_metadata[0]
        width = metadata.block_tables.shape[1]
        if (metadata.max_query_len != 1 or batch > self.sizes[-1] or width > self.max_blocks
                or inputs_embeds.shape[1] != self.inputs_embeds.shape[1]):
            return None
        size = next(size for size in self.sizes if size >= batch)
        self.inputs_embeds[:batch].copy_(inputs_embeds)
        self.positions[..., :batch].copy_(positions)
        for group, group_layout in enumerate(group_metadata):
            self.slot_mapping[group, :batch].copy_(group_layout.slot_mapping)
            self.slot_mapping[group, batch:size].fill_(-1)
            self.block_tables[group, :batch, :width].copy_(group_layout.block_tables)
        self.seq_lens[:batch].copy_(metadata.seq_lens)
        self.seq_lens[batch:size].zero_()
        if not self.capture:
            return self._forward(size)[:batch]
        self.graphs[size].replay()
        return self.outputs[size][:batch]
