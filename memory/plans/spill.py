"""The session cold tier's decisions: spill or drop, what to collect. Pure.

No clock, no I/O, no MLX: the tier (sessions/cold_tier.py) measures (free disk,
bytes written this hour, the queue) and carries out what these functions return.

A shed bank entry is written to disk only if every budget allows it, and each
refusal has a reason that is counted, never silent (MTPLX and oMLX users lost
snapshots in queues and filled disks without a word):
- `not_spillable`: the bank let it go for a reason that makes a copy worthless
  (superseded by a longer prefix of the same session, replaced, dropped by the
  operator);
- `too_short`: fewer prefix tokens than the tier's minimum (a cold prefill of a
  short prompt costs less than the write);
- `exceeds_tier`: the entry alone is larger than the tier's byte budget;
- `write_budget`: the hour's write budget would be crossed;
- `queue_full`: the write queue is full (entries or bytes): also a pressure
  signal, since queued snapshots still hold RAM;
- `disk_full`: the file system's free space would drop below the reserve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DROP_NOT_SPILLABLE = "not_spillable"
DROP_TOO_SHORT = "too_short"
DROP_EXCEEDS_TIER = "exceeds_tier"
DROP_WRITE_BUDGET = "write_budget"
DROP_QUEUE_FULL = "queue_full"
DROP_DISK_FULL = "disk_full"
DROP_WRITE_FAILED = "write_failed"  # the write itself failed (an OSError): the tier counts it
DROP_REASONS = (DROP_NOT_SPILLABLE, DROP_TOO_SHORT, DROP_EXCEEDS_TIER, DROP_WRITE_BUDGET,
                DROP_QUEUE_FULL, DROP_DISK_FULL, DROP_WRITE_FAILED)

# Why files are collected.
COLLECT_INCOMPATIBLE = "incompatible"  # another model, mlx-lm version, dtype or quantization
COLLECT_CORRUPT = "corrupt"  # checksum or size mismatch, unreadable
COLLECT_ORPHAN = "orphan"  # a data file without its index record, or the reverse
COLLECT_LRU = "lru"  # made room within the tier's byte budget
COLLECT_SUPERSEDED = "superseded"  # a longer prefix of the same session was written
COLLECT_DROPPED = "dropped"  # the operator dropped the session

HOUR_S = 3600.0


@dataclass(frozen=True)
class SpillInputs:
    """One shed entry and the tier's state when it is offered (or about to be written)."""

    entry_bytes: int
    prefix_tokens: int
    spillable: bool  # the bank's reason for shedding it allows a copy
    min_prefix_tokens: int
    tier_budget_bytes: int
    tier_bytes: int  # on disk now
    pending_bytes: int  # queued or being written, not counted in tier_bytes
    written_last_hour: int
    write_budget_per_hour: int | None  # None: unbounded
    queue_entries: int = 0
    queue_limit_entries: int = 1
    queue_bytes: int = 0
    queue_limit_bytes: int | None = None
    # Known only right before the write; None: not checked at this point.
    free_disk_bytes: int | None = None
    min_free_bytes: int = 0
    # Disk entries in LRU order (oldest first) that may be collected to make room:
    # (key, bytes). Entries being restored or written are not in it.
    lru: Sequence[tuple[str, int]] = ()
    # Entries already queued count against the queue; at write time the entry is
    # no longer queued (it is the one being written).
    queued: bool = False


@dataclass(frozen=True)
class SpillDecision:
    write: bool
    drop_reason: str | None = None
    collect: tuple[str, ...] = ()  # LRU disk entries to delete first, to stay in budget
    collect_bytes: int = 0


