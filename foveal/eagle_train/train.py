"""`foveal train-eagle`: train an EAGLE-3 head for a target on its own answers.

1. Data (data.py): the target's greedy answers to task prompts (images and
   clips included) and its aux-layer features, recorded from Foveal's forward.
2. Draft vocabulary: the tokens the target wrote most often (all of them for
   small vocabularies); its LM head rows start from the target's.
3. Training-time test (graph.py): the head is unrolled `steps` drafts deep,
   each draft reading the previous one's output; the loss is cross-entropy
   against the target's own tokens (its greedy choices) on the answers.
Writes OUT/config.json + model.safetensors in the layout vLLM and SGLang load.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from foveal.config import TextConfig
from foveal.eagle_train.data import (Sequence, generate_sequences, load_conversations,
                                     task_conversations)
from foveal.eagle_train.graph import Eagle3Graph, save_head
from foveal.loader.eagle_config import EagleConfig, default_aux_layer_ids
from foveal.loader.hf_config import model_config_from_hf

logger = logging.getLogger("foveal")


@dataclass
class EagleTrainConfig:
    num_prompts: int = 256
    max_tokens: int = 48  # answer tokens generated per prompt
    ignore_eos: bool = True  # keep generating past EOS: more tokens per prompt to learn from
    steps: int = 600  # optimizer steps
    batch_size: int = 8  # sequences per step
    unroll: int = 3  # training-time-test depth (drafts per chain)
    lr: float = 2e-3
    warmup: int = 30
    draft_vocab_size: int = 4096  # capped by the target's vocabulary
    intermediate_size: int | None = None  # default: the target's
    seed: int = 0
    eval_fraction: float = 0.1
    device: str | None = None  # default: cuda when present, else cpu
    prompts: str | None = None  # JSONL of prompts (data.load_conversations); default: demo tasks


def head_config(text: TextConfig, cfg: EagleTrainConfig, draft_vocab_size: int
                ) -> EagleConfig:
    """An EAGLE-3 head shaped like one layer of the target `text`."""
    return EagleConfig(
        method="eagle3", path="", hidden_size=text.hidden_size,
        intermediate_size=cfg.intermediate_size or text.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim,
        rms_norm_eps=text.rms_norm_eps, rope_theta=text.rope_theta,
        mrope_section=text.mrope_section, hidden_act=text.hidden_act,
        vocab_size=text.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=text.hidden_size,
        aux_layer_ids=default_aux_layer_ids(text.num_hidden_layers))


def draft_vocabulary(sequences: list[Sequence], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens the target wrote most (ties by id), as sorted ids."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size)
    for seq in sequences:
        counts += torch.bincount(seq.token_ids[seq.answer_start:], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-float(counts[t]), t))
    return torch.tensor(sorted(order[:size]))


def sequence_loss(graph: Eagle3Graph, seq: Sequence, embed: torch.nn.Module,
                  t2d_index: torch.Tensor, unroll: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Mean cross-entropy over the unrolled drafts; per step (correct, counted)."""
    device = t2d_index.device
    tokens = seq.token_ids.to(device)
    n = len(tokens) - 1  # lineages: positions with a feature and a next token
    embeds = embed(tokens[1:])  # (T-1, H): input token of position p is token p+1
    extra = unroll - 1  # chain inputs past the end: computed, then masked below
    embeds = torch.cat([embeds, embeds[-1:].expand(extra, -1)])  # (n + extra, H)
    known = seq.positions.to(device)
    beyond = known[:, -1:] + torch.arange(1, extra + 1, device=device)  # (A, extra)
    positions = torch.cat([known, beyond], dim=-1)[:, :n + extra]
    logits = graph.unroll(seq.features.to(device).float(), embeds, positions, unroll)
    rows = torch.arange(n, device=device)
    losses, stats = [], []
    for step, step_logits in enumerate(logits):
        label_index = rows + step + 2  # the token this row predicts
        valid = (label_index < len(tokens)) & (label_index >= seq.answer_start)
        labels = t2d_index[tokens[label_index.clamp(max=len(tokens) - 1)]]
        valid &= labels >= 0
        if not valid.any():
            stats.append((0, 0))
            continue
        losses.append(torch.nn.functional.cross_entropy(step_logits[valid], labels[valid]))
        correct = int((step_logits[valid].argmax(-1) == labels[valid]).sum())
        stats.append((correct, int(valid.sum())))
    loss = torch.stack(losses).mean() if losses else logits[0].sum() * 0
    return loss, stats


def _takes_video(target: str) -> bool:
    from foveal.multimodal.processors import get_processor_family

    family = get_processor_family(model_config_from_hf(target).model_type)
    return getattr(family.video_processor_class.from_pretrained(target), "takes_video", True)


