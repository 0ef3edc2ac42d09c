"""The web dashboard (`plimsoll serve --http-port`): its HTTP endpoints, the SSE bridge
from the pressure stream, and the page itself in headless Chromium.

Pressure here is real. The server runs in this process (`PlimsollServer` with the real
reader: /proc, psutil, MLX) and `Balloon` grows this very process's memory (pages
written, so RSS grows) past the soft and the hard marks, then frees it. Every link of
reader → governor → publisher → broker → SSE → page is the production one; nothing is
scripted. The custom ceiling is set from this process's size just before the server
starts, so the marks sit a fixed distance above its usage whatever ran earlier in the
session.

docs/web-dashboard.png is the browser test's screenshot after its ok → soft → hard → ok
episode: `PLIMSOLL_DASHBOARD_SCREENSHOT=docs/web-dashboard.png pytest
tests/integration/test_web_dashboard.py -k browser` writes it there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil
import pytest
from google.protobuf import json_format

from memory.config import MemoryConfig
from memory.levels import GIB, PressureLevel, Tier
from plimsoll.v1 import control_pb2
from service.cli import build_parser
from service.server import PlimsollServer, ServerConfig
from tools.harness.server import free_port, serving

pytestmark = pytest.mark.timeout(120)

GAP_BYTES = 384 * 1024**2  # from usage to soft, soft to hard, hard to the ceiling
POLL_S = 0.2
BLOCK_BYTES = 64 * 1024**2  # over glibc's mmap threshold: a free gives the pages back
LEVEL_TIMEOUT_S = 15.0
OWNER = "dashboard-test"
SCREENSHOT_ENV = "PLIMSOLL_DASHBOARD_SCREENSHOT"
CHROMIUM = shutil.which("chromium")
VIEWPORT = (1360, 1020)
# Holds that only make the screenshot read well (a stretch of each level on the chart):
# full length when the screenshot is kept for the docs.
SHOT = bool(os.environ.get(SCREENSHOT_ENV))
HOLD_S = 1.5 if SHOT else 0.2


# -- real memory in the server's own process ---------------------------------------------


class Balloon:
    """Memory this process really holds: every page written, so its RSS grows."""

    def __init__(self) -> None:
        self._blocks: list[bytearray] = []

    async def inflate(self, nbytes: int) -> None:
        def fill() -> None:
            for _ in range(max(1, -(-nbytes // BLOCK_BYTES))):
                self._blocks.append(bytearray(b"\x5a") * BLOCK_BYTES)  # memset: pages touched

        await asyncio.to_thread(fill)

    def deflate(self) -> None:
        self._blocks.clear()


def own_usage() -> int:
    """This process's usage as the reader grades it: max(MLX active, RSS)."""
    return max(psutil.Process().memory_info().rss, mx.get_active_memory())


def memory_config() -> MemoryConfig:
    """Soft, hard and the ceiling one GAP apart, the first one GAP above usage now."""
    base = own_usage()
    ceiling = base + 3 * GAP_BYTES
    return MemoryConfig(
        tier=Tier.CUSTOM, custom_ceiling_gib=ceiling / GIB,
        soft_fraction=(base + GAP_BYTES) / ceiling,
        hard_fraction=(base + 2 * GAP_BYTES) / ceiling,
        active_poll_s=POLL_S, idle_poll_s=POLL_S, empty_poll_s=POLL_S, load_warmup_s=0,
    )


async def start_server(demo_path: Path, http: bool = True) -> PlimsollServer:
    """An in-process server on the tiny demo model, pinned (so the hard mark evicts
    nothing), with the dashboard on a free port."""
    config = ServerConfig(port=0, models=[str(demo_path)], memory=memory_config(),
                          http_port=0 if http else None, drain_grace_s=2.0)
    server = PlimsollServer(config)
    await server.start()
    await server.load_initial_models()
    (entry,) = server.service.pool.entries()
    await server.service.control.pin_model(entry.model_id, OWNER, None)
    return server


