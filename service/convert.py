"""Wire (plimsoll.v1 messages) ↔ domain objects. Nothing here decides anything."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from engine.pool import ModelEntry, ModelState
from engine.request import ChatMessage, Chunk, Finished, FinishReason, SamplingParams
from plimsoll.v1 import control_pb2, inference_pb2
from service.runtime import Admitted, GenerateSpec

_FINISH = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
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
        model=req.model,
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
    )


def start_to_wire(a: Admitted) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        start=inference_pb2.GenerateStart(
            request_id=a.request_id,
            model=a.model_id,
            prompt_tokens=a.prompt_tokens,
            cached_tokens=a.cached_tokens,
            pressure_level=a.pressure_level,
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
                queue_seconds=f.queue_seconds,
                time_to_first_token_seconds=f.ttft_seconds,
                decode_seconds=f.decode_seconds,
                tokens_per_second=tps,
            ),
        )
    )


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def model_to_wire(e: ModelEntry) -> control_pb2.ModelInfo:
    info = control_pb2.ModelInfo(
        id=e.model_id,
        source=e.source,
        state=_STATE[e.state],
        measured_bytes=e.measured_bytes if e.state == ModelState.READY else 0,
        active_requests=e.active_requests,
        waiting_requests=e.waiting_requests,
        pinned=e.pinned,
        context_length=e.context_length,
        kv_bytes_per_token=e.kv_bytes_per_token,
        is_default=e.is_default,
    )
    if e.last_used_wall:
        info.last_used.CopyFrom(timestamp(e.last_used_wall))
    return info
