"""The CUDA path on a GPU (marked gpu: the default suite deselects these; run
`python -m pytest -m gpu tests/gpu` on a CUDA machine; scripts/gpu_check.sh does).

The compiled Triton kernels against attention math in fp32 and bf16, the Triton
backend against SDPA on a mixed batch, and, per model family, greedy tokens and
logprobs of decode steps replayed from CUDA graphs against eager CUDA steps and
against the CPU: images, a batch that pads to a bucket, chunked prefill beside
decodes, preemption (a KV pool too small for every request) and prefix caching."""
from __future__ import annotations

import pytest
import torch

from foveal import LLM, SamplingParams
from foveal.forward_context import AttentionMetadata
from foveal.layers.attention.sdpa import SdpaBackend
from foveal.layers.attention.triton_backend import TritonBackend
from foveal.layers.attention.triton_decode import paged_decode, write_kv
from tests.e2e.test_multimodal_caching import image, user

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


def reference(q, cache, tables, lens, scale, window=None):
    heads, (kv_heads, dim), page = q.shape[1] // cache.shape[-1], cache.shape[-2:], cache.shape[2]
    rows = []
    for b in range(q.shape[0]):
        length = int(lens[b])
        if length == 0:
            rows.append(torch.zeros(heads * dim, device=q.device))
            continue
        pos = torch.arange(length, device=q.device)
        slots = tables[b, pos // page].long() * page + pos % page
        group = heads // kv_heads
        k = cache[0].reshape(-1, kv_heads, dim)[slots].float().repeat_interleave(group, 1)
        v = cache[1].reshape(-1, kv_heads, dim)[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].float().view(heads, dim), k) * scale
        if window:
            scores[:, :max(0, length - window)] = float("-inf")
        rows.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_decode_kernel_matches_math(dtype, tolerance, window):
    torch.manual_seed(0)
    heads, kv_heads, dim, page = 28, 4, 128, 16
    cache = torch.randn(2, 600, page, kv_heads, dim, device=CUDA).to(dtype)
    tables = torch.randperm(599, device=CUDA)[:5 * 100].add(1).view(5, 100).to(torch.int32)
    lens = torch.tensor([1, 17, 1600, 333, 0], dtype=torch.int32, device=CUDA)
    q = torch.randn(5, heads * dim, device=CUDA).to(dtype)
    want = reference(q, cache, tables, lens, dim ** -0.5, window)
    for splits in (1, 7, None):
        got = paged_decode(q, cache, tables, lens, dim ** -0.5, window, splits)
        assert got.dtype == dtype
        assert (got.float() - want).abs().max() < tolerance


def test_compiled_kv_write_skips_padding():
    cache = torch.zeros(2, 4, 16, 2, 64, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(3, 128, device=CUDA, dtype=torch.bfloat16)
    write_kv(cache, k, -k, torch.tensor([3, -1, 60], device=CUDA))
    flat = cache.view(2, -1, 128)
    assert torch.equal(flat[0, 3], k[0]) and torch.equal(flat[1, 60], -k[2])
    assert flat.abs().sum(-1).ne(0).any(0).nonzero().flatten().tolist() == [3, 60]


def test_triton_backend_matches_sdpa_on_a_mixed_batch():
    torch.manual_seed(1)
    heads, kv_heads, dim, page = 8, 2, 64, 16
    num_new, seq_lens = [1, 40, 1, 70], [90, 60, 5, 70]
    tables = torch.arange(1, 25, dtype=torch.int32, device=CUDA).view(4, 6)
    slots = [int(tables[i, p // page]) * page + p % page
             for i, (n, length) in enumerate(zip(num_new, seq_lens))
             for p in range(length - n, length)]
    starts = [0, 1, 41, 42, 112]
    metadata = lambda: AttentionMetadata(  # noqa: E731
        slot_mapping=torch.tensor(slots, device=CUDA),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=CUDA),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA), block_tables=tables,
        max_query_len=70, max_seq_len=90, block_size=page, query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens)
    q = torch.randn(112, heads * dim, device=CUDA)
    k, v = torch.randn(112, kv_heads * dim, device=CUDA), torch.randn(112, kv_heads * dim, device=CUDA)
    base = torch.randn(2, 25, page, kv_heads, dim, device=CUDA)
    outs = []
    for backend in (SdpaBackend, TritonBackend):
        cache = base.clone()
        outs.append((backend(heads, kv_heads, dim, 0.125).forward(q, k, v, cache, metadata()), cache))
    assert torch.equal(outs[0][1], outs[1][1])
    assert (outs[0][0] - outs[1][0]).abs().max() < 1e-4


GREEDY = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1)
          for i in range(5)]


