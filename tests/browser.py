"""Headless Chromium for the tests of nanohlat's pages (the run report, the compare page,
the planner page): open a local file, read its console, keep a screenshot.

Debian's `chromium` and `chromium-driver` driven by selenium (the `test` extra). Both
executables are named here, so selenium never looks for (or downloads) a driver of its
own. Where either is missing, `browser()` skips its test with one line saying why; CI
is not such a place: .ci/run installs them.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = ("chromedriver", "chromium-driver")


def _which(names):
    return next((p for p in map(shutil.which, names) if p), None)


def why_no_browser() -> str | None:
    """None when a headless Chromium can be driven here; else what is missing, in words."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not _which(CHROMIUM):
        return "no Chromium executable on PATH (Debian: apt-get install chromium chromium-driver)"
    if not _which(DRIVER):
        return "no chromedriver on PATH (Debian: apt-get install chromium-driver)"
    return None


class Page:
    """One page open in headless Chromium: `driver` is selenium's, `errors()` the console's
    SEVERE entries (a JavaScript exception, a resource that failed to load)."""

    def __init__(self, driver):
        self.driver = driver

    def errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]

    def find(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def screenshot(self, path: str) -> None:
        self.driver.save_screenshot(path)


def browser():
    """A started headless Chromium (close it with .quit()), or pytest.skip with the reason."""
    why = why_no_browser()
    if why:
        pytest.skip(f"no headless browser: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = _which(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=_which(DRIVER)), options=options)


def open_page(driver, path: str) -> Page:
    """Load a local file (no server, no network) and return it as a Page."""
    driver.get("file://" + os.path.abspath(path))
    return Page(driver)
