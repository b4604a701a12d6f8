"""`foveal train-demo`: train the demo model (the `demo` preset, a ~8M parameter
Qwen2-VL) from scratch on the synthetic tasks, on CPU, with transformers'
Qwen2-VL as the training graph, in two stages (TrainConfig): the vision tower
on dense per-token targets, then the text decoder on the frozen tower.

Resumable: `OUT/train_state.pt` holds weights, optimizer, step and data
position and is rewritten every `--checkpoint-every` steps; rerunning the same
command continues. At the end `OUT/model` is an HF checkpoint folder (float16
safetensors, tokenizer, processor and generation configs) that both
transformers and Foveal load. bf16 autocast is used where the CPU has native
bf16 (avx512_bf16 / AMX), fp32 elsewhere.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from foveal.demo_model.encode import (
    IGNORE_INDEX, Augment, SampleEncoder, batch_centre_targets, batch_char_targets, batch_run_targets,
    batch_scene_targets, batch_shape_targets, collate, to_device,
)
from foveal.demo_model.probe import VisualTokenProbe, probe_accuracy, run_vision_tower
from foveal.demo_model.tasks import TASKS, TRAIN_WEIGHTS, make_page, make_sample
from foveal.errors import ConfigError
from foveal.logger import init_logger

logger = init_logger(__name__)
PRESET = "demo"
TOKENIZER_VOCAB = 1024
IMAGE_MAX_PIXELS = 336 * 336
VIDEO_MAX_PIXELS = 224 * 224
MIN_PIXELS = 56 * 56


@dataclass(frozen=True)
class TrainConfig:
    """Two stages, with optional ones before (0) and after (3). Stage 1
    (`vision_steps`): the vision tower alone learns the dense per-token targets
    (VisualTokenProbe). Stage 2 (`steps`): the tower is
    frozen and the text decoder learns to answer. Trained jointly from scratch,
    the decoder stays on the answer prior while the tower's features move; on a
    frozen tower it learns the same reads in a few hundred steps
    (docs/benchmarks.md, "Demo model", "Training")."""

    # Stage 0 (optional, `read_steps`): the tower learns to read alone, on pages of text
    # (batch_size pages per step; the character head's loss, plus the run head's with
    # `run_weight`), before stage 1 adds the other heads, whose losses otherwise drown it
    # (docs/benchmarks.md, "Reading").
    read_steps: int = 0
    vision_steps: int = 1800
    steps: int = 2400
    # Stage 3 (optional): everything but the probe trains on the answers at a small lr,
    # from where stage 2 ended (refines what the tower passes on, e.g. which colour is
    # whose).
    joint_steps: int = 0
    joint_lr: float = 5e-5
    batch_size: int = 16
    # Stage 1 reading (off by default; the shipped model was trained without it): this many
    # pages of text per step (tasks.make_page), and the weight of the character head's loss
    # (probe.char_loss). Measured so far in docs/benchmarks.md ("Reading"): the head learns
    # the characters alone, not yet beside the other heads.
    pages_per_batch: int = 0
    char_weight: float = 0.0
    # Stages 0-1: weight of the run head's loss (probe.run_loss): each token holding text
    # names the whole word or number: fed such tokens, a decoder read 0.75 of the held-out
    # words after 700 steps, where from the per-cell characters it stayed at the answer
    # prior (docs/benchmarks.md, "Reading whole words"). 0: off.
    run_weight: float = 0.0
    # Stage 1: weight of an extra shape loss on the cells a shape covers alone (probe.loss);
    # 0 leaves shape identity to the head's loss over every cell, where the empty cells
    # outnumber the covered ones and the tower learnt it to 0.32 per cell; the shipped model
    # was trained with 4 (docs/benchmarks.md, "Demo model").
    shape_weight: float = 0.0
    # Stage 1: weight of the centre head's loss (probe.centre_loss): each token learns how
    # many shapes have their centre in its cell, so that an image's object count is a sum
    # over its tokens the decoder can take. 0: the count is one scene target on every
    # token, which the tower learnt for 1-3 objects only; the shipped model was trained with 3.
    centre_weight: float = 0.0
    # Stage 1: weight of an extra colour loss on the cells that show a colour or ink. Without
    # it the background cells dominate the colour head's loss, and beside the centre loss the
    # tower named a shape cell's colour right 32% of the time (0.84 without the centre loss),
    # so the decoder could not say which colour a shape has; the shipped model was trained
    # with 3 (docs/benchmarks.md, "Colour on the shape cells").
    colour_weight: float = 0.0
    vision_lr: float = 1e-3
    # stage 0 peak learning rate (None: vision_lr); at 2e-3 the tower named 0.56 of the
    # characters after 750 steps, where runs at 1e-3 had 0.30 after 800 (docs/benchmarks.md,
    # "Reading whole words")
    read_lr: float | None = None
    lr: float = 3e-4  # 1e-3 and up stall the text decoder (scripts/demo_oracle.py, docs/benchmarks.md)
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.05
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 300
    eval_samples: int = 120
    bf16: bool | None = None  # None: on CUDA, or when the CPU has native bf16
    device: str = "cpu"  # "cuda": the model and the optimizer step on the GPU
    # Processes that render and encode batches ahead of the training step (0: the
    # training process itself). A step's batch depends on its index alone, so any
    # worker count gives the same batches.
    data_workers: int = 0
    # The training mix: task -> relative weight for the tasks named (the rest keep
    # tasks.TRAIN_WEIGHTS; 0 leaves a task out). Every stage that draws samples uses it.
    task_weights: dict[str, float] | None = None

    def __post_init__(self) -> None:
        given = self.task_weights or {}
        if unknown := set(given) - set(TASKS):
            raise ConfigError(f"unknown tasks {sorted(unknown)} in task_weights; "
                             f"the tasks are {', '.join(TASKS)}")
        if any(not weight >= 0 for weight in given.values()):  # rejects NaN too
            raise ConfigError(f"task weights must be >= 0, got {given}")
        for name in ("shape_weight", "centre_weight", "colour_weight", "run_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not any(self.mix()):
            raise ConfigError("task_weights leave every task out")

    def mix(self) -> list[float]:
        """Each task's weight, in TASKS order."""
        return [(self.task_weights or {}).get(task, TRAIN_WEIGHTS[task]) for task in TASKS]

    def spans(self) -> dict[int, tuple[int, int]]:
        """Stage -> its [first, end) steps, for the stages that run."""
        out, start = {}, 0
        for stage, length in enumerate((self.read_steps, self.vision_steps, self.steps,
                                        self.joint_steps)):
            if length:
                out[stage] = (start, start + length)
                start += length
        return out

    @property
    def total_steps(self) -> int:
        return self.read_steps + self.vision_steps + self.steps + self.joint_steps

    def stage_of(self, step: int) -> int:
        spans = self.spans()
        return next((stage for stage, (_, end) in spans.items() if step < end), max(spans))


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def task_corpus() -> str:
    """Text the tokenizer's merges are fitted to: every question and answer form."""
    from foveal.demo_model.tasks import COLOR_NAMES, DIRECTIONS, SHAPES, WORDS

    lines = ["You are a helpful assistant."]
    for index in range(600):
        sample = make_sample("corpus", index)
        lines += [sample.question, sample.answer]
    lines += [" ".join(SHAPES), " ".join(COLOR_NAMES), " ".join(DIRECTIONS), " ".join(WORDS),
              " ".join(str(n) for n in range(10)), "yes no left right top bottom"]
    return "\n".join(lines * 3) + "\n"


