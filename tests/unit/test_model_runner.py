import copy

import pytest
import torch
from torch import nn

from foveal.config import (CacheConfig, EngineConfig, ModelConfig, MultimodalConfig,
                           SchedulerConfig, TextConfig, VisionConfig)
from foveal.engine.plan import CachedRequestData, NewRequestData, StepPlan
from foveal.forward_context import get_forward_context
from foveal.models.positions import MRopePositions
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.sampling_params import SamplingParams
from foveal.worker.kv_cache import kv_cache_spec
from foveal.worker.model_runner import ModelRunner

HIDDEN = 8
VOCAB = 32
IMAGE = 30
BLOCK = 4


def _model_config() -> ModelConfig:
    text = TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=HIDDEN, rms_norm_eps=1e-6, rope_theta=10000.0,
                      mrope_section=(2, 1, 1), max_position_embeddings=256,
                      tie_word_embeddings=True)
    vision = VisionConfig(variant="qwen2_vl", depth=1, hidden_size=8, num_heads=1,
                          intermediate_size=16, out_hidden_size=HIDDEN, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                          hidden_act="quick_gelu")
    return ModelConfig(architecture="Fake", model_type="fake", text=text, vision=vision,
                       image_token_id=IMAGE, video_token_id=31, vision_start_token_id=28,
                       vision_end_token_id=29)


def fake_mrope_positions(config, token_ids, mm_features):
    """Text tokens count up on all axes; an image's tokens share t and spread
    over a 2-wide (h, w) grid; the next token follows the largest position."""
    positions = torch.zeros(3, len(token_ids), dtype=torch.long)
    images = {f.placeholder.offset: f.placeholder.length for f in mm_features}
    next_position, i = 0, 0
    while i < len(token_ids):
        length = images.get(i, 0)
        if length:
            j = torch.arange(length)
            positions[:, i:i + length] = torch.stack(
                [torch.full((length,), next_position), next_position + j // 2,
                 next_position + j % 2])
            next_position = int(positions[:, i:i + length].max()) + 1
            i += length
        else:
            positions[:, i] = next_position
            next_position, i = next_position + 1, i + 1
    return positions, next_position - len(token_ids)


