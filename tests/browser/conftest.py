"""Fixtures of the browser tests: the demo folder, and the system's Chromium driven by Playwright.

pytest-playwright (the `browser` extra: `pip install -e ".[browser]"`) provides `browser` (one headless
Chromium per session, per xdist worker) and `page` (a fresh context and tab per test). Playwright's own
browser download is not used: `browser_type_launch_args` below launches the Chromium already on the machine
through `executable_path`: `$ANCHOR_CHROMIUM` when set, else the first of chromium, chromium-browser,
google-chrome(-stable) on PATH (`tests/browser/install_chromium.sh` installs Debian's package). Playwright
passes --headless, --no-sandbox, --no-first-run, --disable-background-networking, --disable-component-update,
--disable-sync, --disable-dev-shm-usage and --disable-extensions itself; the flags below add what a root
user on a closed network needs besides.

`open_page(path, width=..., screenshot=...)` loads a local page in `page` and reports what it did
(`PageReport`): its images (`complete`, `naturalWidth`; lazy ones switched to eager and awaited), console
errors and uncaught exceptions, failed requests, and every request for anything but a local file, inline
data or a `serve_folder` origin, which is recorded and refused (`page.route`), so nothing leaves the
machine; then it captures the whole page, `width` CSS pixels wide (cut at pagecheck.MAX_SCREENSHOT_HEIGHT),
as a PNG.

Once installed, pytest-playwright's plugin loads in every pytest run of the checkout: it adds its options
(--browser, --headed, --output, ...) and fixtures and imports Playwright (about 0.2 s a process), and deletes
`./test-results` (its --output folder) when a run starts; it starts nothing until a test asks for `page`.

`ANCHOR_DEMO_DIR` names the demo output whose `index.html` is checked (relative to the working directory;
default: `runs/demo` in the checkout). `ANCHOR_SITE_DIR` names a built documentation site (`make docs` writes
`runs/site`); without it `site_dir` builds the checkout's site with `mkdocs build --strict` into a temporary
folder (the `docs` extra). `site_url` serves that folder over http on 127.0.0.1, as a reader's server would:
the theme's search runs in a web worker, which Chromium does not start for a page opened from the file system.
Requests to a server started by `serve_folder` count as local; any other http request, even to this machine,
is refused. `ANCHOR_REQUIRE_BROWSER=1` (set by `make test-browser`) turns a missing Chromium,
pytest-playwright, MkDocs or page into a failure; without it those tests are skipped, so a plain `pytest` run
on a machine without them still passes the pure-parser tests.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.browser.pagecheck import MAX_SCREENSHOT_HEIGHT

REPO = Path(__file__).resolve().parents[2]
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--disable-gpu", "--disable-quic")
LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:")
# Origins of the servers `serve_folder` started (`http://127.0.0.1:PORT/`): `open_page` lets their requests through.
SERVED_ORIGINS: set[str] = set()

# What `info` holds for a page that did not load.
NOT_LOADED = {"title": "", "readyState": "", "url": "", "lazy": 0, "textLength": 0, "scrollWidth": 0,
              "scrollHeight": 0, "images": []}
# Runs in the page: make lazy images eager, wait (bounded) for fonts and every <img>, then report.
_SETTLE_JS = """
async (ms) => {
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
}
"""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: needs headless Chromium (pytest-playwright) or a demo output; skipped without them "
                   "(`make test-browser` installs both and requires them)")


def _missing(reason: str) -> None:
    if os.environ.get("ANCHOR_REQUIRE_BROWSER") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


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


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """pytest-playwright's launch options (--headed, --slowmo) with the system Chromium and FLAGS."""
    binary = find_chromium()
    if binary is None:
        _missing("no Chromium: run tests/browser/install_chromium.sh (Debian: apt-get install chromium) "
                 "or set ANCHOR_CHROMIUM")
    args = [*browser_type_launch_args.get("args", []), *FLAGS]
    return {**browser_type_launch_args, "executable_path": binary, "args": args, "timeout": 60_000}


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    env = os.environ.get("ANCHOR_DEMO_DIR")
    folder = Path(env).absolute() if env else REPO / "runs" / "demo"
    if not (folder / "index.html").is_file():
        _missing(f"{folder}/index.html does not exist: run `anchor demo --out {folder}` or set ANCHOR_DEMO_DIR")
    return folder


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def serve_folder() -> Iterator[Callable[[Path], str]]:
    """`serve_folder(folder) -> "http://127.0.0.1:PORT/"`: the folder's files over http, on this machine only,
    until the session ends."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(folder: Path) -> str:
        handler = functools.partial(_QuietHandler, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        origin = f"http://127.0.0.1:{server.server_address[1]}/"
        SERVED_ORIGINS.add(origin)
        return origin

    yield serve
    for server in servers:
        SERVED_ORIGINS.discard(f"http://127.0.0.1:{server.server_address[1]}/")
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built documentation site: `$ANCHOR_SITE_DIR`, else the checkout's site built now (strict)."""
    env = os.environ.get("ANCHOR_SITE_DIR")
    if env:
        folder = Path(env).absolute()
        if not (folder / "index.html").is_file():
            _missing(f"{folder}/index.html does not exist: run `make docs` or set ANCHOR_SITE_DIR")
        return folder
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        _missing('MkDocs or its Material theme is not installed: pip install -e ".[docs]" (make docs), '
                 "or set ANCHOR_SITE_DIR to a built site")
    folder = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(folder)],
                           cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    return folder


