"""The demo's index page (`anchor demo --out DIR` → `DIR/index.html`) checked in a real browser.

Run with `make test-browser` (installs Chromium, builds `runs/demo` when missing), or by hand:
`ANCHOR_DEMO_DIR=DIR .venv/bin/pytest -q -p no:cacheprovider tests/browser`.

1. The page parsed with `html.parser` (tests/browser/pagecheck.py): every href/src/srcset/CSS
   url() is a relative path inside DIR naming an existing file, no external asset; HTML pages it
   links to inside DIR are checked the same way.
2. The page opened in the system's headless Chromium through pytest-playwright (`open_page` in
   tests/browser/conftest.py): it loads, every <img> loads (`complete` and `naturalWidth > 0`), no
   console error or uncaught exception, no failed request, nothing requested from another host.
3. A full-page screenshot 1280 CSS pixels wide is saved next to the page as `DIR/index.png`: a
   decodable PNG of exactly the captured size with more than a few colours (not blank).
4. The summary figure and the tables (`test_summary_figure_fills_its_canvas_and_tables_print_no_dict`).
"""

from __future__ import annotations

import pytest

from tests.browser.pagecheck import MAX_SCREENSHOT_HEIGHT, check_bands, check_cells, check_links, check_png

pytestmark = pytest.mark.browser

WIDTH = 1280


def test_index_links_are_relative_and_exist(demo_dir):
    problems = check_links(demo_dir / "index.html")
    print(f"{demo_dir}/index.html: {len(problems)} link problems")
    assert not problems, "\n".join(problems)


def test_index_page_in_chromium(demo_dir, open_page):
    shot = demo_dir / "index.png"
    shot.unlink(missing_ok=True)  # a screenshot left by an earlier run must not pass for this one
    report = open_page(demo_dir / "index.html", width=WIDTH, screenshot=shot)
    print(f"Chromium {report.version}: {report.url} title={report.info['title']!r} "
          f"text={report.info['textLength']} chars, {len(report.images)} images, page "
          f"{report.info['scrollWidth']}x{report.info['scrollHeight']}, screenshot {report.screenshot_size}")
    for img in report.images:
        print(f"  <img src={img['src']!r}> {img['naturalWidth']}x{img['naturalHeight']} complete={img['complete']}")
    assert not report.problems(), "\n".join(report.problems())
    assert report.info["title"] and report.info["textLength"] > 0, "the page shows no text"
    assert report.images, "the demo page shows no figure (the demo puts its figures inline)"
    width, height = report.screenshot_size
    assert width == WIDTH, report.screenshot_size
    assert height >= min(report.info["scrollHeight"], MAX_SCREENSHOT_HEIGHT), "the screenshot is not the whole page"
    problems = check_png(shot, width, height)
    assert not problems, "\n".join(problems)


def test_summary_figure_fills_its_canvas_and_tables_print_no_dict(demo_dir, open_page, page):
    """4. The summary figure as the page shows it: no blank band across it taller than 10% of its height
    (check_bands, numpy on the PNG the <img> loaded), shown at 85% of its drawn width or more (its text at
    about the size it was drawn); no table cell of the rendered page holds a `{` (a dict printed raw)."""
    report = open_page(demo_dir / "index.html", width=WIDTH)
    assert not report.problems(), "\n".join(report.problems())
    shown = page.evaluate("""() => [...document.images].filter(i => i.getAttribute('src') === 'summary.png')
        .map(i => ({shown: i.clientWidth, natural: i.naturalWidth}))""")
    assert shown, "the page shows no summary.png"
    print(f"summary.png: {shown[0]['natural']} pixels wide, shown at {shown[0]['shown']}")
    assert shown[0]["shown"] >= 0.85 * shown[0]["natural"], shown
    problems = check_bands(demo_dir / "summary.png")
    assert not problems, "\n".join(problems)
    cells = page.eval_on_selector_all("td, th", "els => els.map(e => e.innerText)")
    raw = [c for c in cells if "{" in c]
    print(f"{len(cells)} table cells, {len(raw)} with a brace")
    assert not raw, "\n".join(c[:100] for c in raw)
    assert not check_cells((demo_dir / "index.html").read_text(encoding="utf-8"))
