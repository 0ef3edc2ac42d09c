"""Access: who may call what, over which transport, and what LoadModel may read.

- **Tokens.** `authorization: Bearer <token>` metadata, checked by `AuthInterceptor`
  against every configured token with a constant-time compare. Each token holds scopes:
  `control` (Pin, Unpin, LoadModel, UnloadModel, DropSession, Admit with `reserve`) and
  `inference` (Generate, Admit without `reserve`, WatchPressure, the status reads).
  `RULES` is the one table; a method it does not list (another service on the same port,
  such as SMG's MlxEngine) needs `inference`. Health and reflection stay open: load
  balancers and grpcurl use them before they hold any credential.
- **TLS** (service/tls.py): server certificate, optionally a client CA for mutual TLS.
- **Exposure.** A listener off loopback with neither TLS nor tokens is refused unless
  the operator says `--insecure` (`exposure`).
- **Model roots.** `SourcePolicy` confines LoadModel's paths to configured folders and
  can refuse Hugging Face repository ids.

Failures are UNAUTHENTICATED ("missing or invalid credentials") or PERMISSION_DENIED
("this credential may not call M"): nothing says whether a token was close, which
tokens exist or what a path resolved to. No token is ever logged. docs/security.md.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import inspect
import ipaddress
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from engine import errors
from engine.demo_models import demo_model_path
from engine.errors import InvalidArgument, PermissionDenied, PlimsollError, Unauthenticated
from engine.sources import looks_like_path  # the same path-or-repository test as loading
from plimsoll.v1 import control_pb2, inference_pb2
from service import status
from service.tls import ServerTls, TlsFiles

log = logging.getLogger(__name__)

CONTROL = "control"
INFERENCE = "inference"
SCOPES = frozenset({CONTROL, INFERENCE})
TOKEN_ENV = "PLIMSOLL_TOKEN"  # one token with every scope (server and CLI alike)
MIN_TOKEN_CHARS = 16  # shorter tokens are guessable; refused at start


# -- the method table -----------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """What a method needs. `open`: no credential at all. Otherwise the caller must hold
    `scope`; with `by_request`, the scope comes from the deserialized request instead
    (the caller must hold one of SCOPES to get that far)."""

    scope: str = INFERENCE
    open: bool = False
    by_request: Callable[[Any], str] | None = None


OPEN = Rule(open=True)
DEFAULT_RULE = Rule(INFERENCE)  # methods of services this table does not list


def _admit_scope(request: control_pb2.AdmitRequest) -> str:
    # A reservation holds memory for its TTL, which shapes what others may run. A request
    # that did not parse (service/decode_guard.py's marker) reserves nothing: the guard
    # inside answers it INVALID_ARGUMENT.
    return CONTROL if getattr(request, "reserve", False) else INFERENCE


def _method(file: Any, service: str, name: str) -> str:
    svc = file.services_by_name[service]
    assert name in svc.methods_by_name, f"{service}/{name} is not in the contract"
    return f"/{svc.full_name}/{name}"


def _control(name: str) -> str:
    return _method(control_pb2.DESCRIPTOR, "ControlService", name)


RULES: dict[str, Rule] = {
    _method(inference_pb2.DESCRIPTOR, "InferenceService", "Generate"): Rule(INFERENCE),
    _control("Admit"): Rule(by_request=_admit_scope),
    _control("WatchPressure"): Rule(INFERENCE),
    _control("GetMemoryStatus"): Rule(INFERENCE),
    _control("ListModels"): Rule(INFERENCE),
    _control("ListSessions"): Rule(INFERENCE),
    _control("Pin"): Rule(CONTROL),
    _control("Unpin"): Rule(CONTROL),
    _control("LoadModel"): Rule(CONTROL),
    _control("UnloadModel"): Rule(CONTROL),
    _control("DropSession"): Rule(CONTROL),
}
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                 "grpc.reflection.v1alpha.ServerReflection")


def rule_for(method: str) -> Rule:
    """`method` as gRPC names it: "/package.Service/Method"."""
    found = RULES.get(method)
    if found is not None:
        return found
    service = method.lstrip("/").partition("/")[0]
    return OPEN if service in OPEN_SERVICES else DEFAULT_RULE


# -- tokens ---------------------------------------------------------------------------
class AccessError(ValueError):
    """A token file, token or access flag that cannot be used (for the operator; never
    quotes a token)."""


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest from returning early on a
    # length difference, so timing tells nothing about a token's length either.
    return hashlib.sha256(token.encode()).digest()


def _check_token(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise AccessError(f"{where}: a token must be at least {MIN_TOKEN_CHARS} characters")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise AccessError(f"{where}: a token must be printable ASCII without spaces")


def parse_token_file(text: str, name: str = "token file") -> list[tuple[str, frozenset[str]]]:
    """Lines `TOKEN SCOPE[,SCOPE]`; blank lines and `#` comments are skipped."""
    found: list[tuple[str, frozenset[str]]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{name} line {n}"
        if len(parts) != 2:
            raise AccessError(f"{where}: expected `TOKEN SCOPE[,SCOPE]` "
                              f"(scopes: {', '.join(sorted(SCOPES))})")
        token, scope_text = parts
        _check_token(token, where)
        scopes = frozenset(s.strip() for s in scope_text.split(",") if s.strip())
        unknown = sorted(scopes - SCOPES)
        if unknown or not scopes:
            raise AccessError(f"{where}: unknown scope {', '.join(unknown) or '(none)'}; "
                              f"scopes are {', '.join(sorted(SCOPES))}")
        found.append((token, scopes))
    return found


class TokenStore:
    """The configured tokens, as digests; `reload()` reads the file and variable again."""

    def __init__(self, token_file: Path | None = None, env_var: str = "",
                 environ: Mapping[str, str] | None = None) -> None:
        self.token_file = token_file
        self.env_var = env_var
        self._environ = environ if environ is not None else os.environ
        self._lock = threading.Lock()
        self._table: tuple[tuple[bytes, frozenset[str]], ...] = self._load()

    @property
    def configured(self) -> bool:
        """Whether tokens are in force at all (a file, or the variable set)."""
        return self.token_file is not None or bool(self._environ.get(self.env_var or "\0"))

    def __len__(self) -> int:
        return len(self._table)

    def _load(self) -> tuple[tuple[bytes, frozenset[str]], ...]:
        pairs: list[tuple[str, frozenset[str]]] = []
        if self.env_var and self._environ.get(self.env_var):
            token = self._environ[self.env_var].strip()
            _check_token(token, f"${self.env_var}")
            pairs.append((token, SCOPES))
        if self.token_file is not None:
            try:
                text = self.token_file.read_text()
                mode = self.token_file.stat().st_mode
            except OSError as err:
                raise AccessError(f"cannot read the token file {self.token_file}: "
                                  f"{err.strerror or err}") from None
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("token file %s is readable by other users; chmod 600 it",
                            self.token_file)
            pairs.extend(parse_token_file(text, str(self.token_file)))
        return tuple((_digest(t), s) for t, s in pairs)

    def reload(self) -> bool:
        try:
            table = self._load()
        except AccessError as err:
            log.error("token reload failed, keeping the tokens in use: %s", err)
            return False
        with self._lock:
            self._table = table
        log.info("tokens reloaded: %d in force", len(table))
        return True

    def scopes_of(self, token: str | None) -> frozenset[str] | None:
        """The scopes `token` holds, None when it is not one of ours."""
        if not token:
            return None
        presented = _digest(token)
        held: frozenset[str] | None = None
        # Every entry is compared, matched or not, so the time taken does not say which.
        for digest, scopes in self._table:
            if hmac.compare_digest(presented, digest):
                held = scopes if held is None else held | scopes
        return held


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, if there is one."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        kind, _, token = text.strip().partition(" ")
        if kind.lower() == "bearer" and token.strip():
            return token.strip()
    return None


# -- the interceptor --------------------------------------------------------------------
def _kind(handler: grpc.RpcMethodHandler | None) -> Callable[..., grpc.RpcMethodHandler]:
    if handler is None:
        return grpc.unary_unary_rpc_method_handler
    return {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]


def _refusal(handler: grpc.RpcMethodHandler | None, err: PlimsollError,
             method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `err`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.info("refused %s from %s: %s", method, context.peer(), err.reason)
        await status.abort(context, err)

    # No deserializer: the request is never read, so a caller without credentials
    # cannot make the server parse anything.
    return _kind(handler)(refuse, response_serializer=getattr(
        handler, "response_serializer", None))


def _guarded(handler: grpc.RpcMethodHandler, rule: Rule, scopes: frozenset[str],
             method: str) -> grpc.RpcMethodHandler:
    """`handler` with its request's scope checked once it is deserialized (unary only)."""
    assert rule.by_request is not None
    if handler.request_streaming or handler.unary_unary is None:
        raise TypeError(f"{method}: per-request scopes need a unary-unary method")
    inner = handler.unary_unary

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        needed = rule.by_request(request)
        if needed not in scopes:
            err = denied(method, "with reserve set" if needed == CONTROL else "")
            log.info("refused %s from %s: %s", method, context.peer(), err.reason)
            await status.abort(context, err)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(
        checked, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


def denied(method: str, how: str = "") -> PermissionDenied:
    name = method.lstrip("/")
    return PermissionDenied(f"this credential may not call {name}" + (f" {how}" if how else ""),
                            errors.SCOPE_DENIED)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens and scopes for every method but the open ones (see `RULES`)."""

    def __init__(self, tokens: TokenStore) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        method: str = handler_call_details.method
        rule = rule_for(method)
        if rule.open:
            return await continuation(handler_call_details)
        scopes = self.tokens.scopes_of(bearer_token(handler_call_details.invocation_metadata))
        handler = await continuation(handler_call_details)
        if scopes is None:
            return _refusal(handler, Unauthenticated(), method)
        if rule.by_request is None and rule.scope not in scopes:
            return _refusal(handler, denied(method), method)
        if handler is not None and rule.by_request is not None:
            return _guarded(handler, rule, scopes, method)
        return handler


# -- model roots ------------------------------------------------------------------------
@dataclass(frozen=True)
class SourcePolicy:
    """What LoadModel may load. `roots` (resolved) empty: any folder the server can read,
    as before; otherwise a path must resolve inside one of them. `allow_hub` False:
    Hugging Face repository ids are refused."""

    roots: tuple[Path, ...] = ()
    allow_hub: bool = True

    @classmethod
    def of(cls, roots: Sequence[Path], allow_hub: bool = True,
           demo_dir: Path | None = None) -> SourcePolicy:
        """`demo_dir` (where demo models are made) joins non-empty roots, so the demo
        model stays loadable; the server writes only its own models there."""
        found = [Path(r).expanduser().resolve() for r in roots]
        if found and demo_dir is not None:
            found.append(demo_dir.expanduser().resolve())
        return cls(tuple(dict.fromkeys(found)), allow_hub)

    def check(self, source: str) -> None:
        """Raises InvalidArgument (`..` in a confined path) or PermissionDenied
        (SOURCE_OUTSIDE_ROOTS, HUB_DISABLED); messages quote only `source`."""
        if not source:
            return  # the loader's own check names the empty field
        path = Path(source).expanduser()
        is_path = path.exists() or looks_like_path(source)
        if not is_path:
            if not self.allow_hub:
                raise PermissionDenied(
                    f"source '{source}' is a Hugging Face repository id; this server "
                    "loads models from its own folders only", errors.HUB_DISABLED,
                    resource_type="source", resource_name=source)
            return
        if not self.roots:
            return
        if ".." in path.parts:
            raise InvalidArgument(f"source must not contain '..' components: '{source}'",
                                  "source")
        resolved = path.resolve()  # follows every symlink: a link out of a root is out
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise PermissionDenied(
                f"source '{source}' is outside the folders this server loads models from",
                errors.SOURCE_OUTSIDE_ROOTS, resource_type="source", resource_name=source)


# -- the whole of it --------------------------------------------------------------------
@dataclass
class AccessConfig:
    """Access settings of a server (`plimsoll serve` flags)."""

    tls: TlsFiles | None = None
    token_file: Path | None = None
    # The variable holding one all-scope token; "" reads none (the default in-process,
    # so an exported PLIMSOLL_TOKEN does not lock tests' servers; `serve` sets it).
    token_env: str = ""
    model_roots: list[Path] = field(default_factory=list)
    allow_hub: bool = True
    insecure: bool = False  # allow a listener off loopback with neither TLS nor tokens


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; anything else (0.0.0.0, a name) is exposed."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure(host: str, tls: bool, tokens: bool, insecure: bool
             ) -> tuple[str | None, list[str]]:
    """(why to refuse to start, or None; warnings to print) for a listener on `host`."""
    if is_loopback(host):
        return None, []
    if not tls and not tokens:
        if not insecure:
            return (f"refusing to listen on {host} with neither TLS nor tokens: anyone who "
                    "can reach the port could load models and run work. Give --tls-cert/"
                    "--tls-key, --token-file or $PLIMSOLL_TOKEN, or --insecure to go on "
                    "anyway"), []
        return None, [f"--insecure: listening on {host} with neither TLS nor tokens; "
                      "anyone who can reach the port may call every method"]
    warnings = []
    if tokens and not tls:
        warnings.append(f"tokens travel in plain text on {host}: add --tls-cert/--tls-key")
    return None, warnings


class Access:
    """A server's access parts, built from its `AccessConfig`: the interceptor, the
    listener's credentials, the LoadModel source policy and the SIGHUP reload."""

    def __init__(self, config: AccessConfig, demo_dir: Path | None = None) -> None:
        self.config = config
        self.tls = ServerTls(config.tls) if config.tls is not None else None
        self.tokens: TokenStore | None = None
        if config.token_file is not None or config.token_env:
            store = TokenStore(config.token_file, config.token_env)
            self.tokens = store if store.configured else None
        self.sources = SourcePolicy.of(config.model_roots, config.allow_hub, demo_dir)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [AuthInterceptor(self.tokens)] if self.tokens is not None else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.credentials())

    def reload(self) -> None:
        """SIGHUP: the certificate files and the tokens, read again (each kept as it
        was when its files cannot be used)."""
        if self.tls is not None:
            self.tls.reload()
        if self.tokens is not None:
            self.tokens.reload()


