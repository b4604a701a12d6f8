// The playground page: the conversation, the composer and the controls. Each
// turn sends the whole history (OpenAI's shape) with stream=true and reports
// what the server's usage says about it (report.js).

import { getJson, readableError, storedKey, storeKey, streamChat } from "./api.js";
import { element } from "./dom.js";
import { acceptDropsAndPastes, describeSize, fromFile, fromUrl, isVisual, toPart } from "./attachments.js";
import { pollPanel } from "./metrics.js";
import { decodeRate, formatSeconds, renderReport } from "./report.js";

const $ = (id) => document.getElementById(id);

const state = {
  history: [], // the messages the server answered, in OpenAI's shape
  sources: [], // the images and videos attached in history, in prompt order
  drafts: [], // attachments of the message being written
  controller: null, // aborts the turn in flight
  conversation: 0, // counts "New chat"s: a turn stopped by one stays out of the new history
};

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

// [mm_processor_kwargs key, field id, integer]
const PROCESSOR_FIELDS = [["max_pixels", "max-pixels", true], ["video_max_pixels", "video-max-pixels", true],
                          ["fps", "fps", false], ["max_visual_tokens", "max-visual-tokens", true]];

function requestBody(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true },
                 temperature: numberField("temperature") ?? 1, top_p: numberField("top-p") ?? 1 };
  for (const [key, id] of [["max_tokens", "max-tokens"], ["seed", "seed"]]) {
    const value = numberField(id);
    if (value !== null) body[key] = Math.round(value);
  }
  const kwargs = {};
  for (const [key, id, integer] of PROCESSOR_FIELDS) {
    const value = numberField(id);
    if (value !== null) kwargs[key] = integer ? Math.round(value) : value;
  }
  if (Object.keys(kwargs).length) body.mm_processor_kwargs = kwargs;
  return body;
}

function attachmentView(attachment) {
  const view = element("span", `attachment ${attachment.kind}`);
  if (attachment.kind === "image") {
    const thumbnail = element("img");
    thumbnail.src = attachment.url || attachment.dataUrl;
    thumbnail.alt = attachment.name;
    view.append(thumbnail);
  }
  const size = attachment.size ? ` ${attachment.size.width}×${attachment.size.height}` : "";
  const label = `${attachment.kind}: ${attachment.name}${size} ${describeSize(attachment.bytes)}`;
  view.append(element("span", "label", label));
  return view;
}

function renderDrafts() {
  $("drafts").replaceChildren(...state.drafts.map((attachment, index) => {
    const item = element("li", "draft");
    const remove = element("button", "remove", "×");
    remove.type = "button";
    remove.title = `remove ${attachment.name}`;
    remove.addEventListener("click", () => {
      state.drafts.splice(index, 1);
      renderDrafts();
    });
    item.append(attachmentView(attachment), remove);
    return item;
  }));
}

function notify(message) {
  $("notice").textContent = message;
}

async function addFiles(files) {
  for (const file of files) {
    try {
      state.drafts.push(await fromFile(file));
    } catch (error) {
      notify(error.message);
    }
  }
  renderDrafts();
}

