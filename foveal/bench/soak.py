"""`foveal bench soak`: a bounded load test over loopback that fails loudly.

It starts `foveal serve` on a free loopback port (the demo model, or --model
DIR) or targets --base-url, then sends the seeded mix of `soak_mix` from
--concurrency clients for --minutes and/or --requests: media of every kind,
streamed or not, some cancelled by the client, some bad input. It records each
request's outcome, the RSS of the server's process tree over time, and after a
settle wait whether the server is idle again (no KV blocks, requests, encoder
cache references or stage queue items held). The exit status is 1 when
anything unexpected happened: a 5xx, a 4xx for a good request, a bad input that
was accepted, a transport error, a hang, a server that died or did not return
to idle; so CI can run it.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from foveal.bench.serve import first_served_model, latency_stats_ms
from foveal.bench.soak_mix import MixSpec, RequestMix, SoakRequest
from foveal.bench.soak_rss import RssSampler
from foveal.errors import ConfigError

CHAT = "/v1/chat/completions"
# Each must read 0 on an idle server; a missing one is reported, not assumed 0,
# except the stage queues', exported only once a stage pool has started.
IDLE_GAUGES = ("foveal:kv_cache_usage_perc", "foveal:num_requests_running",
               "foveal:num_requests_waiting", "foveal:encoder_cache_held_entries",
               "foveal:api_requests_in_flight", "foveal:detokenizer_requests",
               "foveal:stage_queue_depth")
_OPTIONAL_GAUGES = ("foveal:stage_queue_depth",)
_MAX_LISTED = 50  # unexpected outcomes listed one by one in the report (all are counted)
_ABORTS = 'foveal:request_success_total{finished_reason="abort"}'
# Reported beside the idle gauges: bounded caches, allowed to stay full.
_CACHE_GAUGES = ("foveal:encoder_cache_entries", "foveal:stage_cache_entries",
                 "foveal:stage_cache_bytes")


@dataclass(frozen=True)
class SoakPlan:
    minutes: float | None
    num_requests: int | None
    concurrency: int
    request_timeout_s: float
    settle_s: float
    warmup_s: float  # RSS growth is measured from the first sample after this
    rss_interval_s: float
    mix: MixSpec

    def __post_init__(self) -> None:
        if self.minutes is None and self.num_requests is None:
            raise ConfigError("give --minutes N, --requests N or both")
        if (self.minutes or 1) <= 0 or (self.num_requests or 1) < 1 or self.concurrency < 1:
            raise ConfigError("--minutes must be > 0, --requests and --concurrency >= 1")


@dataclass
class Outcome:
    index: int
    kind: str
    stream: bool
    expected: str  # "ok", "cancelled" or "4xx"
    result: str = ""  # "ok", "cancelled" (closed before the answer ended), "4xx", "unexpected"
    status: int | None = None
    problem: str = ""  # what was unexpected
    latency_s: float | None = None
    ttft_s: float | None = None


@dataclass
class _Exchange:
    """One request in flight: when it was sent, and its outcome so far (a hang
    keeps what was seen before the timeout)."""

    outcome: Outcome
    start: float = field(default_factory=time.perf_counter)


def _expected(request: SoakRequest) -> str:
    return "4xx" if request.is_bad else "cancelled" if request.is_cancel else "ok"


def _classify(request: SoakRequest, outcome: Outcome, status: int, text: str) -> None:
    outcome.status = status
    if request.is_bad and 400 <= status < 500:
        outcome.result = "4xx"
    elif status == 200 and not request.is_bad:
        outcome.result = "ok"
    else:
        outcome.result = "unexpected"
        what = f"bad input {request.kind}" if request.is_bad else request.kind
        outcome.problem = f"{what} answered HTTP {status}: {text[:200]}"


async def _post(client, url: str, body: dict, request: SoakRequest, exchange: _Exchange) -> None:
    outcome = exchange.outcome
    try:
        response = await asyncio.wait_for(client.post(url, json=body), request.cancel_after)
    except asyncio.TimeoutError:  # only with cancel_after: the client gives up, as planned
        outcome.result = "cancelled"
        return
    outcome.latency_s = time.perf_counter() - exchange.start
    _classify(request, outcome, response.status_code, response.text)


async def _stream(client, url: str, body: dict, request: SoakRequest,
                  exchange: _Exchange) -> None:
    """Reads the events; a planned cancel leaves the `async with` early, which
    closes the connection under the server's feet."""
    outcome = exchange.outcome
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            _classify(request, outcome, response.status_code, (await response.aread()).decode())
            return
        _classify(request, outcome, 200, "")
        num_chunks = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                outcome.latency_s = time.perf_counter() - exchange.start
                return
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                outcome.result, outcome.problem = "unexpected", f"error event: {chunk['error']}"
                return
            choice = (chunk.get("choices") or [{}])[0]
            if not (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                continue
            num_chunks += 1
            if outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - exchange.start
            if request.cancel_after_chunks and num_chunks >= request.cancel_after_chunks \
                    and not choice.get("finish_reason"):
                outcome.result = "cancelled"
                return
    if outcome.result == "ok":
        outcome.result, outcome.problem = "unexpected", "the stream ended without [DONE]"


async def send(client, base_url: str, model: str, request: SoakRequest,
               timeout_s: float) -> Outcome:
    """One request of the mix, classified; never raises."""
    import httpx

    exchange = _Exchange(Outcome(request.index, request.kind, request.stream, _expected(request)))
    body = {"model": model, **request.body}
    run = _stream if request.stream else _post
    try:
        await asyncio.wait_for(run(client, base_url + CHAT, body, request, exchange), timeout_s)
    except asyncio.TimeoutError:
        exchange.outcome.result = "unexpected"
        exchange.outcome.problem = f"hang: no answer within {timeout_s:g} s (--request-timeout)"
    except (httpx.HTTPError, OSError, ValueError) as error:
        exchange.outcome.result = "unexpected"
        exchange.outcome.problem = f"transport: {type(error).__name__}: {error}"
    return exchange.outcome


async def run_load(plan: SoakPlan, mix: RequestMix, base_url: str, model: str | None,
                   api_key: str | None, progress=None) -> list[Outcome]:
    """--concurrency clients take the next request index until the time or the
    count runs out; progress(outcomes) is called every 30 s."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + plan.minutes * 60 if plan.minutes else float("inf")
    indices = itertools.count()
    outcomes: list[Outcome] = []

    async def client_loop(client) -> None:
        while time.monotonic() < deadline:
            index = next(indices)
            if plan.num_requests is not None and index >= plan.num_requests:
                return
            request = await asyncio.to_thread(mix.request, index)
            outcomes.append(await send(client, base_url, model, request,
                                       plan.request_timeout_s))

    async def report_progress() -> None:
        while progress is not None:
            await asyncio.sleep(30)
            progress(outcomes)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), headers=headers, trust_env=False,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = model or await first_served_model(client, base_url, "--served-model")
        reporter = asyncio.create_task(report_progress())
        await asyncio.gather(*(client_loop(client) for _ in range(plan.concurrency)))
        reporter.cancel()
    return sorted(outcomes, key=lambda outcome: outcome.index)


def wait_for_idle(base_url: str, settle_s: float) -> dict:
    """Polls /metrics until every idle gauge reads 0 or settle_s passes."""
    from foveal.disagg.launch import scrape_metrics

    start = time.monotonic()
    while True:
        values = scrape_metrics(base_url)
        gauges = {name: values.get(name) for name in IDLE_GAUGES}
        busy = {name: value for name, value in gauges.items() if value}
        missing = [name for name, value in gauges.items()
                   if value is None and name not in _OPTIONAL_GAUGES]
        if not busy or time.monotonic() - start >= settle_s:
            break
        time.sleep(0.5)
    return {"idle": not busy and not missing, "seconds_to_idle": time.monotonic() - start,
            "gauges": gauges, "busy": busy, "missing": missing,
            "caches": {name: values.get(name) for name in _CACHE_GAUGES},
            "aborts_seen_by_server": values.get(_ABORTS)}


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    by_kind: dict[str, Counter] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.kind, Counter())[outcome.result] += 1
    # Latency of whole answers only: a planned cancel that finished first asked for more tokens.
    served = [o for o in outcomes if o.result == o.expected == "ok" and o.latency_s is not None]
    latency = {kind: latency_stats_ms([o.latency_s for o in served if o.kind == kind])
               for kind in sorted({o.kind for o in served})}
    ttft = latency_stats_ms([o.ttft_s for o in served if o.stream and o.ttft_s is not None])
    unexpected = [o for o in outcomes if o.result == "unexpected"]
    statuses = Counter(f"{o.kind} -> {o.status if o.status is not None else 'no status'}"
                       for o in outcomes if o.result in ("4xx", "unexpected"))
    return {
        "duration_s": duration_s, "num_requests": len(outcomes),
        "results": dict(Counter(o.result for o in outcomes)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "latency_ms": latency, "stream_ttft_ms": ttft,
        "errors_by_kind_and_status": dict(sorted(statuses.items())),
        "unexpected": [{"index": o.index, "kind": o.kind, "stream": o.stream,
                        "status": o.status, "problem": o.problem}
                       for o in unexpected[:_MAX_LISTED]],
    }


def problems_of(summary: dict, idle: dict | None, server_alive: bool) -> list[str]:
    """Why the run fails, in words; empty when all went as planned."""
    num_unexpected = summary["results"].get("unexpected", 0)
    problems = [(f"{num_unexpected} unexpected outcome(s), e.g. "
                f"{summary['unexpected'][0]['problem']}")] if summary["unexpected"] else []
    if not server_alive:
        problems.append("the server process exited during the run")
    if idle is None:
        problems.append("the server did not answer GET /metrics after the load")
    elif not idle["idle"]:
        problems.append(f"not idle {idle['seconds_to_idle']:.0f} s after the load: "
                        f"busy {idle['busy']}, missing gauges {idle['missing']}")
    return problems


def format_report(report: dict) -> str:
    summary, idle, rss = report["summary"], report["idle"], report["rss"]
    lines = [(f"requests: {summary['num_requests']} in {summary['duration_s']:.0f} s  "
             f"results: {summary['results']}")]
    for kind, counts in summary["by_kind"].items():
        stats = summary["latency_ms"].get(kind)
        shown = "" if stats is None else \
            f"  p50 {stats['median']:.0f} ms  p99 {stats['p99']:.0f} ms"
        lines.append(f"  {kind:<20}{json.dumps(counts)}{shown}")
    ttft = summary["stream_ttft_ms"]
    if ttft["median"] is not None:
        lines.append(f"stream TTFT: p50 {ttft['median']:.0f} ms  p99 {ttft['p99']:.0f} ms")
    for key, count in summary["errors_by_kind_and_status"].items():
        lines.append(f"  {key}: {count}")
    if rss is not None:
        lines.append(f"server RSS (MiB, {rss['num_processes']} processes): first steady "
                     f"{rss['steady_start_mib']:.0f}, end of load {rss['end_of_load_mib']:.0f}, "
                     f"after settle {rss['end_mib']:.0f}; growth {rss['growth_mib']:+.0f} MiB "
                     f"({rss['slope_mib_per_min']:+.1f} MiB/min over the steady samples)")
    if idle is not None:
        lines.append(f"idle after {idle['seconds_to_idle']:.1f} s: {idle['idle']}  "
                     f"gauges {json.dumps(idle['gauges'])}")
        lines.append(f"caches {json.dumps(idle['caches'])}  aborts seen by the server: "
                     f"{idle['aborts_seen_by_server']}")
    lines += [f"PROBLEM: {problem}" for problem in report["problems"]] or ["no problems"]
    return "\n".join(lines)


def _progress(sampler: RssSampler | None, start: float):
    def show(outcomes: list[Outcome]) -> None:
        rss = sampler.latest_mib() if sampler else None
        counts = dict(Counter(outcome.result for outcome in outcomes))
        memory = "" if rss is None else f"  server RSS {rss:.0f} MiB"
        print(f"[{time.monotonic() - start:5.0f} s] {len(outcomes)} requests {counts}{memory}",
              flush=True)
    return show


def _start_server(args: argparse.Namespace):
    from foveal.disagg.launch import ServerProcess

    log_path = Path(args.server_log or Path(tempfile.mkdtemp(prefix="foveal-soak-")) / "server.log")
    command = ["serve", *([args.model] if args.model else []), *shlex.split(args.server_args)]
    server = ServerProcess(command, log_path)
    print(f"starting: foveal {shlex.join(command)} on {server.url} (log: {log_path})", flush=True)
    try:
        server.wait_ready(time.monotonic() + args.startup_timeout)
    except RuntimeError:
        server.kill()
        raise
    return server


def _plan_from_args(args: argparse.Namespace) -> SoakPlan:
    mix = MixSpec(seed=args.seed, cancel_share=args.cancel_share, bad_share=args.bad_share,
                  stream_share=args.stream_share, distinct_media=args.distinct_media,
                  image_limit=args.image_limit, max_tokens=args.max_tokens)
    warmup = args.warmup_s if args.warmup_s is not None else \
        (args.minutes * 12.0 if args.minutes else 15.0)  # 20% of the time
    return SoakPlan(args.minutes, args.requests, args.concurrency, args.request_timeout,
                    args.settle, warmup, args.rss_interval, mix)


def soak(plan: SoakPlan, base_url: str, server, server_pid: int | None,
         served_model: str | None = None, api_key: str | None = None) -> dict:
    """Load, settle, measure; server (a ServerProcess or None) is left running."""
    import httpx

    mix = RequestMix(plan.mix)
    sampler = RssSampler(server_pid, plan.rss_interval_s).start() if server_pid else None
    start = time.monotonic()
    try:
        outcomes = asyncio.run(run_load(plan, mix, base_url, served_model, api_key,
                                        _progress(sampler, start)))
        duration = time.monotonic() - start
        end_of_load = sampler.now() if sampler else duration
        try:
            idle = wait_for_idle(base_url, plan.settle_s)
        except httpx.HTTPError:
            idle = None
    finally:
        if sampler:
            sampler.stop()
    alive = server.alive() if server else idle is not None
    summary = summarize(outcomes, duration)
    rss = sampler.report(plan.warmup_s, end_of_load) if sampler else None
    return {"summary": summary, "idle": idle, "rss": rss, "server_alive": alive,
            "end_of_load_s": end_of_load, "problems": problems_of(summary, idle, alive)}


def run_bench_soak(args: argparse.Namespace) -> int:
    import dataclasses

    plan = _plan_from_args(args)
    server = None if args.base_url else _start_server(args)
    base_url = (args.base_url or server.url).rstrip("/")
    server_pid = server.process.pid if server else args.server_pid
    try:
        report = soak(plan, base_url, server, server_pid, args.served_model, args.api_key)
    finally:
        if server:
            server.stop()
    print(format_report(report))
    if args.json:
        body = {"command_line": shlex.join(["foveal", *sys.argv[1:]]),
                "base_url": base_url, "plan": dataclasses.asdict(plan), **report}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    if args.plot and report["rss"] is not None:
        from foveal.bench.soak_rss import plot_rss

        plot_rss(report["rss"], report["end_of_load_s"], Path(args.plot))
        print(f"wrote {args.plot}")
    if server and report["problems"]:
        print(f"server log: {server.log_path}")
    return 1 if report["problems"] else 0


def register_soak(bench_commands) -> None:
    """Adds `soak` under `foveal bench`."""
    parser = bench_commands.add_parser(
        "soak", help="bounded load test: mixed media, cancels, bad input; leaks and idle",
        description="Start `foveal serve` on a free loopback port (or use --base-url) and send "
                    "a seeded mix of image, video, PDF and audio chat requests, streamed or "
                    "not, some cancelled by the client and some bad input, from --concurrency "
                    "clients. Report outcomes, latency, the server's RSS over time and whether "
                    "it is idle again afterwards; exit 1 if anything unexpected happened.")
    target = parser.add_argument_group("server")
    target.add_argument("--model", metavar="DIR", help="checkpoint to serve (default: the demo model)")
    target.add_argument("--server-args", default="", help="more `foveal serve` flags, one string")
    target.add_argument("--server-log", metavar="FILE", help="the started server's output")
    target.add_argument("--startup-timeout", type=float, default=300.0)
    target.add_argument("--base-url", help="use this running server instead of starting one")
    target.add_argument("--server-pid", type=int, help="with --base-url: the PID whose process "
                                                      "tree's RSS to sample")
    target.add_argument("--served-model", help="model name to send (default: first of /v1/models)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    load = parser.add_argument_group("load")
    load.add_argument("--minutes", type=float, help="send requests for this long")
    load.add_argument("--requests", type=int, help="send at most this many requests")
    load.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--cancel-share", type=float, default=0.1,
                      help="share of requests the client abandons mid-answer")
    load.add_argument("--bad-share", type=float, default=0.1, help="share of bad input (4xx)")
    load.add_argument("--stream-share", type=float, default=0.5)
    load.add_argument("--distinct-media", type=int, default=64,
                      help="distinct contents per media kind; repeats hit the caches")
    load.add_argument("--image-limit", type=int, default=8,
                      help="the server's image limit per request (too-many-images sends one more)")
    load.add_argument("--max-tokens", type=int, default=16, help="max_tokens of good requests")
    checks = parser.add_argument_group("checks")
    checks.add_argument("--request-timeout", type=float, default=120.0,
                        help="a request unanswered this long is a hang")
    checks.add_argument("--settle", type=float, default=30.0,
                        help="seconds the server has to become idle after the load")
    checks.add_argument("--warmup-s", type=float,
                        help="RSS growth counts from the first sample after this "
                             "(default: 20%% of --minutes, else 15 s)")
    checks.add_argument("--rss-interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--json", metavar="OUT", help="write the whole report here")
    parser.add_argument("--plot", metavar="PNG", help="plot RSS over time (matplotlib)")
    parser.set_defaults(func=run_bench_soak)
