"""The CUDA attention path on CPU: the Triton kernels under Triton's interpreter
against plain attention math, the Triton backend against the SDPA reference on
mixed batches, and the decode-graph runner's static buffers and padding
(capture off) through the engine against a plain run.

The kernels run interpreted where there is no CUDA device (triton_decode.py);
on a CUDA machine tests/gpu runs them compiled."""
from __future__ import annotations

import pytest
import torch

from foveal import LLM, SamplingParams
from foveal.forward_context import AttentionMetadata
from foveal.layers.attention.sdpa import SdpaBackend
from foveal.layers.attention.triton_backend import TritonBackend, kernel_fits
from foveal.layers.attention.triton_decode import num_splits, paged_decode, write_kv
from foveal.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_apply
from tests.e2e.test_multimodal_caching import image, same, user

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted kernels: CPU machines; "
                       "tests/gpu runs the compiled ones"),
    # The interpreter evaluates both sides of tl.where: -inf - -inf on padding rows.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

PAGE, HEADS, KV_HEADS, DIM = 16, 6, 2, 32


def reference(q, cache, tables, lens, scale, window=None):
    """Per request: softmax attention over its context, read slot by slot."""
    rows = []
    group = HEADS // KV_HEADS
    for b in range(q.shape[0]):
        length = int(lens[b])
        if length == 0:
            rows.append(torch.zeros(HEADS * DIM))
            continue
        pos = torch.arange(length)
        slots = tables[b, pos // PAGE].long() * PAGE + pos % PAGE
        k = cache[0].reshape(-1, KV_HEADS, DIM)[slots].repeat_interleave(group, 1)
        v = cache[1].reshape(-1, KV_HEADS, DIM)[slots].repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].view(HEADS, DIM), k) * scale
        if window:
            scores[:, :max(0, length - window)] = float("-inf")
        rows.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(rows)


@pytest.fixture
def paged():
    torch.manual_seed(0)
    cache = torch.randn(2, 24, PAGE, KV_HEADS, DIM)
    tables = torch.randperm(23)[:20].add(1).view(2, 10).repeat(2, 1)[:3].to(torch.int32)
    lens = torch.tensor([7, 150, 0], dtype=torch.int32)  # the last row is padding
    return torch.randn(3, HEADS * DIM), cache, tables, lens


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_matches_attention_math(paged, splits, window):
    q, cache, tables, lens = paged
    got = paged_decode(q, cache, tables, lens, 0.2, sliding_window=window, splits=splits)
    want = reference(q, cache, tables, lens, 0.2, window)
    assert got.shape == (3, HEADS * DIM)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[2], torch.zeros(HEADS * DIM))  # context 0: zeros, no NaN


def test_write_kv_skips_padding_slots():
    torch.manual_seed(1)
    cache = torch.zeros(2, 4, PAGE, KV_HEADS, DIM)
    k, v = torch.randn(3, KV_HEADS * DIM), torch.randn(3, KV_HEADS * DIM)
    write_kv(cache, k, v, torch.tensor([5, -1, 40]))
    flat = cache.view(2, -1, KV_HEADS * DIM)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 40], v[2])
    written = flat.abs().sum(-1).ne(0).any(0).nonzero().flatten().tolist()
    assert written == [5, 40]


def test_split_count_fills_the_gpu_and_keeps_pages_per_split():
    assert num_splits(1, 4, 2048) == 64
    assert num_splits(64, 4, 2048) == 2
    assert num_splits(1, 4, 8) == 2  # at least 4 pages a split
    assert num_splits(256, 8, 2048) == 1


def test_kernel_fits_only_power_of_two_pages_of_16_or_more():
    assert kernel_fits(torch.empty(2, 1, 16, 2, 64))
    assert not kernel_fits(torch.empty(2, 1, 8, 2, 64))
    assert not kernel_fits(torch.empty(2, 1, 24, 2, 64))


def _metadata(num_new, seq_lens, tables, slots):
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(num_new), max_seq_len=max(seq_lens), block_size=PAGE,
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))


