"""Access (docs/security.md) over real gRPC: TLS and mutual TLS with certificates made
here, bearer tokens and their scopes, the open health and reflection services, the
refusal to listen off loopback unprotected, the LoadModel model roots, the CLI verbs'
credentials and SIGHUP reloading the certificate and the tokens.

One `plimsoll serve` subprocess with every access flag serves the module; the reload
test replaces its files, so it runs last.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from engine import errors
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service import auth
from tests.support.certs import Authority, Pem
from tools.harness.server import ROOT, ServerProcess, free_port, start_server

INFER = "infer-" + secrets.token_hex(16)  # inference only
CTRL = "ctrl-" + secrets.token_hex(16)  # control only
OPS = "ops-" + secrets.token_hex(16)  # both
ROTATED = "rotated-" + secrets.token_hex(16)  # replaces INFER at the SIGHUP
UNAUTH = "missing or invalid credentials"
# Each test channel has its own subchannels: a reused connection would hide a handshake.
OWN_POOL = [("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Pki:
    ca: Authority
    server: Pem
    client: Pem
    rogue_client: Pem  # from a CA the server does not trust
    next_ca: Authority  # signs the certificate the reload brings in
    next_server: Pem


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue, nxt = Authority(d / "ca"), Authority(d / "rogue", "rogue-ca"), \
        Authority(d / "next", "next-ca")
    return Pki(ca, ca.server(), ca.client(), rogue.client("rogue-client"), nxt,
               nxt.server("next-server"))


@dataclass
class Roots:
    root: Path  # --model-root
    inside: Path  # a model folder in it
    outside: Path  # a model folder elsewhere
    escape: Path  # a symlink in the root to `outside`
    demo_link: Path  # a symlink in the root to the demo model (an allowed folder)


@pytest.fixture(scope="module")
def roots(tmp_path_factory, demo_path) -> Roots:
    d = tmp_path_factory.mktemp("roots")
    root, elsewhere = d / "models", d / "elsewhere"
    inside, outside = root / "tiny-copy", elsewhere / "tiny-copy"
    shutil.copytree(demo_path, inside)
    shutil.copytree(demo_path, outside)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "demo").symlink_to(demo_path, target_is_directory=True)
    return Roots(root, inside, outside, root / "escape", root / "demo")


def write_tokens(path: Path, infer: str) -> None:
    path.write_text(f"# token scopes\n{infer} inference\n{CTRL} control\n"
                    f"{OPS} control,inference\n")
    path.chmod(0o600)


def creds(pki: Pki, client: Pem | None = None, ca: Authority | None = None
          ) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (ca or pki.ca).pem.cert, client.key if client else None,
        client.cert if client else None)


@pytest.fixture(scope="module")
def srv(tmp_path_factory, pki, roots) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("secured")
    # The server reads copies, so the reload test can replace them.
    cert, key = d / "server.crt", d / "server.key"
    shutil.copy(pki.server.cert_path, cert)
    shutil.copy(pki.server.key_path, key)
    write_tokens(d / "tokens", INFER)
    s = start_server(d, "--memory-guard-gb", "8", "--tls-cert", str(cert), "--tls-key",
                     str(key), "--tls-client-ca", str(pki.ca.pem.cert_path),
                     "--token-file", str(d / "tokens"), "--model-root", str(roots.root),
                     "--no-hub", credentials=creds(pki, pki.client))
    s.files = d  # type: ignore[attr-defined]
    yield s
    s.stop()


def channel(srv: ServerProcess, c: grpc.ChannelCredentials | None) -> grpc.Channel:
    if c is None:
        return grpc.insecure_channel(srv.address, options=OWN_POOL)
    return grpc.secure_channel(srv.address, c, options=OWN_POOL)


@pytest.fixture()
def ch(srv, pki) -> Iterator[grpc.Channel]:
    with channel(srv, creds(pki, pki.client)) as c:
        yield c


def md(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def health(c: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(),
                                              timeout=5).status


def fails(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value


def reason_of(err: grpc.RpcError) -> str:
    st = rpc_status.from_call(err)
    for d in st.details if st else ():
        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info):
            return info.reason
    return ""


def detail_kinds(err: grpc.RpcError) -> list[str]:
    st = rpc_status.from_call(err)
    return [d.type_url.rsplit("/", 1)[-1] for d in (st.details if st else ())]


def generate(c: grpc.Channel, token: str | None):
    req = inference_pb2.GenerateRequest(text="hi", max_tokens=3, ignore_eos=True)
    return list(inference_pb2_grpc.InferenceServiceStub(c).Generate(
        req, metadata=md(token), timeout=60))


# -- transport -------------------------------------------------------------------------
def test_plaintext_client_cannot_talk_to_a_tls_server(srv):
    with channel(srv, None) as c:
        assert fails(lambda: health(c)).code() == grpc.StatusCode.UNAVAILABLE


def test_tls_without_a_client_certificate_is_refused(srv, pki):
    with channel(srv, creds(pki)) as c:
        assert fails(lambda: health(c)).code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_from_another_ca_is_refused(srv, pki):
    with channel(srv, creds(pki, pki.rogue_client)) as c:
        assert fails(lambda: health(c)).code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_server_refuses_it(srv, pki):
    with channel(srv, creds(pki, pki.client, ca=pki.next_ca)) as c:
        assert fails(lambda: health(c)).code() == grpc.StatusCode.UNAVAILABLE


# -- open services ---------------------------------------------------------------------
def test_health_and_reflection_need_no_token(ch):
    assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    answers = list(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"plimsoll.v1.InferenceService", "plimsoll.v1.ControlService",
            "grpc.health.v1.Health"} <= names


# -- tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize("metadata", [
    [],
    [("authorization", "Bearer " + "x" * 40)],
    [("authorization", "Bearer " + INFER[:-1])],  # one character short
    [("authorization", "Bearer " + INFER + "0")],  # one character long
    [("authorization", "Basic " + INFER)],
    [("authorization", INFER)],
    [("x-api-key", INFER)],
], ids=["none", "unknown", "short", "long", "basic", "no-scheme", "other-header"])
def test_missing_or_invalid_tokens_are_unauthenticated_alike(ch, metadata):
    control = control_pb2_grpc.ControlServiceStub(ch)
    inference = inference_pb2_grpc.InferenceServiceStub(ch)
    calls = {
        "Generate": lambda: inference.Generate(inference_pb2.GenerateRequest(text="hi"),
                                               metadata=metadata, timeout=10),
        "GetMemoryStatus": lambda: control.GetMemoryStatus(
            control_pb2.GetMemoryStatusRequest(), metadata=metadata, timeout=10),
        "Pin": lambda: control.Pin(control_pb2.PinRequest(model_id="demo-tiny"),
                                   metadata=metadata, timeout=10),
        "unknown service": lambda: ch.unary_unary("/no.such.Service/Call")(
            b"", metadata=metadata, timeout=10),
    }
    for name, call in calls.items():
        err = fails(call)
        # One answer for every failure: nothing tells a near miss from no token at all.
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert err.details() == UNAUTH, name
        assert reason_of(err) == errors.INVALID_CREDENTIALS, name
        assert detail_kinds(err) == ["google.rpc.ErrorInfo"], name


def _admit(reserve: bool):
    return control_pb2.AdmitRequest(
        request=inference_pb2.GenerateRequest(text="hi", max_tokens=2), reserve=reserve)


def _calls(c: grpc.Channel, roots: Roots) -> dict[str, Callable[[str], object]]:
    control = control_pb2_grpc.ControlServiceStub(c)
    return {
        "Generate": lambda t: generate(c, t),
        "Admit": lambda t: control.Admit(_admit(False), metadata=md(t), timeout=10),
        "Admit reserve": lambda t: control.Admit(_admit(True), metadata=md(t), timeout=10),
        "WatchPressure": lambda t: next(iter(control.WatchPressure(
            control_pb2.WatchPressureRequest(), metadata=md(t), timeout=10))),
        "GetMemoryStatus": lambda t: control.GetMemoryStatus(
            control_pb2.GetMemoryStatusRequest(), metadata=md(t), timeout=10),
        "ListModels": lambda t: control.ListModels(control_pb2.ListModelsRequest(),
                                                   metadata=md(t), timeout=10),
        "ListSessions": lambda t: control.ListSessions(control_pb2.ListSessionsRequest(),
                                                       metadata=md(t), timeout=10),
        "Pin": lambda t: control.Unpin(control_pb2.UnpinRequest(
            lease_id=control.Pin(control_pb2.PinRequest(model_id="demo-tiny", ttl={
                "seconds": 30}), metadata=md(t), timeout=30).lease.lease_id),
            metadata=md(t), timeout=10),
        "Unpin": lambda t: control.Unpin(control_pb2.UnpinRequest(lease_id="none"),
                                         metadata=md(t), timeout=10),
        "LoadModel": lambda t: control.LoadModel(control_pb2.LoadModelRequest(
            source=str(roots.root / "nothing")), metadata=md(t), timeout=10),
        "UnloadModel": lambda t: control.UnloadModel(control_pb2.UnloadModelRequest(
            model_id="no-such-model"), metadata=md(t), timeout=10),
        "DropSession": lambda t: control.DropSession(control_pb2.DropSessionRequest(
            session_id="no-such-session"), metadata=md(t), timeout=10),
        "MlxEngine": lambda t: c.unary_unary("/mlx.grpc.engine.MlxEngine/GetServerInfo")(
            b"", metadata=md(t), timeout=10),
    }


CONTROL_CALLS = {"Admit reserve", "Pin", "Unpin", "LoadModel", "UnloadModel", "DropSession"}


@pytest.mark.parametrize("token, scopes", [(INFER, {"inference"}), (CTRL, {"control"}),
                                           (OPS, {"control", "inference"})],
                         ids=["inference", "control", "both"])
def test_each_method_needs_its_scope(ch, roots, token, scopes):
    """What each scope may call (auth.RULES); a call it may make passes the check and
    gets the method's own answer (NOT_FOUND for the unknown ids here, not a refusal)."""
    for name, call in _calls(ch, roots).items():
        needed = "control" if name in CONTROL_CALLS else "inference"
        try:
            call(token)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            if needed not in scopes:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (name, err.details())
                assert reason_of(err) == errors.SCOPE_DENIED
                assert detail_kinds(err) == ["google.rpc.ErrorInfo"]
                assert err.details().startswith("this credential may not call "), name
                continue
        assert needed in scopes, f"{name} was not refused to {scopes}"
        assert code not in (grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.UNAUTHENTICATED), name


