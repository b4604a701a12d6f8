"""Start `foveal serve` / `foveal router` servers as processes and wait for them.

Each server runs in its own session, so killing it (SIGKILL to the process
group) takes its engine core and preprocessing processes along; `stop` sends
SIGINT first, as Ctrl-C would, so a worker leaves its router's pool. Used by
the Ray deployment (one per actor), the disaggregation benchmark and tests.
Torch-free.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from foveal.executor.ranks import free_port


class ServerProcess:
    """`python -m foveal ARGS --host HOST --port PORT`, its output in log_path.

    cpus: the cores it (and every process it starts) may run on; threads:
    OMP_NUM_THREADS for its torch work (default: the number of cpus given).
    """

    def __init__(self, args: list[str], log_path: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, cpus: set[int] | None = None,
                 threads: int | None = None, env: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        environment = {**os.environ, **(env or {})}
        if cpus or threads:
            environment["OMP_NUM_THREADS"] = str(threads or len(cpus))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "foveal", *args, "--host", host, "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environment,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait_ready(self, deadline: float) -> None:
        """Until GET /health answers 200; RuntimeError (with the log's tail) if
        the process exits or time.monotonic() passes deadline first."""
        state = poll_health(self.url, deadline, self.alive)
        if state == "exited":
            raise RuntimeError(f"{self.url} exited ({self.process.returncode}): {self.log()}")
        if state == "timeout":
            raise RuntimeError(f"{self.url} did not become healthy in time: {self.log()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT to the process group, SIGKILL if it has not exited in timeout_s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


def poll_health(url: str, deadline: float, alive) -> str:
    """Poll url/health every 0.5 s: "healthy" once it answers 200, "exited" as
    soon as alive() is false, "timeout" when time.monotonic() passes deadline."""
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if not alive():
                return "exited"
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return "healthy"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    return "timeout"


def start_all(servers: list[ServerProcess], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        server.wait_ready(deadline)


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics: each sample by its full key (labels included), and
    each metric name summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        if name != key:
            values[key] = float(value)
        values[name] = values.get(name, 0.0) + float(value)
    return values


def metric(url: str, name: str) -> float:
    """One metric of a server's /metrics, summed over its labels (0 if absent)."""
    return scrape_metrics(url).get(name, 0.0)