@pytest.mark.parametrize("window", [None, 9])
def test_triton_backend_matches_sdpa_on_a_mixed_batch(window):
    """Two decodes, a chunk after cached context and a fresh prompt in one step."""
    torch.manual_seed(2)
    num_new, seq_lens = [1, 5, 1, 12], [40, 21, 17, 12]
    tables = torch.arange(1, 17, dtype=torch.int32).view(4, 4)
    slots = [int(tables[i, p // PAGE]) * PAGE + p % PAGE
             for i, (n, length) in enumerate(zip(num_new, seq_lens))
             for p in range(length - n, length)]
    total = sum(num_new)
    q = torch.randn(total, HEADS * DIM)
    k, v = torch.randn(total, KV_HEADS * DIM), torch.randn(total, KV_HEADS * DIM)
    base = torch.randn(2, 17, PAGE, KV_HEADS, DIM)
    outs = []
    for backend in (SdpaBackend, TritonBackend):
        cache = base.clone()
        attention = backend(HEADS, KV_HEADS, DIM, 0.17, sliding_window=window)
        outs.append((attention.forward(q, k, v, cache, _metadata(num_new, seq_lens, tables, slots)),
                     cache))
    (want, want_cache), (got, got_cache) = outs
    assert torch.equal(got_cache, want_cache)
    assert torch.allclose(got, want, atol=1e-5)


def test_capture_sizes_are_buckets_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(1000)[-1] == 256
    assert capture_sizes(256, max_size=16) == [1, 2, 4, 8, 16]  # qwen3-vl-30b-a3b: 128 // 8
    assert capture_sizes(6, max_size=4) == [1, 2, 4]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


def _engine(checkpoint, **kwargs) -> LLM:
    return LLM(model=checkpoint, max_model_len=512, max_num_seqs=6, kv_cache_memory_bytes=4 << 20,
               **kwargs)


def test_static_decode_buffers_give_the_eager_answers(checkpoint, monkeypatch):
    """Triton backend + the graph runner's padded static buffers (capture off: CPU)
    against the SDPA engine: images, a batch of 5 padded to the bucket of 6, requests
    finishing at different steps, chunked prefill beside decodes."""
    chats = [[user(f"describe {i}", image(30 * i, (56 + 28 * (i % 2), 56)))]
             for i in range(4)] + [[user("no image here, just text")]]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(5)]
    expected = _engine(checkpoint).chat(chats, params, use_tqdm=False)

    monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", "triton")
    llm = _engine(checkpoint, max_num_batched_tokens=64)
    runner = llm.llm_engine.core.executor.model_runner
    config = runner.config
    assert graphs_apply(config, runner.kv_caches, False) is None
    runner.decode_graphs = graphs = DecodeGraphs(config, runner.model, runner.kv_caches,
                                                 runner.position_rule.num_axes, capture=False)
    calls = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: calls.append(r := run(*a)) or r)
    assert same(llm.chat(chats, params, use_tqdm=False), expected)
    assert sum(r is not None for r in calls) >= 8  # decode steps went through the buffers
    assert any(r is None for r in calls)  # prefill steps did not


def test_static_decode_buffers_beside_video_and_ngram_speculation(checkpoint, monkeypatch):
    """A video request and n-gram drafts: steps with drafts run eagerly (more rows
    than requests), the others through the buffers; answers equal the SDPA engine's."""
    import numpy as np

    rng = np.random.default_rng(0)
    video = {"frames": [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(4)],
             "fps": 1.0}
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    text = "one two three one two three one two three one two"
    outputs = {}
    for backend in ("sdpa", "triton"):
        monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", backend)
        llm = _engine(checkpoint, speculative_config=spec)
        if backend == "triton":
            runner = llm.llm_engine.core.executor.model_runner
            runner.decode_graphs = DecodeGraphs(runner.config, runner.model, runner.kv_caches,
                                                runner.position_rule.num_axes, capture=False)
        tokenizer = llm.get_tokenizer()
        video_prompt = tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": "What moves?"}]}], add_generation_prompt=True)
        prompts = [{"prompt": video_prompt, "multi_modal_data": {"video": video}},
                   {"prompt": text}]
        outputs[backend] = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert same(outputs["triton"], outputs["sdpa"])


