"""Fixtures of the browser tests: the demo folder and one headless Chromium per session.

`ANCHOR_DEMO_DIR` names the demo output whose `index.html` is checked (relative to the working
directory; default: `runs/demo` in the checkout). `ANCHOR_REQUIRE_BROWSER=1` (set by
`make test-browser`) turns a missing Chromium or a missing page into a failure; without it those
tests are skipped, so a plain `pytest` run on a machine without Chromium still passes the
pure-parser tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser.chromium import Chromium, find_chromium

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: needs headless Chromium or a demo output; left out of `make test` (`make test-browser`)")


def _missing(reason: str) -> None:
    if os.environ.get("ANCHOR_REQUIRE_BROWSER") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium():
    binary = find_chromium()
    if binary is None:
        _missing("no Chromium: run tests/browser/install_chromium.sh (Debian: apt-get install chromium) "
                 "or set ANCHOR_CHROMIUM")
    with Chromium(binary) as browser:
        yield browser


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    env = os.environ.get("ANCHOR_DEMO_DIR")
    folder = Path(env).absolute() if env else REPO / "runs" / "demo"
    if not (folder / "index.html").is_file():
        _missing(f"{folder}/index.html does not exist: run `anchor demo --out {folder}` or set ANCHOR_DEMO_DIR")
    return folder
