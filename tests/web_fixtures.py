"""Real browsers for the web page's tests and its README screenshot: Playwright (PyPI)
driving Debian's chromium (`apt-get install chromium`; `.ci/run` installs it), since
Playwright's own browser builds cannot be downloaded here; and Debian's Firefox
(`apt-get install firefox-esr`) through its built-in Marionette protocol with Mozilla's
`marionette_driver` (PyPI), since Playwright drives only its own patched Firefox builds.
`CONVEYOR_CHROMIUM` and `CONVEYOR_FIREFOX` name other binaries."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# How long the page may take to show what a test waits for (a loaded 2-core machine).
PAGE_TIMEOUT_MS = 180_000
VIEWPORT = {"width": 1400, "height": 1000}  # a laptop screen


def chromium_path() -> str:
    path = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("the web page's tests need Debian's chromium: apt-get install chromium "
                    "(or CONVEYOR_CHROMIUM=/path/to/chromium)")
    return path


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    """A fresh page in headless chromium (a new profile: empty local storage)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def screenshot_on_failure(page: Any, folder: Path, name: str) -> Iterator[None]:
    """On an exception, save the page as folder/name.png (the test's tmp dir) and say where."""
    try:
        yield
    except BaseException as error:
        path = folder / f"{name}.png"
        with contextlib.suppress(Exception):
            page.screenshot(path=str(path), full_page=True)
            error.add_note(f"screenshot of the page: {path}")
        raise


def firefox_path() -> str:
    path = (os.environ.get("CONVEYOR_FIREFOX") or shutil.which("firefox-esr")
            or shutil.which("firefox"))
    if not path:
        pytest.fail("the web page's Firefox test needs Debian's Firefox: apt-get install "
                    "firefox-esr (or CONVEYOR_FIREFOX=/path/to/firefox)")
    return path


@contextlib.contextmanager
def firefox_session(folder: Path) -> Iterator[Any]:
    """Headless Firefox (a new profile) and a Marionette session on it; Firefox's log goes
    to folder/gecko.log."""
    from marionette_driver.marionette import Marionette

    client = Marionette(bin=firefox_path(), port=0, headless=True,
                        gecko_log=str(folder / "gecko.log"),
                        startup_timeout=PAGE_TIMEOUT_MS // 1000)
    try:
        client.start_session()
        client.timeout.script = PAGE_TIMEOUT_MS / 1000
        client.set_window_rect(width=VIEWPORT["width"], height=VIEWPORT["height"])
        yield client
    finally:
        client.cleanup()
