"""The allocator of an mt command (mt.allocator): which one MT_ALLOCATOR picks, which command lines
may be executed again, and the re-execution itself, with a stand-in library everywhere and with
jemalloc where it is installed."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mt.allocator import (
    JEMALLOC_CONF,
    active_allocator,
    allocator_choice,
    find_allocator,
    launched_as_command,
)

ROOT = Path(__file__).resolve().parents[1]
JE, TC = "/x/libjemalloc.so.2", "/x/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize(
    "setting, found, expected",
    [
        ("auto", {"jemalloc": JE, "tcmalloc": TC}, ("tcmalloc", TC)),  # tcmalloc first
        ("auto", {"jemalloc": JE, "tcmalloc": None}, ("jemalloc", JE)),
        ("auto", {"jemalloc": None, "tcmalloc": None}, ("system", None)),
        ("", {"jemalloc": None, "tcmalloc": TC}, ("tcmalloc", TC)),  # unset reads as auto
        ("system", {"jemalloc": JE, "tcmalloc": TC}, ("system", None)),
        ("jemalloc", {"jemalloc": JE, "tcmalloc": None}, ("jemalloc", JE)),
        ("TCmalloc", {"jemalloc": JE, "tcmalloc": TC}, ("tcmalloc", TC)),
    ],
)
def test_allocator_choice(setting, found, expected):
    assert allocator_choice(setting, found) == expected


def test_allocator_choice_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"MT_ALLOCATOR=jemalloc: libjemalloc is not installed"):
        allocator_choice("jemalloc", {"jemalloc": None, "tcmalloc": TC})
    with pytest.raises(ValueError, match=r"MT_ALLOCATOR='mimalloc': expected one of"):
        allocator_choice("mimalloc", {"jemalloc": JE, "tcmalloc": TC})


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "-m", "mt", "train"], True),
        (["/v/bin/python3", "-u", "-m", "mt", "train", "x=1"], True),  # as torchrun starts ranks
        (["/v/bin/python", "/v/bin/mt-train", "model=base"], True),  # a console script
        (["python", "-X", "dev", "-m", "mt", "translate"], True),
        (["python", "-m", "pytest", "tests"], False),
        (["/v/bin/python", "/v/bin/pytest", "-x"], False),
        (["python", "-c", "from mt.cli import train_main; train_main()"], False),
        (["python", "scripts/bench.py", "train"], False),
        (["python", "-m", "mt.cli"], False),
        (["python"], False),
    ],
)
def test_only_mt_commands_are_executed_again(argv, expected):
    assert launched_as_command(argv) is expected


def test_this_process_runs_the_system_allocator_unless_preloaded():
    preloaded = os.environ.get("LD_PRELOAD", "")
    expected = next((n for n in ("jemalloc", "tcmalloc") if n in preloaded), "system")
    assert active_allocator() == expected


SCRIPT = """
import os, sys
import mt.allocator as a
print("run", os.getpid(), os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_CONF", ""),
      a.active_allocator(), flush=True)
if {fake!r}:
    a.find_allocator = lambda name: {fake!r} if name == "jemalloc" else None  # auto: jemalloc
a.preload_allocator([sys.executable, *sys.argv])
print("done", os.getpid(), flush=True)
"""


def _run(tmp_path: Path, fake: str | None, **env: str) -> list[list[str]]:
    script = tmp_path / "mt-allocator-check"
    script.write_text(SCRIPT.format(fake=fake))
    mine = ("LD_PRELOAD", "MALLOC_CONF", "MT_ALLOCATOR", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD")
    environ = {k: v for k, v in os.environ.items() if k not in mine}
    environ.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=environ, timeout=60, check=True).stdout  # fmt: skip
    return [line.split(" ") for line in out.splitlines()]


def _libm() -> str | None:
    name = ctypes.util.find_library("m")  # e.g. libm.so.6
    dirs = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")  # fmt: skip
    paths = [Path(d) / name for d in dirs] if name else []
    return next((str(p) for p in paths if p.is_file()), None)


def test_the_command_is_executed_again_once_with_the_library_preloaded(tmp_path):
    # A stand-in library that loads anywhere but does not replace malloc: the command runs
    # again in the same process with it preloaded and jemalloc's settings, once, not forever.
    path = _libm()
    if path is None or not sys.platform.startswith("linux"):
        pytest.skip("no libm to stand in for an allocator")
    lines = _run(tmp_path, path)
    assert [line[0] for line in lines] == ["run", "run", "done"]
    first, second = lines[0], lines[1]
    assert first[1] == second[1] == lines[2][1]  # executed again in place: the same PID
    assert first[2] == "" and second[2] == path
    assert second[3] == JEMALLOC_CONF
    # MT_ALLOCATOR=system: nothing is executed again
    assert [line[0] for line in _run(tmp_path, path, MT_ALLOCATOR="system")] == ["run", "done"]


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc"])
def test_the_allocator_serves_an_mt_command_where_installed(tmp_path, name):
    if find_allocator(name) is None:
        pytest.skip(f"{name} is not installed")
    lines = _run(tmp_path, None, MT_ALLOCATOR=name)
    assert [line[0] for line in lines] == ["run", "run", "done"]
    assert lines[0][4] == "system" and lines[1][4] == name
    assert _run(tmp_path, None, MT_ALLOCATOR="system")[0][4] == "system"


def test_a_bad_setting_stops_the_command_with_one_line(tmp_path):
    env = dict(os.environ, MT_ALLOCATOR="mimalloc", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "mt", "prepare"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "mt-prepare: MT_ALLOCATOR='mimalloc': expected one of auto, tcmalloc, jemalloc, system"
    )


HEAP_SCRIPT = """
import ctypes, sys
from mt.allocator import active_allocator, heap_in_use
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
base = heap_in_use()
blocks = [libc.malloc(1 << 20) for _ in range(64)]  # 64 MB, held
held = heap_in_use()
for b in blocks:
    libc.free(b)
print(active_allocator(), base, held, heap_in_use())
"""


@pytest.mark.parametrize("name", ["system", "tcmalloc", "jemalloc"])
def test_heap_in_use_counts_what_the_program_holds(name):
    """64 MB taken from malloc raise the allocator's count of memory in use by 64 MB, and
    freeing them takes it back down, whatever serves malloc (here: preloaded by hand)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if name != "system":
        path = find_allocator(name)
        if path is None:
            pytest.skip(f"{name} is not installed")
        env["LD_PRELOAD"] = path
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux allocators")
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout.split()  # fmt: skip
    assert out[0] == name
    base, held, freed = (int(x) for x in out[1:])
    assert 62 << 20 <= held - base <= 66 << 20  # (what the interpreter did meanwhile)
    assert freed - base < 2 << 20
