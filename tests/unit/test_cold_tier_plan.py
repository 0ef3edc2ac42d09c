"""The cold tier's pure decisions (memory/plans/spill.py) with scripted inputs."""

from __future__ import annotations

from memory.plans import spill
from memory.plans.spill import SpillInputs, decide_spill

MiB = 1 << 20


def inputs(**kw) -> SpillInputs:
    base = dict(entry_bytes=10 * MiB, prefix_tokens=1000, spillable=True, min_prefix_tokens=64,
                tier_budget_bytes=100 * MiB, tier_bytes=0, pending_bytes=0, written_last_hour=0,
                write_budget_per_hour=1000 * MiB, queue_entries=0, queue_limit_entries=4,
                queue_bytes=0, queue_limit_bytes=64 * MiB)
    base.update(kw)
    return SpillInputs(**base)


def test_writes_when_every_budget_allows():
    assert decide_spill(inputs()) == spill.SpillDecision(True)


def test_each_refusal_has_its_reason():
    cases = {
        spill.DROP_NOT_SPILLABLE: inputs(spillable=False),
        spill.DROP_TOO_SHORT: inputs(prefix_tokens=63),
        spill.DROP_EXCEEDS_TIER: inputs(entry_bytes=101 * MiB),
        spill.DROP_WRITE_BUDGET: inputs(written_last_hour=995 * MiB),
        spill.DROP_QUEUE_FULL: inputs(queue_entries=4),
        spill.DROP_DISK_FULL: inputs(free_disk_bytes=20 * MiB, min_free_bytes=15 * MiB),
    }
    for reason, i in cases.items():
        d = decide_spill(i)
        assert (d.write, d.drop_reason) == (False, reason), reason


def test_queue_bytes_bound_the_queue_too():
    assert decide_spill(inputs(queue_bytes=60 * MiB)).drop_reason == spill.DROP_QUEUE_FULL
    # At write time the entry is no longer queued: the queue does not refuse it.
    assert decide_spill(inputs(queue_entries=4, queued=True, pending_bytes=10 * MiB)).write


def test_lru_collects_oldest_first_to_fit_the_budget_pending_included():
    lru = [("a", 30 * MiB), ("b", 30 * MiB), ("c", 30 * MiB)]
    d = decide_spill(inputs(tier_bytes=95 * MiB, lru=lru))
    assert d.write and d.collect == ("a",) and d.collect_bytes == 30 * MiB
    # 15 MiB of other writes pending need room as well.
    d = decide_spill(inputs(tier_bytes=90 * MiB, pending_bytes=15 * MiB, lru=lru))
    assert d.collect == ("a",)
    d = decide_spill(inputs(tier_bytes=90 * MiB, pending_bytes=35 * MiB, lru=lru))
    assert d.collect == ("a", "b")


def test_no_overshoot_when_collection_cannot_make_room():
    d = decide_spill(inputs(tier_bytes=95 * MiB, lru=[]))  # the rest is busy
    assert (d.write, d.drop_reason) == (False, spill.DROP_EXCEEDS_TIER)


def test_free_space_counts_what_collection_gives_back():
    lru = [("a", 30 * MiB)]
    d = decide_spill(inputs(tier_bytes=95 * MiB, lru=lru, free_disk_bytes=5 * MiB,
                            min_free_bytes=1 * MiB))
    assert d.write and d.collect == ("a",)
    d = decide_spill(inputs(free_disk_bytes=10 * MiB, min_free_bytes=1))
    assert d.drop_reason == spill.DROP_DISK_FULL


def test_write_window_and_default_budget():
    writes = [(0.0, 5), (200.0, 7), (3700.0, 11)]
    assert spill.written_in_window(writes, 3700.0) == 18  # the first is over an hour old
    assert spill.default_tier_budget(1000, 0.1, None) == 100
    assert spill.default_tier_budget(1000, 0.1, 40) == 40  # never above the cap


def test_plan_collect_incompatible_corrupt_then_lru():
    rec = spill.DiskRecord
    records = [
        rec("old-mlx", "m", "c1", "0.1.0", 10, 1.0),
        rec("bad", "m", "c1", "0.32.2", 10, 2.0, valid=False),
        rec("other-weights", "m", "c0", "0.32.2", 10, 3.0),
        rec("unknown-model", "x", "c9", "0.32.2", 10, 4.0),  # kept: it may load later
        rec("lru1", "m", "c1", "0.32.2", 10, 5.0),
        rec("lru2", "m", "c1", "0.32.2", 10, 6.0),
    ]
    out = spill.plan_collect(records, mlx_lm_version="0.32.2", current_compat={"m": "c1"},
                             budget_bytes=20)
    assert [(c.key, c.reason) for c in out] == [
        ("old-mlx", spill.COLLECT_INCOMPATIBLE), ("bad", spill.COLLECT_CORRUPT),
        ("other-weights", spill.COLLECT_INCOMPATIBLE), ("unknown-model", spill.COLLECT_LRU)]