async def wait_level(server: PlimsollServer, level: PressureLevel) -> None:
    deadline = asyncio.get_running_loop().time() + LEVEL_TIMEOUT_S
    while server.publisher.level is not level:
        if asyncio.get_running_loop().time() > deadline:
            snap = server.publisher.snapshot()
            raise AssertionError(f"level {server.publisher.level.name}, not {level.name}: "
                                 f"{snap.readings.process_bytes} B against {snap.limits}")
        await asyncio.sleep(0.05)


async def episode(server: PlimsollServer, balloon: Balloon,
                  on_level=None) -> None:
    """ok → soft → hard → ok by real growth: the balloon takes usage to halfway between
    soft and hard, then halfway between hard and the ceiling, then lets go."""
    limits = server.publisher.snapshot().limits
    gap = limits.hard_bytes - limits.soft_bytes
    usage = own_usage()
    for target, level in ((limits.soft_bytes + gap // 2, PressureLevel.SOFT),
                          (limits.hard_bytes + (limits.ceiling_bytes - limits.hard_bytes) // 2,
                           PressureLevel.HARD)):
        await balloon.inflate(max(BLOCK_BYTES, target - usage))
        usage = own_usage()
        await wait_level(server, level)
        if on_level is not None:
            await on_level(level)
    balloon.deflate()
    await wait_level(server, PressureLevel.OK)
    if on_level is not None:
        await on_level(PressureLevel.OK)


# -- HTTP and SSE clients -------------------------------------------------------------------


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@dataclass
class Event:
    id: str
    kind: str
    data: dict


@dataclass
class SseClient:
    """One SSE connection, read on its own thread (http.client); events are handed to
    the test's loop. `next()` gives None once the server has ended the stream."""

    host: str
    port: int
    path: str
    headers: dict = field(default_factory=dict)
    status: int = 0
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _conn: http.client.HTTPConnection | None = None
    _thread: threading.Thread | None = None

    async def open(self) -> SseClient:
        loop = asyncio.get_running_loop()
        opened = asyncio.Event()
        self._thread = threading.Thread(target=self._run, args=(loop, opened), daemon=True)
        self._thread.start()
        await asyncio.wait_for(opened.wait(), 10)
        return self

    def _run(self, loop: asyncio.AbstractEventLoop, opened: asyncio.Event) -> None:
        put = lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item)  # noqa: E731
        try:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self._conn.request("GET", self.path, headers=self.headers)
            resp = self._conn.getresponse()
            self.status = resp.status
            loop.call_soon_threadsafe(opened.set)
            fields: dict[str, str] = {}
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if line:
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")
                    continue
                if "data" in fields:
                    put(Event(fields.get("id", ""), fields.get("event", "message"),
                              json.loads(fields["data"])))
                fields = {}
        except OSError:
            pass  # closed by the test
        finally:
            loop.call_soon_threadsafe(opened.set)
            put(None)

    async def next(self, timeout: float = LEVEL_TIMEOUT_S) -> Event | None:
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def until(self, pred, timeout: float = LEVEL_TIMEOUT_S) -> list[Event]:
        """Events up to and including the first `pred` accepts."""
        got: list[Event] = []
        while True:
            ev = await self.next(timeout)
            assert ev is not None, f"stream ended early after {[e.kind for e in got]}"
            got.append(ev)
            if pred(ev):
                return got

    def close(self) -> None:
        if self._conn is not None and self._conn.sock is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)


def level_of(ev: Event) -> str:
    body = ev.data[ev.kind]
    return body.get("toLevel") or body.get("level")


def transitions(events: list[Event]) -> list[tuple[str, str, str]]:
    return [(e.id, e.data["transition"]["fromLevel"], e.data["transition"]["toLevel"])
            for e in events if e.kind == "transition"]


# -- the tests --------------------------------------------------------------------------------


