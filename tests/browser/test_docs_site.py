"""The documentation site (`mkdocs build`, mkdocs.yml and docs/) read in headless Chromium at 1,400 x 900.

The site is served over http on 127.0.0.1 (`site_url` in tests/browser/conftest.py), as a reader serves it
(`mkdocs serve`, or any static server over `runs/site`): opened from the file system, its search never starts.
`ANCHOR_SITE_DIR` names a built site (`make docs` writes `runs/site`); without it the checkout's site is built
for the session. Both tests are skipped without Chromium, pytest-playwright or MkDocs, like the other browser
tests.

1. `test_every_page_fits_at_1400px`: on every page, code blocks, tables and the page itself stay within
   their boxes, and no table cell breaks inside a word.
2. `test_search_lists_results`: the search box leaves "Initializing search" and lists pages for a query.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

WIDTH, HEIGHT = 1400, 900
QUERY = "AnchorAttention"

# Runs in a page of the site: one line per box its content runs past, and per table cell line that ends
# inside a word. Cells are read text node by text node; only nodes laid out on more than one line are walked
# character by character, a line break being where a character's box starts lower than the one before it.
_LAYOUT_JS = r"""
() => {
  const out = [], scrolls = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1)
    out.push(`the page scrolls sideways: ${root.scrollWidth} px of content in ${root.clientWidth} px`);
  const column = document.querySelector('.md-content').getBoundingClientRect();
  document.querySelectorAll('.md-content pre > code').forEach((code, i) => {
    if (code.scrollWidth > code.clientWidth + 1) {
      const line = code.innerText.split('\n').reduce((a, b) => (b.length > a.length ? b : a), '');
      out.push(`code block ${i}: ${code.scrollWidth} px wide in a ${code.clientWidth} px box: ` +
               line.slice(0, 100));
    }
  });
  const word = /[\p{L}\p{N}]/u;
  document.querySelectorAll('.md-content table').forEach((table, i) => {
    const wrap = table.closest('.md-typeset__scrollwrap') || table;
    const box = wrap.getBoundingClientRect();
    if (box.right > column.right + 1 || box.left < column.left - 1)
      out.push(`table ${i}: its box (${box.left | 0}-${box.right | 0} px) leaves the content column ` +
               `(${column.left | 0}-${column.right | 0} px)`);
    if (wrap.scrollWidth > wrap.clientWidth + 1)
      scrolls.push(`table ${i}: ${wrap.scrollWidth} px in ${wrap.clientWidth} px`);
    table.querySelectorAll('td, th').forEach(cell => {
      const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const whole = document.createRange();
        whole.selectNodeContents(node);
        if (whole.getClientRects().length < 2) continue;
        const s = node.data;
        let top = null;
        for (let k = 0; k < s.length; k++) {
          const r = document.createRange();
          r.setStart(node, k);
          r.setEnd(node, k + 1);
          const rects = r.getClientRects();
          if (!rects.length) continue;
          if (top !== null && rects[0].top > top + 2 && k > 0 && word.test(s[k - 1]) && word.test(s[k])) {
            out.push(`table ${i}: a cell breaks inside a word: ` +
                     `${s.slice(Math.max(0, k - 20), k)}|${s.slice(k, k + 20)}`);
            break;
          }
          top = rects[0].top;
        }
      }
    });
  });
  return {problems: out, scrolls: scrolls};
}
"""


def test_every_page_fits_at_1400px(site_dir, site_url, open_page, page):
    """Every page of the built site at 1,400 x 900: it loads cleanly (open_page's checks: images, console,
    requests), the page does not scroll sideways, and no `pre > code` block is wider than its box
    (scrollWidth against clientWidth).

    Tables: no table is wider than the content column (its wrapper, Material's `.md-typeset__scrollwrap`, does
    not scroll), and no line of a table cell ends between two letters or digits of one text node: a column
    squeezed until its words break fails as much as one that runs past the page. Paths in a table may break
    after a folder's slash only (the results index writes them with `<wbr>`; Chromium breaks code at a space
    otherwise)."""
    pages = sorted(p.relative_to(site_dir).as_posix() for p in site_dir.rglob("*.html"))
    assert "index.html" in pages, f"{site_dir} holds no index.html"
    problems: list[str] = []
    for rel in pages:
        report = open_page(site_url + rel, width=WIDTH, height=HEIGHT)
        if report.loaded:  # the search index and favicon too: a request left open would fail with the next page
            page.wait_for_load_state("networkidle")
        found = report.problems()
        if report.loaded:
            layout = page.evaluate(_LAYOUT_JS)
            found += layout["problems"] + [f"{t}: wider than the content column" for t in layout["scrolls"]]
        print(f"{rel}: {len(found)} problems")
        problems += [f"{rel}: {p}" for p in found]
    print(f"{len(pages)} pages at {WIDTH}x{HEIGHT}, Chromium {report.version}")
    assert not problems, "\n".join(problems)


def test_search_lists_results(site_url, open_page, page):
    """The home page's search: it leaves "Initializing search" (its web worker started and loaded the index),
    typing QUERY lists at least one page, and the page loaded cleanly (open_page's checks)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    report = open_page(site_url + "index.html", width=WIDTH, height=HEIGHT)
    meta = page.locator(".md-search-result__meta")
    try:
        page.wait_for_function("() => !/Initializing/.test(document.querySelector('.md-search-result__meta')"
                               ".textContent)", timeout=15_000)
    except PlaywrightTimeout:
        pytest.fail(f"the search stays at {meta.text_content().strip()!r} after 15 s", pytrace=False)
    page.locator("input.md-search__input").click()
    page.keyboard.type(QUERY)
    try:
        page.wait_for_selector(".md-search-result__item", timeout=15_000)
    except PlaywrightTimeout:
        pytest.fail(f"no result for {QUERY!r} after 15 s: {meta.text_content().strip()!r}", pytrace=False)
    titles = page.eval_on_selector_all(".md-search-result__item h1, .md-search-result__item h2",
                                       "els => els.map(e => e.textContent.trim())")
    print(f"search {QUERY!r}: {meta.text_content().strip()!r}; {titles[:5]}")
    assert titles, f"no result for {QUERY!r}: {meta.text_content().strip()!r}"
    assert not report.problems(), "\n".join(report.problems())
