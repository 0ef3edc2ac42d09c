"""Micro-benchmark: SessionBank lookup and put at 10,000 entries vs a linear-scan baseline.

The baseline is MTPLX's approach, measured in the same run: a dict keyed by
token tuples, `longest_prefix` as a scan over every key, and `put` with a scan
for covered prefixes and an LRU `min()` over every entry when over the count cap.

Workload: 1,000 conversations that start from 50 shared system prompts
(64-512 tokens) and grow in turns up to 2,048 tokens; each conversation leaves
10 prefix snapshots (64-2,048 tokens), 10,000 entries in all. Lookups are
prompts that extend a stored prefix (hits) or diverge inside one (misses).

    .venv/bin/python tools/bench_bank.py [--entries 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessions.bank import SessionBank, SessionEntry  # noqa: E402

VOCAB = 32_000


def make_workload(n_entries: int, rng: random.Random) -> tuple[list[tuple[int, ...]], list]:
    systems = [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(64, 512))) for _ in range(50)]
    per_conv = 10
    unique: dict[tuple[int, ...], None] = {}
    while len(unique) < n_entries:
        conv = rng.choice(systems) + tuple(rng.randrange(VOCAB) for _ in range(2048))
        cuts = sorted(rng.sample(range(64, 2049), per_conv))
        # Slices share the conversation's int objects; cuts inside a shared system
        # prompt can repeat a key, so dedupe.
        unique.update(dict.fromkeys(conv[:c] for c in cuts))
    keys = list(unique)[:n_entries]
    queries = []
    for _ in range(4000):
        k = rng.choice(keys)
        if rng.random() < 0.7:  # hit: the prompt extends a stored prefix
            queries.append(k + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 64))))
        else:  # miss or shorter hit: diverge somewhere inside the key
            cut = rng.randrange(1, len(k))
            queries.append(k[:cut] + (VOCAB + 1,) + k[cut + 1 :])
    return keys, queries


class LinearBank:
    """The baseline: MTPLX's dict + linear scans."""

    def __init__(self, max_entries: int) -> None:
        self.entries: dict[tuple[int, ...], list] = {}  # key -> [session, last_access, nbytes]
        self.max_entries = max_entries
        self.clock = 0

    def longest_prefix(self, prompt: tuple[int, ...]) -> tuple[int, ...] | None:
        best = None
        n = len(prompt)
        for k in self.entries:
            lk = len(k)
            if lk < n and (best is None or lk > len(best)) and prompt[:lk] == k:
                best = k
        return best

    def put(self, key: tuple[int, ...], session: str) -> None:
        self.clock += 1
        self.entries[key] = [session, self.clock, 1]
        covered = [k for k, v in self.entries.items()
                   if v[0] == session and len(k) < len(key) and key[: len(k)] == k]
        for k in covered:
            del self.entries[k]
        while len(self.entries) > self.max_entries:
            victim = min((k for k in self.entries if k != key),
                         key=lambda k: (self.entries[k][1], -self.entries[k][2]))
            del self.entries[victim]


def timed(op: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    op()
    return (time.perf_counter_ns() - t0) / 1000.0


def summary(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-ops", type=int, default=300)
    ap.add_argument("--ops", type=int, default=3000)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    keys, queries = make_workload(args.entries, rng)
    lens = [len(k) for k in keys]
    print(f"workload: {len(keys)} entries, prefix lengths {min(lens)}-{max(lens)} "
          f"(median {int(statistics.median(lens))}), {len(queries)} prompts")

    big = 1 << 60
    bank = SessionBank(max_entries=args.entries, max_bytes=big, per_session_max_bytes=big,
                       per_session_max_entries=args.entries, idle_ttl_s=None)
    base = LinearBank(max_entries=args.entries)
    fill: list[float] = []
    for i, k in enumerate(keys):
        # Anonymous entries (a shared prefix cache): no supersede, so all 10,000 stay.
        fill.append(timed(lambda k=k: bank.put(SessionEntry("m", k, None, None, 1))))
        base.entries[k] = [f"anon{i}", 0, 1]
    assert bank.entry_count() == len(keys)

    # Correctness first: both lookups agree on every prompt.
    for q in queries[:500]:
        hit = bank.restore_source("m", q)
        assert (hit.tokens if hit else None) == base.longest_prefix(q)

    rows = []
    trie_lookup = [timed(lambda q=q: bank.longest_prefix("m", q)) for q in queries[: args.ops]]
    lin_lookup = [timed(lambda q=q: base.longest_prefix(q)) for q in queries[: args.baseline_ops]]
    rows.append(("lookup (longest_prefix)", trie_lookup, lin_lookup))

    # put at the count cap: each put evicts one LRU entry; named sessions, so the
    # supersede walk runs too.
    new_keys = queries[: args.ops]
    trie_put = [timed(lambda q=q, i=i: bank.put(SessionEntry("m", q, f"s{i}", None, 1)))
                for i, q in enumerate(new_keys)]
    lin_put = [timed(lambda q=q, i=i: base.put(q, f"s{i}"))
               for i, q in enumerate(new_keys[: args.baseline_ops])]
    rows.append(("put at 10k cap (evicts 1)", trie_put, lin_put))
    assert bank.entry_count() == args.entries

    print(f"initial fill: put median {summary(fill)[0]:.1f} us over {len(fill)} entries")
    print(f"{'op':28s} {'trie med':>10s} {'trie p99':>10s} {'linear med':>11s} "
          f"{'linear p99':>11s} {'speed-up (median)':>18s}")
    for name, t, lin in rows:
        (tm, tp), (lm, lp) = summary(t), summary(lin)
        print(f"{name:28s} {tm:9.1f}us {tp:9.1f}us {lm:10.1f}us {lp:10.1f}us {lm / tm:17.0f}x")


if __name__ == "__main__":
    main()
