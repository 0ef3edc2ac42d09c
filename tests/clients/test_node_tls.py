"""A Node service (@grpc/grpc-js) on a server that asks for mutual TLS and tokens:
accepted with a client certificate signed by the server's client CA and a token,
refused without the certificate, with one from another CA, or without the token.

The client is tests/clients/node/tls_client.mjs; the certificates are made here
(tests/support/certs.py).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.support.certs import Authority, Pem
from tools.harness.server import ServerProcess, start_server

NODE_DIR = Path(__file__).resolve().parent / "node"
CLIENT = NODE_DIR / "tls_client.mjs"
NODE = shutil.which("node")
NPM = shutil.which("npm")
TOKEN = "node-" + secrets.token_hex(16)

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None,
    reason="node and npm are needed for the Node client test (not found on PATH)",
)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """The locked dependencies, installed when missing (as tests/clients/test_node_client.py)."""
    needed = [NODE_DIR / "node_modules" / "@grpc" / p / "package.json"
              for p in ("grpc-js", "proto-loader")]
    if not all(p.exists() for p in needed):
        result = subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"
    return NODE_DIR / "node_modules"


@dataclass
class Pki:
    ca: Authority
    client: Pem
    rogue_client: Pem


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = Authority(d / "ca")
    return Pki(ca, ca.client("node-client"), Authority(d / "rogue", "rogue-ca").client())


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki, demo_path) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("mtls")
    server = pki.ca.server()
    (d / "tokens").write_text(f"{TOKEN} inference\n")
    (d / "tokens").chmod(0o600)
    creds = grpc.ssl_channel_credentials(pki.ca.pem.cert, pki.client.key, pki.client.cert)
    s = start_server(d, "--memory-guard-gb", "8", "--tls-cert", str(server.cert_path),
                     "--tls-key", str(server.key_path), "--tls-client-ca",
                     str(pki.ca.pem.cert_path), "--token-file", str(d / "tokens"),
                     credentials=creds)
    yield s
    s.stop()


def node(server: ServerProcess, pki: Pki, client: Pem | None, token: str = TOKEN
         ) -> subprocess.CompletedProcess:
    args = [NODE, str(CLIENT), "--address", server.address, "--ca", str(pki.ca.pem.cert_path)]
    if client is not None:
        args += ["--cert", str(client.cert_path), "--key", str(client.key_path)]
    if token:
        args += ["--token", token]
    return subprocess.run(args, cwd=NODE_DIR, capture_output=True, text=True, timeout=60)


def test_node_with_a_client_certificate_and_token_is_served(mtls_server, pki, node_modules):
    r = node(mtls_server, pki, pki.client)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    memory, generate = (json.loads(line) for line in r.stdout.splitlines())
    assert memory == {"call": "GetMemoryStatus", "level": "PRESSURE_LEVEL_OK"}
    assert generate["events"][0] == "start" and generate["events"][-1] == "end"
    assert generate["events"].count("chunk") >= 1


@pytest.mark.parametrize("which", ["none", "rogue"])
def test_node_without_a_trusted_client_certificate_is_refused(mtls_server, pki,
                                                              node_modules, which):
    r = node(mtls_server, pki, None if which == "none" else pki.rogue_client)
    assert r.returncode == 2, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.stdout == ""  # not even the first call got through
    status = json.loads(r.stderr.strip().splitlines()[-1])
    assert status["codeName"] == "UNAVAILABLE"  # the TLS handshake failed


def test_node_with_the_certificate_but_no_token_is_unauthenticated(mtls_server, pki,
                                                                   node_modules):
    r = node(mtls_server, pki, pki.client, token="")
    assert r.returncode == 2
    status = json.loads(r.stderr.strip().splitlines()[-1])
    assert status == {"code": 16, "codeName": "UNAUTHENTICATED",
                      "details": "missing or invalid credentials"}
