"""A real headless browser for the tests: Debian's chromium driven by selenium through
Debian's chromedriver (`make browser` installs both; .ci/run does too).

Selenium Manager is never asked for a driver (it would download one): the service is the
installed chromedriver. The browser's console and the DevTools network events are logged,
so a test can read every console message and every request the page made.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")
DRIVER_NAMES = ("chromedriver",)
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}
# No traffic of the browser's own: updates, sync, extensions.
_FLAGS = (
    "--headless=new",
    "--no-sandbox",  # CI runs as root
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,1000",
)


def _which(names: tuple[str, ...]) -> str | None:
    return next((path for path in map(shutil.which, names) if path), None)


@contextlib.contextmanager
def headless_chromium() -> Iterator:
    """A selenium Chrome driver over the installed chromium; skips the test, saying so, when
    chromium or its driver is not installed (`make browser` could not install them)."""
    binary, driver_path = _which(CHROMIUM_NAMES), _which(DRIVER_NAMES)
    if binary is None or driver_path is None:
        pytest.skip(
            "chromium and chromium-driver are not installed and could not be "
            "(`make browser`: apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in _FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver) -> list[dict]:
    """The console's errors since the last call (uncaught exceptions, failed loads,
    console.error)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def requested_urls(driver) -> list[str]:
    """Every URL the page requested since the last call (DevTools' Network events)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def emulate_phone(driver) -> None:
    """Render as a phone-sized screen (PHONE: 390 x 844 CSS pixels, touch, mobile viewport)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
