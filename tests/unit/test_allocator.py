"""The `foveal` command moves onto tcmalloc where it is installed (foveal/allocator.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foveal import allocator
from foveal.errors import ConfigError

LIB = Path("/opt/lib/libtcmalloc_minimal.so.4")


def test_reexec_command_preloads_tcmalloc_first_and_marks_the_environment(tmp_path):
    script = tmp_path / "foveal"  # the console script
    script.write_text("#!python\n")
    argv, environ = allocator.reexec_command(
        [str(script), "bench", "throughput", "--model", "m"],
        {"LD_PRELOAD": "/x/libfoo.so", "HOME": "/h"}, "system", LIB, "auto", platform="linux")
    assert argv == [sys.executable, str(script), "bench", "throughput", "--model", "m"]
    assert environ["LD_PRELOAD"] == f"{LIB} /x/libfoo.so"
    assert environ["HOME"] == "/h"
    assert environ[allocator._MARKER] == str(LIB)
    # started as `python -m foveal`: runs the package again, not its __main__.py as a script
    argv, _ = allocator.reexec_command(["/site/foveal/__main__.py", "env"], {}, "system", LIB,
                                       "auto", platform="linux")
    assert argv == [sys.executable, "-m", "foveal", "env"]


@pytest.mark.parametrize("current, environ, library, choice, platform", [
    ("system", {}, LIB, "system", "linux"),  # asked for the C library's malloc
    ("tcmalloc", {}, LIB, "auto", "linux"),  # already preloaded by the user
    ("jemalloc", {}, LIB, "auto", "linux"),  # the user's choice stays
    ("system", {allocator._MARKER: str(LIB)}, LIB, "auto", "linux"),  # re-executed once
    ("system", {}, None, "auto", "linux"),  # not installed
    ("system", {}, LIB, "auto", "darwin"),  # LD_PRELOAD is Linux's
])
def test_reexec_command_goes_on_as_it_is(current, environ, library, choice, platform):
    assert allocator.reexec_command(["foveal", "env"], environ, current, library, choice,
                                    platform=platform) is None


def test_asking_for_tcmalloc_without_the_library_is_a_config_error():
    with pytest.raises(ConfigError, match="libtcmalloc-minimal4"):
        allocator.reexec_command(["foveal", "env"], {}, "system", None, "tcmalloc",
                                 platform="linux")


def test_requested_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "mimalloc")
    with pytest.raises(ConfigError, match="auto, tcmalloc or system"):
        allocator.requested()
    monkeypatch.setenv(allocator.ENV, " TCMalloc ")
    assert allocator.requested() == "tcmalloc"
    monkeypatch.delenv(allocator.ENV)
    assert allocator.requested() == "auto"


def test_loaded_allocator_reads_the_mapped_libraries():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n")
    assert allocator.loaded_allocator(maps) == "tcmalloc"
    assert allocator.loaded_allocator(maps.replace("tcmalloc_minimal", "jemalloc")) == "jemalloc"
    assert allocator.loaded_allocator(maps.splitlines()[0]) == "system"


def test_find_tcmalloc_looks_in_the_given_folders(tmp_path):
    assert allocator.find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc((str(tmp_path),)) == tmp_path / "libtcmalloc.so.4"
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build first
    assert allocator.find_tcmalloc((str(tmp_path),)) == tmp_path / "libtcmalloc_minimal.so.4"


# `python -m foveal`, and the console script pip installed beside this interpreter
COMMANDS = {"module": [sys.executable, "-m", "foveal"],
            "script": [str(Path(sys.executable).with_name("foveal"))]}


def _foveal_env(command: list[str], **extra: str) -> dict:
    environ = {key: value for key, value in os.environ.items()
               if key not in ("LD_PRELOAD", allocator._MARKER, allocator.ENV)}
    environ.update(extra)
    result = subprocess.run([*command, "env", "--json"], env=environ,
                            capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout)


@pytest.mark.parametrize("how", sorted(COMMANDS))
def test_the_foveal_command_runs_on_tcmalloc_where_it_is_installed(how):
    """End to end: the command re-executes itself with tcmalloc preloaded (CI installs
    libtcmalloc-minimal4); FOVEAL_MALLOC=system keeps the C library's malloc."""
    command = COMMANDS[how]
    assert Path(command[0]).is_file(), f"{command[0]}: the package is not installed (pip install -e .)"
    expected = "tcmalloc" if allocator.find_tcmalloc() is not None else "system"
    assert _foveal_env(command)["allocator"] == expected
    info = _foveal_env(command, FOVEAL_MALLOC="system")
    assert info["allocator"] == "system"
    assert "FOVEAL_MALLOC=system" in info["allocator_detail"] or expected == "system"


def test_a_bad_foveal_malloc_value_is_a_clear_error():
    environ = {**os.environ, allocator.ENV: "mimalloc"}
    environ.pop(allocator._MARKER, None)
    result = subprocess.run([sys.executable, "-m", "foveal", "env"], env=environ,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "FOVEAL_MALLOC must be auto, tcmalloc or system" in result.stderr
