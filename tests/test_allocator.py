"""The allocator choice of mt-train (mt.allocator): when it restarts with jemalloc preloaded,
with what environment, and that the restart really happens (same PID) where jemalloc exists."""

import os
import subprocess
import sys

import pytest

from mt.allocator import JEMALLOC_CONF, find_jemalloc, jemalloc_restart

LINUX = sys.platform.startswith("linux")
found = lambda: "libjemalloc.so.2"  # noqa: E731
missing = lambda: None  # noqa: E731


@pytest.mark.skipif(not LINUX, reason="the restart is Linux only")
def test_auto_preloads_jemalloc_where_found_keeping_freed_pages():
    env = jemalloc_restart({"PATH": "/bin"}, find=found)
    assert env["LD_PRELOAD"] == "libjemalloc.so.2"
    assert env["MALLOC_CONF"] == JEMALLOC_CONF == "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    assert env["MT_MALLOC_RESTARTED"] == "1" and env["PATH"] == "/bin"


@pytest.mark.skipif(not LINUX, reason="the restart is Linux only")
def test_a_users_preload_and_malloc_conf_are_kept():
    env = jemalloc_restart(
        {"LD_PRELOAD": "libfoo.so", "MALLOC_CONF": "narenas:2", "MT_MALLOC": "JEMALLOC"}, found
    )
    assert env["LD_PRELOAD"] == "libjemalloc.so.2:libfoo.so"
    assert env["MALLOC_CONF"] == "narenas:2"


@pytest.mark.parametrize(
    "environ, find",
    [
        ({"MT_MALLOC": "glibc"}, found),  # turned off
        ({"MT_MALLOC_RESTARTED": "1"}, found),  # restarted already: never twice
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, found),  # the user preloads it
        ({}, missing),  # auto, and the system has none
        ({"MT_MALLOC": ""}, missing),
    ],
)
def test_stays_where_it_should(environ, find):
    assert jemalloc_restart(environ, find=find) is None


def test_required_but_missing_or_misspelled_is_a_clear_error():
    with pytest.raises(ValueError, match=r"MT_MALLOC=jemalloc: .*apt install libjemalloc2"):
        jemalloc_restart({"MT_MALLOC": "jemalloc"}, find=missing)
    with pytest.raises(ValueError, match=r"MT_MALLOC='tcmalloc': expected auto, glibc or jem"):
        jemalloc_restart({"MT_MALLOC": "tcmalloc"}, find=found)


def test_mt_train_names_a_bad_setting_in_one_line():
    env = {**os.environ, "MT_MALLOC": "tcmalloc"}
    r = subprocess.run([sys.executable, "-m", "mt", "train"], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "mt-train: error: MT_MALLOC='tcmalloc': expected auto, glibc or jemalloc"
    )


SCRIPT = """
import os, sys
from mt.allocator import jemalloc_loaded, preload_jemalloc
print("start", os.getpid(), flush=True)
preload_jemalloc()
print("run", os.getpid(), jemalloc_loaded(), os.environ.get("MALLOC_CONF"), flush=True)
"""


@pytest.mark.skipif(not LINUX, reason="the restart is Linux only")
@pytest.mark.parametrize("choice", ["auto", "glibc"])
def test_the_restart_really_preloads_jemalloc_in_the_same_process(choice):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MT_MALLOC", "MALLOC_CONF"))}
    env["LD_PRELOAD"] = ""
    r = subprocess.run([sys.executable, "-c", SCRIPT], env={**env, "MT_MALLOC": choice},
                       capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    lines = [x.split() for x in r.stdout.splitlines()]
    restarted = choice == "auto" and find_jemalloc() is not None
    starts = [x for x in lines if x[0] == "start"]
    assert len(starts) == (2 if restarted else 1)
    assert {x[1] for x in starts} == {lines[-1][1]}  # one PID throughout
    assert lines[-1][0] == "run" and len(lines) == len(starts) + 1
    assert lines[-1][2] == str(restarted)
    assert lines[-1][3] == (JEMALLOC_CONF if restarted else "None")
