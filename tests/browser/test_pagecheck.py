"""The page checker can fail: hand-made pages in tmp_path, each defect caught and named.

The parser and PNG tests need nothing but Pillow and run under `make test`; the ones marked
`browser` open the pages in headless Chromium (pytest-playwright, tests/browser/conftest.py) and are
skipped when there is none.
"""

from __future__ import annotations

import http.server
import os
import random
import threading
from pathlib import Path

import pytest
from PIL import Image

from tests.browser.pagecheck import check_links, check_png

# Odd on purpose: nothing in the checker may assume 1280 or a round height.
WIDTH = 1025


def write_png(path: Path, size: tuple[int, int] = (97, 61), *, blank: bool = False) -> Path:
    """A small PNG: seeded noise, or a single colour when `blank`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, (255, 255, 255))
    if not blank:
        rng = random.Random(515)
        img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size[0] * size[1])])
    img.save(path)
    return path


def make_site(root: Path, body: str, *, extra: dict[str, str] | None = None) -> Path:
    """`root/index.html` with `body`, a good figure `figs/a.png`, a report and a sub-page; returns the page."""
    write_png(root / "figs" / "a.png")
    (root / "report.md").write_text("# report\n")
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "sub" / "index.html").write_text("<!doctype html><a href='../index.html'>up</a><img src='../figs/a.png'>")
    for name, text in (extra or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    page = root / "index.html"
    page.write_text(f"<!doctype html><meta charset='utf-8'><title>t</title>\n<body>\n{body}\n</body>")
    return page


GOOD_BODY = """<h1 id='top-heading'>demo</h1>
<style>h1{background:url('figs/a.png')}</style>
<p style="background-image:url(figs/a.png)"><a href='report.md'>report</a> <a href='#top-heading'>up</a>
<a href='sub/'>sub</a> <a href='sub/index.html#x'>sub page</a> <a href='figs/a%2Epng?v=1'>figure</a></p>
<img src='figs/a.png' alt='a'>
<img srcset='figs/a.png 1x, figs/a.png 2x' alt='b'>
<img src='data:image/gif;base64,R0lGODlhAQABAIAAAP///wAAACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw==' alt='inline'>
<div style='height:2999px'>tall</div><p>end</p>"""


def test_good_page_has_no_problems(tmp_path):
    page = make_site(tmp_path, GOOD_BODY)
    problems = check_links(page)
    print(problems)
    assert problems == []


# (body, words every problem line must carry): each defect alone on an otherwise good page.
DEFECTS = {
    "missing image": ("<img src='figs/missing.png'>", ["index.html:3", "figs/missing.png", "does not exist"]),
    "missing in srcset": ("<img srcset='figs/a.png 1x, figs/b.png 2x'>", ["figs/b.png", "does not exist"]),
    "absolute path": ("<a href='/etc/hostname'>x</a>", ["/etc/hostname", "absolute path"]),
    "file URL": ("<img src='file:///tmp/x.png'>", ["file:///tmp/x.png", "not relative"]),
    "http asset": ("<script src='http://cdn.example.org/x.js'></script>", ["cdn.example.org", "external URL"]),
    "https link": ("<a href='https://arxiv.org/abs/2411.13476'>paper</a>", ["arxiv.org", "external URL"]),
    "protocol-relative": ("<link rel=stylesheet href='//fonts.example.org/css'>", ["fonts.example.org",
                                                                                   "protocol-relative"]),
    "css url": ("<style>\nbody{background:url(\"https://x.example.org/bg.png\")}</style>",
                ["index.html:4", "x.example.org/bg.png", "external URL"]),
    "css import": ("<style>@import 'http://x.example.org/s.css';</style>", ["x.example.org/s.css", "external"]),
    "style attribute": ("<div style='background:url(figs/none.png)'></div>", ["figs/none.png", "does not exist"]),
    "escapes folder": ("<img src='../outside.png'>", ["../outside.png", "leaves the folder"]),
    "dot-dot inside": ("<img src='figs/../figs/nope.png'>", ["figs/nope.png", "does not exist"]),
    "folder link": ("<a href='figs/'>figs</a>", ["figs/", "folder without index.html"]),
    "bad fragment": ("<a href='#results'>r</a>", ["#results", "names no element"]),
    "backslash": ("<img src='figs\\a.png'>", ["backslash"]),
    "base element": ("<base href='https://example.org/'>", ["<base"]),
    "empty src": ("<img src=''>", ["empty URL"]),
}


@pytest.mark.parametrize("name", DEFECTS)
def test_each_defect_is_caught_and_named(tmp_path, name):
    body, words = DEFECTS[name]
    site = tmp_path / "site"
    write_png(tmp_path / "outside.png")  # exists, but outside the folder
    page = make_site(site, body + "\n" + GOOD_BODY)  # the defect on line 3
    problems = check_links(page)
    print(name, problems)
    assert len(problems) == 1, problems
    for word in words:
        assert word in problems[0], (word, problems[0])


def test_symlink_out_of_the_folder_is_caught(tmp_path):
    outside = write_png(tmp_path / "outside.png")
    page = make_site(tmp_path / "site", "<img src='figs/link.png'>")
    os.symlink(outside, tmp_path / "site" / "figs" / "link.png")
    problems = check_links(page)
    print(problems)
    assert len(problems) == 1 and "link leading out of the folder" in problems[0]


def test_linked_pages_are_checked_too(tmp_path):
    page = make_site(tmp_path, "<a href='more/page.html'>more</a>",
                     extra={"more/page.html": "<p>\n<img src='gone.png'></p>"})
    problems = check_links(page)
    print(problems)
    assert problems == ["more/page.html:2: <img src='gone.png'>: more/gone.png does not exist"]
    assert check_links(page, follow=False) == []


def test_missing_page(tmp_path):
    assert "no such page" in check_links(tmp_path / "index.html")[0]


# -- screenshots ------------------------------------------------------------------------------------

def test_png_good(tmp_path):
    assert check_png(write_png(tmp_path / "s.png", (WIDTH, 97)), WIDTH, 97) == []


def test_png_corrupt(tmp_path):
    path = tmp_path / "s.png"
    path.write_bytes(b"this is not an image at all" * 10)
    problems = check_png(path, WIDTH, 97)
    print(problems)
    assert len(problems) == 1 and "not a PNG" in problems[0] and "s.png" in problems[0]


def test_png_truncated(tmp_path):
    path = write_png(tmp_path / "s.png", (WIDTH, 97))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    problems = check_png(path, WIDTH, 97)
    print(problems)
    assert len(problems) == 1 and "does not decode" in problems[0]


def test_png_wrong_size(tmp_path):
    problems = check_png(write_png(tmp_path / "s.png", (WIDTH, 97)), 1280, 97)
    print(problems)
    assert problems == [f"{tmp_path / 's.png'}: {WIDTH}x97 pixels, 1280x97 requested"]


def test_png_blank(tmp_path):
    problems = check_png(write_png(tmp_path / "s.png", (WIDTH, 97), blank=True), WIDTH, 97)
    print(problems)
    assert len(problems) == 1 and "blank screenshot (1 distinct colours" in problems[0]


def test_png_missing(tmp_path):
    assert "no screenshot" in check_png(tmp_path / "s.png", WIDTH, 97)[0]


# -- in the browser ---------------------------------------------------------------------------------

@pytest.mark.browser
def test_browser_good_page(tmp_path, open_page):
    page = make_site(tmp_path, GOOD_BODY + "\n<img loading='lazy' src='figs/a.png' style='margin-top:5000px'>")
    shot = tmp_path / "index.png"
    report = open_page(page, width=WIDTH, screenshot=shot)
    print(report.problems(), report.screenshot_size, report.info["scrollHeight"], len(report.images))
    assert report.problems() == []
    assert len(report.images) == 4 and report.info["lazy"] == 1
    assert report.images[0]["naturalWidth"] == 97 and report.images[0]["naturalHeight"] == 61
    width, height = report.screenshot_size
    assert width == WIDTH and height >= 2999 + 5000  # the whole page, not the 800-pixel window
    assert check_png(shot, width, height) == []


@pytest.mark.browser
def test_browser_missing_image(tmp_path, open_page):
    page = make_site(tmp_path, "<img src='figs/missing.png'>")
    problems = open_page(page, width=WIDTH).problems()
    print(problems)
    assert any("figs/missing.png" in p and "did not load" in p for p in problems)
    assert any("missing.png: net::ERR_FILE_NOT_FOUND" in p for p in problems)


@pytest.mark.browser
def test_browser_corrupt_image(tmp_path, open_page):
    """The file exists, so the parser passes it; only the browser sees that it does not decode."""
    page = make_site(tmp_path, "<img src='figs/bad.png'>", extra={"figs/bad.png": "not a png"})
    assert check_links(page) == []
    problems = open_page(page, width=WIDTH).problems()
    print(problems)
    assert problems and all("bad.png" in p for p in problems)
    assert any("<img src='figs/bad.png'> did not load" in p for p in problems)


@pytest.mark.browser
def test_browser_console_errors(tmp_path, open_page):
    page = make_site(tmp_path, "<script>console.error('boom 97'); throw new Error('kaboom 515');</script>")
    problems = open_page(page, width=WIDTH).problems()
    print(problems)
    assert any("boom 97" in p for p in problems)
    assert any("kaboom 515" in p for p in problems)


@pytest.mark.browser
def test_browser_external_request(tmp_path, open_page):
    """An asset on another host is requested: recorded and refused before it leaves (port 9 is also on
    Chromium's unsafe list)."""
    page = make_site(tmp_path, "<img src='http://127.0.0.1:9/x.png'>")
    problems = open_page(page, width=WIDTH).problems()
    print(problems)
    assert any("non-local request: http://127.0.0.1:9/x.png" in p for p in problems)


@pytest.mark.browser
def test_browser_external_request_is_refused(tmp_path, open_page):
    """A server on this machine that would answer sees no request: the page's request is refused in the
    browser, not merely recorded."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write((tmp_path / "figs" / "a.png").read_bytes())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/x.png"
        page = make_site(tmp_path, f"<img src='{url}'>")
        report = open_page(page, width=WIDTH)
    finally:
        server.shutdown()
        server.server_close()
    print(report.problems(), hits)
    assert f"non-local request: {url}" in report.problems()
    assert any(url in p and "did not load" in p for p in report.problems())
    assert hits == []


@pytest.mark.browser
def test_browser_missing_page(tmp_path, open_page):
    report = open_page(tmp_path / "index.html", width=WIDTH)
    print(report.problems())
    assert report.navigation_error and any("navigation failed" in p for p in report.problems())
