"""The benchmark's /proc readers over a process tree whose children come and go."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from carryover.bench import proctree


@pytest.fixture
def gone_pid() -> int:
    """The pid of a child that has exited and been reaped: /proc no longer has it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid


def test_a_descendant_that_exits_between_listing_and_reading_is_left_out(
    monkeypatch: pytest.MonkeyPatch, gone_pid: int
) -> None:
    # A router's workers start and end helpers (a multiprocessing tracker, say): the tree is
    # listed first and read after, so a listed child may be gone by the time it is read.
    me = os.getpid()
    monkeypatch.setattr(proctree, "tree", lambda pid: [me, gone_pid])
    alone = proctree.rss_mb(me)
    assert alone > 0
    assert proctree.cpu_seconds(me) > 0
    assert proctree.rss_mb(me, peak=True) >= alone


def test_the_process_asked_about_must_exist(gone_pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        proctree.rss_mb(gone_pid)
    with pytest.raises(ProcessLookupError):
        proctree.cpu_seconds(gone_pid)


def test_a_child_gone_while_the_tree_is_walked_is_left_out(
    monkeypatch: pytest.MonkeyPatch, gone_pid: int
) -> None:
    me = os.getpid()
    real_children = proctree._children
    monkeypatch.setattr(
        proctree, "_children", lambda pid: [gone_pid] if pid == me else real_children(pid)
    )
    assert proctree.tree(me) == [me]
