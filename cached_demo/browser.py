"""A headless Chromium driven over the Chrome DevTools Protocol, for the dashboard's test
and the demo's screenshot (tests/test_dashboard.py, ``cached demo``).

Only what those need: open one page, collect its console errors, uncaught exceptions and
failed loads, evaluate expressions, and take a PNG screenshot. The protocol is spoken with
aiohttp's websocket client (a dependency already), so nothing is downloaded: the browser
is the system's (Debian's ``chromium``; ``$CACHED_CHROMIUM`` names another).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from cached.errors import CachedError

CHROMIUM_ENV = "CACHED_CHROMIUM"
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserError(CachedError):
    """The browser did not start, or a DevTools command failed."""


def find_chromium() -> str | None:
    """The browser to run: ``$CACHED_CHROMIUM``, else the first candidate on ``PATH``."""
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        return shutil.which(named) or (named if Path(named).is_file() else None)
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Page:
    """One page of a running browser, over its DevTools websocket.

    ``errors`` collects, as text, every console message at error level, every uncaught
    exception and every browser log entry at error level (a failed load, a blocked
    resource, a Content-Security-Policy violation) since the page was opened.
    """

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.errors: list[str] = []
        self._reader = asyncio.create_task(self._read(), name="devtools reader")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result."""
        call = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call] = future
        await self._ws.send_json({"id": call, "method": method, "params": params})
        try:
            return await asyncio.wait_for(future, 30)
        finally:
            self._pending.pop(call, None)

    async def goto(self, url: str, timeout_s: float = 30.0) -> None:
        """Navigate to ``url`` and wait for its load event."""
        loaded = self._events.setdefault("Page.loadEventFired", asyncio.Event())
        loaded.clear()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"cannot open {url}: {result['errorText']}")
        await asyncio.wait_for(loaded.wait(), timeout_s)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able; promises awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} failed: {_describe(result['exceptionDetails'])}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout_s:.0f} s waiting for {expression!r}")
            await asyncio.sleep(0.1)

    async def screenshot(self) -> bytes:
        """A PNG of the viewport."""
        result = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        """Stop reading and close the websocket."""
        self._reader.cancel()
        # Closing must not fail: a reader that died has already failed every command that
        # waited for an answer.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        await self._ws.close()

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                if message.type is not aiohttp.WSMsgType.TEXT:
                    break
                data = message.json()
                if "id" in data:
                    future = self._pending.get(data["id"])
                    if future is not None and not future.done():
                        if "error" in data:
                            future.set_exception(BrowserError(f"DevTools: {data['error']}"))
                        else:
                            future.set_result(data.get("result", {}))
                    continue
                self._event(data.get("method", ""), data.get("params", {}))
        finally:
            # The browser went away (or this reader failed): whoever waits for an answer
            # hears it now, not after its timeout.
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(BrowserError("the DevTools connection ended"))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(_arg(a) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            self.errors.append("exception: " + _describe(params.get("exceptionDetails", {})))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                where = f" ({entry['url']})" if entry.get("url") else ""
                self.errors.append(f"log {entry.get('source')}: {entry.get('text')}{where}")
        event = self._events.get(method)
        if event is not None:
            event.set()


@contextlib.asynccontextmanager
async def headless(
    binary: str | None = None, width: int = 1280, height: int = 900
) -> AsyncIterator[Page]:
    """A headless Chromium with one blank page of ``width`` x ``height``, its Runtime,
    Log and Page domains enabled; the browser is stopped and its profile removed after."""
    binary = binary or find_chromium()
    if binary is None:
        raise BrowserError(f"no Chromium found (install `chromium`, or set ${CHROMIUM_ENV})")
    with tempfile.TemporaryDirectory(prefix="cached-chromium-") as profile:
        log_path = Path(profile) / "chromium.log"
        proc = await asyncio.to_thread(_launch, binary, Path(profile), log_path, width, height)
        try:
            port = await _devtools_port(Path(profile), proc, log_path)
            async with aiohttp.ClientSession() as session:
                page = await _open_page(session, port)
                try:
                    await page.send(
                        "Emulation.setDeviceMetricsOverride",
                        width=width,
                        height=height,
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    for domain in ("Runtime", "Log", "Page"):
                        await page.send(f"{domain}.enable")
                    yield page
                finally:
                    with contextlib.suppress(BrowserError, TimeoutError, aiohttp.ClientError):
                        await page.send("Browser.close")
                    await page.close()
        finally:
            await asyncio.to_thread(_stop, proc)


def _launch(
    binary: str, profile: Path, log_path: Path, width: int, height: int
) -> subprocess.Popen[bytes]:
    """Start the browser; it writes its output to ``log_path`` (shown if it fails)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [
                binary,
                "--headless=new",
                # Containers and CI run as root, where the sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                # /dev/shm is 64 MB in a default container: Chromium crashes in it.
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "--hide-scrollbars",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--mute-audio",
                "about:blank",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own process group: the renderer and helpers are stopped with it.
            start_new_session=True,
        )


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port Chromium chose: it writes it to DevToolsActivePort once it listens."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while True:
        if marker.exists():
            lines = marker.read_text().splitlines()
            if lines and lines[0].isdigit():
                return int(lines[0])
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-2000:]
            state = f"exited {proc.returncode}" if proc.returncode is not None else "timed out"
            raise BrowserError(f"Chromium did not start ({state}):\n{tail}")
        await asyncio.sleep(0.05)


async def _open_page(session: aiohttp.ClientSession, port: int) -> Page:
    async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
        targets = await response.json()
    pages = [t for t in targets if t.get("type") == "page"]
    if not pages:
        raise BrowserError(f"Chromium on port {port} has no page: {targets}")
    ws = await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
    return Page(ws)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Chromium, then what is left of its process group (the group is its own)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _arg(arg: dict[str, Any]) -> str:
    return str(arg.get("value", arg.get("description", arg.get("type", ""))))


def _describe(details: dict[str, Any]) -> str:
    exception = details.get("exception") or {}
    text = exception.get("description") or details.get("text") or "error"
    where = details.get("url", "")
    return f"{text} ({where}:{details.get('lineNumber', 0) + 1})" if where else str(text)


async def capture(
    url: str,
    ready: str,
    path: Path,
    *,
    width: int = 1280,
    height: int = 900,
    timeout_s: float = 30,
) -> list[str]:
    """Open ``url``, wait until ``ready`` (a JavaScript expression) is truthy, and save a
    PNG screenshot at ``path``. Returns the page's errors (see :class:`Page`)."""
    async with headless(width=width, height=height) as page:
        await page.goto(url, timeout_s)
        await page.wait_for(ready, timeout_s)
        png = await page.screenshot()
        await asyncio.to_thread(path.write_bytes, png)
        return list(page.errors)
