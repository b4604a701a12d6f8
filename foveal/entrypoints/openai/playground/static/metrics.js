// The server's /metrics (Prometheus text): a few foveal:* gauges and counters
// for the panel, and the encoder-cache counters read around each turn.

import { getText } from "./api.js";

// `name{labels} value` lines; comments and other families are skipped.
export function parsePrometheus(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line.startsWith("foveal:")) continue;
    const cut = line.lastIndexOf(" ");
    const value = Number(line.slice(cut + 1));
    if (cut > 0 && !Number.isNaN(value)) samples.set(line.slice(0, cut), value);
  }
  return samples;
}

export async function readMetrics() {
  return parsePrometheus(await getText("/metrics"));
}

function ratio(hits, queries) {
  return queries > 0 ? `${(100 * hits / queries).toFixed(1)}%` : "-";
}

function stat(samples, name) {
  return samples.get(name) ?? 0;
}

// [label, element id, value from the samples]
const PANEL = [
  ["requests running", "metric-running", (s) => stat(s, "foveal:num_requests_running")],
  ["requests waiting", "metric-waiting", (s) => stat(s, "foveal:num_requests_waiting")],
  ["KV cache usage", "metric-kv-usage",
    (s) => `${(100 * stat(s, "foveal:kv_cache_usage_perc")).toFixed(1)}%`],
  ["prefix cache hits", "metric-prefix-hit-rate",
    (s) => ratio(stat(s, "foveal:prefix_cache_hits_total"), stat(s, "foveal:prefix_cache_queries_total"))],
  ["encoder cache hits", "metric-encoder-hit-rate",
    (s) => ratio(stat(s, "foveal:encoder_cache_hits_total"), stat(s, "foveal:encoder_cache_queries_total"))],
  ["prompt tokens", "metric-prompt-tokens", (s) => stat(s, "foveal:prompt_tokens_total")],
  ["generated tokens", "metric-generation-tokens", (s) => stat(s, "foveal:generation_tokens_total")],
  ["visual tokens", "metric-visual-tokens", (s) => stat(s, "foveal:visual_tokens_total")],
];

export function renderPanel(list, samples) {
  list.replaceChildren(...PANEL.flatMap(([label, id, value]) => {
    const term = document.createElement("dt");
    term.textContent = label;
    const data = document.createElement("dd");
    data.id = id;
    data.textContent = String(value(samples));
    return [term, data];
  }));
}

export function pollPanel(list, status, intervalMs) {
  const refresh = async () => {
    try {
      renderPanel(list, await readMetrics());
      status.textContent = "";
    } catch (error) {
      status.textContent = "(metrics unavailable)";
    }
  };
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, intervalMs);
  return refresh;
}
