"""Static checks of a self-contained HTML page and of a screenshot, standard library plus Pillow.

`check_links(page)` parses `page` with `html.parser` and returns one line per problem: every
`href`, `src`, `srcset`, `poster`, `<object data>`, `<form action>`, CSS `url(...)` and `@import`
(in `<style>` and `style=`) must be relative (no scheme, no leading `/`, no `//host`), must not
leave the page's folder (`..`, or a symlink leading out), and must name an existing file; `data:`
URIs are inline and pass; `#id` fragments must name an element of the page. With `follow=True`
the HTML pages it links to inside the folder are checked the same way.

`check_png(path, width, height)` returns the problems of a screenshot: not a PNG, not decodable,
not of the requested size, or blank (fewer than `min_colours` distinct colours).

Problems are strings `FILE:LINE: <tag attr="value">: what is wrong`, FILE relative to the page's
folder, so a failing assert names the file and the link.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Chromium's compositor cannot capture taller pages in one piece: a screenshot of a longer page is cut here.
MAX_SCREENSHOT_HEIGHT = 16_000

# Attributes that load or link something, per tag ("*": any tag).
_URL_ATTRS = {
    "href": "*", "src": "*", "poster": "*", "xlink:href": "*",
    "data": {"object"}, "action": {"form"}, "formaction": {"button", "input"},
    "background": "*", "manifest": {"html"},
}
_CSS_URL = re.compile(r"""url\(\s*(?P<q>['"]?)(?P<url>.*?)(?P=q)\s*\)""", re.IGNORECASE | re.DOTALL)
_CSS_IMPORT = re.compile(r"""@import\s+(?P<q>['"])(?P<url>.*?)(?P=q)""", re.IGNORECASE)


@dataclass(frozen=True)
class Ref:
    """One URL found in a page: where (line), on which tag and attribute, and its text."""

    line: int
    tag: str
    attr: str
    url: str

    def describe(self) -> str:
        if self.attr == "css url()":
            return f"<style> url({self.url!r})"
        if self.attr == "style url()":
            return f"<{self.tag} style=...url({self.url!r})...>"
        return f"<{self.tag} {self.attr}={self.url!r}>"


class _Collector(HTMLParser):
    """Collects the URLs of a page and the ids/names its fragments may point at."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[Ref] = []
        self.anchors: set[str] = set()
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        line = self.getpos()[0]
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.anchors.add(value)
            where = _URL_ATTRS.get(name)
            if where is not None and (where == "*" or tag in where):
                self.refs.append(Ref(line, tag, name, value))
            elif name in ("srcset", "imagesrcset"):
                for candidate in value.split(","):
                    if candidate.strip():
                        self.refs.append(Ref(line, tag, name, candidate.split()[0]))
            elif name == "style":
                self._css(value, line, tag, "style")
        if tag == "style":
            self._in_style = True

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self._css(data, self.getpos()[0], "style", "css")

    def _css(self, text: str, line: int, tag: str, attr: str) -> None:
        for pattern in (_CSS_URL, _CSS_IMPORT):
            for m in pattern.finditer(text):
                self.refs.append(Ref(line + text.count("\n", 0, m.start()), tag, f"{attr} url()", m["url"]))


def collect(page: Path) -> tuple[list[Ref], set[str]]:
    """The URLs in `page` and the ids/names of its elements."""
    parser = _Collector()
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser.refs, parser.anchors


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def check_ref(ref: Ref, page: Path, root: Path, anchors: set[str]) -> tuple[str | None, Path | None]:
    """(problem or None, the local file `ref` names or None) for one URL of `page`, `root` its folder."""
    url = ref.url.strip()
    if not url:
        return ("empty URL" if ref.attr != "href" else None), None
    if url.lower().startswith("data:"):
        return None, None
    if url.startswith("//"):
        return f"protocol-relative URL: an external asset ({url.split('/')[2] or '?'})", None
    if "\\" in url:
        return "backslash in a URL (not portable)", None
    parts = urlsplit(url)
    if parts.scheme:
        kind = "external URL" if parts.scheme.lower() in ("http", "https", "ftp", "ws", "wss") else "not relative"
        return f"{kind} (scheme {parts.scheme + ':'!r}): every link must be a relative path", None
    if url.startswith("/"):
        return "absolute path: every link must be relative to the page", None
    if not parts.path:
        fragment = unquote(parts.fragment)
        if fragment and fragment != "top" and fragment not in anchors:
            return f"fragment #{fragment} names no element of the page", None
        return None, None
    rel = unquote(parts.path)
    target = os.path.normpath(os.path.join(page.parent, rel))
    root_abs = os.path.normpath(os.path.abspath(root))
    if not _inside(os.path.abspath(target), root_abs):
        return f"{rel} leaves the folder {root.name}/", None
    if not os.path.lexists(target):
        return f"{os.path.relpath(target, root_abs)} does not exist", None
    if not _inside(os.path.realpath(target), os.path.realpath(root_abs)):
        return f"{rel} is a link leading out of the folder ({os.path.realpath(target)})", None
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "index.html")):
            return f"{rel} is a folder without index.html", None
        target = os.path.join(target, "index.html")
    elif not os.path.isfile(target):
        return f"{rel} is not a regular file", None
    return None, Path(target)


def check_links(page: Path, *, root: Path | None = None, follow: bool = True) -> list[str]:
    """Problems of `page`'s links (see the module docstring); `root` defaults to the page's folder."""
    page = Path(page).absolute()
    root = Path(root).absolute() if root is not None else page.parent
    if not page.is_file():
        return [f"{page}: no such page"]
    problems: list[str] = []
    todo, seen = [page], {page}
    while todo:
        current = todo.pop(0)
        refs, anchors = collect(current)
        name = os.path.relpath(current, root)
        for ref in refs:
            if ref.tag == "base":
                problems.append(f"{name}:{ref.line}: {ref.describe()}: <base> changes where every link points")
                continue
            problem, target = check_ref(ref, current, root, anchors)
            if problem:
                problems.append(f"{name}:{ref.line}: {ref.describe()}: {problem}")
            elif follow and target is not None and target.suffix.lower() in (".html", ".htm") and target not in seen:
                seen.add(target)
                todo.append(target)
    return problems


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, or None when `data` does not start like a PNG."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def check_png(path: Path, width: int, height: int, *, min_colours: int = 16) -> list[str]:
    """Problems of the screenshot at `path`: not a readable PNG of `width` x `height`, or blank."""
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        return [f"{path}: no screenshot was written"]
    data = path.read_bytes()
    size = png_size(data)
    if size is None:
        return [f"{path}: not a PNG (starts with {data[:8]!r})"]
    if size != (width, height):
        return [f"{path}: {size[0]}x{size[1]} pixels, {width}x{height} requested"]
    try:
        with Image.open(path) as img:
            img.load()
            colours = img.convert("RGB").getcolors(maxcolors=min_colours)
    except Exception as exc:  # Pillow raises several types for damaged data
        return [f"{path}: PNG does not decode ({type(exc).__name__}: {exc})"]
    if colours is not None:
        return [f"{path}: blank screenshot ({len(colours)} distinct colours, at least {min_colours} expected)"]
    return []


def blank_bands(path: Path, *, tolerance: int = 8) -> list[tuple[int, int]]:
    """The blank horizontal bands of a figure (numpy on its pixels): runs of whole pixel rows where every
    pixel is within `tolerance` (of 255, each channel) of the figure's background, the colour of its top-left
    pixel. Returns [(first row, rows)], top to bottom."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        px = np.asarray(im.convert("RGB"), dtype=np.int16)
    blank = (np.abs(px - px[0, 0]) <= tolerance).all(axis=2).all(axis=1)
    edges = np.flatnonzero(np.diff(np.r_[0, blank.astype(np.int8), 0]))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def check_bands(path: Path, max_share: float = 0.10) -> list[str]:
    """One line per blank horizontal band of the figure `path` taller than `max_share` of its height (a figure
    that fills its canvas has none: its panels, titles and gaps leave no band of nothing across it)."""
    from PIL import Image

    with Image.open(path) as im:
        height = im.size[1]
    return [f"{path.name}: rows {a}-{a + n - 1} are blank across the width ({n} of {height} rows, "
            f"{n / height:.0%} > {max_share:.0%})" for a, n in blank_bands(path) if n > max_share * height]


class _Cells(HTMLParser):
    """The text of every table cell (<td>, <th>) of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self._open = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "th"):
            self._open += 1
            self.cells.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._open:
            self._open -= 1

    def handle_data(self, data: str) -> None:
        if self._open:
            self.cells[-1] += data


def table_cells(html_text: str) -> list[str]:
    """The text of every table cell of a page, in order."""
    parser = _Cells()
    parser.feed(html_text)
    return parser.cells


def check_cells(html_text: str) -> list[str]:
    """One line per table cell holding a `{`: a dict or JSON printed where a table should show rows or
    formatted text."""
    return [f"table cell {k}: {c[:80]!r}" for k, c in enumerate(table_cells(html_text)) if "{" in c]
