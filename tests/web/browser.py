"""Headless Debian Chromium for the dashboard's browser tests (Playwright
with executable_path): one way to open a page, and the skip where it is
not installed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed at "
                                    "/usr/bin/chromium (apt-get install -y chromium)")


@contextmanager
def chromium_page(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """A page of a fresh headless browser, closed on the way out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
