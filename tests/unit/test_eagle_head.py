"""EAGLE heads: the checkpoint layouts vLLM and SGLang load (EAGLE-3 `midlayer`
with a draft vocabulary and d2t; EAGLE-1 `layers.0` with fc.bias and no input
norm), the serving head against the training graph and a plain reference on
the same weights, and the checks that keep a head that does not fit out."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from foveal.eagle_train.graph import Eagle3Graph, save_head
from foveal.errors import CheckpointError, ConfigError
from foveal.forward_context import forward_context
from foveal.loader.eagle_config import load_eagle_config
from foveal.loader.presets import get_preset
from foveal.loader.weights import build_dummy_model, load_draft_head

TARGET = get_preset("tiny-qwen2-vl")
HIDDEN, VOCAB = 64, 512


@pytest.fixture(scope="module")
def target():
    return build_dummy_model(TARGET)


def head_config(**overrides) -> dict:
    return {"hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_theta": 10000.0}, **overrides}


def random_graph(tmp_path, draft_vocab: int = 200, seed: int = 0) -> Eagle3Graph:
    (tmp_path / "config.json").write_text(json.dumps(head_config(draft_vocab_size=draft_vocab)))
    config = load_eagle_config("eagle3", str(tmp_path), target_text())
    torch.manual_seed(seed)
    graph = Eagle3Graph(config)
    with torch.no_grad():
        for param in graph.parameters():
            param.add_(torch.randn_like(param) * 0.05)  # non-unit norms too
    graph.set_draft_vocab(torch.randperm(VOCAB)[:draft_vocab], torch.randn(VOCAB, HIDDEN))
    return graph


def target_text():
    from foveal.loader.hf_config import model_config_from_dict

    return model_config_from_dict(TARGET).text


def inputs(n: int = 7, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3 * HIDDEN, generator=generator)
    embeds = torch.randn(n, HIDDEN, generator=generator)
    positions = torch.stack([torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 3])
    return aux, embeds, positions


def serve(head, embeds, features, positions):
    with forward_context(None, []):
        return head(embeds, features, positions)


def test_eagle3_head_in_the_vllm_layout_matches_the_training_graph(tmp_path, target):
    graph = random_graph(tmp_path)
    save_head(graph, tmp_path / "head")
    config = load_eagle_config("eagle3", str(tmp_path / "head"), target_text())
    head = load_draft_head(config, target, "cpu", "float32")
    assert head.lm_head is not None and head.embed_tokens is None  # embeddings shared
    aux, embeds, positions = inputs()
    scored, _ = serve(head, embeds, head.combine(aux), positions)
    with torch.no_grad():
        expected = graph.unroll(aux, embeds, positions, steps=1)[0]  # (n, draft vocab)
    torch.testing.assert_close(head.lm_head(scored), expected, rtol=1e-4, atol=1e-4)
    drafts = head.draft_token_ids(scored, target.lm_head)
    vocab = torch.nonzero(graph.t2d).squeeze(-1)  # draft id i is target id vocab[i]
    assert torch.equal(drafts, vocab[expected.argmax(-1)])


def test_sglang_and_prefixed_names_load_the_same_head(tmp_path, target):
    graph = random_graph(tmp_path)
    save_head(graph, tmp_path / "midlayer")
    state = {("model." + k.replace("midlayer.", "layers.0.") if k not in ("d2t", "t2d") else k): v
             for k, v in graph.state_dict().items()}
    (tmp_path / "layers0").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()},
              str(tmp_path / "layers0" / "model.safetensors"))
    (tmp_path / "layers0" / "config.json").write_text(
        (tmp_path / "midlayer" / "config.json").read_text())
    heads = [load_draft_head(load_eagle_config("eagle3", str(tmp_path / name), target_text()),
                             target, "cpu", "float32") for name in ("midlayer", "layers0")]
    aux, embeds, positions = inputs()
    first, second = (serve(h, embeds, h.combine(aux), positions)[0] for h in heads)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def eagle1_reference(w: dict, embeds, features, positions, heads=4, kv_heads=2):
    """EAGLE-1 by hand: fc([e, f]) -> attention (no input norm) -> MLP, residuals."""
    from foveal.layers.rotary import MRotaryEmbedding, apply_rotary

    n, d = embeds.shape[0], HIDDEN // heads
    x = F.linear(torch.cat([embeds, features], -1), w["fc.weight"], w["fc.bias"])
    cos, sin = MRotaryEmbedding(d, 10000.0, (2, 3, 3)).cos_sin(positions)
    q = apply_rotary(F.linear(x, w["layers.0.self_attn.q_proj.weight"]).view(n, heads, d), cos, sin)
    k = apply_rotary(F.linear(x, w["layers.0.self_attn.k_proj.weight"]).view(n, kv_heads, d), cos, sin)
    v = F.linear(x, w["layers.0.self_attn.v_proj.weight"]).view(n, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1).reshape(n, -1)
    h = F.linear(attn, w["layers.0.self_attn.o_proj.weight"]) + x
    mlp_in = rms(h, w["layers.0.post_attention_layernorm.weight"])
    gate = F.silu(F.linear(mlp_in, w["layers.0.mlp.gate_proj.weight"]))
    return F.linear(gate * F.linear(mlp_in, w["layers.0.mlp.up_proj.weight"]),
                    w["layers.0.mlp.down_proj.weight"]) + h


def test_eagle1_layout_with_fc_bias_and_no_input_norm(tmp_path, target):
    generator = torch.Generator().manual_seed(3)
    shapes = {"fc.weight": (HIDDEN, 2 * HIDDEN), "fc.bias": (HIDDEN,),
              "layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
              "layers.0.self_attn.k_proj.weight": (32, HIDDEN),
              "layers.0.self_attn.v_proj.weight": (32, HIDDEN),
              "layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
              "layers.0.mlp.gate_proj.weight": (96, HIDDEN),
              "layers.0.mlp.up_proj.weight": (96, HIDDEN),
              "layers.0.mlp.down_proj.weight": (HIDDEN, 96),
              "layers.0.post_attention_layernorm.weight": (HIDDEN,),
              "layers.0.input_layernorm.weight": (HIDDEN,)}  # present in some, unused
    weights = {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] += 1
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        head_config(architectures=["LlamaForCausalLM"])))
    head = load_draft_head(load_eagle_config("eagle", str(tmp_path), target_text()),
                           target, "cpu", "float32")
    assert head.lm_head is None  # EAGLE-1 scores with the target's LM head
    _, embeds, positions = inputs()
    features = torch.randn(embeds.shape, generator=generator)
    scored, next_features = serve(head, embeds, head.combine(features), positions)
    torch.testing.assert_close(scored, eagle1_reference(weights, embeds, features, positions),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(scored, next_features)


@pytest.mark.parametrize("overrides, message", [
    ({"vocab_size": 1000}, "vocab_size 1000"),
    ({"target_hidden_size": 128}, "features of size 128"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, "layer ids"),
    ({"draft_vocab_size": 0}, "draft_vocab_size"),
    ({"num_key_value_heads": 3}, "group"),
    ({"hidden_size": "wide"}, "not an EAGLE config"),
])
def test_a_head_that_does_not_fit_the_target_is_a_config_error(tmp_path, overrides, message):
    (tmp_path / "config.json").write_text(json.dumps(head_config(**overrides)))
    with pytest.raises(ConfigError, match=message):
        load_eagle_config("eagle3", str(tmp_path), target_text())


def test_missing_weights_and_bad_d2t_are_checkpoint_errors(tmp_path, target):
    graph = random_graph(tmp_path)
    state = {k: v.contiguous() for k, v in graph.state_dict().items()}
    config = json.loads((tmp_path / "config.json").read_text())
    for name, broken in (("missing", {k: v for k, v in state.items() if "down_proj" not in k}),
                         ("d2t", {**state, "d2t": state["d2t"] + VOCAB})):
        folder = tmp_path / name
        folder.mkdir()
        save_file(broken, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="lacks weights|d2t"):
            load_draft_head(load_eagle_config("eagle3", str(folder), target_text()),
                            target, "cpu", "float32")


def test_draft_vocabulary_keeps_the_tokens_the_target_wrote_most():
    from foveal.eagle_train.data import Sequence
    from foveal.eagle_train.train import draft_vocabulary

    seq = Sequence(torch.tensor([5, 5, 1, 7, 7, 7, 3]), torch.zeros(6, 3), torch.zeros(1, 7),
                   answer_start=2)  # answers: 1, 7, 7, 7, 3 (the prompt's 5s do not count)
    assert draft_vocabulary([seq], 10, 2).tolist() == [1, 7]  # ties go to the lower id
    assert draft_vocabulary([seq], 10, 10).tolist() == list(range(10))


def test_prompts_file_lines_become_conversations_and_bad_lines_name_their_line(tmp_path):
    from foveal.eagle_train.data import load_conversations

    good = tmp_path / "prompts.jsonl"
    good.write_text('{"prompt": "quote the page"}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert load_conversations(str(good)) == [
        [{"role": "user", "content": "quote the page"}], [{"role": "user", "content": "hi"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_conversations(str(bad))


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-gemma3", "tiny-idefics3",
                                    "tiny-qwen3-vl-moe"])
def test_recorded_features_cover_every_fed_token(tiny_checkpoints, preset):
    """One row per token the target was fed (prompt + answer but its last token),
    with the positions of the decoder's own forward, on decoders of every layout."""
    from foveal.eagle_train.data import generate_sequences
    from foveal.loader.hf_config import model_config_from_hf

    path = tiny_checkpoints(preset)
    hidden = model_config_from_hf(path).text.hidden_size
    conversations = [[{"role": "user", "content": f"count to {n}"}] for n in (3, 12)]
    sequences = generate_sequences(path, (0, 1, 1), conversations, max_tokens=6, ignore_eos=True)
    for seq in sequences:
        assert len(seq.token_ids) == seq.answer_start + 6
        assert seq.features.shape == (len(seq.token_ids) - 1, 3 * hidden)
        assert seq.positions.shape[-1] == len(seq.token_ids)
        assert torch.equal(seq.positions.reshape(-1, len(seq.token_ids))[0],
                           torch.arange(len(seq.token_ids)))  # text only
        # layer 1's input appears twice: the recorder concatenates in the order asked
        assert torch.equal(seq.features[:, hidden:2 * hidden], seq.features[:, 2 * hidden:])
        assert not torch.equal(seq.features[:, :hidden], seq.features[:, hidden:2 * hidden])


def test_training_prompts_skip_clips_for_a_target_without_video(tiny_checkpoints):
    from foveal.eagle_train.data import task_conversations
    from foveal.eagle_train.train import _input_embedding_scale, _takes_video
    from foveal.loader.hf_config import model_config_from_hf

    def has_video(conversation) -> bool:
        return any(part.get("type", "").startswith("video") for turn in conversation
                   for part in (turn["content"] if isinstance(turn["content"], list) else []))

    every = task_conversations(24)
    images_only = task_conversations(24, video=False)
    assert any(has_video(c) for c in every) and not any(has_video(c) for c in images_only)
    assert len(images_only) == 24
    gemma, qwen = tiny_checkpoints("tiny-gemma3"), tiny_checkpoints("tiny-qwen2-vl")
    assert not _takes_video(gemma) and _takes_video(qwen)
    # Gemma 3 feeds its decoder sqrt(hidden)-scaled embeddings: the head trains on those
    hidden = model_config_from_hf(gemma).text.hidden_size
    assert _input_embedding_scale(model_config_from_hf(gemma)) == hidden ** 0.5
    assert _input_embedding_scale(model_config_from_hf(qwen)) == 1.0