def _chats():
    return [[user(f"what is in picture {i}?", image(40 * i, (56 + 28 * (i % 2), 56)))]
            for i in range(4)] + [[user("a question without an image")]]


def _run(checkpoint, device, max_model_len=512, **kwargs) -> dict:
    llm = LLM(model=checkpoint, device=device, dtype="float32", max_model_len=max_model_len,
              max_num_seqs=5, **kwargs)
    outputs = llm.chat(_chats(), GREEDY, use_tqdm=False)
    graphs = llm.llm_engine.core.executor.model_runner.decode_graphs
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "logprobs": [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs]
                           for o in outputs],
              "graphed": graphs is not None and bool(graphs.graphs),
              "preemptions": llm.get_metrics()["foveal:num_preemptions_total"]}
    llm.shutdown()
    return result


def _blocks_bytes(checkpoint, num_blocks: int) -> int:
    """Bytes of num_blocks KV blocks of this checkpoint at float32."""
    from foveal.config import CacheConfig
    from foveal.loader.hf_config import model_config_from_hf
    from foveal.worker.kv_cache import kv_cache_spec

    spec = kv_cache_spec(model_config_from_hf(checkpoint), CacheConfig(), "float32", 1)
    return spec.block_bytes * num_blocks


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-gemma3", "tiny-llava"])
def test_graphed_decode_gives_the_eager_and_cpu_answers(tiny_checkpoints, preset):
    checkpoint = tiny_checkpoints(preset)
    pool = 8 << 20
    cpu = _run(checkpoint, "cpu", kv_cache_memory_bytes=pool)
    eager = _run(checkpoint, "cuda", enforce_eager=True, kv_cache_memory_bytes=pool)
    graphed = _run(checkpoint, "cuda", kv_cache_memory_bytes=pool,
                   max_num_batched_tokens=96)  # chunked prefill beside decodes
    assert graphed["graphed"] and not eager["graphed"]
    assert graphed["tokens"] == eager["tokens"] == cpu["tokens"]
    for a, b in zip(graphed["logprobs"], cpu["logprobs"]):
        assert a == pytest.approx(b, abs=1e-3)
    # a pool of a few blocks: requests are preempted and recomputed
    small = _run(checkpoint, "cuda", max_model_len=160,
                 kv_cache_memory_bytes=_blocks_bytes(checkpoint, 12))
    assert small["preemptions"] > 0 and small["tokens"] == cpu["tokens"]


def test_graphs_with_the_prefix_cache_and_sampling(tiny_checkpoints):
    """A repeated image prompt hits the prefix cache; seeded sampling is reproducible."""
    checkpoint = tiny_checkpoints("tiny-qwen2.5-vl")
    llm = LLM(model=checkpoint, device="cuda", max_model_len=512, kv_cache_memory_bytes=8 << 20)
    chat = [user("describe it", image(90, (84, 56)))]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.chat([chat], params, use_tqdm=False)[0]
    again = llm.chat([chat, chat], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [first.outputs[0].token_ids] * 2
    assert llm.get_metrics()["foveal:prefix_cache_hits_total"] > 0
