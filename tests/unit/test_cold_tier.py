"""The cold tier against real files: real mlx-lm caches written with its own
save_prompt_cache, read back, checked, collected (sessions/cold_tier.py)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from memory.plans import spill
from sessions import disk_format as fmt
from sessions.bank import SessionEntry
from sessions.cold_tier import ColdTier, ColdTierSettings

MiB = 1 << 20
COMPAT = fmt.CompatKey(model_hash="h1", mlx_lm=fmt.mlx_lm_version(), kv_dtype="float32",
                       kv_bits=0)


def snapshot(tokens: int, seed: int = 0, layers: int = 2, dim: int = 32) -> list[KVCache]:
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, 2, tokens, dim))
        c.update_and_fetch(k, k + 1)
        c.keys, c.values = c.keys[..., :tokens, :], c.values[..., :tokens, :]  # no step padding
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def entry(tokens: int, sid: str = "s1", seed: int = 0, first: int = 0) -> SessionEntry:
    cache = snapshot(tokens, seed)
    return SessionEntry(model="m", tokens=tuple(range(first, first + tokens)), session_id=sid,
                        payload=cache, nbytes=sum(c.nbytes for c in cache))


def tier(folder: Path, **kw) -> ColdTier:
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("min_prefix_tokens", 4)
    t = ColdTier(ColdTierSettings(directory=folder, **kw), **kw.pop("_hooks", {})).open()
    t.register_model("m", COMPAT)
    return t


def restore(t: ColdTier, tokens) -> list:
    rec = t.lookup("m", tokens)
    assert rec is not None and t.claim(rec)
    try:
        return fmt.load_snapshot(t.read(rec), rec.compat)
    finally:
        t.release(rec)


def test_spill_rebuild_and_restore_identical(tmp_path):
    t = tier(tmp_path)
    e = entry(100)
    t.offer([e], "memory_pressure")
    assert t.flush(10)
    s = t.stats()
    assert (s.entries, s.writes, s.bytes) == (1, 1, s.written_bytes) and s.bytes > e.nbytes
    t.close()
    again = tier(tmp_path)  # a restart: the index comes from the files
    assert again.stats().entries == 1
    assert again.lookup("m", range(100)) is None  # strict prefix only
    cache = restore(again, list(range(100)) + [7])
    for got, want in zip(cache, e.payload, strict=True):
        assert got.offset == 100 and mx.array_equal(got.keys, want.keys).item()
        assert mx.array_equal(got.values, want.values).item()


def test_reasons_that_are_not_worth_a_copy_are_counted_not_written(tmp_path):
    t = tier(tmp_path)
    t.offer([entry(100)], "superseded")
    t.offer([entry(2)], "idle_ttl")  # under min_prefix_tokens
    assert t.flush(10)
    s = t.stats()
    assert s.entries == 0 and s.drops == {spill.DROP_NOT_SPILLABLE: 1, spill.DROP_TOO_SHORT: 1}


def test_corrupted_file_is_detected_never_restored_and_removed(tmp_path):
    t = tier(tmp_path)
    t.offer([entry(100)], "memory_pressure")
    assert t.flush(10)
    (data,) = tmp_path.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # same size, one flipped byte
    data.write_bytes(bytes(raw))
    rec = t.lookup("m", range(101))
    assert t.claim(rec)
    with pytest.raises(fmt.CorruptSnapshot):
        t.read(rec)
    assert not list(tmp_path.iterdir()) and t.lookup("m", range(101)) is None
    assert t.stats().collected == {spill.COLLECT_CORRUPT: 1}


def test_truncated_file_is_collected_at_start_and_at_read(tmp_path):
    t = tier(tmp_path)
    t.offer([entry(100), entry(50, sid="s2", first=1000)], "memory_pressure")
    assert t.flush(10)
    t.close()
    files = sorted(tmp_path.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    os.truncate(files[-1], files[-1].stat().st_size // 2)
    again = tier(tmp_path)
    assert again.stats().entries == 1 and again.stats().collected == {spill.COLLECT_CORRUPT: 1}
    os.truncate(files[0], 100)  # truncated while running: the read catches it
    rec = again.lookup("m", list(range(1000, 1050)) + [1])
    assert again.claim(rec)
    with pytest.raises(fmt.CorruptSnapshot):
        again.read(rec)
    assert not list(tmp_path.iterdir())


def test_files_of_another_model_or_mlx_lm_are_collected(tmp_path):
    t = tier(tmp_path)
    t.offer([entry(100), entry(60, sid="s2", first=500)], "memory_pressure")
    assert t.flush(10)
    t.close()
    # One record made by another mlx-lm; the model itself is now loaded with other weights.
    rec_path = next(p for p in tmp_path.glob("*.json")
                    if json.loads(p.read_text())["session_id"] == "s2")
    d = json.loads(rec_path.read_text())
    d["compat_key"]["mlx_lm"] = "0.0.1"
    rec_path.write_text(json.dumps(d))
    again = ColdTier(ColdTierSettings(directory=tmp_path, min_free_bytes=0)).open()
    assert again.stats().entries == 1
    assert again.stats().collected == {spill.COLLECT_INCOMPATIBLE: 1}
    other = fmt.CompatKey(model_hash="h2", mlx_lm=COMPAT.mlx_lm, kv_dtype="float32", kv_bits=0)
    assert again.register_model("m", other) == 1
    assert again.lookup("m", range(101)) is None and not list(tmp_path.iterdir())


def test_write_budget_per_hour_is_enforced(tmp_path):
    e1 = entry(100)
    t = tier(tmp_path, write_budget_bytes_per_hour=int(e1.nbytes * 1.5))
    t.offer([e1], "memory_pressure")
    assert t.flush(10)
    t.offer([entry(100, sid="s2", first=300)], "memory_pressure")
    assert t.flush(10)
    s = t.stats()
    assert s.writes == 1 and s.drops == {spill.DROP_WRITE_BUDGET: 1}


def test_a_full_queue_is_a_counted_pressure_signal(tmp_path):
    signals = []
    hold = threading.Event()

    class Gate:  # the model's store-cache gate, closed until `hold` is set
        def try_acquire(self) -> bool:
            return hold.is_set()

        def release(self) -> None:
            pass

    t = ColdTier(ColdTierSettings(directory=tmp_path, min_free_bytes=0, min_prefix_tokens=4,
                                  queue_entries=2),
                 gate_for=lambda _m: Gate(), on_queue_full=lambda: signals.append(1)).open()
    t.register_model("m", COMPAT)
    t.offer([entry(20, sid="s0")], "memory_pressure")
    for _ in range(1000):  # until a writer holds it (waiting for the gate)
        if t.stats().pending_writes == 1 and not t._queue:
            break
        threading.Event().wait(0.005)
    t.offer([entry(20, sid=f"s{i}", first=100 * i) for i in range(1, 5)], "memory_pressure")
    s = t.stats()
    # One is with a writer (waiting for the gate), two are queued, two did not fit.
    assert s.drops == {spill.DROP_QUEUE_FULL: 2} and signals == [1]
    assert s.pending_writes == 3 and s.pending_bytes > 0 and s.writes == 0
    hold.set()
    assert t.flush(10) and t.stats().writes == 3


def test_lru_keeps_the_tier_in_its_byte_budget_and_supersede(tmp_path):
    e = entry(100)
    t = tier(tmp_path, cap_bytes=int(e.nbytes * 2.5))
    for i in range(3):
        t.offer([entry(100, sid=f"s{i}", first=1000 * i)], "memory_pressure")
        assert t.flush(10)
    s = t.stats()
    assert s.entries == 2 and s.collected == {spill.COLLECT_LRU: 1} and s.bytes <= t.budget_bytes
    assert t.lookup("m", range(101)) is None  # the oldest went


def test_a_longer_prefix_of_the_same_session_supersedes_on_disk(tmp_path):
    t = tier(tmp_path)
    t.offer([entry(100), entry(100, sid="other", first=5000)], "memory_pressure")
    assert t.flush(10)
    t.offer([entry(150)], "idle_ttl")  # covers s1's 100-token entry, not other's
    assert t.flush(10)
    s = t.stats()
    assert s.entries == 2 and s.collected == {spill.COLLECT_SUPERSEDED: 1}


@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_drops_with_a_reason_and_leaves_no_partial_file(small_disk):
    # The budget is far above the 4 MiB disk: only the free-space check and ENOSPC guard it.
    t = tier(small_disk, cap_bytes=1 << 40, budget_fraction=1.0)
    t.budget_bytes = 1 << 40
    entries = [entry(1024, sid=f"s{i}", first=10_000 * i) for i in range(8)]  # ~1 MiB each
    for e in entries:
        t.offer([e], "memory_pressure")
        assert t.flush(10)
    s = t.stats()
    assert 1 <= s.writes < 8
    assert s.drops.get(spill.DROP_DISK_FULL, 0) + s.drops.get(spill.DROP_WRITE_FAILED, 0) \
        == 8 - s.writes
    assert not [p for p in small_disk.iterdir() if p.name.startswith(fmt.TMP_PREFIX)]
    for rec, _ in t.entries():  # what was written is whole
        restore(t, list(rec.tokens) + [1])
    t.close()
