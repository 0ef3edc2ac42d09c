"""TLS and mutual TLS for the gRPC listener, reloadable without a restart.

The server's credentials come from `grpc.dynamic_ssl_server_credentials`: gRPC asks
`ServerTls._fetch` for a certificate configuration at every new TLS handshake, and
`reload()` (SIGHUP) hands it a fresh one read from the same files. Connections already
open keep the certificate they were made with; only new handshakes see the new one.
Files are checked with the standard library's `ssl` before gRPC sees them, so a
mismatched key or an unreadable file is one clear error at start, and a bad file at
reload keeps the old configuration instead of breaking every new connection.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """The certificate, key or client CA cannot be used (a message for the operator)."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key; with `client_ca`, clients must
    present a certificate signed by it (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise TlsError(f"cannot read the {what} {path}: {err.strerror or err}") from None


def check_files(files: TlsFiles) -> tuple[bytes, bytes, bytes | None]:
    """(cert, key, client CA) as bytes, once `ssl` has accepted them: the key matches the
    certificate and the CA file holds at least one certificate."""
    cert, key = _read(files.cert, "TLS certificate"), _read(files.key, "TLS key")
    ca = _read(files.client_ca, "client CA") if files.client_ca is not None else None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as err:
        raise TlsError(f"TLS certificate {files.cert} and key {files.key} cannot be used "
                       f"together: {err}") from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as err:
            raise TlsError(f"client CA {files.client_ca} holds no usable certificate: "
                           f"{err}") from None
    return cert, key, ca


def _configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
    cert, key, ca = check_files(files)
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class ServerTls:
    """The listener's TLS: `credentials()` for `add_secure_port`, `reload()` on SIGHUP."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._initial = _configuration(files)
        self._pending: grpc.ServerCertificateConfiguration | None = None
        # gRPC calls the fetcher from its own threads, reload() runs on the event loop.
        self._lock = threading.Lock()
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.files.mutual)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # None: "unchanged"; a configuration is handed over once, then gRPC keeps it.
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> bool:
        """Reads the files again; False (and the old certificate stays) when they cannot
        be used."""
        try:
            config = _configuration(self.files)
        except TlsError as err:
            log.error("TLS reload failed, keeping the certificate in use: %s", err)
            return False
        with self._lock:
            self._pending = config
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.files.cert)
        return True
