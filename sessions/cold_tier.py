"""The session cold tier: bank entries the bank sheds, kept on disk and restored later.

Spill instead of drop: the bank's `on_evict` hands shed entries to `offer`; each is
written if `memory.plans.spill.decide_spill` allows, else dropped with a counted
reason. Writes run on the tier's writer threads (never the engine thread, never
the event loop) through a bounded queue; each write holds a slot of its model's
store-cache gate, so the seed's walking cap bounds how many snapshot stores run
at once. A queued snapshot still holds RAM until written: the queue is bounded in
entries and bytes, and a full queue is a pressure signal (`on_queue_full`, the
governor's wake) as well as a counted drop.

Restore: `lookup` finds the longest strict token prefix on disk among entries
compatible with the model as loaded now; `read` returns its verified bytes (a
worker thread); the engine thread builds the caches (`disk_format.load_snapshot`).
A file that fails its check is removed, never restored.

Restarts: `open()` rebuilds the index from the records on disk, collecting
interrupted writes, corrupt records and entries another mlx-lm made;
`register_model` collects a model's entries made with other weights, dtype or
quantization.

Thread safety: one lock over the index and counters; file I/O runs outside it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from opentelemetry import trace

import telemetry
from memory.plans import spill
from telemetry import names
from telemetry.instruments import Instruments, instruments

from . import disk_format as fmt
from .bank import EntryInfo, SessionInfo
from .trie import TokenTrie

_log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

# Bank eviction reasons whose entry is not worth a copy on disk: superseded, replaced
# and retention keep a longer prefix of the same session in RAM; dropped and removed
# are the operator or the pipeline letting it go on purpose. Every other reason
# (pressure, admission sheds, caps, idle TTL, a model unloaded) spills.
NOT_SPILLABLE_REASONS = frozenset({"superseded", "replaced", "session_retention", "dropped",
                                   "removed"})

REASON_SHUTDOWN = "shutdown"  # the bank's entries spilled at a graceful stop

GATE_POLL_S = 0.005


class StoreGate(Protocol):
    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...


@dataclass
class ColdTierSettings:
    directory: Path
    # The byte budget: budget_fraction of the free disk when the tier opens, never
    # more than cap_bytes.
    cap_bytes: int = 32 * GiB
    budget_fraction: float = 0.10
    write_budget_bytes_per_hour: int | None = 16 * GiB
    min_free_bytes: int = 2 * GiB  # never fill the disk past this reserve
    min_prefix_tokens: int = 64
    queue_entries: int = 16
    queue_bytes: int = 2 * GiB
    writers: int = 1
    kv_bits: int = 0  # 0, 8 or 4: the bank's snapshots (RAM and disk) quantized


@dataclass(frozen=True)
class ColdTierStats:
    enabled: bool
    directory: str
    budget_bytes: int
    bytes: int
    entries: int
    pending_writes: int
    pending_bytes: int
    writes: int
    written_bytes: int
    written_last_hour: int
    write_budget_per_hour: int | None
    restores: int
    restore_failures: int
    hits_ram: int
    hits_disk: int
    misses: int
    drops: dict[str, int] = field(default_factory=dict)
    collected: dict[str, int] = field(default_factory=dict)
    free_disk_bytes: int = 0
    kv_bits: int = 0


@dataclass
class _Indexed:
    record: fmt.Record
    last_access: float  # wall clock (survives restarts through the record's mtime)


@dataclass
class _Job:
    model_id: str
    session_id: str | None
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int
    reason: str
    queued_at: float


class ColdTier:
    def __init__(self, settings: ColdTierSettings, *,
                 gate_for: Callable[[str], StoreGate | None] | None = None,
                 on_queue_full: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 disk_free: Callable[[Path], int] | None = None,
                 tracer: trace.Tracer | None = None,
                 inst: Instruments | None = None) -> None:
        self.settings = settings
        self.folder = Path(settings.directory).expanduser()
        self._gate_for = gate_for or (lambda _m: None)
        self.on_queue_full = on_queue_full
        self._clock = clock
        self._wall = wall
        self._disk_free = disk_free or (lambda p: shutil.disk_usage(p).free)
        self._tracer = tracer
        self._metrics = inst or instruments()
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._index: dict[str, _Indexed] = {}
        self._tries: dict[tuple[str, str], TokenTrie[fmt.Record]] = {}
        self._models: dict[str, fmt.CompatKey] = {}
        self._busy: set[str] = set()  # keys being restored: never collected meanwhile
        self._queue: collections.deque[_Job] = collections.deque()
        self._queue_bytes = 0
        self._writing_bytes = 0
        self._writing = 0
        self._bytes = 0
        self._writes = 0
        self._written_bytes = 0
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._restores = 0
        self._restore_failures = 0
        self._hits_ram = 0
        self._hits_disk = 0
        self._misses = 0
        self._drops: collections.Counter[str] = collections.Counter()
        self._collected: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.budget_bytes = 0
        self.mlx_lm_version = fmt.mlx_lm_version()
        self._metrics.cold_bytes.register(self, lambda t: t._bytes)
        self._metrics.cold_entries.register(self, lambda t: len(t._index))

    # -- start-up and models ---------------------------------------------------------
    def open(self) -> ColdTier:
        """Create the folder, size the budget, rebuild the index, start the writers."""
        self.folder.mkdir(parents=True, exist_ok=True)
        s = self.settings
        self.budget_bytes = spill.default_tier_budget(
            self._disk_free(self.folder) + self._bytes_on_disk(), s.budget_fraction, s.cap_bytes)
        self._rebuild()
        for i in range(max(1, s.writers)):
            t = threading.Thread(target=self._writer, name=f"cold-tier-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _bytes_on_disk(self) -> int:
        # The tier's own files count toward its budget, not against the free space.
        total = 0
        for p in self.folder.iterdir():
            if p.suffix in (fmt.DATA_SUFFIX, fmt.RECORD_SUFFIX):
                with contextlib.suppress(OSError):
                    total += p.stat().st_size
        return total

    def _rebuild(self) -> None:
        with self._span(names.SPAN_COLD_COLLECT, {names.ATTR_REASON: "startup"}) as span:
            records: list[spill.DiskRecord] = []
            found: dict[str, tuple[fmt.Record | None, float]] = {}
            data_keys: set[str] = set()
            for p in list(self.folder.iterdir()):
                if p.name.startswith(fmt.TMP_PREFIX):
                    self._unlink(p, spill.COLLECT_ORPHAN)  # an interrupted write
                elif p.suffix == fmt.DATA_SUFFIX:
                    data_keys.add(p.stem)
                elif p.suffix == fmt.RECORD_SUFFIX:
                    try:
                        rec = fmt.read_record(p)
                        if rec.key != p.stem:
                            raise ValueError("record key does not match its file name")
                    except Exception:  # noqa: BLE001 - any unreadable record is corrupt
                        rec = None
                    found[p.stem] = (rec, p.stat().st_mtime)
            for key in data_keys - set(found):
                self._unlink(fmt.data_path(self.folder, key), spill.COLLECT_ORPHAN)
            for key, (rec, mtime) in found.items():
                valid = rec is not None and self._size_ok(rec)
                records.append(spill.DiskRecord(
                    key=key, model_id=rec.model_id if rec else "", compat=rec.compat if rec else "",
                    mlx_lm_version=rec.mlx_lm_version if rec else "",
                    nbytes=rec.data_bytes if rec else 0, last_access=mtime, valid=valid))
            plan = spill.plan_collect(records, mlx_lm_version=self.mlx_lm_version,
                                      current_compat={}, budget_bytes=self.budget_bytes)
            gone = {c.key for c in plan}
            for c in plan:
                self._remove_files(c.key, c.reason)
            with self._lock:
                for r in records:
                    rec = found[r.key][0]
                    if r.key not in gone and rec is not None:
                        self._insert(rec, r.last_access)
            span.set_attribute(names.ATTR_ENTRIES_EVICTED, len(plan))
            span.set_attribute(names.ATTR_COLD_ENTRIES, len(self._index))
        _log.info("session cold tier at %s: %d entries, %d bytes of a %d-byte budget "
                  "(%d files collected)", self.folder, len(self._index), self._bytes,
                  self.budget_bytes, len(plan))

    def _size_ok(self, rec: fmt.Record) -> bool:
        try:
            return fmt.data_path(self.folder, rec.key).stat().st_size == rec.data_bytes
        except OSError:
            return False

    def register_model(self, model_id: str, compat: fmt.CompatKey) -> int:
        """The model as loaded now; its entries made otherwise are collected -> count."""
        digest = compat.digest()
        with self._lock:
            self._models[model_id] = compat
            stale = [k for k, e in self._index.items()
                     if e.record.model_id == model_id and e.record.compat != digest
                     and k not in self._busy]
        if stale:
            with self._span(names.SPAN_COLD_COLLECT, {
                    names.ATTR_REASON: spill.COLLECT_INCOMPATIBLE, names.ATTR_MODEL: model_id,
                    names.ATTR_ENTRIES_EVICTED: len(stale)}):
                for k in stale:
                    self._remove_files(k, spill.COLLECT_INCOMPATIBLE)
        return len(stale)

    def compat_for(self, model_id: str) -> fmt.CompatKey | None:
        with self._lock:
            return self._models.get(model_id)

    # -- spill -------------------------------------------------------------------------
    def offer(self, entries: Sequence[Any], reason: str) -> None:
        """The bank's on_evict: queue each shed entry for a write, or count its drop."""
        full = False
        for e in entries:
            if e.model not in self._models:
                self._drop(e, reason, spill.DROP_NOT_SPILLABLE)
                continue
            with self._lock:
                d = spill.decide_spill(self._inputs(e.nbytes, e.prefix_len, reason, queued=False))
                if d.write:
                    self._queue.append(_Job(e.model, e.session_id, e.tokens, e.payload, e.nbytes,
                                            reason, self._clock()))
                    self._queue_bytes += e.nbytes
                    self._cv.notify()
                    continue
            full = full or d.drop_reason == spill.DROP_QUEUE_FULL
            self._drop(e, reason, d.drop_reason or spill.DROP_NOT_SPILLABLE)
        if full and self.on_queue_full is not None:
            try:
                self.on_queue_full()
            except Exception:  # noqa: BLE001 - a signal must not fail the shed
                _log.exception("cold tier on_queue_full hook failed")

    def offer_all(self, entries: Sequence[Any], reason: str, timeout_s: float) -> None:
        """`offer`, waiting for queue room instead of dropping (shutdown: nothing else
        needs the RAM, and a restart should find these sessions)."""
        deadline = time.monotonic() + timeout_s
        for e in entries:
            with self._cv:
                while (len(self._queue) >= self.settings.queue_entries
                       or self._queue_bytes + e.nbytes > self.settings.queue_bytes):
                    left = deadline - time.monotonic()
                    if left <= 0 or (not self._queue and not self._writing):
                        break
                    self._cv.wait(left)
            self.offer([e], reason)

    def _inputs(self, nbytes: int, prefix: int, reason: str, *, queued: bool,
                free: int | None = None) -> spill.SpillInputs:
        s = self.settings
        now = self._clock()
        while self._window and now - self._window[0][0] >= spill.HOUR_S:
            self._window.popleft()
        lru = sorted(((k, e.record.data_bytes, e.last_access) for k, e in self._index.items()
                      if k not in self._busy), key=lambda x: x[2])
        return spill.SpillInputs(
            entry_bytes=nbytes, prefix_tokens=prefix, spillable=reason not in NOT_SPILLABLE_REASONS,
            min_prefix_tokens=s.min_prefix_tokens, tier_budget_bytes=self.budget_bytes,
            tier_bytes=self._bytes, pending_bytes=self._queue_bytes + self._writing_bytes,
            written_last_hour=spill.written_in_window(self._window, now),
            write_budget_per_hour=s.write_budget_bytes_per_hour,
            queue_entries=len(self._queue), queue_limit_entries=s.queue_entries,
            queue_bytes=self._queue_bytes, queue_limit_bytes=s.queue_bytes,
            free_disk_bytes=free, min_free_bytes=s.min_free_bytes,
            lru=[(k, n) for k, n, _ in lru], queued=queued)

    def _drop(self, e: Any, reason: str, drop_reason: str) -> None:
        with self._lock:
            self._drops[drop_reason] += 1
        self._metrics.cold_drops.add(1, {names.ATTR_REASON: drop_reason})
        if drop_reason == spill.DROP_NOT_SPILLABLE:
            return  # superseded / dropped on purpose: no write was ever due
        with self._span(names.SPAN_COLD_SPILL, {
                names.ATTR_MODEL: e.model, names.ATTR_REASON: reason,
                names.ATTR_COLD_OUTCOME: "dropped", names.ATTR_COLD_DROP_REASON: drop_reason,
                names.ATTR_PROMPT_TOKENS: e.prefix_len, names.ATTR_COLD_BYTES: e.nbytes}):
            pass

    def _writer(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._queue_bytes -= job.nbytes
                self._writing_bytes += job.nbytes
                self._writing += 1
            try:
                self._write(job)
            except Exception:  # noqa: BLE001 - one failed write must not stop the writer
                _log.exception("cold tier write failed")
            finally:
                with self._cv:
                    self._writing_bytes -= job.nbytes
                    self._writing -= 1
                    job.payload = None
                    self._cv.notify_all()

    def _write(self, job: _Job) -> None:
        gate = self._gate_for(job.model_id)
        if gate is not None:
            # The seed's store-cache cap: at most `cap` snapshot stores of this model at once.
            while not gate.try_acquire():
                if self._closed and not self._queue:
                    break
                time.sleep(GATE_POLL_S)
            else:
                try:
                    self._write_now(job)
                finally:
                    gate.release()
                return
        self._write_now(job)

    def _write_now(self, job: _Job) -> None:
        compat = self.compat_for(job.model_id)
        attrs: dict[str, Any] = {names.ATTR_MODEL: job.model_id, names.ATTR_REASON: job.reason,
                                 names.ATTR_PROMPT_TOKENS: len(job.tokens),
                                 names.ATTR_COLD_BYTES: job.nbytes}
        with self._span(names.SPAN_COLD_SPILL, attrs) as span:
            if compat is None:
                self._count_drop(span, spill.DROP_NOT_SPILLABLE)
                return
            try:
                free = self._disk_free(self.folder)
            except OSError:
                free = 0
            with self._lock:
                d = spill.decide_spill(self._inputs(job.nbytes, len(job.tokens), job.reason,
                                                    queued=True, free=free))
                for k in d.collect:
                    self._busy.add(k)  # claimed: no restore starts on it now
            if not d.write:
                self._count_drop(span, d.drop_reason or spill.DROP_NOT_SPILLABLE)
                return
            self._collect(d.collect, spill.COLLECT_LRU, job.model_id)
            digest = compat.digest()
            key = fmt.entry_key(job.model_id, digest, job.tokens)
            try:
                rec = fmt.write_snapshot(self.folder, key, job.payload, model_id=job.model_id,
                                         compat=compat, session_id=job.session_id,
                                         tokens=job.tokens, kv_bytes=job.nbytes,
                                         now_wall=self._wall())
            except OSError as exc:
                _log.warning("cold tier: writing %s failed: %s", key, exc)
                full = exc.errno in (28, 122)  # ENOSPC, EDQUOT
                self._count_drop(span, spill.DROP_DISK_FULL if full else spill.DROP_WRITE_FAILED)
                return
            with self._lock:
                old = self._index.get(key)
                if old is not None:
                    self._unindex(key)
                self._insert(rec, self._wall())
                self._writes += 1
                self._written_bytes += rec.data_bytes
                self._window.append((self._clock(), rec.data_bytes))
                superseded = self._superseded_by(rec)
            span.set_attribute(names.ATTR_COLD_OUTCOME, "written")
            span.set_attribute(names.ATTR_COLD_FILE_BYTES, rec.data_bytes)
            self._metrics.cold_writes.add(1, {names.ATTR_MODEL: job.model_id})
            self._metrics.cold_written_bytes.add(rec.data_bytes, {names.ATTR_MODEL: job.model_id})
            self._collect(superseded, spill.COLLECT_SUPERSEDED, job.model_id)

    def _count_drop(self, span: trace.Span, reason: str) -> None:
        span.set_attribute(names.ATTR_COLD_OUTCOME, "dropped")
        span.set_attribute(names.ATTR_COLD_DROP_REASON, reason)
        with self._lock:
            self._drops[reason] += 1
        self._metrics.cold_drops.add(1, {names.ATTR_REASON: reason})

    def _superseded_by(self, rec: fmt.Record) -> list[str]:
        """Older disk entries of the same session that the new one covers (a strict prefix)."""
        if rec.session_id is None:
            return []
        trie = self._tries.get((rec.model_id, rec.compat))
        if trie is None:
            return []
        return [r.key for depth, r in trie.prefixes(rec.tokens)
                if depth < len(rec.tokens) and r.session_id == rec.session_id
                and r.key not in self._busy]

    # -- restore -----------------------------------------------------------------------
    def lookup(self, model_id: str, tokens: Sequence[int]) -> fmt.Record | None:
        """The longest compatible entry that is a strict prefix of `tokens`."""
        with self._lock:
            compat = self._models.get(model_id)
            if compat is None or len(tokens) < 2:
                return None
            trie = self._tries.get((model_id, compat.digest()))
            if trie is None:
                return None
            found = trie.longest_prefix(tuple(tokens), max_len=len(tokens) - 1)
            return found[1] if found is not None else None

    def restore_figures(self, model_id: str, tokens: Sequence[int]) -> tuple[int, int]:
        """(prefix tokens, bytes a restore allocates) of the prompt's disk source."""
        rec = self.lookup(model_id, tokens)
        return (len(rec.tokens), rec.kv_bytes) if rec is not None else (0, 0)

    def claim(self, rec: fmt.Record) -> bool:
        """Mark an entry as being restored (collection skips it); False if it is gone."""
        with self._lock:
            if rec.key not in self._index:
                return False
            self._busy.add(rec.key)
            return True

    def read(self, rec: fmt.Record) -> bytes:
        """On a worker thread: the verified bytes of a claimed entry. A file that fails
        its check is removed and CorruptSnapshot raised."""
        try:
            return fmt.read_verified(self.folder, rec)
        except fmt.CorruptSnapshot as exc:
            self.release(rec)
            self._collect([rec.key], spill.COLLECT_CORRUPT, rec.model_id, error=str(exc))
            raise

    def release(self, rec: fmt.Record) -> None:
        with self._lock:
            self._busy.discard(rec.key)

    def note_restore(self, rec: fmt.Record | None, ok: bool, *, model_id: str,
                     seconds: float, error: str = "") -> None:
        """Counts a disk restore's outcome, with its span."""
        attrs: dict[str, Any] = {names.ATTR_MODEL: model_id,
                                 names.ATTR_COLD_OUTCOME: "restored" if ok else "failed"}
        if rec is not None:
            attrs[names.ATTR_CACHED_TOKENS] = len(rec.tokens)
            attrs[names.ATTR_COLD_FILE_BYTES] = rec.data_bytes
        if error:
            attrs[names.ATTR_ERROR] = error
        with self._lock:
            if ok:
                self._restores += 1
                if rec is not None and rec.key in self._index:
                    self._index[rec.key].last_access = self._wall()
            else:
                self._restore_failures += 1
        if ok and rec is not None:
            with contextlib.suppress(OSError):  # LRU order survives a restart (mtime)
                os.utime(fmt.record_path(self.folder, rec.key))
        self._metrics.cold_restores.add(1, {names.ATTR_COLD_OUTCOME: attrs[names.ATTR_COLD_OUTCOME]})
        with self._span(names.SPAN_COLD_RESTORE, attrs) as span:
            span.set_attribute(names.ATTR_COLD_SECONDS, seconds)

    def note_hit(self, tier: str | None) -> None:
        """One session lookup's answer: "ram", "disk" or None (a miss)."""
        with self._lock:
            if tier == "ram":
                self._hits_ram += 1
            elif tier == "disk":
                self._hits_disk += 1
            else:
                self._misses += 1
        self._metrics.session_hits.add(1, {names.ATTR_COLD_TIER: tier or "miss"})

    # -- operator ----------------------------------------------------------------------
    def drop_session(self, session_id: str) -> tuple[int, int]:
        with self._lock:
            keys = [k for k, e in self._index.items() if e.record.session_id == session_id]
            nbytes = sum(self._index[k].record.data_bytes for k in keys)
        self._collect(keys, spill.COLLECT_DROPPED)
        return len(keys), nbytes

    def entries(self, model_id: str | None = None) -> list[tuple[fmt.Record, float]]:
        with self._lock:
            return [(e.record, e.last_access) for e in self._index.values()
                    if model_id is None or e.record.model_id == model_id]

    def stats(self) -> ColdTierStats:
        try:
            free = self._disk_free(self.folder)
        except OSError:
            free = 0
        with self._lock:
            now = self._clock()
            return ColdTierStats(
                enabled=True, directory=str(self.folder), budget_bytes=self.budget_bytes,
                bytes=self._bytes, entries=len(self._index),
                pending_writes=len(self._queue) + self._writing,
                pending_bytes=self._queue_bytes + self._writing_bytes,
                writes=self._writes, written_bytes=self._written_bytes,
                written_last_hour=spill.written_in_window(self._window, now),
                write_budget_per_hour=self.settings.write_budget_bytes_per_hour,
                restores=self._restores, restore_failures=self._restore_failures,
                hits_ram=self._hits_ram, hits_disk=self._hits_disk, misses=self._misses,
                drops=dict(self._drops), collected=dict(self._collected),
                free_disk_bytes=free, kv_bits=self.settings.kv_bits)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (a drain, a test); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (a restart finds them), then stop the writers."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)

    # -- index internals -------------------------------------------------------------------
    def _insert(self, rec: fmt.Record, last_access: float) -> None:
        self._index[rec.key] = _Indexed(rec, last_access)
        self._tries.setdefault((rec.model_id, rec.compat), TokenTrie()).insert(rec.tokens, rec)
        self._bytes += rec.data_bytes

    def _unindex(self, key: str) -> fmt.Record | None:
        e = self._index.pop(key, None)
        if e is None:
            return None
        rec = e.record
        trie = self._tries.get((rec.model_id, rec.compat))
        if trie is not None:
            trie.remove(rec.tokens)
            if not len(trie):
                del self._tries[(rec.model_id, rec.compat)]
        self._bytes -= rec.data_bytes
        return rec

    def _remove_files(self, key: str, reason: str) -> None:
        with self._lock:
            self._unindex(key)
            self._busy.discard(key)
            self._collected[reason] += 1
        self._metrics.cold_collected.add(1, {names.ATTR_REASON: reason})
        for p in (fmt.record_path(self.folder, key), fmt.data_path(self.folder, key)):
            p.unlink(missing_ok=True)  # the record first: no record ever names a missing file

    def _collect(self, keys: Sequence[str], reason: str, model_id: str | None = None,
                 error: str = "") -> None:
        """Delete entries' files under one collect span (start-up and incompatible
        entries have their own)."""
        if not keys:
            return
        attrs: dict[str, Any] = {names.ATTR_REASON: reason, names.ATTR_ENTRIES_EVICTED: len(keys)}
        if model_id:
            attrs[names.ATTR_MODEL] = model_id
        if error:
            attrs[names.ATTR_ERROR] = error
        with self._span(names.SPAN_COLD_COLLECT, attrs):
            for k in keys:
                self._remove_files(k, reason)

    def _unlink(self, path: Path, reason: str) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self._collected[reason] += 1
        self._metrics.cold_collected.add(1, {names.ATTR_REASON: reason})

    def _span(self, name: str, attrs: dict[str, Any]) -> Any:
        tracer = self._tracer or telemetry.tracer()
        return tracer.start_as_current_span(name, attributes=attrs)


def compat_of(model_hash: str, kv_dtype: str, kv_bits: int) -> fmt.CompatKey:
    """The key a model's files carry: its content hash (engine.loading.content_hash,
    taken at load), mlx-lm's version and the snapshots' KV format."""
    return fmt.CompatKey(model_hash=model_hash, mlx_lm=fmt.mlx_lm_version(),
                         kv_dtype=kv_dtype, kv_bits=kv_bits)


def with_disk_entries(infos: Sequence[SessionInfo], tier: ColdTier | None,
                      model_id: str | None, active: Iterable[str] = ()) -> list[SessionInfo]:
    """ListSessions' view: the bank's sessions with their disk entries added (and
    sessions only on disk), disk entries last. Times are monotonic like the bank's."""
    if tier is None:
        return list(infos)
    offset = time.monotonic() - time.time()  # wall -> monotonic, as the bank's clock
    by_sid: dict[str | None, list[EntryInfo]] = {}
    for rec, last in tier.entries(model_id):
        by_sid.setdefault(rec.session_id, []).append(EntryInfo(
            model=rec.model_id, session_id=rec.session_id, prefix_tokens=len(rec.tokens),
            nbytes=rec.data_bytes, terminal=False, hits=0, created_at=rec.created_at + offset,
            last_access=last + offset, live_ref=False, tier="disk"))
    active_set = set(active)
    out: list[SessionInfo] = []
    for info in infos:
        disk = sorted(by_sid.pop(info.session_id, []), key=lambda e: -e.prefix_tokens)
        out.append(dataclasses.replace(info, entries=info.entries + tuple(disk),
                                       nbytes=info.nbytes + sum(e.nbytes for e in disk)))
    for sid, disk in by_sid.items():
        disk.sort(key=lambda e: -e.prefix_tokens)
        out.append(SessionInfo(session_id=sid, entries=tuple(disk),
                               nbytes=sum(e.nbytes for e in disk),
                               active=sid is not None and sid in active_set))
    return out
