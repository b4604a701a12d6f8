"""`foveal bench stages`: the preprocessing stages on their own and in a mixed workload.

1. Per stage (pdf, ocr, asr) at each worker count: N distinct small items are
   submitted at once to a fresh `StagePools` (result cache off, workers warmed
   up first); reports items/s and the median / p90 latency from submission.
2. Mixed workload over the engine (AsyncLLM): requests cycling through a PDF
   (pdf stage), an image with OCR (ocr stage) and a spoken clip (asr stage),
   all arriving at once. "overlapped" lets every request's stage work run as
   soon as it arrives; "serial" runs one request's stage work at a time (a
   single preprocessing lane). Reports requests/s and TTFT from arrival.

Inputs are made here: PDFs written by hand (Helvetica text layer), pages
rendered with pypdfium2 for OCR, speech from espeak-ng (must be installed).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.errors import ConfigError

_SENTENCES = ("Please open the front door.", "The meeting starts after lunch.",
              "Turn left at the next corner.", "Our team won the game last night.")


def text_pdf(lines: list[str]) -> bytes:
    """A one-page PDF whose text layer holds `lines` (Helvetica 14)."""
    escaped = [line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") for line in lines]
    stream = "BT /F1 14 Tf 20 110 Td " + " ".join(f"({line}) Tj 0 -18 Td" for line in escaped) + " ET"
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 420 140] /Contents 4 0 R "
               "/Resources << /Font << /F1 5 0 R >> >> >>",
               f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream",
               "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    body, offsets = b"%PDF-1.4\n", []
    for number, obj in enumerate(objects, 1):
        offsets.append(len(body))
        body += f"{number} 0 obj\n{obj}\nendobj\n".encode("latin-1")
    xref = f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n" + "".join(
        f"{offset:010d} 00000 n \n" for offset in offsets)
    trailer = f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{len(body)}\n%%EOF\n"
    return body + (xref + trailer).encode("latin-1")


def page_png(pdf: bytes, scale: float = 2.0) -> bytes:
    import pypdfium2 as pdfium

    document = pdfium.PdfDocument(pdf)
    image = document[0].render(scale=scale).to_pil().convert("RGB")
    document.close()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def speech_wav(text: str) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise ConfigError("espeak-ng is not installed; the ASR benchmark needs it "
                          "(apt-get install -y espeak-ng)")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "speech.wav"
        subprocess.run([espeak, "-s", "150", "-w", str(path), text], check=True)
        return path.read_bytes()


def stage_items(stage: str, count: int) -> list:
    """`count` distinct items (distinct bytes: no cache or in-flight sharing)."""
    from foveal.stages.asr import AsrItem
    from foveal.stages.ocr import OcrItem
    from foveal.stages.pdf import PdfItem

    lines = [[f"Invoice {index} for order {1000 + index}", _SENTENCES[index % 4]]
             for index in range(count)]
    if stage == "pdf":
        return [PdfItem(text_pdf(page), render="all") for page in lines]
    if stage == "ocr":
        return [OcrItem(page_png(text_pdf(page))) for page in lines]
    if stage == "asr":
        return [AsrItem(speech_wav(f"Number {index}. {_SENTENCES[index % 4]}"))
                for index in range(count)]
    raise ConfigError(f"no benchmark inputs for stage {stage!r}; use pdf, ocr or asr")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def bench_stage(stage: str, workers: int, items: list) -> dict:
    """items/s and latency (s) of one stage with `workers` local processes."""
    from foveal.stages.config import StagesConfig
    from foveal.stages.service import StagePools

    config = StagesConfig(workers={stage: workers}, cache_max_bytes=0, queue_size=len(items) + 1)
    with StagePools(config) as pools:
        pools.warm_up(stage)
        backend = pools.backend(stage)
        backend.submit(items[0]).result()  # first-item costs (lazy imports, graph builds)
        start = time.perf_counter()
        done: list[float] = []
        futures = [backend.submit(item) for item in items]
        for future in futures:
            future.add_done_callback(lambda _: done.append(time.perf_counter()))
        for future in futures:
            future.result()
        wall = time.perf_counter() - start
    latencies = [t - start for t in done]
    return {"stage": stage, "workers": workers, "items": len(items),
            "items_per_s": len(items) / wall, "latency_p50_s": statistics.median(latencies),
            "latency_p90_s": _percentile(latencies, 0.9)}


def mixed_messages(count: int) -> list[list[dict]]:
    """Requests cycling PDF / image-with-OCR / audio, each with a short question."""
    requests = []
    for index in range(count):
        pdf = text_pdf([f"Report {index}: revenue grew {index + 3} percent", _SENTENCES[index % 4]])
        kind = index % 3
        if kind == 0:
            url = "data:application/pdf;base64," + base64.b64encode(pdf).decode()
            part = {"type": "file", "file": {"file_data": url, "filename": f"r{index}.pdf"}}
        elif kind == 1:
            url = "data:image/png;base64," + base64.b64encode(page_png(pdf, 1.0)).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
        else:
            data = base64.b64encode(speech_wav(f"Clip {index}. {_SENTENCES[index % 4]}")).decode()
            part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        requests.append([{"role": "user", "content": [part, {"type": "text", "text": "Summarize."}]}])
    return requests


async def _one_request(engine, pools, messages, lane: asyncio.Lock | None, output_len: int,
                       request_id: str, arrival: float) -> float:
    from foveal.multimodal.chat import parse_chat_conversation
    from foveal.sampling_params import SamplingParams
    from foveal.stages.assembly import expand_preprocessed_parts

    options = {"ocr": "on"} if messages[0]["content"][0]["type"] == "image_url" else {}
    if lane is None:
        messages = await expand_preprocessed_parts(messages, pools, options)
    else:
        async with lane:
            messages = await expand_preprocessed_parts(messages, pools, options)
    conversation = parse_chat_conversation(messages)
    prompt = {"prompt": engine.tokenizer.apply_chat_template(conversation.messages,
                                                             add_generation_prompt=True)}
    if conversation.images:
        prompt["multi_modal_data"] = conversation.multi_modal_data()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    ttft = None
    async for _ in engine.generate(prompt, params, request_id):
        ttft = ttft if ttft is not None else time.perf_counter() - arrival
    return ttft


async def _mixed_run(engine, requests, serial: bool, output_len: int) -> dict:
    from foveal.stages.config import StagesConfig
    from foveal.stages.service import StagePools

    with StagePools(StagesConfig(cache_max_bytes=0)) as pools:
        pools.warm_up("pdf", "ocr", "asr")
        lane = asyncio.Lock() if serial else None
        mode = "serial" if serial else "overlapped"
        arrival = time.perf_counter()
        ttfts = await asyncio.gather(*(
            _one_request(engine, pools, messages, lane, output_len, f"{mode}-{i}", arrival)
            for i, messages in enumerate(requests)))
        wall = time.perf_counter() - arrival
    return {"mode": mode, "requests": len(requests), "requests_per_s": len(requests) / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": _percentile(ttfts, 0.9)}


def bench_mixed(model_dir: str, num_requests: int, output_len: int) -> list[dict]:
    from foveal.async_engine import AsyncLLM
    from foveal.engine_args import EngineArgs

    requests = mixed_messages(num_requests)
    engine = AsyncLLM(EngineArgs.from_kwargs(model_dir, max_model_len=4096),
                      preprocess_workers=1)
    try:
        return [asyncio.run(_mixed_run(engine, requests, serial, output_len))
                for serial in (True, False)]
    finally:
        engine.shutdown()


def _format(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[f"{row[key]:.3f}" if isinstance(row[key], float) else str(row[key]) for key in keys]
             for row in rows]
    widths = [max(len(key), *(len(cell[i]) for cell in cells)) for i, key in enumerate(keys)]
    lines = [" | ".join(key.ljust(w) for key, w in zip(keys, widths))]
    lines += [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def run_bench_stages(args: argparse.Namespace) -> int:
    per_stage = [bench_stage(stage, workers, stage_items(stage, args.items))
                 for stage in args.stages.split(",") for workers in args.workers]
    print(_format(per_stage), flush=True)
    mixed = bench_mixed(str(model_dir_from_args(args)), args.mixed_requests, args.output_len) \
        if args.mixed_requests else []
    if mixed:
        print(_format(mixed))
    if args.json:
        Path(args.json).write_text(json.dumps({"per_stage": per_stage, "mixed": mixed}, indent=2))
    return 0


def register_stages(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "stages", help="preprocessing stage throughput and latency, and a mixed workload",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="pdf,ocr,asr", help="comma-separated stage names")
    parser.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                        help="worker counts to try, e.g. 1,2")
    parser.add_argument("--items", type=int, default=8, help="distinct items per stage run")
    parser.add_argument("--mixed-requests", type=int, default=12,
                        help="requests in the mixed workload (0: skip it)")
    parser.add_argument("--output-len", type=int, default=8, help="tokens per mixed request")
    add_model_source_args(parser, default_dummy="tiny-qwen2-vl")  # for the mixed workload
    parser.add_argument("--json", metavar="OUT", help="write every number here")
    parser.set_defaults(func=run_bench_stages)
