"""`foveal bench soak`: the seeded mix, the process-tree RSS, the exit status on a
misbehaving server, and a short soak of a real `foveal serve` on the tiny checkpoint."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pypdfium2 as pdfium

from foveal.bench.soak import register_soak
from foveal.bench.soak_mix import (
    BAD_KINDS,
    GOOD_KINDS,
    MixSpec,
    RequestMix,
    text_pdf,
    tone_wav,
)
from foveal.bench.soak_rss import RssSampler, _proc_tree_rss, process_tree_rss
from foveal.engine.encoder_budget import EncoderBudget
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.audio import SAMPLE_RATE, decode_audio

TINY_SERVER_FLAGS = ("--max-model-len 2048 --kv-cache-memory-bytes 16777216 --preprocess-workers 1 "
                     "--limit-mm-per-prompt image=2,video=1")


def soak_main(argv: list[str]) -> int:
    """What `foveal bench soak ARGS` runs (the same parser registration)."""
    parser = argparse.ArgumentParser(prog="foveal bench")
    register_soak(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(["soak", *argv])
    return args.func(args)


def test_the_mix_is_determined_by_its_seed_and_holds_every_kind():
    first, again, other = (RequestMix(MixSpec(seed=seed, bad_share=0.3, cancel_share=0.2))
                           for seed in (3, 3, 4))
    requests = [first.request(index) for index in range(200)]
    assert [r.body for r in requests] == [again.request(index).body for index in range(200)]
    assert [r.body for r in requests] != [other.request(index).body for index in range(200)]
    assert {r.kind for r in requests} == set(GOOD_KINDS) | set(BAD_KINDS)
    cancels = [r for r in requests if r.is_cancel]
    assert cancels and not any(r.is_bad for r in cancels)
    assert all((r.cancel_after_chunks is not None) == r.stream for r in cancels)
    too_many = next(r for r in requests if r.kind == "too_many_images")
    images = [p for p in too_many.body["messages"][0]["content"] if p["type"] == "image_url"]
    assert len(images) == MixSpec().image_limit + 1


def test_hand_made_pdf_has_its_text_layer_and_the_tone_decodes():
    document = pdfium.PdfDocument(text_pdf("Soak page 7: red (square)."))
    assert len(document) == 1
    assert document[0].get_textpage().get_text_range().strip() == "Soak page 7: red square."
    samples = decode_audio(tone_wav(5))
    assert samples.shape == (SAMPLE_RATE,) and 0.2 < abs(samples).max() < 0.4


def test_encoder_cache_held_entries_count_referenced_entries_only():
    """The idle gauge foveal:encoder_cache_held_entries: a cached entry nobody needs is idle."""
    budget = EncoderBudget(capacity=100)
    budget.allocate("a", MMFeature("image", "h1", PlaceholderRange(0, 10)))
    budget.allocate("b", MMFeature("image", "h1", PlaceholderRange(0, 10)))
    budget.allocate("b", MMFeature("image", "h2", PlaceholderRange(10, 10)))
    assert (budget.num_entries, budget.num_held_entries) == (2, 2)
    budget.release_all("a")
    assert (budget.num_entries, budget.num_held_entries) == (2, 2)  # "b" holds both
    budget.release_all("b")
    assert (budget.num_entries, budget.num_held_entries) == (2, 0)


def test_process_tree_rss_covers_the_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for rss in (process_tree_rss(os.getpid()), _proc_tree_rss(os.getpid())):
            assert {os.getpid(), child.pid} <= set(rss)
            assert all(value > 0 for value in rss.values())
    finally:
        child.kill()
        child.wait()
    assert _proc_tree_rss(child.pid) == {}


def test_rss_growth_counts_from_the_first_sample_after_the_warmup():
    mib = 1 << 20
    sampler = RssSampler(root_pid=1, interval_s=1.0)
    sampler.samples = [(0.0, {1: 100 * mib}), (10.0, {1: 150 * mib}),
                       (20.0, {1: 160 * mib, 2: 10 * mib}), (30.0, {1: 170 * mib, 2: 10 * mib}),
                       (40.0, {1: 175 * mib})]
    report = sampler.report(steady_from_s=5.0, end_of_load_s=30.0)
    assert (report["steady_from_s"], report["steady_start_mib"]) == (10.0, 150.0)
    assert (report["end_of_load_mib"], report["end_mib"], report["peak_mib"]) == (180, 175, 180)
    assert report["growth_mib"] == 25.0
    assert report["per_process"][0] == {"pid": 1, "command": "?", "steady_start_mib": 150.0,
                                        "end_mib": 175.0, "growth_mib": 25.0}
    assert report["slope_mib_per_min"] > 0


@contextlib.contextmanager
def failing_server(hang: bool = False):
    """A loopback server that answers every chat request 500 (or, with hang, not
    at all until it shuts down) and reports a busy engine."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"foveal:kv_cache_usage_perc 0.25\nfoveal:num_requests_running 1.0\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if hang:
                release.wait(30)
            body = b'{"error": {"message": "boom"}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        thread.join()