def write_model_folder(folder: Path) -> dict:
    """Config, tokenizer, processor and generation configs (no weights yet)."""
    from foveal.loader.presets import get_preset
    from foveal.loader.tiny_model import generation_config, write_json
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer
    from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

    hf_config = get_preset(PRESET)
    folder.mkdir(parents=True, exist_ok=True)
    special = write_tiny_tokenizer(folder, vocab_size=TOKENIZER_VOCAB, extra_corpus=task_corpus())
    write_json(folder / "config.json", hf_config)
    image = Qwen2VLImageProcessor.from_config({}, {"min_pixels": MIN_PIXELS, "max_pixels": IMAGE_MAX_PIXELS})
    write_json(folder / "preprocessor_config.json", image.to_config_dict())
    video = image.with_overrides({"max_pixels": VIDEO_MAX_PIXELS}).to_config_dict()
    del video["image_processor_type"]
    write_json(folder / "video_preprocessor_config.json",
               {**video, "fps": 2.0, "min_frames": 4, "max_frames": 64,
                "video_processor_type": "Qwen2VLVideoProcessor"})
    write_json(folder / "generation_config.json", generation_config(special))
    return hf_config


def build_hf_model(hf_config: dict, seed: int):
    try:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    except ImportError as error:
        raise ConfigError("training uses transformers' Qwen2-VL: pip install 'foveal[train]'") from error

    config = Qwen2VLConfig(**hf_config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Warmup then cosine decay to min_lr_ratio, separately in each stage."""
    stage = cfg.stage_of(step)
    start, end = cfg.spans()[stage]
    read_lr = cfg.vision_lr if cfg.read_lr is None else cfg.read_lr
    peak, length = (read_lr, cfg.vision_lr, cfg.lr, cfg.joint_lr)[stage], end - start
    step -= start
    warmup = min(cfg.warmup, max(1, length // 2))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, length - warmup))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged per sample, then over the batch, so that a
    four-token answer weighs as much as a one-token one."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    mask = (labels != IGNORE_INDEX).float()
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


@torch.no_grad()
def teacher_forced_accuracy(model, encoder: SampleEncoder, num_samples: int, bf16: bool,
                            batch_size: int = 16, task: str | None = None) -> dict[str, float]:
    """Exact match of every answer token under teacher forcing, per task, on the first
    `num_samples` eval samples (of `task` alone, when given). Equal to greedy exact
    match: greedy reproduces the answer (and its end token) exactly when each of those
    positions' argmax is the label."""
    model.eval()
    hits = {name: [0, 0] for name in TASKS}
    samples = [make_sample("eval", i, task=task) for i in range(num_samples)]
    for start in range(0, len(samples), batch_size):
        encoded = [encoder.encode(s) for s in samples[start:start + batch_size]]
        batch = to_device(collate(encoded, pad_id=0), model.device)
        labels = batch.pop("labels")
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits
        predicted = logits[:, :-1].argmax(-1)
        targets = labels[:, 1:]
        for row, item in enumerate(encoded):
            mask = targets[row] != IGNORE_INDEX
            hits[item.task][0] += int(bool((predicted[row][mask] == targets[row][mask]).all()))
            hits[item.task][1] += 1
    model.train()
    scores = {task: h / n for task, (h, n) in hits.items() if n}
    scores["overall"] = sum(h for h, _ in hits.values()) / max(1, sum(n for _, n in hits.values()))
    return scores


def make_batch(encoder: SampleEncoder, cfg: TrainConfig, step: int) -> dict:
    """Step `step`'s training batch (a function of the step alone): the collated
    model inputs, labels, and the probe's targets in stages 0-1."""
    stage = cfg.stage_of(step)
    rng = random.Random(f"augment:{cfg.seed}:{step}")
    tasks = rng.choices(TASKS, weights=cfg.mix(), k=cfg.batch_size)
    samples = [make_sample("train", step * cfg.batch_size + i, task=task)
               for i, task in enumerate(tasks)] if stage else []
    if stage <= 1:
        pages, first = cfg.pages_per_batch if stage else cfg.batch_size, step * (
            cfg.batch_size + cfg.pages_per_batch)
        samples += [make_page(first + i) for i in range(pages)]
    encoded = [encoder.encode(s, rng, _PAGE_AUGMENT if s.task == "page" else _AUGMENT)
               for s in samples]
    batch = collate(encoded, pad_id=0)
    out = {"inputs": batch, "labels": batch.pop("labels")}
    if stage <= 1:
        out.update(chars=batch_char_targets(encoded), runs=batch_run_targets(encoded))
    if stage == 1:
        out.update(shapes=batch_shape_targets(encoded), scenes=batch_scene_targets(encoded),
                   centres=batch_centre_targets(encoded))
    return out


_AUGMENT = Augment()
# pages are never shrunk: a shrunk page's character targets are all ignored (char_targets), so
# it would cost a step's compute for nothing
_PAGE_AUGMENT = Augment(lowres_prob=0.0)
_worker_encoder: SampleEncoder | None = None


def _init_worker(scaffold: str, hf_config: dict) -> None:
    global _worker_encoder
    torch.set_num_threads(1)
    _worker_encoder = SampleEncoder(Path(scaffold), hf_config)


def _worker_batch(cfg: TrainConfig, step: int) -> dict:
    return make_batch(_worker_encoder, cfg, step)


class BatchSource:
    """Batches for steps start, start + 1, ... in order; with workers, up to
    2 x workers steps are rendered ahead in other processes."""

    def __init__(self, encoder: SampleEncoder, cfg: TrainConfig, start: int, scaffold: Path,
                 hf_config: dict) -> None:
        import multiprocessing
        from collections import deque

        self.encoder, self.cfg, self.next_step = encoder, cfg, start
        self.pool = None
        self.pending: deque = deque()
        if cfg.data_workers > 0:
            self.pool = multiprocessing.get_context("spawn").Pool(
                cfg.data_workers, _init_worker, (str(scaffold), hf_config))
            self.submitted = start

    def next(self) -> dict:
        if self.pool is None:
            self.next_step += 1
            return make_batch(self.encoder, self.cfg, self.next_step - 1)
        while self.submitted < min(self.cfg.total_steps, self.next_step + 2 * self.cfg.data_workers):
            self.pending.append(self.pool.apply_async(_worker_batch, (self.cfg, self.submitted)))
            self.submitted += 1
        self.next_step += 1
        return self.pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def train(out_dir: str | Path, cfg: TrainConfig) -> Path:
    from tqdm import tqdm

    out_dir = Path(out_dir)
    folder = out_dir / "model"
    hf_config = write_model_folder(out_dir / "scaffold")
    encoder = SampleEncoder(out_dir / "scaffold", hf_config)
    device = torch.device(cfg.device)
    bf16 = (device.type == "cuda" or cpu_has_native_bf16()) if cfg.bf16 is None else cfg.bf16
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = build_hf_model(hf_config, cfg.seed).to(device)
    model.train()
    probe = VisualTokenProbe(hf_config["text_config"]["hidden_size"], encoder.images.image_mean,
                             encoder.images.image_std, centres=cfg.centre_weight > 0,
                             runs=cfg.run_weight > 0).to(device)
    merged: list[torch.Tensor] = []
    model.model.visual.merger.register_forward_hook(lambda _m, _i, out: merged.append(out))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    decay += [p for p in probe.parameters() if p.dim() >= 2]
    no_decay += [p for p in probe.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    state_path = out_dir / "train_state.pt"
    step, elapsed, history = 0, 0.0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        probe.load_state_dict(state["probe"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        logger.info("resuming at step %d (%.0f s trained so far)", step, elapsed)
    params = sum(p.numel() for p in model.parameters())
    logger.info("demo model: %.2fM parameters on %s, batch %d, %d reading + %d vision + %d decoder "
                "steps, bf16 autocast %s, %d data workers", params / 1e6, device, cfg.batch_size,
                cfg.read_steps, cfg.vision_steps, cfg.steps, "on" if bf16 else "off",
                cfg.data_workers)
    source = BatchSource(encoder, cfg, step, out_dir / "scaffold", hf_config)
    bar = tqdm(total=cfg.total_steps, initial=step, desc="train-demo", dynamic_ncols=True)
    loss_ema = history[-1]["loss"] if history else None
    stage = None
    while step < cfg.total_steps:
        vision_stage = cfg.stage_of(step) <= 1  # the tower alone, through the probe
        if cfg.stage_of(step) != stage:
            stage = cfg.stage_of(step)
            _set_stage(model, probe, stage)
        started = time.perf_counter()
        data = to_device(source.next(), device)
        batch, labels = data["inputs"], data["labels"]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        merged.clear()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if stage == 0:
                run_vision_tower(model, batch)
                loss = probe.reading_loss(torch.cat(merged).float(), data["chars"], 1.0,
                                          data["runs"], cfg.run_weight)
            elif vision_stage:
                media = run_vision_tower(model, batch)
                loss = probe.loss(merged, [batch[k] for k, _ in media], data["shapes"],
                                  [batch[g] for _, g in media], data["scenes"],
                                  data["chars"], cfg.char_weight, cfg.shape_weight,
                                  data["centres"], cfg.centre_weight, cfg.colour_weight,
                                  data["runs"], cfg.run_weight)
            else:
                loss = answer_loss(model(**batch).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in (*model.parameters(), *probe.parameters())
                                        if p.requires_grad], 1.0)
        optimizer.step()
        step += 1
        elapsed += time.perf_counter() - started
        if step - 1 in [start for start, _ in cfg.spans().values()] or loss_ema is None:
            loss_ema = loss.item()  # a new stage, a new loss
        loss_ema = 0.95 * loss_ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(stage=stage, loss=f"{loss_ema:.3f}", lr=f"{lr_at(step, cfg):.1e}")
        record = {"step": step, "loss": loss_ema, "elapsed": elapsed}
        if step % cfg.eval_every == 0 or step in [end for _, end in cfg.spans().values()]:
            if vision_stage:
                record["probe"] = probe_accuracy(model, probe, encoder, cfg.eval_samples, bf16)
                scores = record["probe"]
            else:
                record["eval"] = scores = teacher_forced_accuracy(model, encoder,
                                                                  cfg.eval_samples, bf16)
            bar.write(f"step {step}: loss {loss_ema:.3f}, {'probe' if vision_stage else 'eval'} " +
                      ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
        history.append(record)
        if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
            _save_state(state_path, model, probe, optimizer, step, elapsed, history)
    bar.close()
    source.close()
    export(model, out_dir / "scaffold", folder, history)
    return folder


def _set_stage(model, probe, stage: int) -> None:
    """Stages 0 and 1 train the vision tower and the probe; stage 2 the rest; stage 3
    the whole model (not the probe)."""
    for name, param in model.named_parameters():
        visual = "visual" in name.split(".")[:2]
        param.requires_grad_(stage == 3 or visual == (stage <= 1))
    for param in probe.parameters():
        param.requires_grad_(stage <= 1)


def _save_state(path: Path, model, probe, optimizer, step: int, elapsed: float,
                history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "probe": probe.state_dict(),
                "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "history": history}, tmp)
    os.replace(tmp, path)


def export(model, scaffold: Path, folder: Path, history: list) -> None:
    """HF folder: float16 weights via save_pretrained plus the scaffold's files."""
    staging = folder.with_name(folder.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(scaffold, staging)
    device = model.device
    model.to("cpu", torch.float16).save_pretrained(staging)
    model.to(device, torch.float32)
    (staging / "training_log.json").write_text(json.dumps(history[-1:] + [
        r for r in history if "eval" in r or "probe" in r], indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    logger.info("wrote %s", folder)