function addTurn(role, text, attachments = []) {
  $("empty-hint")?.remove();
  const turn = element("article", `turn ${role}`);
  if (attachments.length) {
    const list = element("div", "attachments");
    list.append(...attachments.map(attachmentView));
    turn.append(list);
  }
  turn.append(element("div", "text", text));
  if (role === "assistant") turn.append(element("div", "report"));
  $("turns").append(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

function showLive(startedAt, timing, numTokens) {
  const ttft = timing.firstAt === null ? null : (timing.firstAt - startedAt) / 1000;
  const rate = decodeRate(numTokens, timing.firstAt, timing.lastAt);
  $("ttft").textContent = ttft === null ? "-" : formatSeconds(ttft);
  $("tokens-per-second").textContent = rate === null ? "-" : rate.toFixed(1);
  $("completion-tokens").textContent = String(numTokens);
  return { ttft, rate };
}

async function streamAnswer(answer, messages, sources) {
  const text = answer.querySelector(".text");
  const timing = { firstAt: null, lastAt: null, deltas: 0 };
  let usage = null;
  const startedAt = performance.now();
  // The server sends its first chunk with the first token (its text may be empty).
  for await (const chunk of streamChat(requestBody(messages), state.controller.signal)) {
    usage = chunk.usage || usage;
    if (!chunk.choices?.length) continue;
    timing.lastAt = performance.now();
    timing.firstAt ??= timing.lastAt;
    const delta = chunk.choices[0].delta?.content;
    if (!delta) continue;
    timing.deltas += 1;
    text.textContent += delta;
    answer.dataset.deltas = timing.deltas;
    showLive(startedAt, timing, timing.deltas);
  }
  const live = showLive(startedAt, timing, usage?.completion_tokens ?? timing.deltas);
  if (usage) renderReport(answer.querySelector(".report"), usage, live, sources);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy;
}

async function send() {
  const text = $("message").value.trim();
  const attachments = state.drafts;
  if (state.controller || (!text && !attachments.length)) return;
  const detail = $("detail").value;
  const content = attachments.map((attachment) => toPart(attachment, detail));
  if (text) content.push({ type: "text", text });
  const message = { role: "user", content };
  const sources = [...state.sources, ...attachments.filter(isVisual)];
  const conversation = state.conversation;
  const question = addTurn("user", text, attachments);
  const answer = addTurn("assistant", "");
  answer.dataset.status = "streaming";
  state.drafts = [];
  renderDrafts();
  $("message").value = "";
  notify("");
  state.controller = new AbortController();
  setBusy(true);
  try {
    await streamAnswer(answer, [...state.history, message], sources);
    answer.dataset.status = "done";
  } catch (error) {
    answer.dataset.status = error.name === "AbortError" ? "stopped" : "error";
    if (answer.dataset.status === "error" || !answer.querySelector(".text").textContent) {
      showFailure(question, answer, error, text, attachments);
      return;
    }
  } finally {
    state.controller = null;
    setBusy(false);
    refreshPanel();
  }
  if (conversation !== state.conversation) return;
  state.history.push(message, { role: "assistant", content: answer.querySelector(".text").textContent });
  state.sources = sources;
}

// The turn leaves the history; its text and attachments come back to the
// composer, to be fixed (a key entered, a file removed) and sent again.
function showFailure(question, answer, error, text, attachments) {
  question.classList.add("failed");
  answer.classList.add("error");
  answer.querySelector(".text").textContent = readableError(error);
  $("message").value = text;
  state.drafts = attachments;
  renderDrafts();
  if (error.status === 401) showKeyPrompt(true);
}

function showKeyPrompt(show) {
  $("key-prompt").hidden = !show;
  $("api-key").classList.toggle("wanted", show);
  if (show) $("api-key").focus();
}

async function probeServer() {
  try {
    const models = await getJson("/v1/models");
    $("model-name").textContent = models.data.map((model) => model.id).join(", ");
    showKeyPrompt(false);
  } catch (error) {
    $("model-name").textContent = "";
    if (error.status === 401) showKeyPrompt(true);
    else notify(readableError(error));
  }
}

function newChat() {
  state.controller?.abort();
  Object.assign(state, { history: [], sources: [], conversation: state.conversation + 1 });
  $("turns").replaceChildren(element("p", "", "New conversation."));
}

function addUrl() {
  const text = $("media-url").value.trim();
  if (!text) return;
  try {
    state.drafts.push(fromUrl(text));
    $("media-url").value = "";
    renderDrafts();
  } catch (error) {
    notify(error.message);
  }
}

const refreshPanel = pollPanel($("metrics-values"), $("metrics-status"), 2000);

$("api-key").value = storedKey();
$("api-key").addEventListener("input", (event) => storeKey(event.target.value.trim()));
$("api-key").addEventListener("change", probeServer);
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
$("file-input").addEventListener("change", (event) => {
  addFiles([...event.target.files]);
  event.target.value = "";
});
$("add-url").addEventListener("click", addUrl);
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", newChat);
acceptDropsAndPastes($("chat"), addFiles);
probeServer();
document.body.dataset.ready = "true";