async def test_no_http_listener_without_the_flag():
    """Off by default: the CLI's flag defaults to no port, and a server without it
    starts no HTTP server."""
    args = build_parser().parse_args(["serve"])
    assert args.http_port is None and args.http_host == "127.0.0.1"
    assert ServerConfig().http_port is None
    server = PlimsollServer(ServerConfig(port=0))
    await server.start()
    try:
        assert server.web is None
    finally:
        await server.drain()


async def test_page_status_and_event_stream_with_replay(demo_path):
    """GET / serves the page and its assets (nothing from elsewhere); /api/status is
    GetMemoryStatus as JSON; /api/watch is a snapshot then every transition of a real
    episode, each with id = its sequence; a reconnect with Last-Event-ID (header, or
    the page's query parameter) replays them before a fresh snapshot; the drain ends
    an open stream and does not wait on it."""
    server = await start_server(demo_path)
    balloon = Balloon()
    base = f"http://127.0.0.1:{server.web.port}"
    stream: SseClient | None = None
    try:
        status, headers, page = await asyncio.to_thread(get, base + "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b'<canvas id="chart"' in page and b'id="level"' in page
        assert headers["content-security-policy"].startswith("default-src 'self'")
        for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            status, headers, body = await asyncio.to_thread(get, f"{base}/static/{name}")
            assert status == 200 and headers["content-type"].startswith(kind)
            assert not re.search(rb"https?://", body), f"{name} names another origin"
        assert not re.search(rb"https?://", page)
        assert (await asyncio.to_thread(get, base + "/static/nope.js"))[0] == 404

        status, headers, body = await asyncio.to_thread(get, base + "/api/status")
        assert status == 200 and headers["content-type"] == "application/json"
        memory = json_format.Parse(body, control_pb2.GetMemoryStatusResponse())
        assert memory.level == PressureLevel.OK
        assert [m.pinned for m in memory.models] == [True]
        assert [lease.owner for lease in memory.leases] == [OWNER]
        assert memory.limits.ceiling_bytes == server.publisher.snapshot().limits.ceiling_bytes

        status, _, _ = await asyncio.to_thread(
            get, base + "/api/watch", {"Last-Event-ID": "not-a-number"})
        assert status == 400

        stream = await SseClient("127.0.0.1", server.web.port, "/api/watch?samples=0").open()
        assert stream.status == 200
        first = await stream.next()
        assert first.kind == "snapshot" and level_of(first) == "PRESSURE_LEVEL_OK"
        assert first.id == first.data["sequence"]
        resume_from = first.id

        await episode(server, balloon)
        seen = await stream.until(lambda e: e.kind == "transition"
                                  and level_of(e) == "PRESSURE_LEVEL_OK")
        live = transitions(seen)
        assert [(f, t) for _, f, t in live][:2] == [
            ("PRESSURE_LEVEL_OK", "PRESSURE_LEVEL_SOFT"),
            ("PRESSURE_LEVEL_SOFT", "PRESSURE_LEVEL_HARD")]
        assert all(e.id == e.data["sequence"] for e in seen)
        assert [int(i) for i, _, _ in live] == sorted(int(i) for i, _, _ in live)

        # A reconnect: what was missed since resume_from comes again, marked replayed,
        # then a snapshot of now. The page's own reconnect says it in the query.
        instance = first.data["instance"]
        assert instance and all(e.data["instance"] == instance for e in seen)
        for path, headers in (("/api/watch?samples=0", {"Last-Event-ID": resume_from}),
                              (f"/api/watch?samples=0&last_event_id={resume_from}", {}),
                              (f"/api/watch?samples=0&last_event_id={resume_from}"
                               f"&instance={instance}", {})):
            again = await SseClient("127.0.0.1", server.web.port, path, headers).open()
            try:
                replay = await again.until(lambda e: e.kind == "snapshot")
            finally:
                again.close()
            assert transitions(replay) == live
            assert all(e.data["replayed"] for e in replay[:-1])
            assert level_of(replay[-1]) == "PRESSURE_LEVEL_OK"
            assert not replay[-1].data["snapshot"]["replayIncomplete"]
        # Numbers from another process (the page saw a server that has since restarted):
        # nothing replayed, and the snapshot says events were missed.
        other = await SseClient("127.0.0.1", server.web.port,
                                f"/api/watch?samples=0&last_event_id={resume_from}"
                                "&instance=0123456789abcdef").open()
        try:
            fresh = await other.until(lambda e: e.kind == "snapshot")
        finally:
            other.close()
        assert [e.kind for e in fresh] == ["snapshot"]
        assert fresh[0].data["snapshot"]["replayIncomplete"]

        status, headers, body = await asyncio.to_thread(get, base + "/metrics")
        if importlib.util.find_spec("telemetry.prometheus") is None:
            assert status == 404 and b"telemetry.prometheus" in body
        else:
            assert status == 200 and headers["content-type"].startswith("text/plain")
            assert b"plimsoll_" in body

        # The drain ends the open stream and does not hang on it.
        await asyncio.wait_for(server.drain(), 20)
        rest = []
        while (ev := await stream.next(5)) is not None:
            rest.append(ev)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), 1).close()
    finally:
        balloon.deflate()
        if stream is not None:
            stream.close()
        await server.drain()


