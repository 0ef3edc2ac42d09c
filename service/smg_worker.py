"""SMG's MLX worker protocol (`mlx.grpc.engine.MlxEngine`, PyPI `smg-grpc-proto`),
served beside `plimsoll.v1` on the same port so the Shepherd Model Gateway can put
Plimsoll workers behind its OpenAI / Anthropic front end.

Wire mapping only, the shape of `service.inference_servicer`: SMG's messages become a
`GenerateSpec` and go through the one Generate pipeline (tokenize → admit through the
governor → restore → submit → stream), so a request from SMG is admitted, shed,
restored from the session bank and aborted by the enforcer exactly like one of ours,
and its errors leave through the one status table (`service.status`): a shed is
RESOURCE_EXHAUSTED, an enforcer abort ABORTED, a drain UNAVAILABLE, each with
ErrorInfo and RetryInfo.

What SMG reads (smg 1.13.0; its Rust worker client and gateway):
- `HealthCheck.healthy` is its health probe for gRPC workers (every
  `--health-check-interval-secs`; `--health-failure-threshold` misses mark the worker
  not ready and routing skips it, `--health-success-threshold` hits bring it back).
  It is false while draining, while the default model is not ready, and while the
  governor's level is HARD or EMERGENCY: a worker that must shed says so before it
  is sent more. At OK and SOFT it is true (SOFT pauses admission but still serves).
  `message` carries the figures.
- `GetModelInfo` and `GetServerInfo` are read when the worker is registered (model
  id, context length, EOS ids). SMG has no load RPC for MLX workers (`GetLoads` is
  vLLM/SGLang only), so its load-aware policies count the requests it has in flight
  to each worker itself; `active_requests` is ours, honestly: running + waiting.
- `GetTokenizer` streams the tokenizer bundle (service/smg_tokenizer.py).
- `Abort` ends a stream the gateway dropped (its client went away).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto import mlx_engine_pb2, mlx_engine_pb2_grpc

from engine.errors import Aborted, PlimsollError, Violations
from engine.loading import resolve_source
from engine.model_engine import ModelEngine
from engine.pool import ModelEntry, ModelState
from engine.request import Chunk, Finished, FinishReason, SamplingParams
from memory.levels import PressureLevel
from service import status
from service.assembly import Service
from service.generate import Admitted, GenerateSpec
from service.smg_tokenizer import BundleCache, bundle_chunks

SERVICE_NAME = mlx_engine_pb2.DESCRIPTOR.services_by_name["MlxEngine"].full_name
SERVER_TYPE = "plimsoll"

# gRPC metadata that names a session. SMG 1.13.0 forwards none of its client's
# headers to gRPC workers (its calls carry only `user-agent: tonic/…`), so this is for
# a client that calls a worker directly, or a gateway that does forward one.
SESSION_METADATA = ("x-session-id", "x-smg-routing-key")
# Without one, a request's session in the bank is its conversation's lineage: the hash
# of its leading tokens, which every later turn repeats (SMG's prefix_hash policy
# routes on the same window, 256 tokens by default). Restores match by exact token
# prefix whatever the label; the label groups a conversation's snapshots so a turn
# supersedes the one before it. Conversations that share all of these leading tokens
# share a label (and its retention of the newest few snapshots).
LINEAGE_TOKENS = 256
LINEAGE_CHARS = 4 * LINEAGE_TOKENS  # untokenized input: SMG's own 4-characters rule

# SMG's MLX servicer treats an unset temperature as 1.0 (OpenAI's default); so do we,
# which is why the gateway's requests say temperature=0 when they mean greedy.
DEFAULT_TEMPERATURE = 1.0


def spec_from_smg(request: mlx_engine_pb2.GenerateRequest, session_id: str = "") -> GenerateSpec:
    """SMG's GenerateRequest as our GenerateSpec; what we cannot honour is refused
    (INVALID_ARGUMENT naming the field) rather than silently ignored."""
    v = Violations()
    which = request.WhichOneof("input")
    token_ids = list(request.tokenized.input_ids) if which == "tokenized" else None
    text = request.text if which == "text" else None
    if which is None:
        v.invalid("input", "input is empty: give tokenized.input_ids or text")
    sp = request.sampling_params
    if sp.frequency_penalty:
        v.invalid("sampling_params.frequency_penalty",
                  "sampling_params.frequency_penalty is not supported; use repetition_penalty")
    if sp.presence_penalty:
        v.invalid("sampling_params.presence_penalty",
                  "sampling_params.presence_penalty is not supported; use repetition_penalty")
    if sp.logit_bias:
        v.invalid("sampling_params.logit_bias", "sampling_params.logit_bias is not supported")
    if sp.HasField("logprobs") and sp.logprobs > 0:
        v.invalid("sampling_params.logprobs", "sampling_params.logprobs is not supported")
    v.raise_if_any()
    sampling = SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else DEFAULT_TEMPERATURE,
        # proto3 zero means unset for these: SMG sends 0 when the client gave none.
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty or 1.0,
        seed=sp.seed if sp.HasField("seed") else None,
    )
    return GenerateSpec(
        text=text, token_ids=token_ids, sampling=sampling,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else 0,
        ignore_eos=sp.ignore_eos, stop_token_ids=tuple(sp.stop_token_ids),
        session_id=session_id)


def session_of(request: mlx_engine_pb2.GenerateRequest,
               metadata: tuple | None) -> str:
    """The session a request's KV is restored for and stored under: one named in
    the metadata, else its lineage (LINEAGE_TOKENS). SMG requests always go through
    the bank: a gateway that routes by prefix presumes workers that cache them."""
    named = dict(metadata or ())
    session = next((str(named[k]) for k in SESSION_METADATA if named.get(k)), "")
    if session:
        return session
    if request.WhichOneof("input") == "tokenized":
        head = ",".join(map(str, request.tokenized.input_ids[:LINEAGE_TOKENS])).encode()
    else:
        head = request.text[:LINEAGE_CHARS].encode()
    return "smg-" + hashlib.blake2b(head, digest_size=8).hexdigest()


def chunk_message(token_ids: list[int], prompt: int, completion: int,
                  cached: int) -> mlx_engine_pb2.GenerateResponse:
    return mlx_engine_pb2.GenerateResponse(chunk=mlx_engine_pb2.GenerateStreamChunk(
        token_ids=token_ids, prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=cached))


def complete_message(end: Finished, output_ids: list[int]) -> mlx_engine_pb2.GenerateResponse:
    complete = mlx_engine_pb2.GenerateComplete(
        output_ids=output_ids, finish_reason=end.reason.value,
        prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
        cached_tokens=end.cached_tokens)
    if end.matched_stop_token is not None:
        complete.matched_stop_token_id = end.matched_stop_token
    return mlx_engine_pb2.GenerateResponse(complete=complete)


@dataclass(frozen=True)
class WorkerHealth:
    healthy: bool
    message: str


def worker_health(service: Service, default: ModelEntry | None,
                  serving: bool | None = None) -> WorkerHealth:
    """What HealthCheck answers: not healthy while draining, without a ready default
    model, or at HARD / EMERGENCY pressure (the level the governor acts on).

    `serving`: the server's readiness decision (service.readiness: the same gate
    grpc.health and the agent check answer from, with its hold below hard) when it
    has one; without it, the level alone decides."""
    if service.draining:
        return WorkerHealth(False, "draining: finishing in-flight requests")
    if default is None or default.state != ModelState.READY or default.engine is None:
        return WorkerHealth(False, "the default model is not loaded")
    gov = service.governor
    level = gov.level
    figures = service.admission_figures()
    readings, limits = gov.readings, gov.limits
    usage = (f"usage {readings.process_bytes >> 20} MiB of ceiling "
             f"{limits.ceiling_bytes >> 20} MiB; " if readings and limits else "")
    detail = (f"pressure {level.label}; {usage}admission "
              f"{'paused' if figures.paused else 'open'}; "
              f"{figures.running} running, {figures.waiting} waiting")
    shut = level >= PressureLevel.HARD if serving is None else not serving
    if shut:
        return WorkerHealth(False, f"{detail}: send new work elsewhere")
    return WorkerHealth(True, detail)


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class GatewayAbort(Aborted):
    """SMG's Abort: ends the stream as CANCELLED, never through the status table."""


