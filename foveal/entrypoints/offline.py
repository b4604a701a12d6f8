"""`foveal generate` (one answer) and `foveal chat` (interactive, multi-turn).

Media by path: --image, --video, --file (a PDF: its text layer, page images and
OCR via the preprocessing stages) and --audio (any format ffmpeg decodes: its
transcript via the speech-to-text stage). Everything goes through `LLM.chat`.
"""
from __future__ import annotations

import argparse
import base64
import sys
from dataclasses import dataclass, field
from pathlib import Path

from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.errors import InvalidRequestError
from foveal.stages.cli import add_engine_stage_args, stages_config_from_args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request seed (same seed, same output)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from(args: argparse.Namespace):
    from foveal.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          stop=args.stop)


@dataclass
class Attachments:
    """Media paths attached to the next user message."""

    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # PDFs
    audio: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Attachments":
        return cls(list(getattr(args, "image", [])), list(args.video), list(args.file),
                   list(args.audio))


def _read(path: str, kind: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InvalidRequestError(f"cannot read {kind} {path!r} ({error.strerror or error})") from None


def _file_part(path: str) -> dict:
    data = base64.b64encode(_read(path, "PDF")).decode("ascii")
    return {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{data}",
                                     "filename": Path(path).name}}


def _audio_part(path: str) -> dict:
    data = base64.b64encode(_read(path, "audio file")).decode("ascii")
    audio_format = Path(path).suffix.lstrip(".").lower() or "wav"
    return {"type": "input_audio", "input_audio": {"data": data, "format": audio_format}}


def user_message(text: str, media: Attachments) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": str(Path(p).resolve())}}
             for p in media.images]
    parts += [{"type": "video_url", "video_url": {"url": str(Path(p).resolve())}}
              for p in media.videos]
    parts += [_file_part(p) for p in media.files] + [_audio_part(p) for p in media.audio]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def _llm(args: argparse.Namespace):
    from foveal import LLM

    if args.model is None:
        from foveal.demo_model import default_model_dir

        args.model = str(default_model_dir())
    return LLM(model=args.model, stages=stages_config_from_args(args), **engine_kwargs(args))


def run_generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = sampling_params_from(args)
    try:
        if args.no_chat_template:
            if args.file or args.audio:
                raise InvalidRequestError("--file and --audio need the chat template; "
                                          "drop --no-chat-template")
            images = [str(Path(p).resolve()) for p in args.image]
            videos = [str(Path(p).resolve()) for p in args.video]
            prompt = {"prompt": args.prompt, "multi_modal_data": {"image": images, "video": videos}}
            output = llm.generate(prompt, params, use_tqdm=False)[0]
        else:
            message = user_message(args.prompt, Attachments.from_args(args))
            output = llm.chat([message], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    print(output.outputs[0].text)
    return 0


def _input_lines():
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


_ATTACH_COMMANDS = {"/image": "images", "/video": "videos", "/file": "files", "/audio": "audio"}


def run_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    try:
        _chat_loop(llm, sampling_params_from(args), Attachments.from_args(args))
    finally:
        llm.shutdown()
    return 0


def _chat_loop(llm, params, pending: Attachments) -> None:
    history: list[dict] = []
    print("Type a message. /image, /video, /file (PDF) or /audio PATH attaches media to your "
          "next message; /reset clears the conversation; /exit quits.")
    for line in _input_lines():
        line = line.strip()
        command, _, argument = line.partition(" ")
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history, pending = [], Attachments()
        elif command in _ATTACH_COMMANDS and argument:
            getattr(pending, _ATTACH_COMMANDS[command]).append(argument.strip())
        elif line:
            history.append(user_message(line, pending))
            pending = Attachments()
            answer = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
            history.append({"role": "assistant", "content": answer})
            print(answer, flush=True)


def register(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="answer one prompt (with images)",
                                     description="Answer one prompt, optionally about images.")
    generate.add_argument("--model", help="Hugging Face checkpoint folder (default: the shipped demo model)")
    generate.add_argument("--image", action="append", default=[], metavar="PATH",
                          help="image file (repeatable)")
    generate.add_argument("--video", action="append", default=[], metavar="PATH",
                          help="video file (repeatable; frames sampled at the processor's fps)")
    _add_document_args(generate)
    generate.add_argument("--no-chat-template", action="store_true",
                          help="send the prompt as is (one <|image_pad|> per image, "
                               "one <|video_pad|> per video)")
    generate.add_argument("prompt")
    _add_sampling_args(generate)
    add_engine_args(generate)
    add_engine_stage_args(generate.add_argument_group("preprocessing stages (PDF, OCR, ASR)"))
    generate.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="interactive multi-turn chat",
                                 description="Chat with a model; attach media by path.")
    chat.add_argument("--model", help="Hugging Face checkpoint folder (default: the shipped demo model)")
    chat.add_argument("--video", action="append", default=[], metavar="PATH",
                      help="video file attached to the first message (repeatable)")
    _add_document_args(chat)
    _add_sampling_args(chat)
    add_engine_args(chat)
    add_engine_stage_args(chat.add_argument_group("preprocessing stages (PDF, OCR, ASR)"))
    chat.set_defaults(func=run_chat)


def _add_document_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", action="append", default=[], metavar="PATH",
                        help="PDF attached to the (first) message: text layer, page images "
                             "and OCR via the preprocessing stages (repeatable)")
    parser.add_argument("--audio", action="append", default=[], metavar="PATH",
                        help="audio file (WAV, MP3, OGG, ...) attached to the (first) message; "
                             "its transcript goes into the prompt (repeatable)")