async def test_serve_flag_and_sigterm_with_a_stream_open(tmp_path, demo_path):
    """`plimsoll serve --http-port`: the page is served, and SIGTERM with an event
    stream open drains and exits 0 promptly, the stream ended by the server."""
    port = free_port()
    with serving(tmp_path, "--http-port", str(port), "--poll-active", "0.2") as srv:
        status, _, page = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/")
        assert status == 200 and b'id="level"' in page
        stream = await SseClient("127.0.0.1", port, "/api/watch").open()
        try:
            assert (await stream.next()).kind == "snapshot"
            code = await asyncio.to_thread(srv.stop, signal.SIGTERM, 20)
            assert code == 0, srv.log()[-2000:]
            while (await stream.next(5)) is not None:
                pass  # samples sent before the end
        finally:
            stream.close()
        assert f"web dashboard on http://127.0.0.1:{port}/" in srv.log()


# -- the page in a real browser -------------------------------------------------------------


class Cdp:
    """The Chrome DevTools Protocol over the browser's websocket (`websockets`)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            fut = self._pending.pop(msg.get("id"), None)
            if fut is None or fut.done():
                continue  # an event: not needed here
            if "error" in msg:
                fut.set_exception(RuntimeError(f"CDP: {msg['error']}"))
            else:
                fut.set_result(msg.get("result", {}))

    async def call(self, method: str, session: str | None = None, **params) -> dict:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        msg = {"id": i, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        await self.ws.send(json.dumps(msg))
        return await asyncio.wait_for(fut, 20)

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()


@dataclass
class Page:
    cdp: Cdp
    session: str

    async def js(self, expression: str):
        result = await self.cdp.call("Runtime.evaluate", self.session, expression=expression,
                                     returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait(self, expression: str, timeout: float = LEVEL_TIMEOUT_S):
        """Until `expression` is truthy in the page (errors count as not yet: the page
        may still be loading); its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()"
        while True:
            value = await self.js(guarded)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"page never satisfied {expression!r}; level "
                                     f"{await self.js('document.body.dataset.level')}")
            await asyncio.sleep(0.1)

    async def screenshot(self) -> bytes:
        shot = await self.cdp.call("Page.captureScreenshot", self.session, format="png")
        return base64.b64decode(shot["data"])