def test_soak_exits_1_on_5xx_and_a_server_that_stays_busy(tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    with failing_server() as url:
        rc = soak_main(["--base-url", url, "--served-model", "m", "--requests", "12",
                        "--concurrency", "3", "--cancel-share", "0", "--settle", "1",
                        "--json", str(report_path)])
    assert rc == 1
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert summary["results"] == {"unexpected": 12}  # good and bad requests alike
    assert all(" answered HTTP 500" in item["problem"] for item in summary["unexpected"])
    assert report["idle"]["busy"] == {"foveal:kv_cache_usage_perc": 0.25,
                                      "foveal:num_requests_running": 1.0}
    assert "foveal:encoder_cache_held_entries" in report["idle"]["missing"]
    assert report["rss"] is None  # no --server-pid
    assert "PROBLEM: not idle" in capsys.readouterr().out


def test_soak_reports_a_request_left_unanswered_as_a_hang(tmp_path):
    report_path = tmp_path / "soak.json"
    with failing_server(hang=True) as url:
        rc = soak_main(["--base-url", url, "--served-model", "m", "--requests", "2",
                        "--bad-share", "0", "--cancel-share", "0", "--request-timeout", "0.5",
                        "--settle", "0", "--json", str(report_path)])
    assert rc == 1
    unexpected = json.loads(report_path.read_text())["summary"]["unexpected"]
    assert [item["problem"] for item in unexpected] == [
        "hang: no answer within 0.5 s (--request-timeout)"] * 2


def test_short_soak_of_the_tiny_server_serves_every_kind_and_returns_to_idle(
        tiny_checkpoints, tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    rc = soak_main(["--model", tiny_checkpoints("tiny-qwen2-vl"), "--server-args",
                    TINY_SERVER_FLAGS, "--image-limit", "2", "--requests", "300",
                    "--minutes", "0.75", "--concurrency", "4", "--seed", "1",
                    "--distinct-media", "4", "--cancel-share", "0.15", "--bad-share", "0.2",
                    "--settle", "20", "--warmup-s", "5", "--json", str(report_path)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert report["problems"] == [] and rc == 0, out
    # Requests 0-28 of seed 1 hold every good kind (not cancelled) and 3 bad ones.
    assert summary["num_requests"] >= 40
    by_kind = summary["by_kind"]
    for kind in GOOD_KINDS:
        assert by_kind[kind].get("ok", 0) >= 1, by_kind
    bad_kinds = [kind for kind in by_kind if kind in BAD_KINDS]
    assert len(bad_kinds) >= 3
    for kind in bad_kinds:
        assert set(by_kind[kind]) == {"4xx"}, by_kind
    assert "unexpected" not in summary["results"]
    assert all(400 <= int(key.rsplit(" ", 1)[1]) < 500
               for key in summary["errors_by_kind_and_status"])
    idle = report["idle"]
    assert idle["idle"] and not any(idle["gauges"].values())
    rss = report["rss"]
    assert rss["num_processes"] >= 3  # the API process, the engine core, a preprocessing worker
    assert rss["steady_start_mib"] > 0 and abs(rss["growth_mib"]) < 4096
    assert "server RSS" in out and "no problems" in out
