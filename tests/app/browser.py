"""Headless Debian chromium for the browser tests, driven by Playwright (no browser download): the binary, and the
flags the project's probe found necessary on a closed-network machine, as root."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
# for a test module: skipped, with the reason, only where no chromium binary is installed (CI installs it)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")


@contextlib.contextmanager
def launched() -> Iterator[Any]:
    """One headless chromium (Playwright's `Browser`), closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
