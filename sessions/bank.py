"""SessionBank: KV-cache snapshots keyed by (model, exact token prefix).

Pure policy over opaque payloads. The engine thread computes a snapshot (an
mlx-lm prompt-cache list) and its byte count and hands both to `put`; the bank
never calls MLX. Evicting an entry only drops the bank's references (and hands
the entry to `on_evict`); the engine clears the MLX buffer pool later.

Vocabulary
- An entry is the cache state after prefilling exactly `tokens`.
- A lineage is (model, session_id); every `session_id=None` entry of a model
  belongs to one anonymous lineage. A lineage's *terminal* entry is its longest
  prefix (computed, never stored); the others are *non-terminal* (siblings and
  forks the conversation moved past).
- A session is *active* when `active_sessions()` names it: the server's real
  in-flight set plus pinned sessions, not a time stamp (a TTL stamp would leave
  idle sessions unreleasable).
- Restore rule: a prompt restores from the longest cached key that is a
  *strict* prefix of it. At least one prompt token must still be prefilled to
  produce the logits the first sampled token needs, so an entry equal to the
  whole prompt is not a restore source (a trimmable cache could be cut back by
  one token, but not every cache type is trimmable).

Threading: the engine thread calls put/lookup while the enforcer's thread calls
shrink/expire; one re-entrant lock serialises them. `on_evict` runs after the
lock is released, so it may call back into the bank.

The clock must be monotonic; the bank also clamps it so it never runs backwards,
which keeps its recency order equal to `last_access` order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

import telemetry
from memory.actions import REASON_ADMISSION_CHAIN, REASON_IDLE_TTL, ShrinkMode
from memory.views import BankFigures
from telemetry import names
from telemetry.instruments import Instruments, instruments

from .trie import TokenTrie

Tokens = tuple[int, ...]


class EntryKey(tuple):
    """(model, tokens), hashing once: a tuple re-hashes all its tokens on every set
    or dict lookup, which made a shrink over thousands of long prefixes cost tens of
    milliseconds."""

    def __new__(cls, model: str, tokens: Tokens) -> EntryKey:
        key = super().__new__(cls, (model, tokens))
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash

    def __getnewargs__(self) -> tuple[str, Tokens]:
        return tuple(self)

Lineage = tuple[str, "str | None"]  # (model, session_id)

_log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

DEFAULT_MAX_BYTES = 24 * GiB
DEFAULT_PER_SESSION_MAX_BYTES = 8 * GiB
DEFAULT_MAX_ENTRIES = 24
DEFAULT_PER_SESSION_MAX_ENTRIES = 3
DEFAULT_IDLE_TTL_S = 3600.0

# Eviction reasons (span/metric attribute values) of the bank's own; the ones it
# shares with the memory plans (admission chain, idle TTL) come from memory.actions.
REASON_MEMORY_PRESSURE = "memory_pressure"
REASON_SUPERSEDED = "superseded"
REASON_REPLACED = "replaced"
REASON_SESSION_RETENTION = "session_retention"
REASON_CAP_BYTES = "cap_bytes"
REASON_CAP_SESSION_BYTES = "cap_session_bytes"
REASON_CAP_ENTRIES = "cap_entries"
REASON_CAP_OWNER_SESSIONS = "cap_owner_sessions"  # an owner past max_sessions_per_owner
REASON_DROPPED = "dropped"
REASON_REMOVED = "removed"
REASON_MODEL_UNLOADED = "model_unloaded"  # its model went: the cold tier may keep a copy

# Why `put` refused an entry.
REFUSED_EXCEEDS_MAX_BYTES = "exceeds_max_bytes"
REFUSED_EXCEEDS_SESSION_BYTES = "exceeds_per_session_bytes"
REFUSED_NO_ENTRIES_ALLOWED = "max_entries_zero"

OnEvict = Callable[[Sequence["SessionEntry"], str], None]


@dataclass(eq=False)
class SessionEntry:
    """One KV snapshot. `nbytes` is what the entry holds, live references included.

    `live_ref` marks an entry whose payload is (or shares) the live cache of a
    running request rather than a private copy; its bytes still count in full
    (honest accounting), but while its session is active dropping it frees
    nothing, so `shrink_for_admission` skips it.
    """

    model: str
    tokens: Tokens
    session_id: str | None
    payload: Any
    nbytes: int
    live_ref: bool = False
    created_at: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    owner: str = ""  # who made it (GenerateRequest.owner): max_sessions_per_owner

    def __post_init__(self) -> None:
        self.tokens = tuple(self.tokens)
        if not self.tokens:
            raise ValueError("a SessionEntry needs at least one token")
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")
        self._key = EntryKey(self.model, self.tokens)

    @property
    def key(self) -> EntryKey:
        return self._key

    @property
    def prefix_len(self) -> int:
        return len(self.tokens)

    @property
    def lineage(self) -> Lineage:
        return (self.model, self.session_id)


@dataclass(frozen=True)
class PutResult:
    """What `put` did. Evicted entries go to `on_evict`, not here (no payload refs)."""

    stored: bool
    refused_reason: str | None = None
    replaced: int = 0
    superseded: int = 0
    evicted: int = 0
    freed_bytes: int = 0


@dataclass(frozen=True)
class ShrinkPlan:
    """The victims a shrink would take, in order, without taking them."""

    target_bytes: int
    bytes_before: int
    bytes_after: int
    victims: tuple[EntryKey, ...] = ()
    non_terminal: int = 0  # shrink_for_admission phase 1
    terminal: int = 0  # shrink_for_admission phase 2
    protected_keys: int = 0

    @property
    def freed_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def entries(self) -> int:
        return len(self.victims)


@dataclass(frozen=True)
class EntryInfo:
    model: str
    session_id: str | None
    prefix_tokens: int
    nbytes: int
    terminal: bool
    hits: int
    created_at: float
    last_access: float
    live_ref: bool
    tier: str = "ram"  # "disk": a cold-tier file (sessions/cold_tier.py)


@dataclass(frozen=True)
class SessionInfo:
    """One session (None: the anonymous entries) and its entries, newest first."""

    session_id: str | None
    entries: tuple[EntryInfo, ...]
    nbytes: int
    active: bool


@dataclass(frozen=True)
class BankStats:
    total_bytes: int
    entries: int
    sessions: int
    hits: int
    misses: int
    evictions: dict[str, int] = field(default_factory=dict)


# -- ordering helpers ------------------------------------------------------


def _lru_groups(entries: Iterable[SessionEntry]) -> Iterator[SessionEntry]:
    """Entries given in last_access order, yielded by (last_access, -nbytes, created_at).

    Only ties on last_access need re-sorting: larger first, then older.
    """
    group: list[SessionEntry] = []
    for e in entries:
        if group and e.last_access != group[0].last_access:
            yield from sorted(group, key=lambda x: (-x.nbytes, x.created_at))
            group = []
        group.append(e)
    yield from sorted(group, key=lambda x: (-x.nbytes, x.created_at))


def _keyset(keys: Iterable[tuple[str, Sequence[int]]]) -> set[EntryKey]:
    """(model, tokens) pairs as hashable keys, whatever sequence type the tokens came in."""
    return {EntryKey(model, tuple(tokens)) for model, tokens in keys}


def _take_until(order: Iterator[SessionEntry], excess: int) -> list[SessionEntry]:
    """Victims from `order` until at least `excess` bytes are covered."""
    victims: list[SessionEntry] = []
    freed = 0
    for e in order:
        if freed >= excess:
            break
        victims.append(e)
        freed += e.nbytes
    return victims


class SessionBank:
    """KV snapshots per (model, token prefix), with trie lookup and shrink policies."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        per_session_max_bytes: int = DEFAULT_PER_SESSION_MAX_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        per_session_max_entries: int = DEFAULT_PER_SESSION_MAX_ENTRIES,
        idle_ttl_s: float | None = DEFAULT_IDLE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        active_sessions: Callable[[], Collection[str]] | None = None,
        on_evict: OnEvict | None = None,
        supersede_anonymous: bool = False,
        tracer: trace.Tracer | None = None,
        inst: Instruments | None = None,
        max_sessions_per_owner: int | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        # Sessions one owner may keep: past it, its least recently used go first.
        self.max_sessions_per_owner = max_sessions_per_owner
        self.per_session_max_bytes = per_session_max_bytes
        self.max_entries = max_entries
        self.per_session_max_entries = per_session_max_entries
        self.idle_ttl_s = idle_ttl_s
        # Anonymous entries are a shared prefix cache: by default a longer one
        # does not supersede a shorter one (another prompt may fork from it).
        self.supersede_anonymous = supersede_anonymous
        self._clock = clock
        self._active_fn = active_sessions or (lambda: ())
        self._on_evict = on_evict
        self._tracer = tracer
        self._lock = threading.RLock()
        self._entries: OrderedDict[EntryKey, SessionEntry] = OrderedDict()  # oldest first
        self._tries: dict[str, TokenTrie[SessionEntry]] = {}
        self._lineages: dict[Lineage, set[EntryKey]] = {}
        self._sessions: dict[str, set[EntryKey]] = {}
        self._session_bytes: dict[str, int] = {}
        self._total = 0
        self._hits = 0
        self._misses = 0
        self._evictions: Counter[str] = Counter()
        self._last_now = float("-inf")
        # The cold tier's lookup (sessions/cold_tier.py): (prefix tokens, bytes a restore
        # allocates) of a prompt's disk source, for admission's projection.
        self.cold_lookup: Callable[[str, Sequence[int]], tuple[int, int]] | None = None
        self._metrics = inst or instruments()
        self._metrics.bank_bytes.register(self, lambda b: b.total_bytes())
        self._metrics.bank_entries.register(self, lambda b: b.entry_count())

    # -- read-only views ---------------------------------------------------

    def total_bytes(self) -> int:
        """Bytes held now, live references included (O(1))."""
        return self._total

    def entry_count(self) -> int:
        return len(self._entries)

    @property
    def total_nbytes(self) -> int:
        """Bytes held now, live references included (`total_bytes()` as a property)."""
        return self._total

    def session_bytes(self, session_id: str) -> int:
        return self._session_bytes.get(session_id, 0)

    def stats(self) -> BankStats:
        with self._lock:
            return BankStats(
                total_bytes=self._total,
                entries=len(self._entries),
                sessions=len(self._sessions),
                hits=self._hits,
                misses=self._misses,
                evictions=dict(self._evictions),
            )

    def entries(self, model: str | None = None) -> list[SessionEntry]:
        """Entries, least recently used first (a snapshot list)."""
        with self._lock:
            return [e for e in self._entries.values() if model is None or e.model == model]

    def get(self, model: str, tokens: Sequence[int]) -> SessionEntry | None:
        """The entry stored under exactly these tokens (no stats, no touch)."""
        with self._lock:
            trie = self._tries.get(model)
            return trie.get(tuple(tokens)) if trie is not None else None

    def restore_source(self, model: str, tokens: Sequence[int]) -> SessionEntry | None:
        """The entry `tokens` would restore from: the longest strict prefix (read-only)."""
        with self._lock:
            return self._restore_source(model, tuple(tokens))

    def reusable_tokens(self, model: str, tokens: Sequence[int]) -> int:
        src = self.restore_source(model, tokens)
        return src.prefix_len if src is not None else 0

    def is_terminal(self, entry: SessionEntry) -> bool:
        with self._lock:
            keys = self._lineages.get(entry.lineage, ())
            return entry.prefix_len >= max((len(k[1]) for k in keys), default=0)

    def list_sessions(self, model: str | None = None) -> list[SessionInfo]:
        with self._lock:
            active = self._active()
            maxima = self._lineage_maxima(())
            groups: dict[str | None, list[SessionEntry]] = {}
            for e in self._entries.values():
                if model is None or e.model == model:
                    groups.setdefault(e.session_id, []).append(e)
            out = []
            for sid, group in groups.items():
                group.sort(key=lambda e: e.created_at, reverse=True)
                infos = tuple(
                    EntryInfo(
                        model=e.model, session_id=e.session_id, prefix_tokens=e.prefix_len,
                        nbytes=e.nbytes, terminal=e.prefix_len >= maxima[e.lineage],
                        hits=e.hits, created_at=e.created_at, last_access=e.last_access,
                        live_ref=e.live_ref,
                    )
                    for e in group
                )
                out.append(SessionInfo(
                    session_id=sid, entries=infos, nbytes=sum(e.nbytes for e in group),
                    active=sid is not None and sid in active,
                ))
            return out

    # -- lookup --------------------------------------------------------------

    def longest_prefix(self, model: str, tokens: Sequence[int]) -> SessionEntry | None:
        """The entry to restore `tokens` from (strict-prefix rule), counting a hit or miss.

        Marks the hit entry as used now. (Entries past the idle TTL go on the
        governor's tick.)
        """
        key = tuple(tokens)
        with self._lock:
            entry = self._restore_source(model, key)
            if entry is not None:
                self._hits += 1
                entry.hits += 1
                self._touch(entry, self._now())
            else:
                self._misses += 1
        counter = self._metrics.bank_hits if entry is not None else self._metrics.bank_misses
        counter.add(1, {names.ATTR_MODEL: model})
        return entry

    def _restore_source(self, model: str, key: Tokens) -> SessionEntry | None:
        trie = self._tries.get(model)
        if trie is None or len(key) < 2:
            return None
        found = trie.longest_prefix(key, max_len=len(key) - 1)
        return found[1] if found is not None else None

    def _restore_source_keys(self, model: str | None, tokens: Sequence[int] | None) -> set[EntryKey]:
        if tokens is None:
            return set()
        key = tuple(tokens)
        models = [model] if model is not None else list(self._tries)
        sources = (self._restore_source(m, key) for m in models)
        return {s.key for s in sources if s is not None}

    # -- put -------------------------------------------------------------------

    def put(self, entry: SessionEntry) -> PutResult:
        """Store `entry`, then supersede, retain the newest few, and evict to the caps.

        The new entry is never a victim; if it alone breaks a byte cap (or no
        entries are allowed) it is refused up front and nothing else is touched.
        """
        refusal = self._refusal(entry)
        if refusal is not None:
            return PutResult(stored=False, refused_reason=refusal)
        evicted: list[tuple[SessionEntry, str]] = []
        with self._lock:
            now = self._now()
            entry.created_at = entry.last_access = now
            old = self._remove(entry.key)
            if old is not None and old is not entry:
                evicted.append((old, REASON_REPLACED))
            self._insert(entry)
            evicted += [(e, REASON_SUPERSEDED) for e in self._supersede(entry)]
            evicted += [(e, REASON_SESSION_RETENTION) for e in self._retain_newest(entry)]
            evicted += self._evict_to_caps(entry)
        self._dispatch(evicted)
        return PutResult(
            stored=True,
            replaced=sum(1 for _, r in evicted if r == REASON_REPLACED),
            superseded=sum(1 for _, r in evicted if r == REASON_SUPERSEDED),
            evicted=sum(1 for _, r in evicted if r not in (REASON_REPLACED, REASON_SUPERSEDED)),
            freed_bytes=sum(e.nbytes for e, _ in evicted),
        )

    def _refusal(self, entry: SessionEntry) -> str | None:
        if self.max_entries < 1:
            return REFUSED_NO_ENTRIES_ALLOWED
        if entry.nbytes > self.max_bytes:
            return REFUSED_EXCEEDS_MAX_BYTES
        if entry.session_id is not None and entry.nbytes > self.per_session_max_bytes:
            return REFUSED_EXCEEDS_SESSION_BYTES
        return None

    def _supersede(self, new: SessionEntry) -> list[SessionEntry]:
        """Strict-prefix entries of the same lineage that the new entry covers."""
        if new.session_id is None and not self.supersede_anonymous:
            return []
        covered = [
            e for depth, e in self._tries[new.model].prefixes(new.tokens)
            if depth < new.prefix_len and e.session_id == new.session_id
        ]
        for e in covered:
            self._remove(e.key)
        return covered

    def _retain_newest(self, new: SessionEntry) -> list[SessionEntry]:
        """Keep the newest `per_session_max_entries` of a named session."""
        if new.session_id is None:
            return []
        keys = self._sessions[new.session_id]
        extra = len(keys) - max(1, self.per_session_max_entries)
        if extra <= 0:
            return []
        older = sorted(
            (self._entries[k] for k in keys if k != new.key),
            key=lambda e: (e.created_at, e.last_access),
        )[:extra]
        for e in older:
            self._remove(e.key)
        return older

    def _evict_to_caps(self, new: SessionEntry) -> list[tuple[SessionEntry, str]]:
        out: list[tuple[SessionEntry, str]] = []
        active = self._active()
        sid = new.session_id
        if sid is not None and self._session_bytes[sid] > self.per_session_max_bytes:
            # Victims come from that session only.
            excess = self._session_bytes[sid] - self.per_session_max_bytes
            order = self._ordered(lambda e: e.session_id == sid and e is not new, None)
            out += [(e, REASON_CAP_SESSION_BYTES) for e in self._evict_all(_take_until(order, excess))]
        out += [(e, REASON_CAP_OWNER_SESSIONS) for e in self._evict_all(
            self._owner_excess(new, active))]
        if self._total > self.max_bytes:
            order = self._ordered(lambda e: e is not new, active)
            victims = _take_until(order, self._total - self.max_bytes)
            out += [(e, REASON_CAP_BYTES) for e in self._evict_all(victims)]
        if len(self._entries) > self.max_entries:
            order = self._ordered(lambda e: e is not new, active)
            victims = [e for _, e in zip(range(len(self._entries) - self.max_entries), order, strict=False)]
            out += [(e, REASON_CAP_ENTRIES) for e in self._evict_all(victims)]
        return out

    def _owner_excess(self, new: SessionEntry, active: frozenset[str]) -> list[SessionEntry]:
        """Every entry of the owner's least recently used idle sessions beyond
        max_sessions_per_owner (the new entry's own session is never one)."""
        cap = self.max_sessions_per_owner
        if cap is None or new.session_id is None:
            return []
        last: dict[str, float] = {}
        for e in self._entries.values():
            if e.owner == new.owner and e.session_id is not None:
                last[e.session_id] = max(last.get(e.session_id, 0.0), e.last_access)
        over = len(last) - cap
        if over <= 0:
            return []
        idle = sorted((t, sid) for sid, t in last.items()
                      if sid != new.session_id and sid not in active)
        gone = {sid for _, sid in idle[:over]}
        return [e for e in self._entries.values() if e.session_id in gone]

    # -- removal ---------------------------------------------------------------

    def remove(self, model: str, tokens: Sequence[int], reason: str = REASON_REMOVED) -> SessionEntry | None:
        """Remove one entry (e.g. a consumed single-use live reference) and return it."""
        with self._lock:
            entry = self._remove((model, tuple(tokens)))
        if entry is not None:
            self._dispatch([(entry, reason)])
        return entry

    def drop_session(self, session_id: str) -> tuple[int, int]:
        """Drop every entry of a session -> (entries, bytes)."""
        with self._lock:
            victims = self._evict_all([self._entries[k] for k in self._sessions.get(session_id, ())])
        self._dispatch([(e, REASON_DROPPED) for e in victims])
        return len(victims), sum(e.nbytes for e in victims)

    def drop_model(self, model: str, reason: str = REASON_DROPPED) -> tuple[int, int]:
        """Drop every entry of a model (it is being unloaded) -> (entries, bytes)."""
        with self._lock:
            victims = self._evict_all([e for e in self._entries.values() if e.model == model])
        self._dispatch([(e, reason) for e in victims])
        return len(victims), sum(e.nbytes for e in victims)

    def expire_idle(self, now: float | None = None) -> int:
        """Evict entries idle for at least `idle_ttl_s`, sparing active sessions."""
        if not self.idle_ttl_s or self.idle_ttl_s <= 0:
            return 0
        with self._lock:
            now = self._now() if now is None else now
            active = self._active()
            victims = []
            for e in self._entries.values():  # oldest first: stop at the first fresh one
                if now - e.last_access < self.idle_ttl_s:
                    break
                if not (e.session_id is not None and e.session_id in active):
                    victims.append(e)
            self._evict_all(victims)
        self._dispatch([(e, REASON_IDLE_TTL) for e in victims], own=False)
        return len(victims)

    def expired_count(self, now: float | None = None) -> int:
        """Entries `expire_idle` would evict now (read-only)."""
        if not self.idle_ttl_s or self.idle_ttl_s <= 0:
            return 0
        with self._lock:
            now = max(self._clock(), self._last_now) if now is None else now
            active = self._active()
            count = 0
            for e in self._entries.values():
                if now - e.last_access < self.idle_ttl_s:
                    break
                if not (e.session_id is not None and e.session_id in active):
                    count += 1
            return count

    # -- dry runs for admission -------------------------------------------------

    def figures(self, model: str, prompt_tokens: Sequence[int],
                protect_session_ids: Sequence[str] = ()) -> BankFigures:
        """What admission's bank steps could free at most for this prompt, without freeing."""
        sids = tuple(protect_session_ids)
        src = self.restore_source(model, prompt_tokens)
        keys = (src.key,) if src is not None else ()
        lru = self.plan_shrink_to_bytes(0, protect_active=True, protect_keys=keys,
                                        protect_session_ids=sids)
        chain = self.plan_shrink_for_admission(0, protect_tokens=prompt_tokens, model=model,
                                               protect_session_ids=sids,
                                               assume_evicted=lru.victims)
        ram_tokens = src.prefix_len if src is not None else 0
        disk_tokens = disk_bytes = 0
        if self.cold_lookup is not None:
            disk_tokens, disk_bytes = self.cold_lookup(model, prompt_tokens)
            if disk_tokens <= ram_tokens:
                disk_tokens = disk_bytes = 0  # RAM's source wins a tie: it costs nothing
        return BankFigures(
            total_bytes=lru.bytes_before, max_bytes=self.max_bytes,
            lru_freeable_bytes=lru.freed_bytes, lru_freeable_entries=lru.entries,
            chain_freeable_bytes=chain.freed_bytes, chain_freeable_entries=chain.entries,
            restore_prefix_tokens=max(ram_tokens, disk_tokens),
            restore_disk_tokens=disk_tokens, restore_disk_bytes=disk_bytes,
        )

    def preview_freed(
        self, target_bytes: int, *, mode: str, protect_active: bool,
        protect_tokens: Sequence[int] | None, model: str | None,
        protect_session_ids: Sequence[str], assume_evicted: Sequence[object],
    ) -> tuple[int, int, tuple[EntryKey, ...]]:
        """A shrink's dry run on top of `assume_evicted` -> (entries, bytes, keys)."""
        gone = [k for k in assume_evicted if isinstance(k, EntryKey)]
        sids = list(protect_session_ids)
        if ShrinkMode(mode) is ShrinkMode.TO_BYTES:
            plan = self.plan_shrink_to_bytes(target_bytes, protect_active=protect_active,
                                             protect_session_ids=sids, assume_evicted=gone)
        else:
            if protect_active:
                sids += list(self._active())
            plan = self.plan_shrink_for_admission(
                target_bytes, protect_tokens=protect_tokens, model=model,
                protect_session_ids=sids, assume_evicted=gone)
        return plan.entries, plan.freed_bytes, plan.victims

    # -- shrink policies ---------------------------------------------------------

    def plan_shrink_to_bytes(
        self,
        target_bytes: int,
        *,
        protect_active: bool = False,
        protect_keys: Iterable[EntryKey] = (),
        protect_session_ids: Iterable[str] = (),
        assume_evicted: Iterable[EntryKey] = (),
    ) -> ShrinkPlan:
        """What `shrink_to_bytes` would evict, without evicting (for Admit's dry run).

        `assume_evicted` plans on the bank as if those keys were already gone.
        """
        with self._lock:
            return self._plan_to_bytes(
                target_bytes, protect_active, _keyset(protect_keys), set(protect_session_ids),
                _keyset(assume_evicted),
            )

    def shrink_to_bytes(
        self,
        target_bytes: int,
        *,
        protect_active: bool = False,
        reason: str = REASON_MEMORY_PRESSURE,
        protect_keys: Iterable[EntryKey] = (),
        protect_session_ids: Iterable[str] = (),
    ) -> int:
        """Evict until total <= max(0, target) -> the number of entries evicted.

        Victim = min by (session active, last_access, -nbytes, created_at): idle
        sessions first, least recently used first, larger first among equals.
        With `protect_active`, active sessions' entries are never taken, so the
        bank may stay above target (the dynamic ceiling: an active session is
        spared a re-prefill). Entries holding live references are taken too:
        this is the take-anything pass, it drops the bank's references.
        """
        keys, sids = _keyset(protect_keys), set(protect_session_ids)
        with self._lock:
            plan = self._plan_to_bytes(target_bytes, protect_active, keys, sids, set())
            victims = self._evict_all([self._entries[k] for k in plan.victims])
        self._dispatch([(e, reason) for e in victims], own=False)
        return len(victims)

    def plan_shrink_for_admission(
        self,
        target_bytes: int,
        *,
        protect_tokens: Sequence[int] | None = None,
        model: str | None = None,
        protect_keys: Iterable[EntryKey] = (),
        protect_session_ids: Iterable[str] = (),
        assume_evicted: Iterable[EntryKey] = (),
    ) -> ShrinkPlan:
        """What `shrink_for_admission` would evict, without evicting."""
        with self._lock:
            return self._plan_for_admission(
                target_bytes, protect_tokens, model, _keyset(protect_keys),
                set(protect_session_ids), _keyset(assume_evicted),
            )

    def shrink_for_admission(
        self,
        target_bytes: int,
        *,
        protect_tokens: Sequence[int] | None = None,
        model: str | None = None,
        reason: str = REASON_ADMISSION_CHAIN,
        protect_keys: Iterable[EntryKey] = (),
        protect_session_ids: Iterable[str] = (),
        protect_active: bool = False,
    ) -> tuple[int, int]:
        """Two-phase shed before a prefill -> (non_terminal_evicted, terminal_evicted).

        Protected: the entry `protect_tokens` would restore from (the real
        strict-prefix restore rule, in `model` or every model when None), plus
        `protect_keys` / `protect_session_ids`. Phase 1 takes non-terminal
        entries by (last_access, -nbytes, created_at) until total <= target;
        phase 2, only if a deficit remains, any unprotected entry with active
        sessions last. An entry holding a live reference of an active session is
        skipped: dropping it would free nothing (the running request still holds
        the cache) while costing that session its restore point. With
        `protect_active`, active sessions' entries are never taken.
        """
        keys, sids = _keyset(protect_keys), set(protect_session_ids)
        with self._lock:
            if protect_active:
                sids |= self._active()
            plan = self._plan_for_admission(target_bytes, protect_tokens, model, keys, sids, set())
            victims = self._evict_all([self._entries[k] for k in plan.victims])
        self._dispatch([(e, reason) for e in victims], own=False)
        return plan.non_terminal, plan.terminal

    def _plan_to_bytes(
        self,
        target: int,
        protect_active: bool,
        protect_keys: set[EntryKey],
        protect_sids: set[str],
        gone: set[EntryKey],
    ) -> ShrinkPlan:
        active = self._active()
        before = self._total - self._bytes_of(gone)
        excess = before - max(0, target)
        victims: list[SessionEntry] = []
        if excess > 0:

            skip_keys = protect_keys | gone  # usually empty: then no key is hashed
            skip_sids = protect_sids | active if protect_active else protect_sids

            def accept(e: SessionEntry) -> bool:
                return not (
                    (skip_keys and e.key in skip_keys)
                    or (e.session_id is not None and e.session_id in skip_sids)
                )

            victims = _take_until(self._ordered(accept, active), excess)
        freed = sum(e.nbytes for e in victims)
        return ShrinkPlan(
            target_bytes=target, bytes_before=before, bytes_after=before - freed,
            victims=tuple(e.key for e in victims), protected_keys=len(protect_keys),
        )

    def _plan_for_admission(
        self,
        target: int,
        protect_tokens: Sequence[int] | None,
        model: str | None,
        protect_keys: set[EntryKey],
        protect_sids: set[str],
        gone: set[EntryKey],
    ) -> ShrinkPlan:
        active = self._active()
        protected = protect_keys | self._restore_source_keys(model, protect_tokens)
        before = self._total - self._bytes_of(gone)
        excess = before - max(0, target)
        if excess <= 0:
            return ShrinkPlan(target, before, before, protected_keys=len(protected))
        maxima = self._lineage_maxima(gone)

        def evictable(e: SessionEntry) -> bool:
            return not (
                e.key in protected or e.key in gone or e.session_id in protect_sids
                or (e.live_ref and self._is_active(e, active))
            )

        phase1 = _take_until(
            self._ordered(lambda e: evictable(e) and e.prefix_len < maxima[e.lineage], None), excess
        )
        freed = sum(e.nbytes for e in phase1)
        phase2: list[SessionEntry] = []
        if freed < excess:
            taken = {e.key for e in phase1}
            order = self._ordered(lambda e: evictable(e) and e.key not in taken, active)
            phase2 = _take_until(order, excess - freed)
            freed += sum(e.nbytes for e in phase2)
        return ShrinkPlan(
            target_bytes=target, bytes_before=before, bytes_after=before - freed,
            victims=tuple(e.key for e in phase1 + phase2), non_terminal=len(phase1),
            terminal=len(phase2), protected_keys=len(protected),
        )

    # -- internals ---------------------------------------------------------------

    def _now(self) -> float:
        now = max(self._clock(), self._last_now)  # never backwards: keeps LRU order exact
        self._last_now = now
        return now

    def _active(self) -> frozenset[str]:
        return frozenset(self._active_fn())

    @staticmethod
    def _is_active(e: SessionEntry, active: frozenset[str]) -> bool:
        return e.session_id is not None and e.session_id in active

    def _bytes_of(self, keys: Iterable[EntryKey]) -> int:
        return sum(self._entries[k].nbytes for k in keys if k in self._entries)

    def _lineage_maxima(self, gone: set[EntryKey]) -> dict[Lineage, int]:
        maxima: dict[Lineage, int] = {}
        for e in self._entries.values():
            if e.key not in gone and e.prefix_len > maxima.get(e.lineage, 0):
                maxima[e.lineage] = e.prefix_len
        return maxima

    def _ordered(
        self, accept: Callable[[SessionEntry], bool], active: frozenset[str] | None
    ) -> Iterator[SessionEntry]:
        """Accepted entries in victim order; with `active`, idle sessions before active.

        Lazy, so picking one victim out of thousands stays cheap. Must be fully
        consumed (or dropped) before the bank is mutated.
        """
        if active is None:
            yield from _lru_groups(e for e in self._entries.values() if accept(e))
            return
        busy: list[SessionEntry] = []  # one pass: accept runs once per entry
        idle = []
        for e in self._entries.values():
            if accept(e):
                (busy if self._is_active(e, active) else idle).append(e)
        yield from _lru_groups(idle)
        yield from _lru_groups(busy)

    def _touch(self, entry: SessionEntry, now: float) -> None:
        entry.last_access = now
        self._entries.move_to_end(entry.key)

    def _insert(self, e: SessionEntry) -> None:
        self._entries[e.key] = e
        self._tries.setdefault(e.model, TokenTrie()).insert(e.tokens, e)
        self._lineages.setdefault(e.lineage, set()).add(e.key)
        if e.session_id is not None:
            self._sessions.setdefault(e.session_id, set()).add(e.key)
            self._session_bytes[e.session_id] = self._session_bytes.get(e.session_id, 0) + e.nbytes
        self._total += e.nbytes

    def _remove(self, key: EntryKey) -> SessionEntry | None:
        e = self._entries.pop(key, None)
        if e is None:
            return None
        trie = self._tries[e.model]
        trie.remove(e.tokens)
        if not len(trie):
            del self._tries[e.model]
        lineage = self._lineages[e.lineage]
        lineage.discard(key)
        if not lineage:
            del self._lineages[e.lineage]
        if e.session_id is not None:
            keys = self._sessions[e.session_id]
            keys.discard(key)
            self._session_bytes[e.session_id] -= e.nbytes
            if not keys:
                del self._sessions[e.session_id]
                del self._session_bytes[e.session_id]
        self._total -= e.nbytes
        return e

    def _evict_all(self, victims: Iterable[SessionEntry]) -> list[SessionEntry]:
        return [e for e in victims if self._remove(e.key) is not None]

    def _dispatch(self, evicted: Sequence[tuple[SessionEntry, str]], own: bool = True) -> None:
        """Hand evictions to `on_evict`, grouped by reason, outside the lock.

        `own`: evictions the bank made by itself (caps, retention, drops) get their
        span and count here; shrinks and expiry the governor asked for are recorded
        by the governor, once.
        """
        if not evicted:
            return
        by_reason: dict[str, list[SessionEntry]] = {}
        for e, reason in evicted:
            by_reason.setdefault(reason, []).append(e)
        with self._lock:
            for reason, group in by_reason.items():
                self._evictions[reason] += len(group)
        for reason, group in by_reason.items():
            if own:
                self._record_own(reason, group)
            if self._on_evict is not None:
                try:
                    self._on_evict(group, reason)
                except Exception:  # a faulty hook must not undo or block the policy
                    _log.exception("session bank on_evict hook failed (reason=%s)", reason)

    def _record_own(self, reason: str, group: Sequence[SessionEntry]) -> None:
        tracer = self._tracer or telemetry.tracer()
        attrs: dict[str, Any] = {
            names.ATTR_REASON: reason,
            names.ATTR_ENTRIES_EVICTED: len(group),
            names.ATTR_BYTES_FREED: sum(e.nbytes for e in group),
        }
        models = {e.model for e in group}
        if len(models) == 1:
            attrs[names.ATTR_MODEL] = next(iter(models))
        with tracer.start_as_current_span(names.SPAN_BANK_EVICT, attributes=attrs):
            pass
        self._metrics.evictions.add(len(group), {
            names.ATTR_REASON: reason, names.ATTR_EVICTION_KIND: "session_entry"})