@pytest.fixture(scope="session")
def site_url(site_dir: Path, serve_folder: Callable[[Path], str]) -> str:
    """The built site served over http: `http://127.0.0.1:PORT/`."""
    return serve_folder(site_dir)


@dataclass
class PageReport:
    """What a page did in the browser; `problems()` lists what makes it broken."""

    url: str
    navigation_error: str | None
    loaded: bool
    info: dict[str, Any]
    version: str = ""
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


@pytest.fixture
def open_page(request: pytest.FixtureRequest) -> Callable[..., PageReport]:
    """`open_page(path, *, width=1280, height=800, screenshot=None, settle_ms=15000) -> PageReport` in
    pytest-playwright's `page` (see the module docstring); `path` is a local file, or a URL under a
    `serve_folder` origin."""
    if not request.config.pluginmanager.hasplugin("playwright"):
        _missing('pytest-playwright is not installed: pip install -e ".[browser]" (make test-browser)')
    from playwright.sync_api import Error as PlaywrightError

    page = request.getfixturevalue("page")
    timeout_ms = 60_000
    page.set_default_timeout(timeout_ms)
    console: list[str] = []
    failed: list[str] = []
    external: list[str] = []

    def on_console(msg: Any) -> None:
        if msg.type in ("error", "assert"):
            loc = msg.location or {}
            where = f" ({loc['url']})" if loc.get("url") else ""
            console.append(f"console.{msg.type}: {msg.text}{where}")

    def on_request_failed(req: Any) -> None:
        if req.url in external:  # refused by `route` below: reported as a non-local request, not twice
            return
        failed.append(f"{req.url}: {req.failure}")

    def route(r: Any) -> None:
        if r.request.url.startswith(LOCAL_SCHEMES) or r.request.url.startswith(tuple(SERVED_ORIGINS)):
            r.continue_()
        else:
            external.append(r.request.url)
            r.abort("blockedbyclient")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: console.append(f"uncaught {exc.name}: {exc.message}".splitlines()[0]))
    page.on("requestfailed", on_request_failed)
    page.on("websocket", lambda ws: external.append(ws.url))
    page.route("**/*", route)

    def load(path: Path | str, *, width: int = 1280, height: int = 800, screenshot: Path | None = None,
             settle_ms: int = 15_000) -> PageReport:
        served = isinstance(path, str) and path.startswith(tuple(SERVED_ORIGINS))
        url = path if served else Path(path).absolute().as_uri()
        for seen in (console, failed, external):  # what an earlier page of the same test did is not this one's
            seen.clear()
        page.set_viewport_size({"width": width, "height": height})
        nav_error, loaded = None, False
        try:
            page.goto(url, wait_until="load", timeout=timeout_ms)
            loaded = True
        except PlaywrightError as exc:
            nav_error = exc.message.splitlines()[0]
        # a failed navigation goes on to Chromium's error page: nothing of the page to measure or capture
        info = page.evaluate(_SETTLE_JS, settle_ms) if loaded else dict(NOT_LOADED)
        report = PageReport(url=url, navigation_error=nav_error, loaded=loaded, info=info,
                            version=page.context.browser.version if page.context.browser else "")
        if screenshot is not None and loaded:
            full = page.evaluate("document.documentElement.scrollHeight")  # whole CSS pixels, as the capture
            h = max(1, min(full, MAX_SCREENSHOT_HEIGHT))
            data = page.screenshot(full_page=True, clip={"x": 0, "y": 0, "width": width, "height": h},
                                   scale="css", animations="disabled", caret="hide")
            part = Path(screenshot).with_name(f".{Path(screenshot).name}.part")
            part.write_bytes(data)
            os.replace(part, screenshot)
            report.screenshot, report.screenshot_size = Path(screenshot), (width, h)
        report.console_errors, report.failed_requests, report.external_requests = [*console], [*failed], [*external]
        return report

    return load
