"""What the operator verbs share: the target flags, the one-line typed error, byte and
enum formatting, and wire messages as plain JSON-friendly dicts.

Kept free of the server's own modules (no MLX import) so a client verb starts fast.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

DEFAULT_PORT = 50051
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

LEVEL_STYLES = {
    "ok": "bold black on green",
    "soft": "bold black on yellow",
    "hard": "bold white on red",
    "emergency": "bold white on magenta",
    "unspecified": "bold white on grey35",
}
LEVEL_COLOURS = {"ok": "green", "soft": "yellow", "hard": "red", "emergency": "magenta"}


class OperatorError(Exception):
    """A failure that is already one line for the user."""


def new_process(instance: str, seen_instance: str, sequence: int, seen_sequence: int) -> bool:
    """Whether a WatchPressure snapshot came from another server process than the events
    seen before: its instance differs; from a server that names none, its sequence is
    lower (sequences only grow within one process)."""
    if instance and seen_instance:
        return instance != seen_instance
    return sequence < seen_sequence


def add_target(p: argparse.ArgumentParser, timeout: float = 600.0) -> None:
    """--host/--port/--timeout, as the existing client verbs take them, and --json."""
    p.add_argument("--host", default="127.0.0.1", help="server address (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="server port (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=timeout,
                   help="seconds before the call gives up (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (JSON lines for streams) instead of text")
    add_access(p)


def address(args: argparse.Namespace) -> str:
    return f"{args.host}:{args.port}"


# -- credentials (a server with TLS or tokens; docs/security.md) ----------------------
TOKEN_ENV = "PLIMSOLL_TOKEN"  # the same variable `plimsoll serve` reads


def add_access(p: argparse.ArgumentParser) -> None:
    """--token, --tls-ca, --tls-cert, --tls-key: how a client verb reaches a secured server."""
    p.add_argument("--token", default=None, metavar="TOKEN",
                   help=f"bearer token to send (default: ${TOKEN_ENV}, if set)")
    p.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="connect with TLS, trusting this CA (any of the --tls-* flags "
                   "turns TLS on; with none of them the system roots are not used)")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM",
                   help="the private key of --tls-cert")


def _token(args: argparse.Namespace) -> str | None:
    token = getattr(args, "token", None)
    return token if token is not None else (os.environ.get(TOKEN_ENV) or None)


def channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --tls-*, or None for a plain channel."""
    ca, cert, key = (getattr(args, n, None) for n in ("tls_ca", "tls_cert", "tls_key"))
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise OperatorError("--tls-cert and --tls-key go together")
    try:
        return grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes() if ca is not None else None,
            private_key=key.read_bytes() if key is not None else None,
            certificate_chain=cert.read_bytes() if cert is not None else None)
    except OSError as err:
        raise OperatorError(f"cannot read {err.filename}: {err.strerror}") from None


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


