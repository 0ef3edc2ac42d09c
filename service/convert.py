"""Wire (plimsoll.v1 messages) ↔ domain objects. Nothing here decides anything."""

from __future__ import annotations

import re
import time

from google.protobuf import duration_pb2, timestamp_pb2

from engine.pool import KeepAlive, ModelEntry, ModelState
from engine.request import ChatMessage, Chunk, Finished, FinishReason, SamplingParams
from memory import ceiling
from memory.ceiling import Limits
from memory.levels import PressureLevel, Tier
from memory.plans.admission import admission_lines
from plimsoll.v1 import control_pb2, inference_pb2, types_pb2
from service.generate import Admitted, GenerateSpec
from sessions.leases import HeldLease

_FINISH = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: inference_pb2.FINISH_REASON_ABORTED,
}
_TERMS = {
    ceiling.TERM_STATIC: types_pb2.CEILING_TERM_STATIC,
    ceiling.TERM_DYNAMIC: types_pb2.CEILING_TERM_DYNAMIC,
    ceiling.TERM_CONTAINER: types_pb2.CEILING_TERM_CONTAINER,
    ceiling.TERM_DEVICE: types_pb2.CEILING_TERM_DEVICE,
    ceiling.TERM_CUSTOM: types_pb2.CEILING_TERM_CUSTOM,
    ceiling.TERM_OPERATOR: types_pb2.CEILING_TERM_OPERATOR,
}
_TIERS = {
    Tier.SAFE: types_pb2.MEMORY_GUARD_TIER_SAFE,
    Tier.BALANCED: types_pb2.MEMORY_GUARD_TIER_BALANCED,
    Tier.AGGRESSIVE: types_pb2.MEMORY_GUARD_TIER_AGGRESSIVE,
    Tier.CUSTOM: types_pb2.MEMORY_GUARD_TIER_CUSTOM,
}
_OS_PRESSURE = {
    "normal": types_pb2.OS_PRESSURE_NORMAL,
    "warning": types_pb2.OS_PRESSURE_WARNING,
    "critical": types_pb2.OS_PRESSURE_CRITICAL,
}
_STATE = {
    ModelState.LOADING: control_pb2.MODEL_STATE_LOADING,
    ModelState.READY: control_pb2.MODEL_STATE_READY,
    ModelState.UNLOADING: control_pb2.MODEL_STATE_UNLOADING,
    ModelState.UNLOADED: control_pb2.MODEL_STATE_UNLOADED,
}


def sampling_from_wire(s: inference_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        repetition_penalty=(
            s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
        ),
        seed=s.seed if s.HasField("seed") else None,
    )


def spec_from_wire(req: inference_pb2.GenerateRequest) -> GenerateSpec:
    which = req.WhichOneof("prompt")
    return GenerateSpec(
        model=req.model_id,
        text=req.text if which == "text" else None,
        token_ids=list(req.token_ids.ids) if which == "token_ids" else None,
        chat=(
            [ChatMessage(m.role, m.content) for m in req.chat.messages]
            if which == "chat"
            else None
        ),
        sampling=sampling_from_wire(req.sampling),
        max_tokens=req.max_tokens,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        session_id=req.session_id,
        admission_ticket=req.admission_ticket,
        max_tokens_per_chunk=req.max_tokens_per_chunk,
        keep_alive=keep_alive_from_wire(req.keep_alive) if req.HasField("keep_alive") else None,
        owner=req.owner,
    )


def keep_alive_from_wire(d: duration_pb2.Duration) -> KeepAlive:
    """Negative keeps the model loaded; zero unloads it once idle."""
    return KeepAlive.from_seconds(d.ToNanoseconds() / 1e9)


def start_to_wire(a: Admitted) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        start=inference_pb2.GenerateStart(
            request_id=a.request_id,
            model_id=a.model_id,
            prompt_tokens=a.prompt_tokens,
            cached_tokens=a.cached_tokens,
            pressure_level=a.pressure_level,
            cached_disk_tokens=a.cached_disk_tokens,
        )
    )


def chunk_to_wire(c: Chunk) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        chunk=inference_pb2.GenerateChunk(token_ids=c.token_ids, text=c.text)
    )


