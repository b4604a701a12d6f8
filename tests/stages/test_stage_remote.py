"""Remote stages over loopback: `foveal stage serve` processes and a round-robin client."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from stage_fakes import FAKE_TARGET, FakeItem

from foveal.errors import MediaError
from foveal.stages import register_stage
from foveal.stages.config import StagesConfig
from foveal.stages.service import StagePools

register_stage("fake", FAKE_TARGET)
HERE = pathlib.Path(__file__).parent
# `foveal stage ...` with only the stage subcommand registered
STAGE_CLI = ("import argparse, sys; from foveal.stages import cli; parser = argparse.ArgumentParser(); "
             "cli.register(parser.add_subparsers(required=True)); args = parser.parse_args(); "
             "sys.exit(args.func(args))")


def _serve_fake(workers: int = 1) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", STAGE_CLI, "stage", "serve", "--stage", "fake",
         "--target", FAKE_TARGET, "--port", "0", "--workers", str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    assert "serving on http://" in line, process.stderr.read()
    return process, line.rsplit(" ", 1)[1].strip()


@pytest.fixture
def servers():
    started: list[subprocess.Popen] = []

    def start(workers: int = 1) -> tuple[subprocess.Popen, str]:
        process, url = _serve_fake(workers)
        started.append(process)
        return process, url

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_remote_stage_serves_requests_over_loopback(servers):
    _, url = servers()
    with StagePools(StagesConfig(endpoints={"fake": (url,)})) as stages:
        result = stages.run_sync("fake", FakeItem(b"over http"))
        assert result.text == "over http" and result.pid != os.getpid()
        with pytest.raises(MediaError, match="fake media b'bad' is invalid"):
            stages.run_sync("fake", FakeItem(b"bad", invalid=True))
        assert stages.get_metrics()['foveal:stage_items_total{stage="fake"}'] == 1


def test_one_of_two_endpoints_going_down_does_not_fail_requests(servers):
    doomed, doomed_url = servers(workers=2)
    _, survivor_url = servers(workers=2)
    config = StagesConfig(endpoints={"fake": (doomed_url, survivor_url)}, health_interval_s=0.5)
    with StagePools(config) as stages:
        in_flight = [stages.submit("fake", FakeItem(f"slow{i}".encode(), sleep_s=1.5)) for i in range(4)]
        time.sleep(0.5)  # both servers hold items now
        doomed.send_signal(signal.SIGKILL)
        assert [f.result(timeout=60).text for f in in_flight] == [f"slow{i}" for i in range(4)]
        after = [stages.submit("fake", FakeItem(f"after{i}".encode())) for i in range(4)]
        assert [f.result(timeout=60).text for f in after] == [f"after{i}" for i in range(4)]
        assert stages.get_metrics()['foveal:stage_workers{stage="fake"}'] == 1  # the dead one is skipped
