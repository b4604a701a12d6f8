"""The process's memory allocator: tcmalloc where it is installed.

glibc's malloc serves a block larger than its mmap threshold (32 MiB at most) with a fresh
mapping and unmaps it on free, so every large activation a forward pass allocates (a
batch of images through the vision tower: 4,096 patches x 3,072 fp32 is 50 MB) comes back
as new pages, each zeroed by a page fault. tcmalloc keeps freed pages for the next
allocation. On the 32-request throughput workload (docs/benchmarks.md, "Memory allocator")
that cut the vision tower's time by a fifth, the run's by 16-19% and the kernel's CPU time
from ~20 s to 3-4 s. jemalloc, with its default decay, measured slower than glibc there,
so it is not used.

An allocator is chosen when a process starts (LD_PRELOAD), so the `foveal` command
re-executes itself once with tcmalloc preloaded (`reexec_with_allocator`); the processes it
starts (tensor-parallel ranks, disaggregated workers) inherit the setting. Python programs
that import foveal keep their own allocator: `LD_PRELOAD=$(python -c "from foveal.allocator
import find_tcmalloc; print(find_tcmalloc())") python app.py` gives them tcmalloc too.

FOVEAL_MALLOC: auto (tcmalloc if installed; the default) | tcmalloc (an error if it is
missing) | system (the C library's malloc).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from foveal.errors import ConfigError

ENV = "FOVEAL_MALLOC"
_MARKER = "FOVEAL_MALLOC_PRELOADED"  # set on the re-executed process: never twice
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                 "/usr/local/lib", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
_KNOWN = {"tcmalloc": "libtcmalloc", "jemalloc": "libjemalloc"}


def requested() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "tcmalloc", "system"):
        raise ConfigError(f"{ENV} must be auto, tcmalloc or system, got {value!r}")
    return value


def find_tcmalloc(dirs: tuple[str, ...] = _LIBRARY_DIRS) -> Path | None:
    """The installed tcmalloc shared library (Debian: libtcmalloc-minimal4), or None."""
    for directory in dirs:
        for name in _TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return path
    return None


def loaded_allocator(maps: str | None = None) -> str:
    """tcmalloc | jemalloc | system: which malloc this process runs on (its mapped
    libraries; `maps` is /proc/self/maps' text, read when not given)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "system"
    for name, soname in _KNOWN.items():
        if soname in maps:
            return name
    return "system"


def preload_environment(environ: dict[str, str], library: Path) -> dict[str, str]:
    """environ with `library` first in LD_PRELOAD and the re-exec marker set."""
    preload = [str(library)] + [entry for entry in environ.get("LD_PRELOAD", "").split()
                                if entry and entry != str(library)]
    return {**environ, "LD_PRELOAD": " ".join(preload), _MARKER: str(library)}


def reexec_command(argv: list[str], environ: dict[str, str], current: str,
                   library: Path | None, choice: str, platform: str = sys.platform
                   ) -> tuple[list[str], dict[str, str]] | None:
    """(argv, environment) to run this command (argv: sys.argv) again on tcmalloc, or
    None to go on as we are: already on tcmalloc or jemalloc, already re-executed,
    system malloc asked for, not Linux, or tcmalloc not installed under auto (under
    `tcmalloc`: an error). The same script runs again (the `foveal` entry point), or
    `-m foveal` when that is how it was started."""
    if choice == "system" or current != "system" or _MARKER in environ:
        return None
    if library is None:
        if choice == "tcmalloc":
            raise ConfigError(f"{ENV}=tcmalloc but no tcmalloc library was found in "
                              f"{', '.join(_LIBRARY_DIRS)} (Debian: apt-get install "
                              f"libtcmalloc-minimal4)")
        return None
    if not platform.startswith("linux"):
        return None
    script, arguments = argv[0], argv[1:]
    start = (["-m", "foveal"] if Path(script).name == "__main__.py" or not Path(script).is_file()
             else [script])
    return [sys.executable, *start, *arguments], preload_environment(environ, library)


def reexec_with_allocator() -> None:
    """Replace this process by the same `foveal` command on tcmalloc, where reexec_command
    says so; returns only when the process goes on as it is."""
    command = reexec_command(list(sys.argv), dict(os.environ), loaded_allocator(),
                             find_tcmalloc(), requested())
    if command is None:
        return
    argv, environ = command
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, environ)


def describe() -> str:
    """For the start-up log line: the allocator and, on glibc, how to change it."""
    current = loaded_allocator()
    if current != "system":
        return current
    if find_tcmalloc() is None:
        return "system malloc (install libtcmalloc-minimal4 for faster large allocations)"
    return f"system malloc ({ENV}=system or not started by the foveal command)"