def _with_token(metadata, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), ("authorization", f"Bearer {token}")]


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer` to every call. Metadata rather than gRPC call
    credentials, which refuse a plain channel (a loopback server with tokens, no TLS)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, _with_token(d.metadata, self._token),
                            d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _AioBearer(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(d.method, d.timeout,
                                          _with_token(d.metadata, self._token),
                                          d.credentials, d.wait_for_ready)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the verb's server: TLS with --tls-*, the token with --token."""
    creds = channel_credentials(args)
    target = address(args)
    channel = (grpc.secure_channel(target, creds) if creds is not None
               else grpc.insecure_channel(target))
    token = _token(args)
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


def open_aio_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """The same, for grpc.aio."""
    creds = channel_credentials(args)
    token = _token(args)
    interceptors = [_AioBearer(token)] if token else None
    target = address(args)
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


# -- numbers and names ---------------------------------------------------------------


def fmt_bytes(n: int | float) -> str:
    """Bytes for people: 512 B, 3.1 KiB, 412.3 MiB, 7.12 GiB (negative keeps its sign)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < KiB:
        return f"{sign}{n:.0f} B"
    if n < MiB:
        return f"{sign}{n / KiB:.1f} KiB"
    if n < 10 * GiB:
        return f"{sign}{n / MiB:.1f} MiB"
    return f"{sign}{n / GiB:.2f} GiB"


def enum_label(enum_desc: descriptor.EnumDescriptor, value: int) -> str:
    """CEILING_TERM_DYNAMIC -> "dynamic": the value without its enum's prefix, lowercase."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum_desc.name).upper() + "_"
    value_desc = enum_desc.values_by_number.get(value)
    if value_desc is None:
        return str(value)
    return value_desc.name.removeprefix(prefix).lower()


def label(enum_type: Any, value: int) -> str:
    """The same for a generated enum wrapper (types_pb2.PressureLevel, ...)."""
    return enum_label(enum_type.DESCRIPTOR, value)


def timestamp_text(ts: timestamp_pb2.Timestamp) -> str:
    return ts.ToDatetime(tzinfo=UTC).isoformat().replace("+00:00", "Z")


def local_clock(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s).strftime("%H:%M:%S")


# -- wire messages as plain dicts ----------------------------------------------------


def _value(field: descriptor.FieldDescriptor, value: Any) -> Any:
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        return enum_label(field.enum_type, value)
    if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.full_name == timestamp_pb2.Timestamp.DESCRIPTOR.full_name:
            return timestamp_text(value) if (value.seconds or value.nanos) else None
        if field.message_type.full_name == duration_pb2.Duration.DESCRIPTOR.full_name:
            return value.ToNanoseconds() / 1e9
        return wire_dict(value)
    return value


def _repeated(field: descriptor.FieldDescriptor) -> bool:
    # protobuf 7 dropped FieldDescriptor.label for is_repeated; older releases have only label.
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return field.label == descriptor.FieldDescriptor.LABEL_REPEATED


def wire_dict(msg: Message) -> dict[str, Any]:
    """A message as a dict for scripts: proto field names, every field present, 64-bit
    integers as numbers (not the strings proto JSON uses), enums as short labels
    ("soft", "dynamic"), timestamps as RFC 3339 (None when unset), durations as seconds."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif _repeated(field):
            out[field.name] = [_value(field, v) for v in value]
        elif (field.type == descriptor.FieldDescriptor.TYPE_MESSAGE
              and not msg.HasField(field.name)):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def print_json(doc: Mapping[str, Any] | list[Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=False) + "\n")
    sys.stdout.flush()


# -- errors ----------------------------------------------------------------------------


def error_fields(err: grpc.RpcError, target: str) -> dict[str, Any]:
    """code, reason, message, metadata, retry_after_s and field violations of a failed call,
    read from google.rpc.Status details (ErrorInfo, RetryInfo, BadRequest)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (err.details() if callable(getattr(err, "details", None)) else "") or ""
    doc: dict[str, Any] = {"code": code.name, "reason": "", "message": message,
                           "metadata": {}, "retry_after_s": None, "field_violations": []}
    try:
        status = rpc_status.from_call(err)
    except ValueError:  # a status whose details disagree with its code: keep the plain line
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            doc["reason"], doc["metadata"] = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            doc["retry_after_s"] = retry.retry_delay.ToNanoseconds() / 1e9
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            doc["field_violations"] = [{"field": v.field, "description": v.description,
                                        "reason": v.reason} for v in bad.field_violations]
    # Transport failures carry no ErrorInfo; say what a person can act on.
    if code == grpc.StatusCode.UNAVAILABLE and not doc["reason"] and (
            "connect" in message.lower() or "refused" in message.lower()):
        doc["message"] = f"cannot reach a server at {target}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not doc["reason"]:
        doc["message"] = f"no answer from {target} before the timeout"
    return doc


def error_line(doc: Mapping[str, Any]) -> str:
    """`error: NOT_FOUND MODEL_NOT_FOUND: model 'x' is not known (known: demo-tiny)`."""
    head = " ".join(p for p in (doc["code"], doc["reason"]) if p)
    line = f"error: {head}: {doc['message']}".replace("\n", " ")
    if doc.get("retry_after_s") is not None:
        line += f" (retry after {doc['retry_after_s']:g}s)"
    return line


def report_error(err: grpc.RpcError, target: str, as_json: bool) -> int:
    """The one-line error on stderr (and, with --json, the same as a JSON document on
    stdout); the exit code."""
    doc = error_fields(err, target)
    if as_json:
        print_json({"error": doc})
    print(error_line(doc), file=sys.stderr)
    return 1
