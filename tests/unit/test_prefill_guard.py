"""The engine's prefill planner over memory.chunking, with scripted readings."""

from memory.ceiling import compute_limits
from memory.chunking import PrefillFigures, prefill_abort_line
from memory.config import MemoryConfig
from memory.levels import GIB, MIB
from memory.plans.admission import AdmissionRequest, prefill_transient_bytes
from memory.plans.tick import plan_propagate
from memory.readings import MemoryReadings
from service.engines import PrefillGuard

# 256 KiB of KV per token, one head: a chunk costs 5 x 256 KiB per token (its KV and
# activations) plus 8 bytes per prompt token of scores; PROMPT keeps that small.
KV = 256 * 1024
PROMPT = 1024


def guard_for(readings: MemoryReadings, config: MemoryConfig) -> PrefillGuard:
    """A guard updated the way the governor does it every tick (PropagateLimits)."""
    limits = compute_limits(readings, config)
    p = plan_propagate(readings, limits)
    g = PrefillGuard(PrefillFigures(KV), min_chunk=32, max_chunk=2048)
    g.update(p.ceiling_bytes, p.abort_cap_bytes, p.non_mlx_bytes, p.tier)
    return g


def guard_at(process_bytes: int, mlx_active: int) -> PrefillGuard:
    config = MemoryConfig.from_mapping({"custom_ceiling_gib": 4})  # custom: fraction 0.95
    readings = MemoryReadings(process_bytes=process_bytes, system_total_bytes=64 * GIB,
                              mlx_active_bytes=mlx_active)
    return guard_for(readings, config)


def test_without_limits_the_step_is_the_max():
    g = PrefillGuard(PrefillFigures(1024), min_chunk=32, max_chunk=512)
    assert g.plan(0, 10_000) == (512, False)
    assert g.plan(0, 100) == (100, False)


def test_chunk_shrinks_near_the_ceiling():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)  # 512 MiB outside MLX
    roomy, abort = g.plan(512 * MIB, 100_000, PROMPT)
    assert not abort and roomy == 2048
    # 4 GiB * 0.95 (custom) = 3.8 GiB target.
    per_token = 5 * KV + 8 * PROMPT
    tight, abort = g.plan(int(3.7 * GIB) - 512 * MIB, 100_000, PROMPT)
    assert not abort
    assert tight == int((0.95 * 4 * GIB - int(3.7 * GIB)) // per_token)
    assert 32 <= tight < 2048


def test_aborts_when_even_the_smallest_chunk_crosses_the_margin():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    chunk, abort = g.plan(int(4 * GIB * 0.95) - 512 * MIB, 100_000, PROMPT)
    assert chunk == 32 and abort


def test_measured_cost_raises_the_estimate_and_a_lucky_chunk_never_lowers_it():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    static = g.cost.linear(PROMPT)
    g.observe(100, 100 * 4 * MIB, PROMPT)  # ~3x the estimate measured
    assert g.cost_factor > 2.5
    assert g.cost.linear(PROMPT)[0] > static[0]
    for _ in range(30):
        g.observe(100, 0, PROMPT)  # pooled buffers reused: nothing grew
    assert g.cost_factor == 1.0 and g.cost.linear(PROMPT) == static


def test_a_long_prompt_measured_does_not_overstate_a_short_one():
    """The factor is learned over the estimate, whose attention grows with the prompt:
    4,000-token chunks that cost what was estimated leave a 100-token prompt's chunk at
    its own (small) estimate, not at a per-token figure of the long prompt."""
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    figures = g.cost.figures
    for _ in range(5):
        g.observe(512, figures.chunk_bytes(512, 4000), 4000)
    assert g.cost_factor == 1.0
    assert g.cost.linear(100)[0] == 5 * KV + 8 * 100


def test_the_guard_lets_run_what_admission_admits():
    """At the last chunk the guard projects what admission projected for the whole
    prompt (same figures, same factor): usage that admission found just under the line
    leaves the guard's last chunk just under it too."""
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    g.observe(512, 3 * g.cost.figures.chunk_bytes(512, 2048), 2048)  # learned 3x
    prompt, step = 2048, 512
    req = AdmissionRequest(model="m", prompt_tokens=tuple(range(prompt)), max_tokens=0,
                           kv_bytes_per_token=KV, prefill_step_size=step,
                           prefill_cost_factor=g.cost_factor)
    limits = g.limits
    line = prefill_abort_line(limits.tier, limits.abort_cap_bytes, limits.ceiling_bytes)
    projected_extra = prompt * KV + prefill_transient_bytes(req, prompt)
    usage = line - projected_extra  # admitted with nothing to spare
    # The guard before the last chunk: the earlier chunks' KV is in usage now.
    active = usage - limits.non_mlx_bytes + (prompt - step) * KV
    chunk, abort = g.plan(active, step, prompt)
    assert (chunk, abort) == (step, False)
    # More usage than admission saw and the guard runs a smaller chunk.
    assert g.plan(active + step * KV, step, prompt)[0] < step


def test_chunk_target_follows_the_dynamic_ceiling_not_the_stable_cap():
    """64 GiB machine, balanced: static 58 GiB; the system can give only enough for a
    50 GiB dynamic ceiling. Chunks aim at 0.92 x 50 GiB and never past the ceiling."""
    process = 10 * GIB
    readings = MemoryReadings(process_bytes=process, system_total_bytes=64 * GIB,
                              mlx_active_bytes=process, footprint_bytes=process,
                              system_available_bytes=40 * GIB)
    g = guard_for(readings, MemoryConfig())
    assert g.ceiling == 50 * GIB and g.abort_cap == 58 * GIB
    target = int(0.92 * 50 * GIB)
    # Headroom of 100 tokens under the target.
    per_token = 5 * KV + 8 * PROMPT
    chunk, abort = g.plan(target - 100 * per_token, 100_000, PROMPT)
    assert (chunk, abort) == (100, False)
    # At 0.93 of the stable cap (53.9 GiB) a chunk would run past the 50 GiB ceiling.
    chunk, abort = g.plan(50 * GIB - 16 * MIB, 100_000, PROMPT)
    assert abort