def test_moe_decoder_decodes_through_the_static_buffers(tiny_checkpoints, monkeypatch):
    """Qwen3-VL-MoE (8 experts, top 2): graphed for batches of up to 4 tokens, with the
    experts' fixed-shape dispatch; a batch of 3 goes through the buffers, one of 5
    runs eagerly; answers (images, a text-only request) equal the SDPA engine's."""
    moe = tiny_checkpoints("tiny-qwen3-vl-moe")
    chats = [[user(f"describe {i}", image(40 * i, (64, 64)))] for i in range(4)] + \
        [[user("text only, no picture")]]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True, logprobs=2)
              for i in range(5)]
    expected = _engine(moe).chat(chats, params, use_tqdm=False)
    expected_three = _engine(moe).chat(chats[:3], params[:3], use_tqdm=False)
    monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", "triton")
    llm = _engine(moe)
    runner = llm.llm_engine.core.executor.model_runner
    assert graphs_apply(runner.config, runner.kv_caches, False) is None
    runner.decode_graphs = graphs = DecodeGraphs(runner.config, runner.model, runner.kv_caches,
                                                 runner.position_rule.num_axes, capture=False)
    assert graphs.sizes == [1, 2, 4]
    calls = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: calls.append((a[0].shape[0], run(*a))) or calls[-1][1])
    assert same(llm.chat(chats[:3], params[:3], use_tqdm=False), expected_three)
    assert any(rows == 3 and out is not None for rows, out in calls)
    calls.clear()
    assert same(llm.chat(chats, params, use_tqdm=False), expected)
    assert any(rows == 5 and out is None for rows, out in calls)  # past the top bucket: eager


def test_graphs_stay_off_where_a_step_is_not_static(checkpoint, monkeypatch):
    monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", "triton")
    llm = _engine(checkpoint, kv_cache_dtype="int8")
    runner = llm.llm_engine.core.executor.model_runner
    assert graphs_apply(runner.config, runner.kv_caches, False) == "int8 KV cache"
    assert graphs_apply(runner.config, runner.kv_caches, True) is not None
    monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", "sdpa")
    llm = _engine(checkpoint, enforce_eager=True)
    runner = llm.llm_engine.core.executor.model_runner
    assert graphs_apply(runner.config, runner.kv_caches, False) == "--enforce-eager"


def test_sliding_window_groups_decode_through_the_static_buffers(tiny_checkpoints, monkeypatch):
    """Gemma 3 with KV cache groups (window 16, blocks behind it given back): each
    group's slots and block tables in the static buffers, prompts well past the
    window; answers equal the SDPA engine's."""
    gemma = tiny_checkpoints("tiny-gemma3")
    chats = [[user("describe it " * (12 + 6 * i), image(40 * i, (64, 64)))] for i in range(3)] + \
        [[user("text only, a longer question about nothing in particular " * 3)]]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=2)
              for i in range(4)]
    options = dict(max_num_batched_tokens=48)  # 16-token blocks: one window
    expected = _engine(gemma, **options).chat(chats, params, use_tqdm=False)
    monkeypatch.setenv("FOVEAL_ATTENTION_BACKEND", "triton")
    llm = _engine(gemma, **options)
    runner = llm.llm_engine.core.executor.model_runner
    assert runner.kv_caches.spec.layer_groups.is_hybrid
    assert graphs_apply(runner.config, runner.kv_caches, False) is None
    runner.decode_graphs = graphs = DecodeGraphs(runner.config, runner.model, runner.kv_caches,
                                                 runner.position_rule.num_axes, capture=False)
    calls = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: calls.append(r := run(*a)) or r)
    outputs = llm.chat(chats, params, use_tqdm=False)
    assert min(len(o.prompt_token_ids) for o in outputs[:3]) > 48  # blocks left the window
    assert same(outputs, expected)
    assert sum(r is not None for r in calls) >= 6
