// Attachments and the OpenAI content parts they become: images (image_url),
// videos (video_url), PDFs (a file part) and audio (input_audio), from the file
// picker, drag and drop, the clipboard or a URL the server fetches.

const KINDS = [
  { kind: "image", mime: /^image\//, extension: /\.(png|jpe?g|gif|webp|bmp|tiff?)$/i },
  { kind: "video", mime: /^video\//, extension: /\.(mp4|webm|mov|mkv|avi|m4v)$/i },
  { kind: "pdf", mime: /^application\/pdf$/, extension: /\.pdf$/i },
  { kind: "audio", mime: /^audio\//, extension: /\.(wav|mp3|flac|ogg|oga|m4a|aac|opus)$/i },
];

export function kindOf(mime, name) {
  const found = KINDS.find((entry) => entry.mime.test(mime || ""))
    || KINDS.find((entry) => entry.extension.test(name || ""));
  return found ? found.kind : null;
}

function extensionOf(name) {
  const match = /\.([a-z0-9]+)$/i.exec(name || "");
  return match ? match[1].toLowerCase() : "";
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function imageSize(url) {
  return new Promise((resolve) => {
    const image = new Image();
    image.onload = () => resolve({ width: image.naturalWidth, height: image.naturalHeight });
    image.onerror = () => resolve(null);
    image.src = url;
  });
}

// The server checks a data URL's media type by kind ("video/..." for videos).
function mimeFor(kind, file) {
  if (kindOf(file.type, "") === kind) return file.type;
  if (kind === "pdf") return "application/pdf";
  return `${kind}/${extensionOf(file.name) || "octet-stream"}`;
}

export async function fromFile(file) {
  const kind = kindOf(file.type, file.name);
  if (!kind) throw new Error(`${file.name || "the pasted item"} is not an image, video, PDF or audio file`);
  const payload = (await readDataUrl(file)).split(",", 2)[1] || "";
  const dataUrl = `data:${mimeFor(kind, file)};base64,${payload}`;
  const name = file.name || `pasted ${kind}`;
  const size = kind === "image" ? await imageSize(dataUrl) : null;
  return { kind, name, bytes: file.size, dataUrl, payload, size };
}

export function fromUrl(text) {
  const url = new URL(text, window.location.href);
  if (!["http:", "https:", "data:"].includes(url.protocol)) {
    throw new Error(`${text}: use an http(s) or data: URL`);
  }
  const kind = kindOf("", url.pathname) === "video" || /^data:video\//.test(text) ? "video" : "image";
  return { kind, name: text.length > 60 ? text.slice(0, 57) + "..." : text, url: url.href, size: null };
}

export function isVisual(attachment) {
  return attachment.kind === "image" || attachment.kind === "video";
}

export function toPart(attachment, detail) {
  const url = attachment.url || attachment.dataUrl;
  switch (attachment.kind) {
    case "image":
      return { type: "image_url", image_url: detail === "auto" ? { url } : { url, detail } };
    case "video":
      return { type: "video_url", video_url: { url } };
    case "pdf":
      return { type: "file", file: { file_data: attachment.dataUrl, filename: attachment.name } };
    default:
      return { type: "input_audio",
               input_audio: { data: attachment.payload, format: extensionOf(attachment.name) || "wav" } };
  }
}

// Files dropped on `zone`, and images pasted anywhere on the page, go to onFiles.
export function acceptDropsAndPastes(zone, onFiles) {
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("dragging");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    onFiles([...event.dataTransfer.files]);
  });
  document.addEventListener("paste", (event) => {
    const images = [...(event.clipboardData?.files || [])].filter((file) => file.type.startsWith("image/"));
    if (images.length) {
      event.preventDefault();
      onFiles(images);
    }
  });
}

export function describeSize(bytes) {
  if (bytes === undefined) return "";
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(0)} KB`;
  return `${(bytes / 1024 / 1024).toFixed(1)} MB`;
}
