"""Prompt -> engine Request: tokenize, load media, plan the visual-token budget,
process, expand placeholders, and check every limit before the engine sees it.

multi_modal_data: {"image": item | [items], "video": item | [items]}
  image item: a source `load_image` takes, or {"image": source, "detail": "low"|"high"|"auto"}
  video item: a source `load_video` takes (path, file:// / data: URL, bytes, a list of
              frames, a (T, H, W, 3) array or {"frames": [...], "fps": 4.0})
multi_modal_uuids: {"image": ["id1", None, ...]} parallel to multi_modal_data: a
  client-given id names an image (the same id must always mean the same image).
  A repeat is served from the processor cache without decoding; an entry whose
  data is None is served from the cache alone, or fails if the id is unknown.
  Video ids are not supported yet.
cache_salt: a string folded into the first KV block's prefix hash; requests with
  different salts never share prefix-cache KV (per-tenant isolation).
mm_processor_kwargs (per LLM, overridden per prompt): the model family's image and
  video processor keys (Qwen2-VL: min_pixels / max_pixels, video_min_pixels /
  video_max_pixels / fps / min_frames / max_frames), max_visual_tokens (the
  planner's budget; foveal.multimodal.budget), transcribe_audio (default true;
  false keeps videos' audio tracks out of the prompt), and per LLM only,
  transcriber (a registered `Transcriber` name that transcribes in-process
  instead of the speech-to-text stage).

Videos' transcripts: `video_speech(prompt)` gives each video's audio track; the
caller that owns the preprocessing stages (LLM, AsyncLLM) transcribes them with
`foveal.stages.assembly.video_transcripts` and passes the result to
`process(..., transcripts=...)`, which puts each right after its video.

Modules: `prompt` (validation), `media` (loading, processor cache), `planning`
(the visual-token plan), `processor` (InputProcessor, tying them together).
"""
from foveal.input_processor.processor import InputProcessor, ProcessedPrompt
from foveal.input_processor.prompt import PromptType

__all__ = ["InputProcessor", "ProcessedPrompt", "PromptType"]
