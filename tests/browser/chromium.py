"""Headless Chromium driven over the DevTools protocol, standard library only.

The trick: Chromium started with `--remote-debugging-pipe` reads DevTools commands from its file
descriptor 3 and writes replies and events to descriptor 4, each message one JSON object ended by
a NUL byte. We start it through `bash -c 'exec "$@" 3<&R 4>&W'` so two `os.pipe()`s land on those
numbers (bash, unlike dash, accepts descriptors above 9), then speak the protocol ourselves: no
selenium, no playwright, no browser download, no network port. `open_page` opens a `file://` page
in a fresh tab of the 1280-pixel-wide window, waits for its load event and for every `<img>` (lazy
ones are switched to eager), and reports what the page did: its images (`complete`,
`naturalWidth`), console errors and uncaught exceptions, failed and non-local requests; then it
captures the full page (`captureBeyondViewport`) as a PNG.

The binary is `$ANCHOR_CHROMIUM` when set, else the first of chromium, chromium-browser,
google-chrome(-stable) on PATH (`tests/browser/install_chromium.sh` installs Debian's package).
"""

from __future__ import annotations

import base64
import fcntl
import json
import math
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--no-first-run",
    "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps", "--mute-audio",
    "--hide-scrollbars", "--force-device-scale-factor=1", "--allow-file-access-from-files",
    "--remote-debugging-pipe",
)
# Chromium's compositor cannot capture taller pages in one piece; longer pages are cut there.
MAX_SCREENSHOT_HEIGHT = 16_000

# Runs in the page: make lazy images eager, wait (bounded) for fonts and every <img>, then report.
_SETTLE_JS = """
(async (ms) => {
  const imgs = Array.from(document.images);
  const lazy = imgs.filter(i => i.loading === 'lazy').length;
  imgs.forEach(i => { if (i.loading === 'lazy') i.loading = 'eager'; });
  const done = i => i.complete ? null : new Promise(r => {
    i.addEventListener('load', r, {once: true}); i.addEventListener('error', r, {once: true}); });
  await Promise.race([Promise.all([document.fonts.ready, ...imgs.map(done)]),
                      new Promise(r => setTimeout(r, ms))]);
  const root = document.documentElement;
  return {
    title: document.title, readyState: document.readyState, url: location.href, lazy: lazy,
    textLength: document.body ? document.body.innerText.length : 0,
    scrollWidth: root.scrollWidth, scrollHeight: root.scrollHeight,
    images: imgs.map(i => ({src: i.getAttribute('src') || '', currentSrc: i.currentSrc,
                            complete: i.complete, naturalWidth: i.naturalWidth,
                            naturalHeight: i.naturalHeight})),
  };
})
"""


class ChromiumError(RuntimeError):
    """Chromium could not be started or stopped answering."""


