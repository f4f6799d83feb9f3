"""The vLLM worker's bookkeeping of pulls that ended ``failed_blocks_held`` (a UCX read the
agent could not stop): a request is reported (a failed load) only once every one of its
blocks came back from ``DecodeAgent.poll_reclaimed``, whatever the order and grouping. The
reports and reclaim records here have the shape the binding gives them."""

from __future__ import annotations

import pytest

pytest.importorskip("kvxfer._kvxfer", reason="the kvxfer extension is not built")
from kvxfer.vllm.common import FORGET_AFTER  # noqa: E402
from kvxfer.vllm.worker import HeldLoads  # noqa: E402


def held_report(parent: str, child: int, blocks):
    return {
        "outcome": "failed_blocks_held",
        "parent_request_id": parent,
        "child_index": child,
        "remote_request_id": f"{child}_{parent}",
        "local_blocks": blocks,
    }


def test_a_request_is_ready_only_once_every_block_came_back():
    held = HeldLoads()
    held.hold("dec-0", held_report("P", 0, [4, 5, 6]), now=0.0)
    assert held and held.ready(1.0) == []
    held.reclaimed("P", [4, 5], now=2.0)
    assert held.ready(2.0) == [], "block 6 may still be written"
    held.reclaimed("P", [6], now=3.0)
    assert [rid for rid, _ in held.ready(3.0)] == ["dec-0"]
    assert not held


def test_blocks_reclaimed_before_the_report_are_kept_for_it():
    held = HeldLoads()
    held.reclaimed("P", [7, 8], now=0.0)
    held.hold("dec-1", held_report("P", 1, [7, 8]), now=1.0)
    assert [rid for rid, _ in held.ready(1.0)] == ["dec-1"]


def test_one_pulls_blocks_never_release_a_sibling_still_held():
    held = HeldLoads()
    held.hold("dec-0", held_report("P", 0, [1, 2]), now=0.0)
    # A sibling's blocks come back (its report is a step late): nothing of dec-0's is.
    held.reclaimed("P", [3, 4], now=1.0)
    assert held.ready(1.0) == []
    held.hold("dec-1", held_report("P", 1, [3, 4]), now=2.0)
    assert [rid for rid, _ in held.ready(2.0)] == ["dec-1"]
    assert len(held) == 1
    held.reclaimed("P", [1, 2], now=3.0)
    assert [rid for rid, _ in held.ready(3.0)] == ["dec-0"]


def test_another_parents_blocks_of_the_same_ids_do_not_count():
    held = HeldLoads()
    held.hold("dec-0", held_report("P", 0, [1]), now=0.0)
    held.reclaimed("Q", [1], now=1.0)
    assert held.ready(1.0) == []


def test_groups_are_told_apart():
    """A hybrid cache: block 3 of group 1 is not block 3 of group 0."""
    held = HeldLoads()
    held.hold("dec-0", held_report("P", 0, [[3], [3, 9]]), now=0.0)
    held.reclaimed("P", [[3, 9], []], now=1.0)
    assert held.ready(1.0) == []
    held.reclaimed("P", [[], [3, 9]], now=2.0)
    assert [rid for rid, _ in held.ready(2.0)] == ["dec-0"]


def test_unclaimed_blocks_are_forgotten_and_a_stuck_request_keeps_waiting():
    held = HeldLoads()
    held.reclaimed("P", [1], now=0.0)
    assert held.ready(FORGET_AFTER + 1) == []
    assert not held, "reclaimed blocks no request claimed are forgotten"
    held.hold("dec-0", held_report("P", 0, [2]), now=0.0)
    assert held.ready(10 * FORGET_AFTER) == [] and len(held) == 1
