"""Resident memory of a process and all its descendants, sampled over time
(for `foveal bench soak`): psutil when installed, else /proc (Linux)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

_MIB = float(1 << 20)


def process_tree_rss(root_pid: int) -> dict[int, int]:
    """pid -> RSS bytes of root_pid and every descendant alive now ({} if root is gone)."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(root_pid)
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    rss = {}
    for process in processes:
        try:
            rss[process.pid] = process.memory_info().rss
        except psutil.NoSuchProcess:
            pass  # exited between the listing and the read
    return rss


def _proc_tree_rss(root_pid: int) -> dict[int, int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    rss, pending = {}, [root_pid]
    while pending:
        pid = pending.pop()
        value = _vm_rss(pid)
        if value is not None:
            rss[pid] = value
            pending += children.get(pid, [])
    return rss


def _vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return 0  # a zombie has no VmRSS line


def command_of(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return text.strip()[:100]


class RssSampler:
    """Samples the tree's RSS every interval_s on a thread, from start() to stop()."""

    def __init__(self, root_pid: int, interval_s: float) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self.samples: list[tuple[float, dict[int, int]]] = []  # (seconds since start, rss)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foveal-soak-rss", daemon=True)
        self._start = time.monotonic()
        self._commands: dict[int, str] = {}

    def start(self) -> RssSampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def now(self) -> float:
        return time.monotonic() - self._start

    def sample(self) -> None:
        rss = process_tree_rss(self.root_pid)
        for pid in rss:
            if pid not in self._commands:
                self._commands[pid] = command_of(pid)
        self.samples.append((self.now(), rss))

    def latest_mib(self) -> float | None:
        return sum(self.samples[-1][1].values()) / _MIB if self.samples else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def report(self, steady_from_s: float, end_of_load_s: float) -> dict | None:
        """Totals over time and the growth from the first sample at or after
        steady_from_s to the last one, overall and per process."""
        if not self.samples:
            return None
        times = np.array([t for t, _ in self.samples])
        totals = np.array([sum(rss.values()) for _, rss in self.samples]) / _MIB
        steady = int(np.searchsorted(times, steady_from_s))
        steady = min(steady, len(times) - 1)
        load_end = max(0, int(np.searchsorted(times, end_of_load_s, side="right")) - 1)
        slope = (float(np.polyfit(times[steady:], totals[steady:], 1)[0]) * 60
                 if len(times) - steady >= 3 else 0.0)
        first, last = self.samples[steady][1], self.samples[-1][1]
        per_process = [{"pid": pid, "command": self._commands.get(pid, "?"),
                        "steady_start_mib": first.get(pid, 0) / _MIB,
                        "end_mib": last.get(pid, 0) / _MIB,
                        "growth_mib": (last.get(pid, 0) - first.get(pid, 0)) / _MIB}
                       for pid in sorted(set(first) | set(last))]
        return {"source": "psutil" if _has_psutil() else "/proc",
                "num_processes": len(last), "steady_from_s": float(times[steady]),
                "steady_start_mib": float(totals[steady]),
                "end_of_load_mib": float(totals[load_end]), "end_mib": float(totals[-1]),
                "peak_mib": float(totals.max()),
                "growth_mib": float(totals[-1] - totals[steady]), "slope_mib_per_min": slope,
                "per_process": sorted(per_process, key=lambda p: -abs(p["growth_mib"])),
                "series": [[round(float(t), 2), round(float(m), 1)]
                           for t, m in zip(times, totals)]}


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def plot_rss(report: dict, end_of_load_s: float, path: Path) -> None:
    """RSS of the server's process tree over time, the steady start and the load's end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, mib = zip(*report["series"])
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.plot(times, mib, label="server process tree")
    axes.axvline(report["steady_from_s"], color="gray", linestyle=":", label="steady from")
    axes.axvline(end_of_load_s, color="gray", linestyle="--", label="load ends")
    axes.set_xlabel("seconds since the load started")
    axes.set_ylabel("RSS (MiB)")
    axes.set_title(f"foveal bench soak: RSS growth {report['growth_mib']:+.0f} MiB")
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
