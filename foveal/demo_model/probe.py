"""The training-only probe heads of `foveal train-demo`'s first stage: dense
per-token targets that give the vision tower gradient before any answer does.
Not exported with the model."""
from __future__ import annotations

import torch

from foveal.demo_model.encode import (
    CHAR_SLOTS, IGNORE_INDEX, MAX_CENTRES, MAX_COUNT, RUN_SLOTS, TEXT_CHARS, TEXT_SLOTS,
    SampleEncoder, batch_centre_targets, batch_char_targets, batch_run_targets, batch_scene_targets,
    batch_shape_targets, collate, to_device,
)
from foveal.demo_model.render import COLORS, SHAPES
from foveal.demo_model.tasks import DIRECTIONS, make_sample


class VisualTokenProbe(torch.nn.Module):
    """Training-only auxiliary heads (not exported): from each visual token, predict
    what its 28x28 cell shows: its colour (background, a named colour, or dark
    text ink, read off the cell's own pixels) and the shape covering it (from
    the objects the generator drew). A VLM trained from scratch sits on the
    answer prior until its vision tower carries signal; these dense losses give
    the tower gradient from the first step.

    Scene heads: every token of an image (or clip) also predicts what the whole
    picture shows (encode.scene_targets: object count, each shape's colour, the
    text's characters, the motion direction, the one shape's place). The tower
    attends across its image, so it learns to write the scene into each token,
    and the text decoder can answer from any visual token it attends to.

    Character head: each token names the characters whose centres fall in its
    cell, left to right (encode.char_targets), learnt mostly from
    training-only pages of text (tasks.make_page); the decoder then reads a word
    off the tokens it covers, left to right. Run head: each token holding text
    names the whole word or number it belongs to (encode.run_targets), so the
    decoder can read a word off any one of its tokens.

    Centre head: each token says how many shapes have their centre in its cell
    (encode.centre_targets), so an image's count is the sum over its tokens."""

    NUM_CLASSES = len(COLORS) + 2  # background, colours..., ink
    # each scene column (encode.scene_targets) and its class count
    SCENE_COLUMNS = ("count",) + ("colors",) * len(SHAPES) + ("text",) * TEXT_SLOTS + ("direction",)
    SCENE_GROUPS = ((MAX_COUNT + 1,) + (len(COLORS) + 1,) * len(SHAPES)
                    + (len(TEXT_CHARS) + 1,) * TEXT_SLOTS + (len(DIRECTIONS),))
    SCENE_WEIGHT = 4.0
    CHAR_CLASSES = len(TEXT_CHARS) + 1  # 0: no (further) character in the cell
    EMPTY_CHAR_WEIGHT = 0.1  # most cells hold no text; they count less

    def __init__(self, hidden: int, mean, std, merge: int = 2, patch: int = 14, temporal: int = 2,
                 centres: bool = False, runs: bool = False):
        super().__init__()
        self.head = torch.nn.Linear(hidden, self.NUM_CLASSES)
        self.shape_head = torch.nn.Linear(hidden, len(SHAPES) + 1)
        self.position_head = torch.nn.Linear(hidden, 2)
        self.scene_head = torch.nn.Linear(hidden, sum(self.SCENE_GROUPS))
        self.where_head = torch.nn.Linear(hidden, 2)
        self.char_head = torch.nn.Linear(hidden, CHAR_SLOTS * self.CHAR_CLASSES)
        # only in runs that train them, so that older training states still load
        self.centre_head = torch.nn.Linear(hidden, MAX_CENTRES + 1) if centres else None
        self.run_head = torch.nn.Linear(hidden, RUN_SLOTS * self.CHAR_CLASSES) if runs else None
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1), persistent=False)
        self.register_buffer("palette", torch.tensor(list(COLORS.values()), dtype=torch.float32) / 255,
                             persistent=False)
        self.merge, self.patch, self.temporal = merge, patch, temporal

    @torch.no_grad()
    def targets(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(patches, C*T*P*P) rows in merge-window order -> one class per visual token."""
        window = self.merge ** 2
        rows = pixel_values.float().view(-1, 3, self.temporal, self.patch * self.patch)[:, :, 0]
        cells = rows.view(-1, window, 3, self.patch * self.patch).permute(0, 2, 1, 3)
        rgb = (cells.reshape(cells.shape[0], 3, -1) * self.std + self.mean).clamp(0, 1)
        saturation = rgb.amax(1) - rgb.amin(1)
        # nearest palette colour: argmin |x - p|^2 = argmin (|p|^2 - 2 x.p)
        distance = (self.palette ** 2).sum(1) - 2 * rgb.transpose(1, 2) @ self.palette.T
        classes = torch.where(saturation > 0.25, distance.argmin(2) + 1, 0)
        classes = torch.where((saturation <= 0.25) & (rgb.amax(1) < 0.5), self.NUM_CLASSES - 1, classes)
        counts = torch.zeros(classes.shape[0], self.NUM_CLASSES, device=classes.device
                             ).scatter_add_(1, classes, torch.ones(classes.shape, device=classes.device))
        counts[:, 0] = 0
        best = counts.argmax(1)
        enough = counts.gather(1, best[:, None]).squeeze(1) >= 0.08 * classes.shape[1]
        return torch.where(enough, best, 0)

    def positions(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """(tokens, 2): each visual token's cell centre as (row, column) fractions
        of its image. The vision tower only sees relative positions (2-D RoPE);
        this target makes it carry where a token sits, which the position and
        motion questions need."""
        out = []
        for t, h, w in grid_thw.tolist():
            rows, cols = h // self.merge, w // self.merge
            r = (torch.arange(rows, dtype=torch.float32) + 0.5) / rows
            c = (torch.arange(cols, dtype=torch.float32) + 0.5) / cols
            cell = torch.stack(torch.meshgrid(r, c, indexing="ij"), -1).view(-1, 2)
            out.append(cell.repeat(t, 1))
        return torch.cat(out).to(grid_thw.device)

    def scene_loss(self, features: torch.Tensor, classes: torch.Tensor,
                   where: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the scene columns a token has targets for, plus
        the one shape's place where there is exactly one."""
        logits = self.scene_head(features).split(self.SCENE_GROUPS, dim=-1)
        losses = [torch.nn.functional.cross_entropy(out, classes[:, i], ignore_index=IGNORE_INDEX)
                  for i, out in enumerate(logits) if (classes[:, i] != IGNORE_INDEX).any()]
        known = ~where[:, 0].isnan()
        if known.any():
            losses.append(10 * torch.nn.functional.mse_loss(self.where_head(features[known]), where[known]))
        return torch.stack(losses).sum() / len(self.SCENE_GROUPS)

    def char_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.char_head(features).view(-1, CHAR_SLOTS, self.CHAR_CLASSES)

    def run_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.run_head(features).view(-1, RUN_SLOTS, self.CHAR_CLASSES)

    def char_loss(self, features: torch.Tensor, chars: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the character head on the first len(chars) tokens (the
        batch's images), empty slots weighted EMPTY_CHAR_WEIGHT."""
        return self._slot_loss(self.char_logits(features[:len(chars)]), chars, chars > 0)

    def run_loss(self, features: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the run head on the first len(runs) tokens, every slot of a
        token without text (all 0) weighted EMPTY_CHAR_WEIGHT; a text token's end
        slots (0 after its last character) weigh fully, since they give its length."""
        holds = (runs > 0).any(1, keepdim=True).expand_as(runs)
        return self._slot_loss(self.run_logits(features[:len(runs)]), runs, holds)

    def _slot_loss(self, logits: torch.Tensor, targets: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        targets = targets.reshape(-1)
        weight = torch.where(full.reshape(-1), 1.0, self.EMPTY_CHAR_WEIGHT) * (targets != IGNORE_INDEX)
        per_slot = torch.nn.functional.cross_entropy(logits.reshape(-1, self.CHAR_CLASSES),
                                                     targets.clamp(min=0), reduction="none")
        return (per_slot * weight).sum() / weight.sum().clamp(min=1e-6)

    def centre_loss(self, features: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the centre head, the cells holding a centre and the others
        weighing half each (a few cells per image hold one)."""
        per_token = torch.nn.functional.cross_entropy(self.centre_head(features), centres,
                                                      reduction="none")
        held = centres > 0
        parts = [per_token[mask].mean() for mask in (held, ~held) if mask.any()]
        return torch.stack(parts).mean()

    def loss(self, features: list[torch.Tensor], pixels: list[torch.Tensor],
             shapes: list[torch.Tensor], grids: list[torch.Tensor],
             scenes: tuple[torch.Tensor, torch.Tensor], chars: torch.Tensor | None = None,
             char_weight: float = 0.0, shape_weight: float = 0.0,
             centres: list[torch.Tensor] | None = None, centre_weight: float = 0.0,
             colour_weight: float = 0.0, runs: torch.Tensor | None = None,
             run_weight: float = 0.0) -> torch.Tensor:
        """The stage-1 loss. `shape_weight` adds the shape head's cross-entropy over
        the cells a shape covers alone, so that naming the shape weighs as much
        wherever there is one, however many empty cells the batch holds;
        `colour_weight` does the same for the colour head over the cells that show a
        colour or ink (in the plain term the background cells, ~90% of a batch,
        outweigh them); `centre_weight` adds the centre head's loss (centre_loss),
        `char_weight` the character head's (char_loss), `run_weight` the run head's
        (run_loss)."""
        features = torch.cat(features).float()
        colours = torch.cat([self.targets(p) for p in pixels])
        where = torch.cat([self.positions(g) for g in grids])
        shape_logits, shapes = self.shape_head(features), torch.cat(shapes)
        colour_logits = self.head(features)
        loss = (torch.nn.functional.cross_entropy(colour_logits, colours)
                + torch.nn.functional.cross_entropy(shape_logits, shapes)
                + 10 * torch.nn.functional.mse_loss(self.position_head(features), where)
                + self.SCENE_WEIGHT * self.scene_loss(features, *scenes))
        for weight, logits, classes in ((shape_weight, shape_logits, shapes),
                                        (colour_weight, colour_logits, colours)):
            shown = classes > 0  # the cells a shape covers, the cells that show a colour
            if weight and shown.any():
                loss = loss + weight * torch.nn.functional.cross_entropy(logits[shown], classes[shown])
        if self.centre_head is not None and centres is not None and centre_weight:
            loss = loss + centre_weight * self.centre_loss(features, torch.cat(centres))
        return loss + self.reading_loss(features, chars, char_weight, runs, run_weight)

    def reading_loss(self, features: torch.Tensor, chars: torch.Tensor | None, char_weight: float,
                     runs: torch.Tensor | None, run_weight: float) -> torch.Tensor | float:
        """char_weight x char_loss + run_weight x run_loss, each where weighted and given
        (the run head's only when the probe has one): stage 0's whole loss, stage 1's
        reading part."""
        loss = 0.0
        if chars is not None and char_weight:
            loss = loss + char_weight * self.char_loss(features, chars)
        if self.run_head is not None and runs is not None and run_weight:
            loss = loss + run_weight * self.run_loss(features, runs)
        return loss


def run_vision_tower(model, batch: dict) -> list[tuple[str, str]]:
    """The tower alone on the batch's images, then its videos (the probe's hook
    collects the merged tokens); returns the (pixels, grid) keys it ran."""
    media = [(k, g) for k, g in (("pixel_values", "image_grid_thw"),
                                 ("pixel_values_videos", "video_grid_thw")) if k in batch]
    for pixels, grid in media:
        model.model.visual(batch[pixels], grid_thw=batch[grid])
    return media


@torch.no_grad()
def probe_accuracy(model, probe: VisualTokenProbe, encoder: SampleEncoder, num_samples: int,
                   bf16: bool, batch_size: int = 16) -> dict[str, float]:
    """Stage 1's held-out score: per visual token, how often the scene heads name
    the object count, the shapes' colours, the text's characters and the motion
    direction (where the scene says), the per-cell colour head on every cell
    ("cell_color", mostly background) and on the cells that show a colour or ink
    ("shown_color"), the shape head on the cells a shape covers ("cell_shape") and
    the character head on the cells that hold a character ("chars"), the run head
    on the cells that hold text, a whole word or number right ("run"); with a centre
    head, how often the counts it names over an image's (or clip's) tokens add up
    to the shapes drawn ("centre_count", per image)."""
    merged: list[torch.Tensor] = []
    hook = model.model.visual.merger.register_forward_hook(lambda _m, _i, out: merged.append(out))
    hits = {name: [0, 0] for name in ["cell_color", "shown_color", "cell_shape", "chars",
                                      *dict.fromkeys(probe.SCENE_COLUMNS)]}
    if probe.run_head is not None:
        hits["run"] = [0, 0]
    if probe.centre_head is not None:
        hits["centre_count"] = [0, 0]
    try:
        for start in range(0, num_samples, batch_size):
            encoded = [encoder.encode(make_sample("eval", i))
                       for i in range(start, min(num_samples, start + batch_size))]
            batch = to_device(collate(encoded, pad_id=0), model.device)
            merged.clear()
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
                media = run_vision_tower(model, batch)
            features = torch.cat(merged).float()
            colours = torch.cat([probe.targets(batch[k]) for k, _ in media])
            right, shown = probe.head(features).argmax(-1) == colours, colours > 0
            hits["cell_color"][0] += int(right.sum())
            hits["cell_color"][1] += len(colours)
            hits["shown_color"][0] += int(right[shown].sum())
            hits["shown_color"][1] += int(shown.sum())
            shapes = torch.cat(batch_shape_targets(encoded)).to(model.device)
            covered = shapes > 0
            predicted = probe.shape_head(features).argmax(-1)
            hits["cell_shape"][0] += int((predicted[covered] == shapes[covered]).sum())
            hits["cell_shape"][1] += int(covered.sum())
            chars = to_device(batch_char_targets(encoded), model.device)
            if chars is not None:
                known = chars > 0
                predicted = probe.char_logits(features[:len(chars)]).argmax(-1)
                hits["chars"][0] += int((predicted[known] == chars[known]).sum())
                hits["chars"][1] += int(known.sum())
            if chars is not None and probe.run_head is not None:
                runs = to_device(batch_run_targets(encoded), model.device)
                text = (runs > 0).any(1)
                named = (probe.run_logits(features[:len(runs)]).argmax(-1) == runs).all(1)
                hits["run"][0] += int(named[text].sum())
                hits["run"][1] += int(text.sum())
            classes, _ = to_device(batch_scene_targets(encoded), model.device)
            scene_logits = probe.scene_head(features).split(probe.SCENE_GROUPS, dim=-1)
            for column, (name, logits) in enumerate(zip(probe.SCENE_COLUMNS, scene_logits)):
                known = classes[:, column] != IGNORE_INDEX
                hits[name][0] += int((logits.argmax(-1)[known] == classes[known, column]).sum())
                hits[name][1] += int(known.sum())
            if probe.centre_head is not None:
                wanted = batch_centre_targets(encoded)
                named = probe.centre_head(features).argmax(-1).cpu().split([len(t) for t in wanted])
                hits["centre_count"][0] += sum(int(got.sum() == want.sum())
                                               for got, want in zip(named, wanted))
                hits["centre_count"][1] += len(wanted)
    finally:
        hook.remove()
    return {name: h / max(1, n) for name, (h, n) in hits.items()}
