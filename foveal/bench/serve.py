"""`foveal bench serve`: load an OpenAI-compatible server with seeded multimodal
chat requests (images as data URLs, streamed, EOS ignored) arriving as a Poisson
process, and report throughput and latency (TTFT, TPOT, ITL, E2E) and goodput.

Works against any server speaking OpenAI's streaming chat API; token counts come
from the server's `usage` (stream_options.include_usage), so no tokenizer is
needed here. The workload shares `WorkloadSpec` (sizes, seed) with
`foveal bench throughput`; its text is random words, since token ids are not
portable across servers.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from foveal.bench.workload import (WorkloadSpec, add_workload_args, draw_images, draw_output_len,
                                   workload_spec_from_args)
from foveal.errors import ConfigError

PROMPT_WORDS = ("image", "describe", "color", "shape", "left", "right", "top", "bottom",
                "small", "large", "what", "where", "count", "the", "a", "object", "scene",
                "light", "dark", "near", "far", "red", "green", "blue", "text", "read", "tell",
                "me", "about", "this")
_SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class ChatRequest:
    messages: list[dict]
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def png_data_url(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def build_chat_requests(spec: WorkloadSpec) -> list[ChatRequest]:
    """N chat requests; the same spec always gives the same requests."""
    rng = np.random.default_rng(spec.seed)
    requests = []
    for _ in range(spec.num_prompts):
        parts = [{"type": "image_url", "image_url": {"url": png_data_url(pixels)}}
                 for pixels in draw_images(spec, rng)]
        words = rng.choice(PROMPT_WORDS, size=spec.input_len).tolist() if spec.input_len else []
        parts.append({"type": "text", "text": " ".join(words)})
        output_len = draw_output_len(spec, rng)
        requests.append(ChatRequest([{"role": "user", "content": parts}], output_len))
    return requests


@dataclass(frozen=True)
class ServeBenchPlan:
    base_url: str
    model: str | None
    api_key: str | None
    request_rate: float  # requests/s; inf sends all at once
    max_concurrency: int | None
    goodput_slos_ms: dict[str, float]
    workload: WorkloadSpec


async def _stream_one(client, url: str, body: dict) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                result.error = str(chunk["error"].get("message"))
                return result
            now = time.perf_counter()
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                result.output_tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            # A chunk carries tokens if it has text, token logprobs, or ends the answer.
            if (choice.get("delta", {}).get("content") or choice.get("logprobs")
                    or choice.get("finish_reason")):
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    result.latency = time.perf_counter() - start
    result.ttft = result.ttft or result.latency
    result.ok = True
    return result


async def _send(client, plan: ServeBenchPlan, model: str, request: ChatRequest,
                limit: asyncio.Semaphore | None) -> RequestResult:
    body = {"model": model, "messages": request.messages, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            # Per-token logprobs make every token visible in the stream, even while the
            # detokenizer holds back bytes of an unfinished character.
            "logprobs": True, "top_logprobs": 0}
    url = plan.base_url.rstrip("/") + "/v1/chat/completions"
    try:
        if limit is None:
            return await _stream_one(client, url, body)
        async with limit:
            return await _stream_one(client, url, body)
    except Exception as error:  # network failures count as failed requests, not crashes
        return RequestResult(error=f"{type(error).__name__}: {error}")


async def first_served_model(client, base_url: str, flag: str = "--model") -> str:
    """The first model of GET /v1/models; ConfigError naming `flag` to pass one instead."""
    response = await client.get(base_url.rstrip("/") + "/v1/models")
    if response.status_code != 200 or not response.json().get("data"):
        raise ConfigError(f"GET /v1/models on {base_url} answered {response.status_code}; "
                          f"pass {flag} NAME")
    return response.json()["data"][0]["id"]


async def run_requests(plan: ServeBenchPlan, requests: list[ChatRequest]
                       ) -> tuple[list[RequestResult], float, str]:
    """Send every request on schedule; returns results in request order,
    the wall time from first send to last answer, and the model name used."""
    import httpx

    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    arrivals = random.Random(plan.workload.seed)
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = plan.model or await first_served_model(client, plan.base_url)
        start = time.perf_counter()
        tasks = []
        for index, request in enumerate(requests):
            if index and not math.isinf(plan.request_rate):
                await asyncio.sleep(arrivals.expovariate(plan.request_rate))
            tasks.append(asyncio.create_task(_send(client, plan, model, request, limit)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start, model


def latency_stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    array = np.asarray(values) * 1000.0
    return {"mean": float(array.mean()), "median": float(np.median(array)),
            "p99": float(np.percentile(array, 99))}


def _meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[key] * 1000.0 <= limit for key, limit in slos_ms.items())


def summarize(results: list[RequestResult], duration_s: float,
              slos_ms: dict[str, float]) -> dict:
    done = [result for result in results if result.ok]
    prompt_tokens = sum(result.prompt_tokens for result in done)
    output_tokens = sum(result.output_tokens for result in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({result.error for result in results if not result.ok})[:5],
        "duration_s": duration_s, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": latency_stats_ms([result.ttft for result in done]),
        "tpot_ms": latency_stats_ms([result.tpot for result in done if result.tpot is not None]),
        "itl_ms": latency_stats_ms([gap for result in done for gap in result.itl]),
        "e2el_ms": latency_stats_ms([result.latency for result in done]),
        "goodput": None,
    }
    if slos_ms:
        good = sum(_meets_slos(result, slos_ms) for result in done)
        summary["goodput"] = good / duration_s
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"{'successful requests':<34}{summary['completed']}",
             f"{'failed requests':<34}{summary['failed']}",
             f"{'benchmark duration (s)':<34}{summary['duration_s']:.2f}",
             f"{'prompt / output tokens':<34}{summary['prompt_tokens']} / "
             f"{summary['output_tokens']}",
             f"{'request throughput (req/s)':<34}{summary['request_throughput']:.2f}",
             f"{'output token throughput (tok/s)':<34}{summary['output_throughput']:.2f}",
             f"{'total token throughput (tok/s)':<34}{summary['total_token_throughput']:.2f}"]
    if summary["goodput"] is not None:
        lines.append(f"{'goodput (req/s)':<34}{summary['goodput']:.2f}")
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2el_ms", "E2E latency")):
        stats = summary[key]
        for name in ("mean", "median", "p99"):
            value = stats[name]
            shown = "n/a" if value is None else f"{value:.2f}"
            lines.append(f"{f'{name} {title} (ms)':<34}{shown}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ConfigError(f"--goodput expects KEY:MS, got {item!r}") from None
        if key not in _SLO_KEYS or slos[key] <= 0:
            raise ConfigError(f"--goodput {item!r}: keys are {_SLO_KEYS}, values > 0 ms")
    return slos


def run_bench_serve(args: argparse.Namespace) -> int:
    spec = workload_spec_from_args(args)
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ConfigError("--request-rate must be > 0 (or inf) and --max-concurrency >= 1")
    plan = ServeBenchPlan(args.base_url, args.model, args.api_key, args.request_rate,
                          args.max_concurrency, parse_goodput(args.goodput or []), spec)
    requests = build_chat_requests(spec)
    results, duration, model = asyncio.run(run_requests(plan, requests))
    summary = summarize(results, duration, plan.goodput_slos_ms)
    print(f"server: {plan.base_url}  model: {model}")
    print(format_summary(summary))
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        rate = "inf" if math.isinf(plan.request_rate) else plan.request_rate
        body = {"model": model, "base_url": plan.base_url, "request_rate": rate,
                "max_concurrency": plan.max_concurrency, "workload": asdict(spec),
                "goodput_slos_ms": plan.goodput_slos_ms, **summary}
        path.write_text(json.dumps(body, indent=2, allow_nan=False, default=str) + "\n")
        print(f"wrote {path}")
    return 0 if summary["completed"] else 1


def register_serve(bench_commands) -> None:
    """Adds `serve` under `foveal bench`."""
    parser = bench_commands.add_parser(
        "serve", help="load an OpenAI-compatible server and measure latency",
        description="Send seeded multimodal chat requests (streamed, EOS ignored) to "
                    "BASE_URL/v1/chat/completions and report throughput, TTFT, TPOT, ITL, "
                    "E2E latency and goodput.")
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: first of /v1/models)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    parser.add_argument("--save-result", metavar="FILE", help="write every number as JSON")
    parser.set_defaults(func=run_bench_serve)