def decide_spill(i: SpillInputs) -> SpillDecision:
    """Write it (after collecting `collect`), or drop it with a reason."""
    if not i.spillable:
        return SpillDecision(False, DROP_NOT_SPILLABLE)
    if i.prefix_tokens < i.min_prefix_tokens:
        return SpillDecision(False, DROP_TOO_SHORT)
    if i.entry_bytes > i.tier_budget_bytes:
        return SpillDecision(False, DROP_EXCEEDS_TIER)
    if (i.write_budget_per_hour is not None
            and i.written_last_hour + i.entry_bytes > i.write_budget_per_hour):
        return SpillDecision(False, DROP_WRITE_BUDGET)
    if not i.queued:
        if i.queue_entries >= i.queue_limit_entries:
            return SpillDecision(False, DROP_QUEUE_FULL)
        if i.queue_limit_bytes is not None and i.queue_bytes + i.entry_bytes > i.queue_limit_bytes:
            return SpillDecision(False, DROP_QUEUE_FULL)
    # Make room in the byte budget, oldest first. What is pending (other queued writes)
    # will need room too: count it, so the tier never overshoots its budget.
    pending_others = i.pending_bytes - (i.entry_bytes if i.queued else 0)
    excess = i.tier_bytes + max(0, pending_others) + i.entry_bytes - i.tier_budget_bytes
    collect: list[str] = []
    freed = 0
    for key, nbytes in i.lru:
        if freed >= excess:
            break
        collect.append(key)
        freed += nbytes
    if freed < excess:
        # Even collecting every idle disk entry does not make room (the rest is being
        # written or restored): a drop, not an overshoot.
        return SpillDecision(False, DROP_EXCEEDS_TIER)
    # What collecting frees comes back to the file system before the write.
    if (i.free_disk_bytes is not None
            and i.free_disk_bytes + freed - i.entry_bytes < i.min_free_bytes):
        return SpillDecision(False, DROP_DISK_FULL)
    return SpillDecision(True, None, tuple(collect), freed)


def written_in_window(writes: Iterable[tuple[float, int]], now: float,
                      window_s: float = HOUR_S) -> int:
    """Bytes written in the last `window_s` seconds: `writes` are (time, bytes)."""
    return sum(n for t, n in writes if now - t < window_s)


def default_tier_budget(free_disk_bytes: int, fraction: float, cap_bytes: int | None) -> int:
    """The tier's byte budget: a fraction of the disk's free space when the tier starts,
    never more than the operator's cap."""
    budget = int(max(0, free_disk_bytes) * fraction)
    return budget if cap_bytes is None else min(budget, cap_bytes)


@dataclass(frozen=True)
class DiskRecord:
    """What collection needs to know about one file on disk."""

    key: str
    model_id: str
    compat: str  # the compatibility key's digest
    mlx_lm_version: str
    nbytes: int
    last_access: float
    valid: bool = True  # the record parsed and its data file has the recorded size


@dataclass(frozen=True)
class Collection:
    key: str
    reason: str


def plan_collect(records: Iterable[DiskRecord], *, mlx_lm_version: str,
                 current_compat: dict[str, str], budget_bytes: int) -> list[Collection]:
    """Files to delete: unreadable or truncated, made by another mlx-lm, made for a
    model now loaded with different weights, dtype or quantization; then the least
    recently used until the rest fits the budget.

    `current_compat`: model id -> compatibility digest of the models known now. An
    entry of a model not known now is kept (it may be loaded later) unless LRU takes it.
    """
    out: list[Collection] = []
    kept: list[DiskRecord] = []
    for r in records:
        if not r.valid:
            out.append(Collection(r.key, COLLECT_CORRUPT))
        elif r.mlx_lm_version != mlx_lm_version or r.model_id in current_compat and current_compat[r.model_id] != r.compat:
            out.append(Collection(r.key, COLLECT_INCOMPATIBLE))
        else:
            kept.append(r)
    total = sum(r.nbytes for r in kept)
    for r in sorted(kept, key=lambda r: (r.last_access, -r.nbytes)):
        if total <= budget_bytes:
            break
        out.append(Collection(r.key, COLLECT_LRU))
        total -= r.nbytes
    return out