def end_to_wire(f: Finished) -> inference_pb2.GenerateResponse:
    tps = f.completion_tokens / f.decode_seconds if f.decode_seconds > 0 else 0.0
    return inference_pb2.GenerateResponse(
        end=inference_pb2.GenerateEnd(
            finish_reason=_FINISH[f.reason],
            usage=inference_pb2.Usage(
                prompt_tokens=f.prompt_tokens,
                cached_tokens=f.cached_tokens,
                completion_tokens=f.completion_tokens,
            ),
            timings=inference_pb2.Timings(
                queue_duration=duration(f.queue_seconds),
                time_to_first_token=duration(f.ttft_seconds),
                decode_duration=duration(f.decode_seconds),
                tokens_per_second=tps,
            ),
            matched_stop=f.matched_stop,
        )
    )


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def duration(seconds: float) -> duration_pb2.Duration:
    """To the nearest nanosecond: a lifetime computed as (t + 300.0) - t is 300 s less a
    float rounding at some clock readings t, and truncating it read 299.999999999 s."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def model_to_wire(e: ModelEntry) -> control_pb2.ModelInfo:
    info = control_pb2.ModelInfo(
        model_id=e.model_id,
        source=e.source,
        state=_STATE[e.state],
        measured_bytes=e.measured_bytes if e.state == ModelState.READY else 0,
        active_requests=e.active_requests,
        waiting_requests=e.waiting_requests,
        pinned=e.pinned,
        context_length=e.context_length,
        kv_bytes_per_token=e.kv_bytes_per_token,
        is_default=e.is_default,
        batch_cap=e.engine.batch_cap if e.engine else 0,
        store_cache_cap=e.engine.store_gate.cap if e.engine else 0,
        pending_unload=e.pending_unload_reason,
    )
    if e.last_used_wall:
        info.last_used_time.CopyFrom(timestamp(e.last_used_wall))
    if e.keep_alive_s is not None:
        info.keep_alive.CopyFrom(duration(e.keep_alive_s))
        if e.state == ModelState.READY and not e.pinned and not e.busy and e.last_used_wall:
            info.expire_time.CopyFrom(timestamp(e.last_used_wall + e.keep_alive_s))
    return info


# -- memory → wire --------------------------------------------------------------------

_READING_FIELDS = (
    "process_bytes", "mlx_active_bytes", "mlx_pool_bytes", "footprint_bytes",
    "system_total_bytes", "system_available_bytes", "container_limit_bytes",
    "container_usage_bytes", "device_limit_bytes",
)


def readings_to_wire(r) -> types_pb2.MemoryReadings:
    msg = types_pb2.MemoryReadings(os_pressure=_OS_PRESSURE.get(r.os_pressure or "", 0),
                                   sources=r.sources)
    for name in _READING_FIELDS:
        value = getattr(r, name)
        if value is not None:
            setattr(msg, name, int(value))
    return msg


def limits_to_wire(limits: Limits) -> types_pb2.MemoryLimits:
    admission = admission_lines(limits)
    return types_pb2.MemoryLimits(
        ceiling_bytes=limits.ceiling_bytes,
        soft_bytes=limits.soft_bytes,
        hard_bytes=limits.hard_bytes,
        abort_cap_bytes=limits.abort_cap_bytes,
        binding_term=_TERMS[limits.binding_term],
        terms=[types_pb2.CeilingTermBytes(term=_TERMS[k], bytes=int(v))
               for k, v in limits.terms.items()],
        tier=_TIERS[limits.tier],
        admission_limit_bytes=admission.limit_bytes,
        admission_shed_bytes=admission.shed_bytes,
    )


def level_to_wire(level: PressureLevel) -> int:
    """The domain level's value is the wire enum's (EMERGENCY included)."""
    return int(level)


def transition_to_wire(t, readings, limits) -> control_pb2.PressureTransition:
    return control_pb2.PressureTransition(
        from_level=int(t.from_level),
        to_level=level_to_wire(t.to_level),
        readings=readings_to_wire(readings),
        limits=limits_to_wire(limits),
        reason=transition_reason(t),
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def transition_reason(t) -> str:
    """Why, in figures: "usage 7.10 GiB >= hard 6.90 GiB (poll)"."""
    u = _gib(t.usage_bytes)
    match t.to_level:
        case PressureLevel.EMERGENCY:
            crossed = f"usage {u} >= ceiling {_gib(t.ceiling_bytes)}"
        case PressureLevel.HARD:
            crossed = f"usage {u} >= hard {_gib(t.hard_bytes)}"
        case PressureLevel.SOFT if t.to_level > t.from_level:
            crossed = f"usage {u} >= soft {_gib(t.soft_bytes)}"
        case PressureLevel.SOFT:
            crossed = f"usage {u} < hard {_gib(t.hard_bytes)}"
        case _:
            crossed = f"usage {u} < soft {_gib(t.soft_bytes)}"
    return f"{crossed} ({t.reason})"


def sample_to_wire(sample, admission: types_pb2.AdmissionState) -> control_pb2.PressureSample:
    return control_pb2.PressureSample(
        level=level_to_wire(sample.level),
        readings=readings_to_wire(sample.readings),
        limits=limits_to_wire(sample.limits),
        admission=admission,
    )


# memory.recording's event kinds → the wire enum (a kind missing here fails at import
# of the test that checks every TABLE entry).
ACTION_KINDS = {
    "clear_aux_caches": control_pb2.ENFORCER_ACTION_KIND_CLEAR_AUX_CACHES,
    "pressure_reclaim": control_pb2.ENFORCER_ACTION_KIND_PRESSURE_RECLAIM,
    "idle_reclaim": control_pb2.ENFORCER_ACTION_KIND_IDLE_RECLAIM,
    "shrink_sessions": control_pb2.ENFORCER_ACTION_KIND_SHRINK_SESSIONS,
    "expire_sessions": control_pb2.ENFORCER_ACTION_KIND_EXPIRE_SESSIONS,
    "evict_model": control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL,
    "abort_requests": control_pb2.ENFORCER_ACTION_KIND_ABORT_REQUESTS,
    "mark_pending_unload": control_pb2.ENFORCER_ACTION_KIND_MARK_PENDING_UNLOAD,
    "abort_load": control_pb2.ENFORCER_ACTION_KIND_ABORT_LOAD,
    "prefill_abort": control_pb2.ENFORCER_ACTION_KIND_PREFILL_ABORT,
    "refuse": control_pb2.ENFORCER_ACTION_KIND_REFUSE_ADMISSION,
    "refuse_load": control_pb2.ENFORCER_ACTION_KIND_REFUSE_LOAD,
    "pause_admission": control_pb2.ENFORCER_ACTION_KIND_PAUSE_ADMISSION,
    "resume_admission": control_pb2.ENFORCER_ACTION_KIND_RESUME_ADMISSION,
    "store_cache_cap": control_pb2.ENFORCER_ACTION_KIND_STORE_CACHE_CAP,
    "batch_cap": control_pb2.ENFORCER_ACTION_KIND_BATCH_CAP,
}


# -- leases and sessions → wire ---------------------------------------------------------


def _wall(monotonic_at: float) -> float:
    return time.time() + (monotonic_at - time.monotonic())


def lease_to_wire(held: HeldLease) -> control_pb2.Lease:
    """A lease on a model or on a session's cache."""
    lease = held.lease
    msg = control_pb2.Lease(lease_id=lease.lease_id, owner=lease.owner,
                            client_request_id=lease.client_request_id)
    if lease.model_id:
        msg.model_id = lease.model_id
    else:
        msg.session_id = lease.session_id
    if held.expires_at is not None:
        msg.expire_time.CopyFrom(timestamp(_wall(held.expires_at)))
    return msg