class FakeVLM(nn.Module):
    """Embedding -> causal mean over the paged KV cache -> tied logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN,
                                                generator=torch.Generator().manual_seed(0)))
        self.forward_calls: list[dict] = []
        self.encoder_batches: list[list[str]] = []

    @classmethod
    def position_rule(cls, config):
        return MRopePositions(config, fake_mrope_positions)

    def embed_input_ids(self, input_ids):
        return self.embed(input_ids)

    def embed_multimodal(self, features):
        self.encoder_batches.append([f.mm_hash for f in features])
        if any(f.data.get("fail") for f in features):
            raise ValueError("corrupt pixels")
        return [encoder_rows(f) for f in features]

    def forward(self, inputs_embeds, positions):
        metadata = get_forward_context().attn_metadata
        self.forward_calls.append({"inputs_embeds": inputs_embeds.clone(),
                                   "positions": positions.clone(),
                                   "metadata": copy.deepcopy(metadata)})
        cache = get_forward_context().kv_caches[0].view(2, -1, HIDDEN)  # (2, slots, H)
        cache[0, metadata.slot_mapping] = inputs_embeds
        cache[1, metadata.slot_mapping] = inputs_embeds
        out = torch.empty_like(inputs_embeds)
        bounds = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            index = torch.arange(seq_len)
            slots = metadata.block_tables[i, index // BLOCK].long() * BLOCK + index % BLOCK
            values = cache[1, slots]  # (seq_len, H)
            means = values.cumsum(0) / (index + 1)[:, None]  # (seq_len, H)
            out[bounds[i]:bounds[i + 1]] = means[seq_len - (bounds[i + 1] - bounds[i]):]
        return out

    def compute_logits(self, hidden_states):
        return (hidden_states @ self.embed.weight.T).float()


def encoder_rows(feature: MMFeature) -> torch.Tensor:
    rows = torch.arange(feature.placeholder.length, dtype=torch.float32)[:, None]
    return (feature.data["value"] + 0.1 * rows).expand(-1, HIDDEN).clone()


def reference_greedy(model, token_ids, features, num_new):
    """Greedy continuation computed without a cache, from the full sequence."""
    tokens = list(token_ids)
    for _ in range(num_new):
        embeds = model.embed(torch.tensor(tokens))
        for f in features:
            embeds[f.placeholder.offset:f.placeholder.end] = encoder_rows(f)
        hidden = embeds.cumsum(0)[-1] / len(tokens)
        tokens.append(int(model.compute_logits(hidden[None]).argmax()))
    return tokens[len(token_ids):]


def _runner(seed: int = 0) -> ModelRunner:
    config = EngineConfig(model=_model_config(), cache=CacheConfig(block_size=BLOCK),
                          scheduler=SchedulerConfig(), multimodal=MultimodalConfig(),
                          seed=seed)
    kv_caches = kv_cache_spec(config.model, config.cache, "float32").allocate(32, "cpu")
    return ModelRunner(config, FakeVLM(config.model), kv_caches)


def _image(mm_hash: str, offset: int, length: int, value: float, fail=False) -> MMFeature:
    return MMFeature("image", mm_hash, PlaceholderRange(offset, length),
                     {"value": value, "fail": fail})


def _prompt_with_image(offset=3, length=4, total=10, seed=1):
    text = torch.randint(0, 28, (total,), generator=torch.Generator().manual_seed(seed))
    tokens = text.tolist()
    tokens[offset:offset + length] = [IMAGE] * length
    return tokens


def _new(request_id, tokens, blocks, features=(), computed=0, **params):
    return NewRequestData(request_id, list(tokens), list(features),
                          SamplingParams(temperature=params.pop("temperature", 0.0), **params),
                          [list(blocks)], computed)


def test_chunked_prefill_then_decode_builds_inputs_positions_and_metadata():
    runner = _runner()
    model = runner.model
    image = _image("img-a", offset=3, length=4, value=5.0)
    tokens_a = _prompt_with_image()
    tokens_b = [1, 2, 3]
    positions_a, delta_a = fake_mrope_positions(None, tokens_a, [image])

    out = runner.execute(StepPlan(new_requests=[_new("a", tokens_a, [5, 2, 7], [image])],
                                  num_scheduled_tokens={"a": 5},
                                  scheduled_encoder_inputs={"a": [0]}))
    call = model.forward_calls[-1]
    md = call["metadata"]
    assert out.sampled_token_ids == {} and out.num_encoder_items_run == 1
    assert model.encoder_batches == [["img-a"]]
    assert torch.equal(call["positions"], positions_a[:, :5])
    assert md.slot_mapping.tolist() == [20, 21, 22, 23, 8]
    assert md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.tolist() == [0, 5] and md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [5] and md.seq_lens.dtype == torch.int32
    assert md.block_tables.tolist() == [[5, 2, 7]] and md.block_tables.dtype == torch.int32
    assert (md.max_query_len, md.max_seq_len, md.block_size) == (5, 5, BLOCK)
    rows = encoder_rows(image)
    assert torch.equal(call["inputs_embeds"][3:5], rows[0:2])
    assert torch.equal(call["inputs_embeds"][:3], model.embed(torch.tensor(tokens_a[:3])))

    out = runner.execute(StepPlan(new_requests=[_new("b", tokens_b, [9])],
                                  cached_requests=[CachedRequestData("a", [[]], 5)],
                                  num_scheduled_tokens={"a": 5, "b": 3}))
    call = model.forward_calls[-1]
    md = call["metadata"]
    assert model.encoder_batches == [["img-a"]]  # cached: not encoded again
    assert out.num_encoder_items_run == 0
    assert torch.equal(call["inputs_embeds"][0:2], rows[2:4])
    assert torch.equal(call["positions"][:, :5], positions_a[:, 5:10])
    assert torch.equal(call["positions"][:, 5:], torch.arange(3).expand(3, 3))
    assert md.slot_mapping.tolist() == [9, 10, 11, 28, 29, 36, 37, 38]
    assert md.query_start_loc.tolist() == [0, 5, 8]
    assert md.query_start_loc_cpu == [0, 5, 8] and md.seq_lens_cpu == [10, 3]
    assert md.block_tables.tolist() == [[5, 2, 7], [9, 0, 0]]
    expected_a = reference_greedy(model, tokens_a, [image], 3)
    expected_b = reference_greedy(model, tokens_b, [], 2)
    assert out.sampled_token_ids == {"a": [expected_a[0]], "b": [expected_b[0]]}

    out = runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[]], 10),
                                                   CachedRequestData("b", [[]], 3)],
                                  num_scheduled_tokens={"a": 1, "b": 1}))
    call = model.forward_calls[-1]
    md = call["metadata"]
    assert call["positions"].tolist() == [[10 + delta_a, 3]] * 3
    assert torch.equal(call["inputs_embeds"][0], model.embed.weight[expected_a[0]])
    assert md.slot_mapping.tolist() == [30, 39]
    assert md.seq_lens.tolist() == [11, 4] and md.max_query_len == 1
    assert out.sampled_token_ids == {"a": [expected_a[1]], "b": [expected_b[1]]}

    out = runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[11]], 11)],
                                  num_scheduled_tokens={"a": 1},
                                  finished_request_ids={"b"}))
    md = model.forward_calls[-1]["metadata"]
    assert md.slot_mapping.tolist() == [31]
    assert md.block_tables.tolist() == [[5, 2, 7, 11]]
    assert out.sampled_token_ids == {"a": [expected_a[2]]}
    assert "b" not in runner.requests


def test_resumed_request_recomputes_into_fresh_blocks_and_continues():
    runner = _runner()
    image = _image("img-a", offset=2, length=4, value=-3.0)
    tokens = _prompt_with_image(offset=2, length=4, total=8, seed=3)
    expected = reference_greedy(runner.model, tokens, [image], 4)
    runner.execute(StepPlan(new_requests=[_new("a", tokens, [1, 2], [image])],
                            num_scheduled_tokens={"a": 8}, scheduled_encoder_inputs={"a": [0]}))
    runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[3]], 8)],
                            num_scheduled_tokens={"a": 1}))
    known = tokens + expected[:2]
    # Preempted: its blocks were freed; it comes back with every known token.
    out = runner.execute(StepPlan(new_requests=[_new("a", known, [6, 4, 8], [image])],
                                  num_scheduled_tokens={"a": 7}))
    md = runner.model.forward_calls[-1]["metadata"]
    assert md.slot_mapping.tolist() == [24, 25, 26, 27, 16, 17, 18]
    assert out.sampled_token_ids == {}
    out = runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[]], 7)],
                                  num_scheduled_tokens={"a": 3}))
    call = runner.model.forward_calls[-1]
    positions, delta = fake_mrope_positions(None, tokens, [image])
    assert call["positions"].tolist() == [[7 + delta, 8 + delta, 9 + delta]] * 3
    assert call["metadata"].slot_mapping.tolist() == [19, 32, 33]
    assert out.sampled_token_ids == {"a": [expected[2]]}


def test_resumed_prefix_hit_starts_at_num_computed_tokens():
    runner = _runner()
    tokens = list(range(1, 11))
    runner.execute(StepPlan(new_requests=[_new("a", tokens, [1, 2, 3])],
                            num_scheduled_tokens={"a": 10}))
    out = runner.execute(StepPlan(new_requests=[_new("b", tokens, [1, 2, 5], computed=8)],
                                  num_scheduled_tokens={"b": 2}))
    md = runner.model.forward_calls[-1]["metadata"]
    assert md.slot_mapping.tolist() == [20, 21]
    assert md.seq_lens_cpu == [10]
    assert out.sampled_token_ids == {"b": reference_greedy(runner.model, tokens, [], 1)[:1]}


def test_item_split_across_chunks_is_encoded_once():
    runner = _runner()
    image = _image("img", offset=1, length=6, value=2.0)
    tokens = _prompt_with_image(offset=1, length=6, total=9)
    runner.execute(StepPlan(new_requests=[_new("a", tokens, [0, 1, 2], [image])],
                            num_scheduled_tokens={"a": 3}, scheduled_encoder_inputs={"a": [0]}))
    runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[]], 3)],
                            num_scheduled_tokens={"a": 3}))
    out = runner.execute(StepPlan(cached_requests=[CachedRequestData("a", [[]], 6)],
                                  num_scheduled_tokens={"a": 3}))
    embeds = [c["inputs_embeds"] for c in runner.model.forward_calls]
    rows = encoder_rows(image)
    assert runner.model.encoder_batches == [["img"]]
    assert torch.equal(embeds[0][1:3], rows[0:2])
    assert torch.equal(embeds[1], rows[2:5])
    assert torch.equal(embeds[2][0], rows[5])
    assert out.sampled_token_ids == {"a": reference_greedy(runner.model, tokens, [image], 1)[:1]}


def test_items_of_one_step_are_encoded_in_one_batched_call_deduplicated_by_hash():
    runner = _runner()
    shared = _image("same", offset=0, length=2, value=1.0)
    other = _image("other", offset=3, length=2, value=4.0)
    tokens = [IMAGE, IMAGE, 5, IMAGE, IMAGE, 6]
    out = runner.execute(StepPlan(
        new_requests=[_new("a", tokens, [0, 1], [shared, other]),
                      _new("b", tokens[:3], [2], [shared])],
        num_scheduled_tokens={"a": 6, "b": 3},
        scheduled_encoder_inputs={"a": [0, 1], "b": [0]}))
    assert runner.model.encoder_batches == [["same", "other"]]
    assert out.num_encoder_items_run == 2
    assert set(out.sampled_token_ids) == {"a", "b"}


def test_failed_encoder_item_fails_only_its_request():
    runner = _runner()
    good = _image("good", offset=0, length=2, value=1.0)
    bad = _image("bad", offset=0, length=2, value=1.0, fail=True)
    tokens = [IMAGE, IMAGE, 7, 8]
    out = runner.execute(StepPlan(
        new_requests=[_new("ok", tokens, [0], [good]), _new("broken", tokens, [1], [bad]),
                      _new("text", [3, 4], [2])],
        num_scheduled_tokens={"ok": 4, "broken": 4, "text": 2},
        scheduled_encoder_inputs={"ok": [0], "broken": [0]}))
    assert set(out.failed_requests) == {"broken"}
    assert "corrupt pixels" in out.failed_requests["broken"]
    assert set(out.sampled_token_ids) == {"ok", "text"}
    assert out.num_encoder_items_run == 1
    md = runner.model.forward_calls[-1]["metadata"]
    assert md.query_start_loc_cpu == [0, 4, 6] and md.slot_mapping.tolist()[:4] == [0, 1, 2, 3]


def test_missing_encoder_output_fails_the_request():
    runner = _runner()
    image = _image("never-encoded", offset=1, length=2, value=1.0)
    out = runner.execute(StepPlan(new_requests=[_new("a", [1, IMAGE, IMAGE, 2], [0], [image])],
                                  num_scheduled_tokens={"a": 4}))
    assert "never-encoded" in out.failed_requests["a"]
    assert runner.model.forward_calls == []


def test_freed_mm_hashes_are_dropped_from_the_encoder_cache():
    runner = _runner()
    image = _image("img", offset=0, length=2, value=1.0)
    runner.execute(StepPlan(new_requests=[_new("a", [IMAGE, IMAGE, 1], [0], [image])],
                            num_scheduled_tokens={"a": 3}, scheduled_encoder_inputs={"a": [0]}))
    assert "img" in runner.encoder_cache
    runner.execute(StepPlan(freed_mm_hashes=["img"], finished_request_ids={"a"}))
    assert "img" not in runner.encoder_cache and runner.requests == {}


def test_seeded_request_samples_the_same_tokens_with_or_without_companions():
    def run(with_companion: bool) -> list[int]:
        runner = _runner(seed=int(with_companion))
        new = [_new("s", [1, 2, 3], [0, 1], temperature=1.0, seed=42)]
        scheduled = {"s": 3}
        if with_companion:
            new.insert(0, _new("c", [4, 5], [2, 3], temperature=1.0))
            scheduled = {"c": 2, "s": 3}
        tokens = [runner.execute(StepPlan(new_requests=new,
                                          num_scheduled_tokens=scheduled)).sampled_token_ids["s"][0]]
        for step in range(5):
            cached = [CachedRequestData("s", [[]], 3 + step)]
            scheduled = {"s": 1}
            if with_companion:
                cached.append(CachedRequestData("c", [[]], 2 + step))
                scheduled = {"c": 1, "s": 1}
            out = runner.execute(StepPlan(cached_requests=cached, num_scheduled_tokens=scheduled))
            tokens.extend(out.sampled_token_ids["s"])
        return tokens

    assert run(False) == run(True)


def test_logprobs_are_returned_for_requests_that_ask():
    runner = _runner()
    out = runner.execute(StepPlan(new_requests=[_new("a", [1, 2], [0], logprobs=3),
                                                _new("b", [1, 2], [1])],
                                  num_scheduled_tokens={"a": 2, "b": 2}))
    assert set(out.logprobs) == {"a"}
    assert [p.token_ids[0] for p in out.logprobs["a"]] == out.sampled_token_ids["a"]
    assert len(out.logprobs["a"][0].token_ids) == 4


def test_seeded_request_keeps_its_generator_across_preemption():
    def run(preempt: bool) -> list[int]:
        runner = _runner()
        tokens = [1, 2, 3]
        runner.execute(StepPlan(new_requests=[_new("s", tokens, [0, 1], temperature=2.0,
                                                   seed=7)],
                                num_scheduled_tokens={"s": 3}))
        for step in range(4):
            known = runner.requests["s"].token_ids
            if preempt and step == 2:
                plan = StepPlan(new_requests=[_new("s", known, [4, 5], temperature=2.0,
                                                   seed=7)],
                                num_scheduled_tokens={"s": len(known)})
            else:
                plan = StepPlan(cached_requests=[CachedRequestData("s", [[]], len(known) - 1)],
                                num_scheduled_tokens={"s": 1})
            runner.execute(plan)
        return runner.requests["s"].token_ids

    assert run(True) == run(False)


def test_encoder_output_with_wrong_row_count_fails_its_request():
    runner = _runner()
    short = _image("short", offset=0, length=3, value=1.0)
    runner.model.embed_multimodal = lambda features: [
        encoder_rows(f)[:2] if f.mm_hash == "short" else encoder_rows(f) for f in features]
    good = _image("good", offset=0, length=3, value=2.0)
    tokens = [IMAGE] * 3 + [5]
    out = runner.execute(StepPlan(
        new_requests=[_new("a", tokens, [0], [short]), _new("b", tokens, [1], [good])],
        num_scheduled_tokens={"a": 4, "b": 4},
        scheduled_encoder_inputs={"a": [0], "b": [0]}))
    assert "2 rows" in out.failed_requests["a"] and set(out.failed_requests) == {"a"}
    assert set(out.sampled_token_ids) == {"b"}
    assert "short" not in runner.encoder_cache


def test_uniproc_executor_sizes_the_kv_cache_and_runs_plans(monkeypatch):
    import sys
    import types

    from foveal.errors import EngineDeadError
    from foveal.executor.uniproc import UniProcExecutor

    model_config = _model_config()
    block_bytes = kv_cache_spec(model_config, CacheConfig(block_size=BLOCK), "float32").block_bytes
    loader = types.ModuleType("foveal.loader.weights")
    loader.load_model = lambda engine_config: FakeVLM(engine_config.model)
    monkeypatch.setitem(sys.modules, "foveal.loader.weights", loader)
    config = EngineConfig(model=model_config,
                          cache=CacheConfig(block_size=BLOCK,
                                            kv_cache_memory_bytes=block_bytes * 40 + 1),
                          scheduler=SchedulerConfig(max_model_len=64),
                          multimodal=MultimodalConfig())
    executor = UniProcExecutor(config)
    assert executor.num_blocks == 40
    assert executor.model_runner.kv_caches.layers[0].shape == (2, 40, BLOCK, 1, HIDDEN)
    out = executor.execute(StepPlan(new_requests=[_new("a", [1, 2], [3])],
                                    num_scheduled_tokens={"a": 2}))
    assert set(out.sampled_token_ids) == {"a"}
    executor.shutdown()
    with pytest.raises(EngineDeadError):
        executor.execute(StepPlan())
