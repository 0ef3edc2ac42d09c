"""Quantized session snapshots (`--session-kv-bits 8|4`) against a cold run: do restored
turns give the same greedy output, and how far do the first restored step's logits move?

Two measurements per model and bit width, over the same prompts (random token ids,
seeded, of `--min-tokens`..`--max-tokens`):

* Greedy match, through the real pipeline (an in-process Service, as
  tests/integration/test_cold_tier.py builds one): turn 1 stores the snapshot of
  prompt + its 8 tokens; turn 2 (that + 3 new tokens, `--gen` tokens greedy,
  ignore_eos) restores it from RAM, then again from disk (the RAM entry shed and
  written first), and each output is compared with a cold run of the same prompt
  (no session). Reported: identical sequences out of N, the first divergence
  position of each that differs, the distinct tokens of the cold outputs (a
  degenerate, repeating output would prove little).
* Logits, with mlx-lm directly (not the engine: its batched prefill and, for bf16
  models, the float32 fast prefill differ from a plain forward in rounding): the
  prefix is prefilled once into a prompt cache, stored as the bank stores it
  (`engine.kv_snapshot.materialize(cache, bits)`), for disk also saved and loaded
  with mlx-lm's own prompt-cache files, thawed (`thaw`), and the 3 new tokens run on
  it; the last position's logits are compared with a one-pass cold forward of the
  whole prompt. Bits 0 is the baseline (for the greedy runs too): what restoring a
  full-precision snapshot, i.e. splitting the computation in two, alone moves.
  Reported: max |restored - cold| over the vocabulary (the worst prompt), the cold
  logits' own scale (max |logit|), the smallest top-1/top-2 gap of the cold logits,
  and how many restored argmaxes equal the cold one.

    .venv/bin/python -m tools.check_kv_bits --models tiny small --prompts 8

Measured on a 2-core Linux CPU (mlx-lm 0.32.2), 8 prompts of 276..1720 tokens, 32
tokens: tiny (float32) identical at 0 and 8 bits (8/8, RAM and disk), 4 bits 4/8;
first-step logits max |diff| 4.8e-7 / 7.9e-4 / 1.3e-2 at 0 / 8 / 4 bits (cold max
|logit| 0.82). small (bfloat16) with the default fast prefill: 2/8 at 0 bits, 3/8 at
8, 1/8 at 4; with `--no-fast-prefill` 8/8 at 0 bits and 4/8 at 8; logits max |diff|
0 / 2.0e-2 / 6.4e-2 (cold max |logit| 1.86, smallest top-2 gap 2.3e-2). About 10 s
for tiny, 6.5 min for small (9 min with --no-fast-prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.demo_models import ensure_demo_model
from engine.model_engine import EngineSettings
from service.assembly import Service
from service.generate import Admitted
from tools.harness.in_process import close, cold_tier_service, greedy_turn

FIRST_TOKENS = 8  # turn 1's output, part of the stored snapshot
NEW_TOKENS = 3


@dataclass
class Match:
    same: int = 0
    total: int = 0
    diverged_at: list[int] = field(default_factory=list)  # first differing position

    def add(self, got: list[int], want: list[int]) -> None:
        self.total += 1
        if got == want:
            self.same += 1
            return
        self.diverged_at.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=False))
                                      if a != b), min(len(got), len(want))))

    def __str__(self) -> str:
        extra = f" (diverged at {sorted(self.diverged_at)})" if self.diverged_at else ""
        return f"{self.same}/{self.total}{extra}"


@dataclass
class Logits:
    max_abs: float = 0.0
    argmax_same: int = 0
    total: int = 0

    def add(self, diff: float, same: bool) -> None:
        self.max_abs = max(self.max_abs, diff)
        self.argmax_same += int(same)
        self.total += 1


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(vocab, 1000)
    return [[rng.randrange(5, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def service(folder: str, path: Path, bits: int, fast_prefill: bool = True) -> Service:
    return await cold_tier_service(folder, path, "m", kv_bits=bits, min_prefix_tokens=8,
                                   engine=EngineSettings(fast_prefill=fast_prefill))


async def turn(svc: Service, tokens: list[int], sid: str, n: int) -> tuple[Admitted, list[int]]:
    return await greedy_turn(svc, "m", tokens, sid, n)


async def greedy(path: Path, bits: int, cases: list[list[int]], gen: int, fast_prefill: bool
                 ) -> tuple[Match, Match, list[int], list[tuple[list[int], list[int]]]]:
    """(RAM match, disk match, distinct tokens per cold output, (prefix, next) pairs)."""
    with tempfile.TemporaryDirectory(prefix="check-kv-bits-") as folder:
        return await _greedy(folder, path, bits, cases, gen, fast_prefill)


async def _greedy(folder: str, path: Path, bits: int, cases: list[list[int]], gen: int,
                  fast_prefill: bool
                  ) -> tuple[Match, Match, list[int], list[tuple[list[int], list[int]]]]:
    svc = await service(folder, path, bits, fast_prefill)
    ram, disk, distinct, pairs = Match(), Match(), [], []
    try:
        for i, prompt in enumerate(cases):
            sid = f"s{i}"
            _, out1 = await turn(svc, prompt, sid, FIRST_TOKENS)
            prefix = prompt + out1
            nxt = prefix + [7 + i, 11 + i, 13 + i][:NEW_TOKENS]
            pairs.append((prefix, nxt))
            cold_start, cold = await turn(svc, nxt, "", gen)
            assert cold_start.cached_tokens == 0
            distinct.append(len(set(cold)))
            warm, out = await turn(svc, nxt, sid, gen)
            assert (warm.cached_tokens, warm.cached_disk_tokens) == (len(prefix), 0), warm
            ram.add(out, cold)
            svc.bank.drop_session(sid)  # turn 2's own snapshot
            _, again = await turn(svc, prompt, sid, FIRST_TOKENS)
            assert again == out1, "turn 1 is not deterministic"
            svc.bank.shrink_to_bytes(0)
            assert svc.cold.flush(60)
            warm, out = await turn(svc, nxt, sid, gen)
            assert warm.cached_disk_tokens == len(prefix), warm
            disk.add(out, cold)
            svc.bank.drop_session(sid)
            svc.cold.drop_session(sid)
    finally:
        await close(svc)
    return ram, disk, distinct, pairs


def logits(path: Path, pairs: list[tuple[list[int], list[int]]], bit_widths: list[int]
           ) -> tuple[dict[tuple[int, str], Logits], float, float]:
    """Per (bits, "ram"|"disk"): the logit figures; the cold logits' scale and smallest
    top-1/top-2 gap over the prompts."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    from engine.kv_snapshot import materialize, thaw

    model, _ = load(str(path))
    out: dict[tuple[int, str], Logits] = {}
    scale, gap = 0.0, float("inf")
    tmp = tempfile.TemporaryDirectory(prefix="check-kv-bits-logits-")
    folder = Path(tmp.name)
    for prefix, nxt in pairs:
        cold = model(mx.array(nxt)[None], cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
        top2 = mx.sort(cold)[-2:]
        mx.eval(cold, top2)
        scale = max(scale, float(mx.abs(cold).max()))
        gap = min(gap, float(top2[1] - top2[0]))
        want = int(mx.argmax(cold))
        base = make_prompt_cache(model)
        mx.eval(model(mx.array(prefix)[None], cache=base))
        # The prefix's keys and values, trimmed to its length (new array objects: a
        # forward's in-place update of one restored cache cannot reach `base`).
        states = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset)
                  for c in base]
        for bits in bit_widths:
            for where in ("ram", "disk"):
                cache = make_prompt_cache(model)
                for c, state in zip(cache, states, strict=True):
                    c.state = state
                snap = materialize(cache, bits)
                if where == "disk":
                    file = folder / f"snap-{bits}.safetensors"
                    save_prompt_cache(str(file), snap)
                    snap = load_prompt_cache(str(file))
                restored = thaw(snap)
                got = model(mx.array(nxt[len(prefix):])[None], cache=restored)[0, -1]
                got = got.astype(mx.float32)
                diff = float(mx.abs(got - cold).max())
                out.setdefault((bits, where), Logits()).add(diff, int(mx.argmax(got)) == want)
    tmp.cleanup()
    return out, scale, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--bits", nargs="+", type=int, default=[0, 8, 4],
                    help="bit widths for the greedy runs (the logits always add 0)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn 2")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-fast-prefill", dest="fast_prefill", action="store_false",
                    help="the engine's stock prefill (as `serve --no-fast-prefill`)")
    ap.add_argument("--no-logits", dest="logits", action="store_false",
                    help="the greedy runs only")
    args = ap.parse_args()

    rows: list[str] = []
    for size in args.models:
        path = ensure_demo_model(size)
        cfg = json.loads((path / "config.json").read_text())
        cases = prompts(args.prompts, args.min_tokens, args.max_tokens, cfg["vocab_size"],
                        args.seed)
        lengths = sorted(len(p) for p in cases)
        print(f"\n{size}: {cfg.get('torch_dtype')} weights, head_dim {cfg.get('head_dim')}, "
              f"{len(cases)} prompts of {lengths[0]}..{lengths[-1]} tokens, {args.gen} "
              f"tokens greedy per turn, fast prefill {'on' if args.fast_prefill else 'off'}")
        pairs: list[tuple[list[int], list[int]]] = []
        for bits in args.bits:
            t0 = time.monotonic()
            ram, disk, distinct, pairs = asyncio.run(greedy(path, bits, cases, args.gen,
                                                            args.fast_prefill))
            print(f"  {bits}-bit greedy: RAM {ram}, disk {disk}; cold outputs' distinct tokens "
                  f"{distinct} ({time.monotonic() - t0:.0f}s)")
            rows.append(f"{size:>6} {bits:>4} {'greedy identical':<22} RAM {ram}; disk {disk}")
        if not args.logits:
            continue
        t0 = time.monotonic()
        figures, scale, gap = logits(path, pairs, sorted({0, *args.bits}))
        print(f"  logits ({time.monotonic() - t0:.0f}s): cold max |logit| {scale:.3f}, smallest "
              f"top-1/top-2 gap {gap:.2e}")
        for (bits, where), f in sorted(figures.items()):
            line = (f"{size:>6} {bits:>4} {'first-step logits ' + where:<22} max |diff| "
                    f"{f.max_abs:.3e} ({f.max_abs / scale:.2e} of max |logit|), argmax same "
                    f"{f.argmax_same}/{f.total}")
            print("  " + line.strip())
            rows.append(line)
        rows.append(f"{size:>6}      cold logits: max |logit| {scale:.3f}, smallest top-2 gap "
                    f"{gap:.2e}")
    print("\n model bits measure                figures")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
