// One turn's report under its answer: tokens, prefix- and encoder-cache hits,
// timings, and the visual-token plan of every media item in the prompt
// (usage.mm_plan: the planner's choice per item, in prompt order).

import { element } from "./dom.js";

function percent(part, whole) {
  return whole > 0 ? ` (${Math.round(100 * part / whole)}%)` : "";
}

export function formatSeconds(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

// Tokens per second after the first: the decode rate.
export function decodeRate(numTokens, firstAt, lastAt) {
  return numTokens > 1 && lastAt > firstAt ? (numTokens - 1) / ((lastAt - firstAt) / 1000) : null;
}

function summary(usage, timing) {
  const details = usage.prompt_tokens_details || {};
  const encoder = { hits: details.encoder_cache_hits || 0,
                    queries: details.encoder_cache_queries || 0 };
  const cached = details.cached_tokens || 0;
  const parts = [
    `prompt ${usage.prompt_tokens} tokens`,
    `prefix cache hit ${cached}${percent(cached, usage.prompt_tokens)}`,
    `image ${details.image_tokens || 0}`,
    `video ${details.video_tokens || 0}`,
    `completion ${usage.completion_tokens}`,
  ];
  if (encoder.queries > 0) {
    parts.push(`encoder cache hit ${encoder.hits} of ${encoder.queries} items`);
  } else if (details.image_tokens || details.video_tokens) {
    parts.push("encoder not run (media in the cached prefix)");
  }
  if (timing.ttft !== null) parts.push(`TTFT ${formatSeconds(timing.ttft)}`);
  if (timing.rate !== null) parts.push(`${timing.rate.toFixed(1)} tokens/s`);
  return parts.join(" · ");
}

function resolution(item, source) {
  const resized = item.width ? `${item.width}×${item.height}` : "";
  const original = source?.size ? `${source.size.width}×${source.size.height}` : "";
  return original && resized && original !== resized ? `${original} → ${resized}` : resized || original;
}

// sources: the conversation's images and videos in prompt order, or fewer when
// the plan holds items the page did not attach (a scanned PDF's page images).
function planTable(plan, sources) {
  const named = sources.length === plan.length;
  const table = element("table", "plan");
  const head = table.createTHead().insertRow();
  for (const title of ["item", "resolution", "frames", "tokens", "detail", "max_pixels", "budget"]) {
    head.append(element("th", "", title));
  }
  const body = table.createTBody();
  plan.forEach((item, index) => {
    const row = body.insertRow();
    row.dataset.tokens = item.num_tokens;
    row.dataset.frames = item.num_frames;
    row.dataset.downsampled = item.downsampled;
    const cells = [
      named ? sources[index].name : `${item.modality} ${index + 1}`,
      resolution(item, named ? sources[index] : null),
      item.num_frames,
      item.num_tokens,
      item.detail,
      item.max_pixels,
      item.downsampled ? "downsampled" : "full",
    ];
    for (const cell of cells) row.insertCell().textContent = String(cell);
  });
  return table;
}

export function renderReport(container, usage, timing, sources) {
  const details = usage.prompt_tokens_details || {};
  Object.assign(container.dataset, {
    promptTokens: usage.prompt_tokens,
    cachedTokens: details.cached_tokens || 0,
    imageTokens: details.image_tokens || 0,
    videoTokens: details.video_tokens || 0,
    encoderCacheQueries: details.encoder_cache_queries || 0,
    encoderCacheHits: details.encoder_cache_hits || 0,
    completionTokens: usage.completion_tokens,
  });
  const children = [element("p", "summary", summary(usage, timing))];
  if (usage.mm_plan?.length) children.push(planTable(usage.mm_plan, sources));
  container.replaceChildren(...children);
}
