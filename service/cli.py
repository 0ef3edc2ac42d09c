"""The `plimsoll` command: serve, generate, models, health.

Errors print as one line on stderr with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tomllib
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import blas
from engine.demo_models import DEMO_SIZES
from memory.config import MemoryConfig
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service import auth, operator_cli
from service.cli_common import MiB, add_access, open_aio_channel, report_error
from service.readiness import DEFAULT_HOLD_S

DEFAULT_PORT = 50051


class CliError(Exception):
    """A one-line error for the user."""


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="server address (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="server port (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before the call gives up (default: %(default)s)")
    add_access(p)  # --token, --tls-ca, --tls-cert, --tls-key


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plimsoll",
        description="A memory-safe gRPC inference server for MLX language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="start the server",
                       description="Start the gRPC server. With no --model it makes (once) "
                       "and serves the embedded demo model.")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; use 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port to listen on; 0 picks a free one (default: %(default)s)")
    s.add_argument("--model", action="append", default=[], metavar="SOURCE",
                   help="a local mlx-lm model folder or a Hugging Face repository id; "
                   "repeat to serve several (the first is the default model)")
    s.add_argument("--demo-size", default="tiny", choices=sorted(DEMO_SIZES),
                   help="demo model served when no --model is given (default: %(default)s)")
    s.add_argument("--cache-dir", type=Path, default=None,
                   help="where demo models are made (default: $PLIMSOLL_CACHE_DIR or "
                   "~/.cache/plimsoll)")
    s.add_argument("--max-num-seqs", type=int, default=32,
                   help="most sequences decoded together per model (default: %(default)s)")
    s.add_argument("--prefill-step-size", type=int, default=512,
                   help="prompt tokens processed per step (default: %(default)s)")
    s.add_argument("--no-fast-prefill", dest="fast_prefill", action="store_false",
                   help="prefill with MLX's own kernels only: no conversion of bf16/fp16/"
                   "quantized layers to float32 for the optimized BLAS, one at a time, and "
                   "no NumPy attention or SwiGLU (Linux CPU; see engine/fast_prefill.py)")
    s.add_argument("--no-prefill-last-token", dest="prefill_last_token",
                   action="store_false",
                   help="run a prompt's last token as a decode step of its own, as mlx-lm "
                   "does, instead of with the prompt's final chunk (one model pass later "
                   "to the first token; see engine/final_chunk.py)")
    s.add_argument("--no-compiled-decode", dest="compiled_decode", action="store_false",
                   help="decode with MLX's own RoPE and RMSNorm operations instead of one "
                   "compiled kernel each (the same logits; Linux CPU; see "
                   "engine/compiled_decode.py)")
    s.add_argument("--no-decode-kernel", dest="decode_kernel", action="store_false",
                   help="decode bfloat16/float16 and 4/8-bit layers with MLX's own products "
                   "and attention instead of the CBLAS shim's kernels (which read the "
                   "weights as stored, sum in float32, and are used where they measure "
                   "faster at load; Linux CPU)")
    s.add_argument("--fast-decode-dense", action="store_true",
                   help="decode the cache-sized layers of bf16/fp16 models through float32 "
                   "copies and the optimized BLAS where that measures faster at load (2-2.5x "
                   "on the small and medium demo models; the copies, a block's layers at "
                   "once, count in admission)")
    s.add_argument("--max-streams-per-connection", type=int, default=100, metavar="N",
                   help="calls one client connection may have open at once (HTTP/2); its "
                   "further calls wait in the client (default: %(default)s)")
    s.add_argument("--max-watchers", type=int, default=256, metavar="N",
                   help="WatchPressure streams open at once; more are refused "
                   "RESOURCE_EXHAUSTED / WATCHER_LIMIT (default: %(default)s)")
    s.add_argument("--max-reservations-per-owner", type=int, default=64, metavar="N",
                   help="live Admit reservations one owner may hold; more are refused "
                   "RESOURCE_EXHAUSTED / RESERVATION_LIMIT (default: %(default)s)")
    s.add_argument("--max-sessions-per-owner", type=int, default=None, metavar="N",
                   help="sessions one GenerateRequest.owner keeps in the bank; past it its "
                   "least recently used idle sessions are shed (default: no per-owner cap; "
                   "the bank's own caps hold)")
    s.add_argument("--max-leases-per-owner", type=int, default=64, metavar="N",
                   help="Pin leases one owner may hold at once; more are refused "
                   "RESOURCE_EXHAUSTED / LEASE_LIMIT (default: %(default)s)")
    s.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="S",
                   help="end a Generate stream (ABORTED, CLIENT_STALLED) whose client has "
                   "read nothing for this long, freeing its batch slot (default: %(default)s)")
    s.add_argument("--stream-interval-ms", type=float, default=2.0,
                   help="send steady token chunks at most this often; first tokens and "
                   "ends go at once; 0 sends every token (default: %(default)s)")
    s.add_argument("--burst-wait-ms", type=float, default=10.0,
                   help="an idle model's first request waits while more follow within 1 ms "
                   "of each other, up to this long, so a burst is prefilled together; "
                   "after 8 lone requests in a row it waits no more until a burst comes "
                   "again; 0 starts each at once (default: %(default)s)")
    s.add_argument("--mlx-pool-mb", type=int, default=512, metavar="MB",
                   help="MLX keeps up to this much of freed buffers for reuse, at most "
                   "1/32 of the memory ceiling, so a prefill's transients are not faulted "
                   "in afresh layer after layer; emptied when a model's batch drains and "
                   "under pressure; 0 leaves MLX's own limit (default: %(default)s)")
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="most requests in flight before RESOURCE_EXHAUSTED "
                   "(default: %(default)s)")
    s.add_argument("--max-message-mb", type=int, default=64,
                   help="largest gRPC message accepted or sent, in MiB (default: %(default)s)")
    s.add_argument("--drain-seconds", type=float, default=30.0, metavar="S",
                   help="on SIGTERM or SIGINT: health turns NOT_SERVING and new requests "
                   "get UNAVAILABLE at once; in-flight streams may finish for this long, "
                   "then end with UNAVAILABLE (a second signal ends them now) "
                   "(default: %(default)s)")
    mem = s.add_argument_group("memory", "The enforcer that keeps the process under its "
                               "ceiling. Flags override --memory-config.")
    mem.add_argument("--memory-config", type=Path, default=None, metavar="FILE",
                     help="TOML file with memory keys (tier, custom_ceiling_gib, "
                     "soft_fraction, hard_fraction, operator_cap_gib, active_poll_s, "
                     "idle_poll_s, empty_poll_s, enabled, abort_order, ...), top level or "
                     "under [memory]")
    mem.add_argument("--no-enforcer", action="store_true",
                     help="turn the memory enforcer off: no ticks, no pre-load or "
                     "pre-prefill memory checks (the process may be OOM-killed)")
    mem.add_argument("--memory-guard", choices=["safe", "balanced", "aggressive", "custom"],
                     default=None,
                     help="ceiling tier: reserve left to the system and soft mark "
                     "(default: balanced)")
    mem.add_argument("--memory-guard-gb", type=float, default=None, metavar="GIB",
                     help="custom ceiling in GiB (selects the custom tier)")
    mem.add_argument("--memory-cap-gb", type=float, default=None, metavar="GIB",
                     help="an operator cap on the ceiling in GiB, whatever the tier")
    mem.add_argument("--soft-fraction", type=float, default=None,
                     help="soft mark as a fraction of the ceiling (default: by tier)")
    mem.add_argument("--hard-fraction", type=float, default=None,
                     help="hard mark as a fraction of the ceiling (default: 0.95)")
    mem.add_argument("--poll-active", type=float, default=None, metavar="S",
                     help="enforcer interval under pressure or activity (default: 1.0)")
    mem.add_argument("--poll-idle", type=float, default=None, metavar="S",
                     help="enforcer interval with models loaded and idle (default: 10)")
    mem.add_argument("--poll-empty", type=float, default=None, metavar="S",
                     help="enforcer interval with no model loaded (default: 30)")
    mem.add_argument("--load-warmup", type=float, default=None, metavar="S",
                     help="a just-loaded model is spared idle eviction this long, except "
                     "at hard pressure and above; 0 turns it off (default: 10)")
    mem.add_argument("--keep-alive", type=float, default=None, metavar="S",
                     help="unload a model loaded by LoadModel once unused this long, when "
                     "its request sets no keep_alive (negative: keep loaded); models named "
                     "with --model are kept loaded (default: kept loaded)")
    mem.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                     help="at most N models loaded; a load unloads idle LRU unpinned models "
                     "first, or is refused (default: no limit)")
    mem.add_argument("--max-model-memory-gb", type=float, default=None, metavar="GB",
                     help="at most this much measured model memory loaded; same eviction "
                     "order (default: no limit)")
    mem.add_argument("--abort-order", choices=["all", "youngest", "largest"], default=None,
                     help="which requests a busy victim loses first at hard pressure "
                     "(default: all)")
    adm = s.add_argument_group("admission and sessions")
    adm.add_argument("--scheduler-mode", choices=["default", "hyper"], default="default",
                     help="hyper admits exactly one request at a time (default: %(default)s)")
    adm.add_argument("--admission-queue-limit", type=int, default=32,
                     help="requests that may wait while admission pauses "
                     "(default: %(default)s)")
    adm.add_argument("--admission-timeout", type=float, default=30.0, metavar="S",
                     help="longest wait for admission before RESOURCE_EXHAUSTED "
                     "(default: %(default)s)")
    adm.add_argument("--reservation-ttl", type=float, default=30.0, metavar="S",
                     help="an Admit ticket's lifetime when the client sets none "
                     "(default: %(default)s)")
    adm.add_argument("--max-reservation-ttl", type=float, default=300.0, metavar="S",
                     help="longer reservation_ttl asks are clamped to this "
                     "(default: %(default)s)")
    adm.add_argument("--no-admission-chain-shed", action="store_true",
                     help="do not shed session-cache entries (shrink_for_admission) to admit "
                     "a prompt")
    adm.add_argument("--no-session-bank", action="store_true",
                     help="do not cache session KV between turns")
    adm.add_argument("--session-bank-gb", type=float, default=8.0, metavar="GIB",
                     help="most bytes the session bank may hold (default: %(default)s; the "
                     "enforcer's dynamic ceiling may hold it lower)")
    adm.add_argument("--session-disk-dir", default="", metavar="DIR",
                     help="keep session snapshots the bank sheds (pressure, caps, idle TTL, "
                     "model unloads, shutdown) in this folder and restore from it, across "
                     "restarts too (default: off, shed snapshots are dropped)")
    adm.add_argument("--session-disk-gb", type=float, default=32.0, metavar="GIB",
                     help="most bytes the disk tier may hold; it also holds at most 10%% of "
                     "the disk's free space at start (default: %(default)s)")
    adm.add_argument("--session-disk-write-gb-per-hour", type=float, default=16.0,
                     metavar="GIB", help="most bytes the disk tier writes in any hour; "
                     "0: no limit (default: %(default)s)")
    adm.add_argument("--session-disk-min-free-gb", type=float, default=2.0, metavar="GIB",
                     help="never write a snapshot that would leave less free disk than this "
                     "(default: %(default)s)")
    adm.add_argument("--session-kv-bits", type=int, choices=(0, 4, 8), default=0,
                     help="keep bank snapshots (RAM and disk) as mlx-lm's quantized KV cache "
                     "of this many bits: 2-4x more sessions per byte; 0: full precision "
                     "(default: %(default)s)")
    adm.add_argument("--session-idle-ttl", type=float, default=3600.0, metavar="S",
                     help="drop a session's cache after this long unused, checked every "
                     "enforcer tick (default: %(default)s)")
    auth.add_serve_arguments(s)  # --tls-*, --token-file, --insecure, --model-root, --no-hub
    s.add_argument("--otlp-endpoint", default="",
                   help="send traces and metrics over OTLP/gRPC to this endpoint "
                   "(default: the OTEL_EXPORTER_OTLP_ENDPOINT variable; none: nothing leaves)")
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics over HTTP at /metrics on this port "
                   "(the plimsoll_ catalogue and vLLM's gateway gauges; see "
                   "docs/metrics.md); 0 picks a free one (default: off)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics listener binds (default: %(default)s)")
    s.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="serve the web dashboard (live pressure, models, enforcer actions; "
                   "also /api/status and /metrics) on this port; 0 picks a free one "
                   "(default: off)")
    s.add_argument("--http-host", default="127.0.0.1",
                   help="address the web dashboard binds (default: %(default)s)")
    s.add_argument("--agent-port", type=int, default=None, metavar="PORT",
                   help="answer HAProxy's agent-check on this TCP port: 'up ready 100%%' at "
                   "ok, 'up ready 50%%' at soft, 'drain' at hard and through the "
                   "--unready-hold-seconds after it, 'down #emergency', 'down #draining' on "
                   "SIGTERM; 0 picks a free one (default: off)")
    s.add_argument("--agent-host", default="127.0.0.1",
                   help="address the agent check binds (default: %(default)s)")
    s.add_argument("--unready-hold-seconds", type=float, default=DEFAULT_HOLD_S, metavar="S",
                   help="inference health turns NOT_SERVING at hard pressure and SERVING "
                   "again only once the level has stayed below hard this long "
                   "(default: %(default)s)")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default: %(default)s)")
    s.add_argument(blas.FLAG, action="store_true",
                   help="keep MLX's bundled reference BLAS instead of the optimized one of "
                   "the [blas] extra (Linux); the same as PLIMSOLL_BLAS=reference")

    g = sub.add_parser("generate", help="stream a generation to the terminal",
                       description="Send one Generate request and stream its text.")
    _add_target(g)
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--model", default="", help="model id (default: the server's default)")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 is greedy (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user chat message (chat template)")
    g.add_argument("--session", default="", help="session id to reuse cached KV")
    g.add_argument("--ticket", default="",
                   help="redeem a reservation from `plimsoll admit --reserve`")

    m = sub.add_parser("models", help="list the server's models",
                       description="List models with their state and measured size.")
    _add_target(m)

    h = sub.add_parser("health", help="check the server's health",
                       description="Call grpc.health.v1.Health/Check; exit 0 when SERVING.")
    _add_target(h)
    h.add_argument("--service", default="",
                   help="service name to check (default: overall)")
    operator_cli.register(sub)  # status, admit, pin, unpin, load, unload, sessions, watch, plot
    return parser


def _channel(args) -> grpc.aio.Channel:
    return open_aio_channel(args)  # TLS and the token when given


async def _generate(args) -> int:
    req = inference_pb2.GenerateRequest(model_id=args.model, max_tokens=args.max_tokens)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    req.sampling.temperature = args.temperature
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.session:
        req.session_id = args.session
    req.admission_ticket = args.ticket
    async with _channel(args) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        async for msg in stub.Generate(req, timeout=args.timeout):
            kind = msg.WhichOneof("event")
            if kind == "chunk":
                sys.stdout.write(msg.chunk.text)
                sys.stdout.flush()
            elif kind == "end":
                u = msg.end.usage
                t = msg.end.timings
                sys.stdout.write("\n")
                print(f"[{u.prompt_tokens} prompt + {u.completion_tokens} generated tokens, "
                      f"ttft {(t.time_to_first_token.ToNanoseconds() / 1e9) * 1000:.0f} ms, "
                      f"{t.tokens_per_second:.1f} tok/s]", file=sys.stderr)
    return 0


async def _models(args) -> int:
    async with _channel(args) as ch:
        resp = await control_pb2_grpc.ControlServiceStub(ch).ListModels(
            control_pb2.ListModelsRequest(), timeout=args.timeout)
    print(f"{'ID':<24} {'STATE':<10} {'MiB':>8} {'ACTIVE':>6} {'CONTEXT':>8}  SOURCE")
    for m in resp.models:
        state = control_pb2.ModelState.Name(m.state).removeprefix("MODEL_STATE_").lower()
        mark = "*" if m.is_default else ""
        print(f"{m.model_id + mark:<24} {state:<10} {m.measured_bytes / MiB:>8.1f} "
              f"{m.active_requests:>6} {m.context_length:>8}  {m.source}")
    return 0


async def _health(args) -> int:
    async with _channel(args) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(name)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def memory_config(args) -> MemoryConfig:
    """--memory-config file, overridden by flags; validated with one clear error."""
    values: dict = {}
    if args.memory_config is not None:
        with open(args.memory_config, "rb") as fh:
            data = tomllib.load(fh)
        values.update(data["memory"] if isinstance(data.get("memory"), dict) else data)
    flags = {
        "tier": args.memory_guard,
        "custom_ceiling_gib": args.memory_guard_gb,
        "operator_cap_gib": args.memory_cap_gb,
        "soft_fraction": args.soft_fraction,
        "hard_fraction": args.hard_fraction,
        "active_poll_s": args.poll_active,
        "idle_poll_s": args.poll_idle,
        "empty_poll_s": args.poll_empty,
        "abort_order": args.abort_order,
        "load_warmup_s": args.load_warmup,
        "max_loaded_models": args.max_loaded_models,
        "max_model_memory_gib": args.max_model_memory_gb,
        "enabled": False if args.no_enforcer else None,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return MemoryConfig.from_mapping(values)
    except ValueError as err:
        raise CliError(f"memory settings: {err}") from err


def _refuse_bad_serve_flags(args) -> None:
    """Flags checkable without the server's modules: one CliError naming the first bad one."""
    from memory.plans.admission import validate_scheduler_settings

    if args.max_sessions_per_owner is not None and args.max_sessions_per_owner <= 0:
        raise CliError(f"--max-sessions-per-owner must be > 0, got {args.max_sessions_per_owner}")
    try:
        validate_scheduler_settings(args.scheduler_mode, args.max_num_seqs,
                                    queue_limit=args.admission_queue_limit)
    except ValueError as err:
        raise CliError(str(err)) from err
    for name, value in (("--max-num-seqs", args.max_num_seqs),
                        ("--prefill-step-size", args.prefill_step_size),
                        ("--max-queued-requests", args.max_queued_requests),
                        ("--max-message-mb", args.max_message_mb),
                        ("--stream-stall-timeout", args.stream_stall_timeout),
                        ("--max-watchers", args.max_watchers),
                        ("--max-streams-per-connection", args.max_streams_per_connection),
                        ("--max-leases-per-owner", args.max_leases_per_owner),
                        ("--max-reservations-per-owner", args.max_reservations_per_owner)):
        if value <= 0:
            raise CliError(f"{name} must be > 0, got {value}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        raise CliError(f"--http-port must be 0..65535, got {args.http_port}")
    if args.agent_port is not None and not 0 <= args.agent_port <= 65535:
        raise CliError(f"--agent-port must be 0..65535, got {args.agent_port}")
    if args.unready_hold_seconds < 0:
        raise CliError(f"--unready-hold-seconds must be >= 0, got {args.unready_hold_seconds}")
    if args.drain_seconds < 0:
        raise CliError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    if args.mlx_pool_mb < 0:
        raise CliError(f"--mlx-pool-mb must be >= 0, got {args.mlx_pool_mb}")


def _serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Settings that need none of the server's modules are checked first: a bad memory or
    # access setting, or a limit out of range, fails at once, before MLX and mlx-lm load.
    memory = memory_config(args)
    try:
        access = auth.access_from_args(args)
        refusal, warnings = auth.preflight(args.host, access)
    except ValueError as err:  # AccessError, TlsError: a file or flag that cannot be used
        raise CliError(str(err)) from err
    if refusal is not None:
        print(f"plimsoll: {refusal}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"plimsoll: warning: {warning}", file=sys.stderr)
    _refuse_bad_serve_flags(args)
    # The server's modules load only here: client verbs start fast.
    from engine.model_engine import EngineSettings
    from engine.pool import KeepAlive
    from service.server import ServerConfig, serve
    from telemetry.setup import TelemetrySettings

    config = ServerConfig(
        host=args.host,
        port=args.port,
        models=args.model,
        demo_size=args.demo_size,
        cache_dir=args.cache_dir,
        max_message_bytes=args.max_message_mb * MiB,
        stream_stall_timeout_s=args.stream_stall_timeout,
        max_watchers=args.max_watchers,
        max_streams_per_connection=args.max_streams_per_connection,
        drain_grace_s=args.drain_seconds,
        engine=EngineSettings(max_num_seqs=args.max_num_seqs,
                              prefill_step_size=args.prefill_step_size,
                              fast_prefill=args.fast_prefill,
                              prefill_last_token=args.prefill_last_token,
                              fast_decode_dense=args.fast_decode_dense,
                              compiled_decode=args.compiled_decode,
                              fast_decode_kernel=args.decode_kernel,
                              stream_interval_s=max(0.0, args.stream_interval_ms) / 1000,
                              burst_wait_s=max(0.0, args.burst_wait_ms) / 1000),
        telemetry=TelemetrySettings(otlp_endpoint=args.otlp_endpoint),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        http_host=args.http_host,
        http_port=args.http_port,
        agent_host=args.agent_host,
        agent_port=args.agent_port,
        unready_hold_s=args.unready_hold_seconds,
        mlx_pool_bytes=args.mlx_pool_mb * MiB,
    )
    config.memory = memory
    config.access = access
    rt = config.service
    rt.max_queued_requests = args.max_queued_requests
    rt.scheduler_mode = args.scheduler_mode
    rt.admission_queue_limit = args.admission_queue_limit
    rt.admission_timeout_s = args.admission_timeout
    rt.reservation_ttl_s = args.reservation_ttl
    rt.max_reservation_ttl_s = args.max_reservation_ttl
    rt.chain_shed = not args.no_admission_chain_shed
    rt.session_bank = not args.no_session_bank
    rt.bank_max_bytes = int(args.session_bank_gb * 1024**3)
    rt.bank_per_session_max_bytes = min(rt.bank_per_session_max_bytes, rt.bank_max_bytes)
    rt.bank_idle_ttl_s = args.session_idle_ttl
    rt.max_leases_per_owner = args.max_leases_per_owner
    rt.max_reservations_per_owner = args.max_reservations_per_owner
    rt.max_sessions_per_owner = args.max_sessions_per_owner
    rt.session_disk_dir = args.session_disk_dir
    rt.session_disk_cap_bytes = int(args.session_disk_gb * 1024**3)
    rt.session_disk_write_bytes_per_hour = (int(args.session_disk_write_gb_per_hour * 1024**3)
                                            if args.session_disk_write_gb_per_hour > 0 else None)
    rt.session_disk_min_free_bytes = int(args.session_disk_min_free_gb * 1024**3)
    rt.session_kv_bits = args.session_kv_bits
    if args.keep_alive is not None:
        rt.keep_alive_s = KeepAlive.from_seconds(args.keep_alive).seconds
    if args.no_optimized_blas and blas.state().optimized:
        # The BLAS was chosen when engine/ was imported, from the process's command line.
        raise CliError(f"{blas.FLAG} works on the command line only; or set "
                       f"{blas.ENV}=reference")
    asyncio.run(serve(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command in operator_cli.VERBS:
            return operator_cli.run(args)
        runner = {"generate": _generate, "models": _models, "health": _health}[args.command]
        return asyncio.run(runner(args))
    except grpc.aio.AioRpcError as err:
        # The operator verbs' one line: code, ErrorInfo reason, message.
        return report_error(err, f"{args.host}:{args.port}", as_json=False)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - one clear line, not a traceback
        print(f"plimsoll: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