def test_a_refusal_names_the_method_and_nothing_else(ch):
    control = control_pb2_grpc.ControlServiceStub(ch)
    err = fails(lambda: control.Pin(control_pb2.PinRequest(model_id="demo-tiny"),
                                    metadata=md(INFER), timeout=10))
    assert err.details() == "this credential may not call plimsoll.v1.ControlService/Pin"
    err = fails(lambda: control.Admit(_admit(True), metadata=md(INFER), timeout=10))
    assert err.details() == ("this credential may not call plimsoll.v1.ControlService/Admit "
                             "with reserve set")


def test_an_admit_that_does_not_parse_is_invalid_not_a_crash(ch):
    """The per-request scope reads `reserve` from what service/decode_guard.py hands on,
    which for bytes that do not parse is its marker, not an AdmitRequest."""
    bad_utf8 = b"\x22\x02\xff\xfe"  # client_request_id (field 4): invalid UTF-8
    err = fails(lambda: ch.unary_unary("/plimsoll.v1.ControlService/Admit")(
        bad_utf8, metadata=md(INFER), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()


def test_every_contract_method_has_a_rule():
    """A new RPC must be placed in a scope on purpose, not fall to the default."""
    for file in (control_pb2.DESCRIPTOR, inference_pb2.DESCRIPTOR):
        for svc in file.services_by_name.values():
            for m in svc.methods:
                assert f"/{svc.full_name}/{m.name}" in auth.RULES, m.full_name
    assert auth.rule_for("/grpc.health.v1.Health/Watch").open
    assert auth.rule_for("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo").open
    assert auth.rule_for("/mlx.grpc.engine.MlxEngine/Abort") == auth.DEFAULT_RULE
    assert auth.DEFAULT_RULE.scope == auth.INFERENCE


def test_token_file_format_is_checked():
    good = auth.parse_token_file(f"# c\n\n{INFER} inference\n{OPS} control, inference\n"
                                 .replace(", ", ","))
    assert [s for _, s in good] == [{"inference"}, {"control", "inference"}]
    for bad, words in [(f"{INFER}", "expected"), (f"{INFER} admin", "unknown scope admin"),
                       ("short inference", "at least 16"),
                       (f"{INFER} inference extra", "expected")]:
        with pytest.raises(auth.AccessError, match=words) as info:
            auth.parse_token_file(bad, "tokens")
        assert INFER not in str(info.value)


# -- model roots -----------------------------------------------------------------------
def load(ch: grpc.Channel, source: str, model_id: str = "") -> control_pb2.LoadModelResponse:
    return control_pb2_grpc.ControlServiceStub(ch).LoadModel(
        control_pb2.LoadModelRequest(source=source, model_id=model_id),
        metadata=md(OPS), timeout=60)


def unload(ch: grpc.Channel, model_id: str) -> None:
    control_pb2_grpc.ControlServiceStub(ch).UnloadModel(
        control_pb2.UnloadModelRequest(model_id=model_id, force=True), metadata=md(OPS),
        timeout=60)


def test_load_model_inside_a_root_and_the_demo_folder(ch, roots, demo_path):
    assert load(ch, str(roots.inside), "inside").model.model_id == "inside"
    unload(ch, "inside")
    # The demo model's folder stays loadable, directly or through a link in a root.
    assert load(ch, str(demo_path), "demo-again").model.model_id == "demo-again"
    unload(ch, "demo-again")
    assert load(ch, str(roots.demo_link), "demo-link").model.model_id == "demo-link"
    unload(ch, "demo-link")


def _resource(err: grpc.RpcError) -> tuple[str, str]:
    st = rpc_status.from_call(err)
    for d in st.details:
        info = error_details_pb2.ResourceInfo()
        if d.Unpack(info):
            return info.resource_type, info.resource_name
    return "", ""


def test_load_model_outside_the_roots_is_permission_denied(ch, roots, tmp_path):
    for source in (str(roots.outside), str(tmp_path / "not-there"), str(roots.escape),
                   "/etc"):
        err = fails(lambda s=source: load(ch, s))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, source
        assert reason_of(err) == errors.SOURCE_OUTSIDE_ROOTS
        assert err.details() == (f"source '{source}' is outside the folders this server "
                                 "loads models from")
        assert _resource(err) == ("source", source)
        # Where the link leads, or where the roots are, is not told.
        assert str(roots.root) not in err.details() or source.startswith(str(roots.root))
        assert str(roots.outside) not in err.details() or source == str(roots.outside)


def test_dot_dot_in_a_source_is_invalid(ch, roots):
    source = f"{roots.root}/../elsewhere/tiny-copy"
    err = fails(lambda: load(ch, source))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    st = rpc_status.from_call(err)
    fields = []
    for d in st.details:
        bad = error_details_pb2.BadRequest()
        if d.Unpack(bad):
            fields = [v.field for v in bad.field_violations]
    assert fields == ["source"]


def test_hub_ids_are_refused_with_no_hub(ch):
    err = fails(lambda: load(ch, "mlx-community/Qwen3-0.6B-4bit"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason_of(err) == errors.HUB_DISABLED
    assert _resource(err) == ("source", "mlx-community/Qwen3-0.6B-4bit")


# -- the CLI verbs ---------------------------------------------------------------------
def plimsoll(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "PLIMSOLL_TOKEN"}
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT,
                          env={**full, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


def test_cli_verbs_reach_a_secured_server(srv, pki):
    tls = ["--tls-ca", str(pki.ca.pem.cert_path), "--tls-cert", str(pki.client.cert_path),
           "--tls-key", str(pki.client.key_path), "--port", str(srv.port)]
    ok = plimsoll("status", "--json", *tls, env={"PLIMSOLL_TOKEN": INFER})
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["level"]
    models = plimsoll("models", *tls, "--token", OPS)  # grpc.aio path
    assert models.returncode == 0, models.stderr
    assert "demo-tiny" in models.stdout
    refused = plimsoll("pin", "demo-tiny", *tls, "--token", INFER)
    assert refused.returncode == 1
    assert "PERMISSION_DENIED SCOPE_DENIED" in refused.stderr
    anonymous = plimsoll("status", *tls)
    assert anonymous.returncode == 1
    assert f"UNAUTHENTICATED INVALID_CREDENTIALS: {UNAUTH}" in anonymous.stderr


# -- exposure --------------------------------------------------------------------------
def test_off_loopback_without_tls_or_tokens_refuses_to_start():
    r = plimsoll("serve", "--host", "0.0.0.0", "--port", str(free_port()))
    assert r.returncode == 2, r.stderr
    assert "refusing to listen on 0.0.0.0 with neither TLS nor tokens" in r.stderr
    assert "--insecure" in r.stderr


def test_insecure_starts_with_a_warning(tmp_path):
    s = start_server(tmp_path, "--host", "0.0.0.0", "--insecure")
    try:
        assert "warning: --insecure: listening on 0.0.0.0 with neither TLS nor tokens" \
            in s.log()
    finally:
        s.stop()


def test_exposure_rules():
    assert auth.exposure("127.0.0.1", False, False, False) == (None, [])
    assert auth.exposure("::1", False, False, False) == (None, [])
    assert auth.exposure("localhost", False, False, False) == (None, [])
    assert auth.exposure("0.0.0.0", False, False, False)[0] is not None
    assert auth.exposure("10.1.2.3", True, False, False) == (None, [])
    refusal, warnings = auth.exposure("10.1.2.3", False, True, False)
    assert refusal is None and "plain text" in warnings[0]


# -- last: the reload replaces the server's files ---------------------------------------
def test_tokens_are_never_logged(srv):
    text = srv.log()
    assert "refused" in text  # the refusals above were logged, by reason
    for token in (INFER, CTRL, OPS):
        assert token not in text


def test_sighup_reloads_the_certificate_and_the_tokens(srv, pki):
    d: Path = srv.files  # type: ignore[attr-defined]
    shutil.copy(pki.next_server.cert_path, d / "server.crt")
    shutil.copy(pki.next_server.key_path, d / "server.key")
    write_tokens(d / "tokens", ROTATED)
    os.kill(srv.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "TLS certificate reloaded" not in srv.log():
        assert time.monotonic() < deadline, srv.log()[-2000:]
        time.sleep(0.1)
    assert srv.proc.poll() is None  # SIGHUP did not end it
    # New handshakes present the new certificate; the client CA is the same.
    with channel(srv, creds(pki, pki.client, ca=pki.next_ca)) as c:
        assert health(c) == health_pb2.HealthCheckResponse.SERVING
        assert generate(c, ROTATED)
        err = fails(lambda: generate(c, INFER))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    with channel(srv, creds(pki, pki.client)) as c:
        assert fails(lambda: health(c)).code() == grpc.StatusCode.UNAVAILABLE
    assert ROTATED not in srv.log()


@pytest.mark.parametrize("case", ["mismatched key", "bad token line"])
def test_unusable_files_stop_the_server_at_start(tmp_path, pki, case):
    args = ["serve", "--port", str(free_port())]
    if case == "mismatched key":
        args += ["--tls-cert", str(pki.server.cert_path), "--tls-key",
                 str(pki.next_server.key_path)]
        words = f"TLS certificate {pki.server.cert_path} and key"
    else:
        (tmp_path / "tokens").write_text(f"{INFER} inference\n{OPS} admin\n")
        args += ["--token-file", str(tmp_path / "tokens")]
        words = "line 2: unknown scope admin"
    r = plimsoll(*args)
    assert r.returncode == 1, r.stderr
    assert words in r.stderr
    assert INFER not in r.stderr + r.stdout and OPS not in r.stderr + r.stdout
    assert "Traceback" not in r.stderr


def test_a_reload_with_unusable_files_keeps_what_is_in_use(tmp_path, pki):
    from service.tls import ServerTls, TlsFiles

    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    shutil.copy(pki.server.cert_path, cert)
    shutil.copy(pki.server.key_path, key)
    tls = ServerTls(TlsFiles(cert, key, pki.ca.pem.cert_path))
    shutil.copy(pki.next_server.key_path, key)  # no longer the certificate's key
    assert tls.reload() is False
    assert tls._fetch() is None  # gRPC keeps the configuration it has
    shutil.copy(pki.next_server.cert_path, cert)
    assert tls.reload() is True
    assert tls._fetch() is not None and tls._fetch() is None  # handed over once

    tokens = tmp_path / "tokens"
    write_tokens(tokens, INFER)
    store = auth.TokenStore(tokens)
    tokens.write_text("not a token file\n")
    assert store.reload() is False
    assert store.scopes_of(INFER) == {"inference"}
    assert store.scopes_of(OPS) == {"control", "inference"}
    assert store.scopes_of(INFER[:-1]) is None and store.scopes_of("") is None
