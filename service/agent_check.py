"""HAProxy's agent check: a TCP port that answers one line with this node's state.

HAProxy (`server ... check agent-check agent-port N agent-inter 500ms`) connects,
reads one ASCII line and sets the server's weight and state from its words; see
service.readiness for what is said when (``up ready 100%``, ``up ready 50%``,
``drain``, ``down #emergency``, ``down #draining``, ``down #loading``).

Served from the server's own asyncio loop: the answer is computed at connect time
from the same decision that sets gRPC health, so the two never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# After answering, wait this long for the peer to close (HAProxy closes once it has
# read the line) before closing ourselves: closing with unread input (an
# `agent-send` string) would reset the connection and could lose the answer.
PEER_CLOSE_WAIT_S = 1.0
MAX_INPUT_BYTES = 4096


async def start_agent_check(host: str, port: int, answer: Callable[[], str]) -> asyncio.Server:
    """Listens on host:port (0: any free port); each connection gets `answer()` + newline."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = answer()
            writer.write(line.encode("ascii", "replace") + b"\n")
            await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
                async with asyncio.timeout(PEER_CLOSE_WAIT_S):
                    while await reader.read(MAX_INPUT_BYTES):
                        pass  # whatever HAProxy sent (agent-send), until it closes
        except ConnectionError:
            pass  # the checker went away first: nothing to tell it
        except Exception:  # noqa: BLE001 - one bad connection must not end the listener
            log.exception("agent check: answering failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port, reuse_address=True)
    return server


def bound_port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]
