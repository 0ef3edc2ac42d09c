"""The operator verbs of `plimsoll`: status, admit, pin, unpin, load, unload, sessions,
watch and plot (the last two live in service/watch.py and service/plot.py).

Each verb makes one or a few ControlService calls over a plain gRPC channel and prints
either text for people (rich; plain when not a terminal) or, with --json, one JSON
document built by `cli_common.wire_dict`. A failed call prints one line,
`error: CODE REASON: message`, read from google.rpc.ErrorInfo, and exits 1.

`register(sub)` adds the verbs to the `plimsoll` parser; `run(args)` runs one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import duration_pb2
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, types_pb2
from service.cli_common import (
    LEVEL_STYLES,
    OperatorError,
    add_target,
    address,
    fmt_bytes,
    label,
    open_channel,
    print_json,
    report_error,
    timestamp_text,
    wire_dict,
)

VERBS = ("status", "admit", "pin", "unpin", "load", "unload", "sessions", "watch", "plot")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the operator verbs to the `plimsoll` subcommands."""
    from service import plot, watch  # noqa: PLC0415 - their own flags, their own modules

    s = sub.add_parser("status", help="memory, limits, admission and models",
                       description="GetMemoryStatus: the level, usage against the soft and "
                       "hard marks and the ceiling, the binding term, the MLX pool and the "
                       "session bank, reservations, models and leases.")
    add_target(s, timeout=30.0)

    a = sub.add_parser("admit", help="would the server admit this request now?",
                       description="Admit: the verdict Generate would get now and the "
                       "numbers behind it, without generating. Give the prompt as TEXT or "
                       "as a token count (--tokens).")
    add_target(a, timeout=30.0)
    a.add_argument("text", nargs="?", default=None, help="the prompt text")
    a.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="a prompt of N token ids (id 0), to size a request of that length")
    a.add_argument("--model", default="", help="model id (default: the server's default)")
    a.add_argument("--max-tokens", type=int, default=0,
                   help="tokens to generate; 0 is the server default (256)")
    a.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    a.add_argument("--session", default="", help="session id (counts a cached prefix)")
    a.add_argument("--reserve", action="store_true",
                   help="reserve the request's bytes and print the ticket")
    a.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="reservation lifetime in seconds (default: the server's)")
    a.add_argument("--client-request-id", default="",
                   help="retry-safe id: the same id returns the same ticket")

    p = sub.add_parser("pin", help="keep a model loaded or a session cached",
                       description="Pin: take a lease on a model (reloading a known, unloaded "
                       "one) or, with --session, on a session's cache.")
    add_target(p)
    p.add_argument("model", nargs="?", default=None, help="model id to pin")
    p.add_argument("--session", default=None, help="pin this session instead of a model")
    p.add_argument("--owner", default="plimsoll-cli", help="who holds it (default: %(default)s)")
    p.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="lease duration in seconds (default: until unpin)")
    p.add_argument("--client-request-id", default="",
                   help="retry-safe id: the same id returns the same lease")

    u = sub.add_parser("unpin", help="release a lease", description="Unpin: release a lease.")
    add_target(u, timeout=30.0)
    u.add_argument("lease_id", help="the lease id that pin printed")

    ld = sub.add_parser("load", help="load a model",
                        description="LoadModel from a local mlx-lm folder or a Hugging Face "
                        "repository id.")
    add_target(ld)
    ld.add_argument("source", help="a local model folder or a Hugging Face repository id")
    ld.add_argument("--id", dest="model_id", default="",
                    help="serve it under this id (default: the folder or repository name)")

    ul = sub.add_parser("unload", help="unload a model",
                        description="UnloadModel; a pinned or busy model needs --force.")
    add_target(ul)
    ul.add_argument("model_id", help="the model id")
    ul.add_argument("--force", action="store_true",
                    help="abort its running requests (ABORTED) and release its leases")

    ss = sub.add_parser("sessions", help="list cached sessions, or drop one",
                        description="`plimsoll sessions` lists the session bank; "
                        "`plimsoll sessions drop ID` drops every entry of session ID.")
    add_target(ss, timeout=30.0)
    ss.add_argument("action", nargs="?", default="list", choices=("list", "drop"),
                    help="list (default) or drop")
    ss.add_argument("session_id", nargs="?", default=None, help="the session to drop")
    ss.add_argument("--model", default="", help="list only this model's entries")

    watch.add_parser(sub)
    plot.add_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Run one operator verb; the exit code. Errors are one line, never a traceback."""
    from service import plot, watch  # noqa: PLC0415

    runners: dict[str, Callable[[argparse.Namespace], int]] = {
        "status": _status, "admit": _admit, "pin": _pin, "unpin": _unpin, "load": _load,
        "unload": _unload, "sessions": _sessions, "watch": watch.run, "plot": plot.run,
    }
    try:
        return runners[args.command](args)
    except grpc.RpcError as err:
        return report_error(err, address(args), getattr(args, "json", False))
    except OperatorError as err:
        if getattr(args, "json", False):
            print_json({"error": {"code": "", "reason": "", "message": str(err)}})
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# -- plumbing -------------------------------------------------------------------------------


def console() -> Console:
    """rich on a terminal; a wide plain console otherwise, so tables do not wrap figures."""
    out = Console(highlight=False)
    return out if out.is_terminal else Console(highlight=False, width=160)


def _control(args: argparse.Namespace) -> tuple[grpc.Channel, control_pb2_grpc.ControlServiceStub]:
    channel = open_channel(args)  # TLS and the token when given
    return channel, control_pb2_grpc.ControlServiceStub(channel)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    channel, stub = _control(args)
    with channel:
        return getattr(stub, method)(request, timeout=args.timeout)


def _emit(args: argparse.Namespace, doc: dict[str, Any], view: RenderableType) -> int:
    if args.json:
        print_json(doc)
    else:
        console().print(view)
    return 0


def _duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def level_text(level: int) -> Text:
    name = label(types_pb2.PressureLevel, level)
    return Text(f" {name.upper()} ", style=LEVEL_STYLES.get(name, ""))


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _kv(rows: list[tuple[str, RenderableType | str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, value)
    return grid


# -- status ---------------------------------------------------------------------------------


def models_table(models: list[control_pb2.ModelInfo]) -> Table:
    t = Table(title="models", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("model", "state", "size", "pinned", "active", "waiting", "context",
                "batch cap", "store cap", "pending unload", "expires"):
        t.add_column(col, justify="right" if col in ("size", "active", "waiting", "context",
                                                     "batch cap", "store cap") else "left")
    for m in models:
        name = m.model_id + (" (default)" if m.is_default else "")
        t.add_row(name, label(control_pb2.ModelState, m.state), fmt_bytes(m.measured_bytes),
                  "pinned" if m.pinned else "-", str(m.active_requests),
                  str(m.waiting_requests), str(m.context_length), str(m.batch_cap),
                  str(m.store_cache_cap), m.pending_unload or "-", _model_expiry(m))
    return t


def _model_expiry(m: control_pb2.ModelInfo) -> str:
    """When its keep-alive unloads it; 'kept' without one, 'held' while it cannot expire."""
    if m.HasField("expire_time"):
        return timestamp_text(m.expire_time)
    return "held" if m.HasField("keep_alive") else "kept"


def _lease_target(lease: control_pb2.Lease) -> str:
    return f"model {lease.model_id}" if lease.model_id else f"session {lease.session_id}"


def leases_table(leases: list[control_pb2.Lease]) -> Table:
    t = Table(title="leases", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("lease", "target", "owner", "expires"):
        t.add_column(col)
    for lease in leases:
        expires = timestamp_text(lease.expire_time) if lease.HasField("expire_time") else "never"
        t.add_row(lease.lease_id, _lease_target(lease), lease.owner or "-", expires)
    return t


def status_view(r: control_pb2.GetMemoryStatusResponse) -> RenderableType:
    """GetMemoryStatus for people: the figures first, then models and leases."""
    rd, lim, adm = r.readings, r.limits, r.admission
    usage = rd.process_bytes
    binding = label(types_pb2.CeilingTerm, lim.binding_term)
    terms = " · ".join(f"{label(types_pb2.CeilingTerm, t.term)} {fmt_bytes(t.bytes)}"
                       for t in lim.terms)
    enforcer = "on" if r.enforcer_enabled else "off"
    tick = r.poll_interval.ToNanoseconds() / 1e9
    paused = " · admissions paused" if adm.paused else ""
    draining = " · draining" if adm.draining else ""
    rows: list[tuple[str, RenderableType | str]] = [
        ("level", Text.assemble(level_text(r.level),
                                f"  enforcer {enforcer}, next tick in {tick:g} s, tier "
                                f"{label(types_pb2.MemoryGuardTier, lim.tier)}")),
        ("usage", f"{fmt_bytes(usage)}  ({_pct(usage, lim.ceiling_bytes)} of the ceiling; "
                  f"{_pct(usage, lim.soft_bytes)} of soft)"),
        ("soft", fmt_bytes(lim.soft_bytes)),
        ("hard", fmt_bytes(lim.hard_bytes)),
        ("ceiling", f"{fmt_bytes(lim.ceiling_bytes)}  (binding term: {binding})"),
        ("terms", terms or "-"),
        ("admission limit", f"{fmt_bytes(lim.admission_limit_bytes)}  (sheds above "
                            f"{fmt_bytes(lim.admission_shed_bytes)})"),
        ("pool", f"{fmt_bytes(rd.mlx_pool_bytes)}  (MLX buffer pool, reclaimable; active "
                 f"{fmt_bytes(rd.mlx_active_bytes)}, footprint {fmt_bytes(rd.footprint_bytes)})"),
        ("bank", f"{fmt_bytes(adm.session_bank_bytes)}  (session KV cache)"),
        ("reservations", f"{adm.reservations} holding {fmt_bytes(adm.reserved_bytes)}"),
        ("requests", f"{adm.running} running, {adm.waiting} waiting{paused}{draining}"),
        ("system", f"{fmt_bytes(rd.system_available_bytes)} available of "
                   f"{fmt_bytes(rd.system_total_bytes)}; os pressure "
                   f"{label(types_pb2.OsPressure, rd.os_pressure)}"),
    ]
    if rd.container_limit_bytes:
        rows.append(("container", f"{fmt_bytes(rd.container_usage_bytes)} used of "
                                  f"{fmt_bytes(rd.container_limit_bytes)}"))
    if r.blas.description:
        rows.append(("blas", r.blas.description))
    parts: list[RenderableType] = [_kv(rows), Text(""), models_table(list(r.models))]
    if r.leases:
        parts += [Text(""), leases_table(list(r.leases))]
    return Group(*parts)


def _status(args: argparse.Namespace) -> int:
    resp = _call(args, "GetMemoryStatus", control_pb2.GetMemoryStatusRequest())
    return _emit(args, wire_dict(resp), status_view(resp))


# -- admit ------------------------------------------------------------------------------------


def admit_request(args: argparse.Namespace) -> control_pb2.AdmitRequest:
    """The AdmitRequest the flags describe; the server judges every field."""
    if (args.text is None) == (args.tokens is None):
        raise OperatorError("admit: give the prompt TEXT or --tokens N (exactly one)")
    gen = inference_pb2.GenerateRequest(model_id=args.model, max_tokens=max(0, args.max_tokens),
                                        session_id=args.session)
    if args.text is not None:
        gen.text = args.text
    else:
        if args.tokens < 0:
            raise OperatorError(f"admit: --tokens must be >= 0, got {args.tokens}")
        gen.token_ids.ids.extend([0] * args.tokens)
        if not args.tokens:
            gen.token_ids.SetInParent()  # the server names the empty field
    if args.temperature is not None:
        gen.sampling.temperature = args.temperature
    req = control_pb2.AdmitRequest(request=gen, reserve=args.reserve,
                                   client_request_id=args.client_request_id)
    ttl = _duration(args.ttl)
    if ttl is not None:
        req.reservation_ttl.CopyFrom(ttl)
    return req


def admit_view(r: control_pb2.AdmitResponse) -> RenderableType:
    verdict = label(control_pb2.AdmitVerdict, r.verdict)
    admits = r.verdict in (control_pb2.ADMIT_VERDICT_ADMIT,
                           control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING)
    style = "bold green" if admits else ("bold yellow" if verdict == "wait" else "bold red")
    constraint = label(control_pb2.AdmitConstraint, r.binding_constraint)
    rows: list[tuple[str, RenderableType | str]] = [
        ("verdict", Text.assemble((verdict.upper(), style),
                                  f"  (binding: {constraint})" if r.binding_constraint else "")),
        ("level", level_text(r.pressure_level)),
        ("usage", fmt_bytes(r.usage_bytes)),
        ("request", f"{fmt_bytes(r.request_bytes)}  (its KV, prefill and restore)"),
        ("reserved", f"{fmt_bytes(r.reserved_bytes)}  (other clients' reservations)"),
        ("projected", f"{fmt_bytes(r.projected_bytes)}  (usage + request + reserved)"),
        ("admission limit", fmt_bytes(r.admission_limit_bytes)),
        ("headroom", fmt_bytes(r.admission_headroom_bytes)),
        ("cached prefix", f"{r.reusable_prefix_tokens} tokens"),
        ("would shed", f"{r.shed_entries} entries, {fmt_bytes(r.shed_bytes)}"),
    ]
    if r.error_reason:
        rows.append(("generate would end", r.error_reason))
    if r.HasField("retry_after"):
        rows.append(("retry after", f"{r.retry_after.ToNanoseconds() / 1e9:g} s"))
    if r.ticket:
        rows.append(("ticket", r.ticket))
        rows.append(("expires", f"{timestamp_text(r.ticket_expire_time)}  (ttl "
                                f"{r.reservation_ttl.ToNanoseconds() / 1e9:g} s)"))
    if r.reason:
        rows.append(("reason", r.reason))
    return _kv(rows)


def _admit(args: argparse.Namespace) -> int:
    resp = _call(args, "Admit", admit_request(args))
    return _emit(args, wire_dict(resp), admit_view(resp))


# -- pins -----------------------------------------------------------------------------------


def _lease_view(verb: str, lease: control_pb2.Lease) -> RenderableType:
    expires = timestamp_text(lease.expire_time) if lease.HasField("expire_time") else "never"
    return _kv([(verb, lease.lease_id), ("target", _lease_target(lease)),
                ("owner", lease.owner or "-"), ("expires", expires)])


def _pin(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.session is None):
        raise OperatorError("pin: give a MODEL or --session ID (exactly one)")
    req = control_pb2.PinRequest(owner=args.owner, client_request_id=args.client_request_id)
    if args.model is not None:
        req.model_id = args.model
    else:
        req.session_id = args.session
    ttl = _duration(args.ttl)
    if ttl is not None:
        req.ttl.CopyFrom(ttl)
    resp = _call(args, "Pin", req)
    return _emit(args, wire_dict(resp), _lease_view("pinned", resp.lease))


def _unpin(args: argparse.Namespace) -> int:
    resp = _call(args, "Unpin", control_pb2.UnpinRequest(lease_id=args.lease_id))
    return _emit(args, wire_dict(resp), _lease_view("released", resp.lease))


# -- models -----------------------------------------------------------------------------------


def _load(args: argparse.Namespace) -> int:
    resp = _call(args, "LoadModel",
                 control_pb2.LoadModelRequest(source=args.source, model_id=args.model_id))
    m = resp.model
    view = Group(Text(f"loaded {m.model_id}: {fmt_bytes(m.measured_bytes)}, context "
                      f"{m.context_length}"), models_table([m]))
    return _emit(args, wire_dict(resp), view)


def _unload(args: argparse.Namespace) -> int:
    resp = _call(args, "UnloadModel",
                 control_pb2.UnloadModelRequest(model_id=args.model_id, force=args.force))
    view = _kv([("unloaded", args.model_id), ("freed", fmt_bytes(resp.freed_bytes)),
                ("aborted requests", str(resp.aborted_requests)),
                ("released leases", str(resp.released_leases))])
    return _emit(args, wire_dict(resp), view)


# -- sessions ---------------------------------------------------------------------------------


def list_sessions(args: argparse.Namespace) -> control_pb2.ListSessionsResponse:
    """Every page of ListSessions, joined into one response."""
    channel, stub = _control(args)
    out = control_pb2.ListSessionsResponse()
    token = ""
    with channel:
        while True:
            page = stub.ListSessions(control_pb2.ListSessionsRequest(
                model_id=args.model, page_token=token), timeout=args.timeout)
            out.sessions.extend(page.sessions)
            out.total_bytes = page.total_bytes
            token = page.next_page_token
            if not token:
                return out


def sessions_view(r: control_pb2.ListSessionsResponse) -> RenderableType:
    t = Table(title=f"sessions: {len(r.sessions)}, {fmt_bytes(r.total_bytes)} in the bank",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("session", "bytes", "entries", "longest prefix", "models", "active", "pinned",
                "last used"):
        t.add_column(col, justify="right" if col in ("bytes", "entries", "longest prefix")
                     else "left")
    for s in r.sessions:
        longest = max((e.prefix_tokens for e in s.entries), default=0)
        models = ",".join(sorted({e.model_id for e in s.entries})) or "-"
        last = max((e.last_access_time.ToNanoseconds() for e in s.entries), default=0)
        last_text = "-"
        if last:
            stamp = type(s.entries[0].last_access_time)()
            stamp.FromNanoseconds(last)
            last_text = timestamp_text(stamp)
        t.add_row(s.session_id, fmt_bytes(s.bytes), str(len(s.entries)), f"{longest} tokens",
                  models, "yes" if s.active else "-", "yes" if s.pinned else "-", last_text)
    return t


def _sessions(args: argparse.Namespace) -> int:
    if args.action == "drop":
        if not args.session_id:
            raise OperatorError("sessions drop: give the session ID")
        resp = _call(args, "DropSession",
                     control_pb2.DropSessionRequest(session_id=args.session_id))
        view = _kv([("dropped", args.session_id), ("entries", str(resp.entries_dropped)),
                    ("freed", fmt_bytes(resp.bytes_freed))])
        return _emit(args, wire_dict(resp), view)
    if args.session_id:
        raise OperatorError(f"sessions: unexpected {args.session_id!r} (did you mean "
                            f"`sessions drop {args.session_id}`?)")
    resp = list_sessions(args)
    return _emit(args, wire_dict(resp), sessions_view(resp))