def _above_nine(fd: int) -> int:
    """A copy of `fd` numbered 10 or more (close-on-exec); `fd` itself is closed."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def find_chromium() -> str | None:
    """Path of the Chromium binary to use, or None when there is none."""
    env = os.environ.get("ANCHOR_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageReport:
    """What a page did in the browser; `problems()` lists what makes it broken."""

    url: str
    navigation_error: str | None
    loaded: bool
    info: dict[str, Any]
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    screenshot: Path | None = None
    screenshot_size: tuple[int, int] | None = None

    @property
    def images(self) -> list[dict[str, Any]]:
        return self.info.get("images", [])

    def broken_images(self) -> list[dict[str, Any]]:
        return [i for i in self.images if not (i["complete"] and i["naturalWidth"] > 0)]

    def problems(self) -> list[str]:
        out = []
        if self.navigation_error:
            out.append(f"{self.url}: navigation failed ({self.navigation_error})")
        if not self.loaded:
            out.append(f"{self.url}: no load event")
        out += [f"<img src={i['src']!r}> did not load (complete={i['complete']}, naturalWidth={i['naturalWidth']})"
                for i in self.broken_images()]
        out += [f"console error: {m}" for m in self.console_errors]
        out += [f"request failed: {m}" for m in self.failed_requests]
        out += [f"non-local request: {m}" for m in self.external_requests]
        return out


class Chromium:
    """One headless Chromium process; `open_page` may be called many times. Use as a context manager."""

    def __init__(self, binary: str | None = None, *, timeout: float = 60.0) -> None:
        binary = binary or find_chromium()
        if binary is None:
            raise ChromiumError("no Chromium found: run tests/browser/install_chromium.sh or set ANCHOR_CHROMIUM")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="anchor-chromium-")
        self._log = open(os.path.join(self._profile, "chromium.log"), "wb")
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        # The child's ends move above 9 first, so `3<&R 4>&W` never reads a descriptor it just replaced.
        cmd_r, resp_w = (_above_nine(fd) for fd in (cmd_r, resp_w))
        argv = ["bash", "-c", f'exec "$@" 3<&{cmd_r} 4>&{resp_w} {cmd_r}<&- {resp_w}>&-', "bash", binary,
                *FLAGS, f"--user-data-dir={self._profile}", "--window-size=1280,800", "about:blank"]
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                          pass_fds=(cmd_r, resp_w), start_new_session=True)
        finally:
            os.close(cmd_r)
            os.close(resp_w)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        try:
            self.version = self.call("Browser.getVersion")["product"]
        except BaseException:
            self.close()
            raise

    # -- the wire -------------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChromiumError(f"Chromium did not answer within {self.timeout:.0f} s{self._log_tail()}")
            ready, _, _ = select.select([self._resp_r], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._resp_r, 1 << 20)
                if not chunk:
                    raise ChromiumError(f"Chromium exited (status {self._proc.poll()}){self._log_tail()}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """Send one command and return its result; events arriving meanwhile are kept."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def _wait_event(self, method: str, session: str, deadline: float) -> dict[str, Any] | None:
        """The first event `method` of `session` (already received or arriving before `deadline`)."""
        while True:
            for ev in self._events:
                if ev["method"] == method and ev.get("sessionId") == session:
                    return ev
            try:
                self._events.append(self._read_message(deadline))
            except ChromiumError:
                if time.monotonic() >= deadline:
                    return None
                raise

    def _log_tail(self) -> str:
        self._log.flush()
        try:
            text = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return (": " + " | ".join(text[-3:])) if text else ""

    # -- pages ----------------------------------------------------------------------------------

    def open_page(self, page: Path, *, width: int = 1280, height: int = 800,
                  screenshot: Path | None = None, settle_ms: int = 15_000) -> PageReport:
        """Load `page` (a local file) at `width` x `height` CSS pixels; capture it whole into `screenshot`."""
        url = Path(page).absolute().as_uri()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable", session=session)
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
            self._events = [e for e in self._events if e.get("sessionId") != session]
            nav = self.call("Page.navigate", {"url": url}, session)
            deadline = time.monotonic() + self.timeout
            loaded = self._wait_event("Page.loadEventFired", session, deadline) is not None
            info = self.call("Runtime.evaluate", {
                "expression": f"({_SETTLE_JS})({settle_ms})", "awaitPromise": True, "returnByValue": True,
            }, session, timeout=self.timeout + settle_ms / 1000)
            if "exceptionDetails" in info:
                raise ChromiumError(f"page script failed: {info['exceptionDetails'].get('text')}")
            report = PageReport(url=url, navigation_error=nav.get("errorText") or None, loaded=loaded,
                                info=info["result"]["value"])
            if screenshot is not None:
                self._screenshot(report, session, width, Path(screenshot))
            self._collect_events(report, session)
            return report
        finally:
            self.call("Target.closeTarget", {"targetId": target})
            self._events = [e for e in self._events if e.get("sessionId") != session]

    def _screenshot(self, report: PageReport, session: str, width: int, path: Path) -> None:
        metrics = self.call("Page.getLayoutMetrics", session=session)
        full = math.ceil(metrics["cssContentSize"]["height"])
        h = max(1, min(full, MAX_SCREENSHOT_HEIGHT))
        shot = self.call("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True, "fromSurface": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": h, "scale": 1},
        }, session)
        data = base64.b64decode(shot["data"])
        part = path.with_name(f".{path.name}.part")
        part.write_bytes(data)
        os.replace(part, path)
        report.screenshot, report.screenshot_size = path, (width, h)

    def _collect_events(self, report: PageReport, session: str) -> None:
        for ev in self._events:
            if ev.get("sessionId") != session:
                continue
            m, p = ev["method"], ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                report.console_errors.append(f"console.{p['type']}: {args}")
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                text = (d.get("exception", {}).get("description") or d.get("text", "")).splitlines()[0]
                where = f"{d['url']}:{d.get('lineNumber', -1) + 1}" if d.get("url") else "?"
                report.console_errors.append(f"uncaught {text} ({where})")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                report.console_errors.append(f"{e.get('text', '')} {e.get('url', '')}".strip())
            elif m == "Network.requestWillBeSent":
                req_url = p.get("request", {}).get("url", "")
                if not req_url.startswith(("file:", "data:", "about:", "blob:")):
                    report.external_requests.append(req_url)
        # Network.loadingFailed names no URL: take it from the request with the same id.
        urls = {ev["params"]["requestId"]: ev["params"]["request"]["url"] for ev in self._events
                if ev.get("sessionId") == session and ev["method"] == "Network.requestWillBeSent"}
        report.failed_requests = [f"{urls.get(ev['params']['requestId'], '?')}: {ev['params'].get('errorText')}"
                                  for ev in self._events
                                  if ev.get("sessionId") == session and ev["method"] == "Network.loadingFailed"
                                  and not ev["params"].get("canceled")]

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                try:
                    self.call("Browser.close", timeout=10)
                except (ChromiumError, OSError):
                    pass
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, 9)
                    self._proc.wait()
        finally:
            for fd in (self._cmd_w, self._resp_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