class _Stream:
    """One Generate from SMG: where its request runs once admitted, for Abort."""

    def __init__(self) -> None:
        self._engine: ModelEngine | None = None
        self._request_id = ""
        self._aborted = False

    def admitted(self, service: Service, event: Admitted) -> None:
        entry = service.pool.get(event.model_id)
        self._engine, self._request_id = entry.engine, event.request_id
        if self._aborted:
            self.abort()

    def abort(self) -> None:
        self._aborted = True
        if self._engine is not None:
            self._engine.abort(GatewayAbort("aborted by the gateway"), [self._request_id])


class MlxEngineServicer(mlx_engine_pb2_grpc.MlxEngineServicer):
    """SMG's requests name no model: they go to the server's default model."""

    def __init__(self, service: Service,
                 serving: Callable[[], bool | None] = lambda: None) -> None:
        self._service = service
        self._serving = serving
        self._started = time.time()
        self._bundles = BundleCache()
        self._folders: dict[str, Path] = {}
        # SMG's request ids → their streams, for Abort.
        self._streams: dict[str, set[_Stream]] = {}

    # -- Generate ---------------------------------------------------------------------
    async def Generate(self, request, context: grpc.aio.ServicerContext):
        stream = _Stream()
        tracked = self._streams.setdefault(request.request_id, set())
        tracked.add(stream)
        try:
            spec = spec_from_smg(request,
                                 session_of(request, context.invocation_metadata()))
            prompt = cached = completion = 0
            output_ids: list[int] = []
            async for event in self._service.pipeline.generate(spec):
                if isinstance(event, Admitted):
                    prompt, cached = event.prompt_tokens, event.cached_tokens
                    stream.admitted(self._service, event)
                elif isinstance(event, Chunk):
                    if not event.token_ids:
                        continue
                    completion += len(event.token_ids)
                    if request.stream:
                        yield chunk_message(event.token_ids, prompt, completion, cached)
                    else:
                        output_ids.extend(event.token_ids)
                elif isinstance(event, Finished) and event.reason is not FinishReason.ABORTED:
                    # Streamed ids went out in the chunks; the complete repeats none.
                    yield complete_message(event, [] if request.stream else output_ids)
                # An ABORTED end is followed by the error that ended it: its status.
        except GatewayAbort:
            await context.abort(grpc.StatusCode.CANCELLED, "aborted by the gateway")
        except Exception as err:
            await status.abort(context, err)
        finally:
            tracked.discard(stream)
            if not tracked:
                self._streams.pop(request.request_id, None)

    async def Abort(self, request, context):
        # The gateway's client went away. The engine ends the request at its next step
        # (batch slot and KV freed) and the stream ends through its own path; one still
        # waiting for admission is ended the moment it is admitted.
        for request_id in request.request_ids:
            for stream in list(self._streams.get(request_id, ())):
                stream.abort()
        return mlx_engine_pb2.AbortResponse()

    # -- health and info ---------------------------------------------------------------
    async def HealthCheck(self, request, context):
        health = worker_health(self._service, self._default(), self._serving())
        return mlx_engine_pb2.HealthCheckResponse(healthy=health.healthy,
                                                  message=health.message)

    async def GetServerInfo(self, request, context):
        return mlx_engine_pb2.GetServerInfoResponse(
            server_type=SERVER_TYPE,
            active_requests=self._service.pipeline.in_flight,  # running + waiting
            uptime_seconds=time.time() - self._started)

    async def GetModelInfo(self, request, context):
        try:
            entry = self._ready_default()
            folder = await self._folder(entry)
        except Exception as err:
            await status.abort(context, err)
        config = _read_config(folder)
        info = entry.engine.info if entry.engine is not None else None
        eos = sorted(info.tokenizer.eos_token_ids) if info is not None else []
        return mlx_engine_pb2.GetModelInfoResponse(
            model_path=entry.source,
            is_generation=True,
            max_context_length=entry.context_length,
            vocab_size=entry.vocab_size,
            served_model_name=entry.model_id,
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures", [])],
            eos_token_ids=eos,
            pad_token_id=int(config.get("pad_token_id") or 0),
            bos_token_id=int(config.get("bos_token_id") or 0),
            # One token of the context is left for the first generated one.
            max_req_input_len=max(0, entry.context_length - 1),
        )

    async def GetTokenizer(self, request, context):
        try:
            folder = await self._folder(self._ready_default())
            bundle = await self._bundles.get(folder)
        except Exception as err:
            await status.abort(context, err)
        for chunk in bundle_chunks(bundle):
            yield chunk

    # -- the default model -----------------------------------------------------------------
    def _default(self) -> ModelEntry | None:
        try:
            return self._service.pool.get("")
        except PlimsollError:
            return None

    def _ready_default(self) -> ModelEntry:
        return self._service.pool.ready("")  # NOT_FOUND / UNAVAILABLE, typed

    async def _folder(self, entry: ModelEntry) -> Path:
        folder = self._folders.get(entry.source)
        if folder is None:
            # A loaded repository is in the hub cache already: no fetch, but file I/O.
            folder = await asyncio.to_thread(resolve_source, entry.source)
            self._folders[entry.source] = folder
        return folder


def add_to_server(service: Service, server: grpc.aio.Server,
                  serving: Callable[[], bool | None] = lambda: None) -> MlxEngineServicer:
    servicer = MlxEngineServicer(service, serving)
    mlx_engine_pb2_grpc.add_MlxEngineServicer_to_server(servicer, server)
    return servicer