def train_eagle(target: str, out: str | Path, cfg: EagleTrainConfig) -> Path:
    from tqdm import tqdm

    from foveal.loader.weights import iterate_checkpoint

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    text = model_config_from_hf(target).text
    aux = default_aux_layer_ids(text.num_hidden_layers)
    data_path = out / "sequences.pt"
    if data_path.exists():  # resumable: the data is the slow part on big targets
        sequences = torch.load(data_path, weights_only=False)
    else:
        conversations = (load_conversations(cfg.prompts)[:cfg.num_prompts] if cfg.prompts
                         else task_conversations(cfg.num_prompts, video=_takes_video(target)))
        sequences = generate_sequences(target, aux, conversations, cfg.max_tokens,
                                       cfg.ignore_eos)
        torch.save(sequences, data_path)
    vocab = draft_vocabulary(sequences, text.vocab_size, cfg.draft_vocab_size)
    graph = Eagle3Graph(head_config(text, cfg, len(vocab)))
    embedding, lm_head = _target_embedding_and_head(iterate_checkpoint(target), text)
    embedding = embedding * _input_embedding_scale(model_config_from_hf(target))
    graph.set_draft_vocab(vocab, lm_head)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    graph.to(device)
    embed = torch.nn.Embedding.from_pretrained(embedding, freeze=True).to(device)
    t2d_index = torch.full((text.vocab_size,), -1, dtype=torch.long)
    t2d_index[vocab] = torch.arange(len(vocab))
    t2d_index = t2d_index.to(device)
    logger.info("train-eagle: EAGLE-3 head of %.2fM parameters on %s, draft vocabulary %d",
                sum(p.numel() for p in graph.parameters()) / 1e6, device, len(vocab))
    split = max(1, int(len(sequences) * cfg.eval_fraction))
    evals, trains = sequences[:split], sequences[split:]
    optimizer = torch.optim.AdamW(graph.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    bar = tqdm(total=cfg.steps, desc="train-eagle", dynamic_ncols=True)
    loss_ema, started, history = None, time.perf_counter(), []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg)
        optimizer.zero_grad(set_to_none=True)
        batch = [trains[rng.randrange(len(trains))] for _ in range(cfg.batch_size)]
        total = 0.0
        for seq in batch:
            loss, _ = sequence_loss(graph, seq, embed, t2d_index, cfg.unroll)
            (loss / len(batch)).backward()
            total += loss.item() / len(batch)
        torch.nn.utils.clip_grad_norm_(graph.parameters(), 1.0)
        optimizer.step()
        loss_ema = total if loss_ema is None else 0.95 * loss_ema + 0.05 * total
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{_lr(step, cfg):.1e}")
        if (step + 1) % 100 == 0 or step + 1 == cfg.steps:
            accuracy = evaluate(graph, evals, embed, t2d_index, cfg.unroll)
            history.append({"step": step + 1, "loss": loss_ema, "eval_accuracy": accuracy,
                            "elapsed": time.perf_counter() - started})
            bar.write(f"step {step + 1}: loss {loss_ema:.3f}, held-out draft accuracy per "
                      f"position {[round(a, 3) for a in accuracy]}")
    bar.close()
    save_head(graph.cpu(), out)
    (out / "train_eagle.json").write_text(json.dumps(
        {"target": str(target), "config": asdict(cfg), "history": history}, indent=2))
    return out


@torch.no_grad()
def evaluate(graph: Eagle3Graph, sequences: list[Sequence], embed, t2d_index,
             unroll: int) -> list[float]:
    """Per draft position: the fraction of held-out answer tokens predicted,
    given the true tokens before it (an upper bound on chained acceptance)."""
    correct, counted = [0] * unroll, [0] * unroll
    for seq in sequences:
        _, stats = sequence_loss(graph, seq, embed, t2d_index, unroll)
        for i, (c, n) in enumerate(stats):
            correct[i] += c
            counted[i] += n
    return [c / max(n, 1) for c, n in zip(correct, counted)]


def _lr(step: int, cfg: EagleTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def _input_embedding_scale(model_config) -> float:
    """What the target multiplies a token's embedding by before its first layer, so the head
    trains on the embeddings it is served with (`embed_input_ids`): Gemma 3, sqrt(hidden)."""
    return model_config.text.hidden_size ** 0.5 if model_config.model_type == "gemma3" else 1.0


def _target_embedding_and_head(weights, text) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head (the embedding when tied), float32."""
    embedding = head = None
    for name, tensor in weights:
        if name.endswith("embed_tokens.weight") and "visual" not in name:
            embedding = tensor.float()
        elif name.endswith("lm_head.weight"):
            head = tensor.float()
    if embedding is None:
        raise ValueError("the target checkpoint has no embed_tokens weight")
    return embedding, head if head is not None and not text.tie_word_embeddings else embedding