def session_to_wire(info, pinned: bool) -> control_pb2.SessionInfo:
    return control_pb2.SessionInfo(
        session_id=info.session_id or "",
        entries=[
            control_pb2.SessionEntry(
                model_id=e.model, prefix_tokens=e.prefix_tokens, bytes=e.nbytes,
                terminal=e.terminal, hits=e.hits,
                last_access_time=timestamp(_wall(e.last_access)),
                tier=(control_pb2.SESSION_TIER_DISK if e.tier == "disk"
                      else control_pb2.SESSION_TIER_RAM),
            )
            for e in info.entries
        ],
        bytes=info.nbytes,
        active=info.active,
        pinned=pinned,
    )


def session_disk_to_wire(t) -> control_pb2.SessionDiskTier:
    """`sessions.cold_tier.ColdTierStats` on the wire."""
    return control_pb2.SessionDiskTier(
        directory=t.directory, budget_bytes=t.budget_bytes, bytes=t.bytes, entries=t.entries,
        pending_writes=t.pending_writes, pending_bytes=t.pending_bytes, writes=t.writes,
        written_bytes=t.written_bytes, written_last_hour_bytes=t.written_last_hour,
        write_budget_bytes_per_hour=t.write_budget_per_hour or 0, restores=t.restores,
        restore_failures=t.restore_failures, hits_ram=t.hits_ram, hits_disk=t.hits_disk,
        misses=t.misses, drops=t.drops, collected=t.collected,
        free_disk_bytes=t.free_disk_bytes, kv_bits=t.kv_bits)


def admission_to_wire(a) -> types_pb2.AdmissionState:
    """`service.assembly.AdmissionFigures` on the wire."""
    return types_pb2.AdmissionState(
        paused=a.paused, reserved_bytes=a.reserved_bytes, reservations=a.reservations,
        running=a.running, waiting=a.waiting, draining=a.draining,
        session_bank_bytes=a.session_bank_bytes,
    )


def label(enum_type, value: int) -> str:
    """A wire enum value as a short lowercase word: CEILING_TERM_DYNAMIC -> "dynamic"."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum_type.DESCRIPTOR.name).upper() + "_"
    return enum_type.Name(value).removeprefix(prefix).lower()
