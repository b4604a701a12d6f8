// The server's API, on the page's own origin: the API key, OpenAI error bodies
// as readable messages, and chat completions streamed as Server-Sent Events.

const KEY_STORAGE = "foveal.apiKey";

export function storedKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function storeKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// What to do about a status, before the server's own message.
const ADVICE = {
  401: "This server needs an API key: enter it in the API key field and send again.",
  413: "The request is too large.",
  429: "Rate limited: wait a moment and send again.",
  503: "The server is busy: send again in a moment.",
};

export function readableError(error) {
  if (error.name === "AbortError") return "Stopped.";
  if (!(error instanceof ApiError)) return `Cannot reach the server (${error.message}).`;
  const advice = ADVICE[error.status];
  return `${advice ? advice + " " : ""}Server says (${error.status}): ${error.message}`;
}

function authHeaders() {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body.error?.message || body.detail || message;
  } catch {
    // not an OpenAI error body: keep the status line
  }
  return new ApiError(response.status, message);
}

export async function getJson(path) {
  const response = await fetch(path, { headers: authHeaders() });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export async function getText(path) {
  const response = await fetch(path, { headers: authHeaders() });
  if (!response.ok) throw await errorOf(response);
  return response.text();
}

// Yields each chat.completion.chunk; an error event inside the stream (the
// server had already answered 200) throws like an error status does.
export async function* streamChat(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { ...authHeaders(), "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
      yield chunk;
    }
  }
}