@contextlib.asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[Cdp]:
    """Headless Chromium with its DevTools endpoint on a free port."""
    from websockets.asyncio.client import connect

    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-extensions", "--remote-debugging-port=0",
        f"--user-data-dir={profile}", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
        "about:blank", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    log: list[str] = []
    drain: asyncio.Task | None = None
    try:
        url = None
        while url is None:
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            if not line:
                raise RuntimeError("chromium exited:\n" + "".join(log))
            log.append(line.decode(errors="replace"))
            found = re.search(r"DevTools listening on (ws://\S+)", log[-1])
            url = found and found.group(1)

        async def keep_reading() -> None:  # a full pipe would stall the browser
            while await proc.stderr.readline():
                pass

        drain = asyncio.ensure_future(keep_reading())
        ws = await connect(url, max_size=64 * 1024**2, ping_interval=None)
        cdp = Cdp(ws)
        try:
            yield cdp
        finally:
            with contextlib.suppress(Exception):
                await cdp.call("Browser.close")
            await cdp.close()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            drain.cancel()


async def open_page(cdp: Cdp, url: str) -> Page:
    target = await cdp.call("Target.createTarget", url="about:blank")
    attached = await cdp.call("Target.attachToTarget", targetId=target["targetId"],
                              flatten=True)
    page = Page(cdp, attached["sessionId"])
    await cdp.call("Emulation.setDeviceMetricsOverride", page.session, width=VIEWPORT[0],
                   height=VIEWPORT[1], deviceScaleFactor=1, mobile=False)
    await cdp.call("Page.enable", page.session)
    await cdp.call("Page.navigate", page.session, url=url)
    return page


LEVEL_TEXT = "document.getElementById('level').textContent"
TRANSITIONS = ("[...document.querySelectorAll('#events li.transition .what')]"
               ".map(e => e.textContent)")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
async def test_browser_shows_the_level_and_follows_a_real_episode(demo_path, tmp_path):
    """The page in headless Chromium: shows OK, then SOFT and HARD as this process
    really grows past the marks, then OK again; each transition lands in its list,
    the model shows pinned, the chart is drawn. When its stream is ended for falling
    behind, the page reconnects on its own and stays live."""
    server = await start_server(demo_path)
    balloon = Balloon()
    try:
        async with chromium(tmp_path / "profile") as cdp:
            page = await open_page(cdp, server.web.url)
            assert await page.wait(f"{LEVEL_TEXT} === 'OK' && "
                                   "document.getElementById('conn').textContent === 'live'")
            model_id = server.service.pool.entries()[0].model_id
            assert await page.wait("document.querySelector('#models tbody').textContent"
                                   f".includes({json.dumps(model_id)})")
            assert "pinned" in await page.js("document.querySelector('#models').textContent")

            seen: list[str] = []

            async def on_level(level: PressureLevel) -> None:
                seen.append(await page.wait(
                    f"{LEVEL_TEXT} === {json.dumps(level.name)} && {LEVEL_TEXT}"))
                await asyncio.sleep(HOLD_S)  # a stretch of each level on the chart

            await episode(server, balloon, on_level)
            assert seen == ["SOFT", "HARD", "OK"]
            listed = await page.wait(f"{TRANSITIONS}.includes('hard → ok') && {TRANSITIONS}")
            assert listed[-2:] == ["soft → hard", "ok → soft"], listed  # newest first
            assert await page.js("document.body.dataset.level") == "ok"
            if SHOT:
                await asyncio.sleep(1.2)  # one more redraw of the chart with the episode
            shot = await page.screenshot()
            assert shot[:8] == b"\x89PNG\r\n\x1a\n"
            (tmp_path / "web-dashboard.png").write_bytes(shot)
            if SHOT:
                Path(os.environ[SCREENSHOT_ENV]).write_bytes(shot)

            # Overflow: the server ends the page's stream; the page reconnects by itself.
            (sub,) = server.web.streams.open
            sub.overflowed = True
            sub.wakeup.set()
            await page.wait("document.getElementById('conn').textContent !== 'live'", 5)
            await page.wait("document.getElementById('conn').textContent === 'live'")
            (again,) = server.web.streams.open
            assert again is not sub
            assert await page.js(f"{TRANSITIONS}.length") == len(listed)  # no duplicates
    finally:
        balloon.deflate()
        await server.drain()