def demo_dir(cache_dir: Path | None) -> Path:
    """The folder the demo models live in (any size)."""
    return demo_model_path("tiny", cache_dir).parent


# -- `plimsoll serve` -------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The access flags of `plimsoll serve`."""
    g = parser.add_argument_group(
        "access", "TLS, tokens and what LoadModel may read (docs/security.md). SIGHUP "
        "re-reads the certificate, key, client CA and token file.")
    g.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="serve TLS with this certificate chain (needs --tls-key)")
    g.add_argument("--tls-key", type=Path, default=None, metavar="PEM",
                   help="the private key of --tls-cert")
    g.add_argument("--tls-client-ca", type=Path, default=None, metavar="PEM",
                   help="mutual TLS: clients must present a certificate signed by this CA")
    g.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="bearer tokens, one `TOKEN SCOPE[,SCOPE]` per line (scopes: "
                   f"control, inference); ${TOKEN_ENV} adds one token with every scope")
    g.add_argument("--insecure", action="store_true",
                   help="allow listening off loopback with neither TLS nor tokens")
    g.add_argument("--model-root", type=Path, action="append", default=[], metavar="DIR",
                   help="LoadModel loads folders inside DIR only (repeatable; the demo "
                   "model folder is always allowed); default: any folder")
    g.add_argument("--no-hub", action="store_true",
                   help="LoadModel refuses Hugging Face repository ids")


def access_from_args(args: argparse.Namespace) -> AccessConfig:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise AccessError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise AccessError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = (TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
           if args.tls_cert is not None else None)
    for root in args.model_root:
        if not root.expanduser().is_dir():
            raise AccessError(f"--model-root {root} is not a folder")
    return AccessConfig(tls=tls, token_file=args.token_file, token_env=TOKEN_ENV,
                        model_roots=list(args.model_root), allow_hub=not args.no_hub,
                        insecure=args.insecure)


def preflight(host: str, config: AccessConfig) -> tuple[str | None, list[str]]:
    """Reads the TLS files and tokens once (a bad one is an AccessError / TlsError here,
    before any model loads) -> `exposure`'s (refusal, warnings)."""
    tls = ServerTls(config.tls) if config.tls is not None else None
    store = (TokenStore(config.token_file, config.token_env)
             if config.token_file is not None or config.token_env else None)
    tokens = store is not None and store.configured
    refusal, warnings = exposure(host, tls is not None, tokens, config.insecure)
    if store is not None and store.configured and not len(store):
        warnings.append("the token file holds no token: every call but health and "
                        "reflection is refused")
    return refusal, warnings
