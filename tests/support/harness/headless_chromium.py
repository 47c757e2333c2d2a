"""Debian's Chromium and chromedriver driven by selenium, headless: where they are, what
is missing, and one started driver (the dashboard's browser test and bench/api_bench.py)."""

from __future__ import annotations

import os
from typing import Any

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"
ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--window-size=1400,1000",
)


def chromium_binary() -> str | None:
    """The Chromium executable installed, if any."""
    return next((p for p in CHROMIUM if os.access(p, os.X_OK)), None)


def missing_parts() -> list[str]:
    """What is not installed of chromium, chromium-driver and selenium."""
    missing = [
        what
        for what, ok in (
            ("chromium", chromium_binary() is not None),
            ("chromium-driver", os.access(CHROMEDRIVER, os.X_OK)),
        )
        if not ok
    ]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    return missing


def start_chromium() -> Any:
    """A headless Chromium under chromedriver (selenium's WebDriver; quit it when done).
    Raises selenium's WebDriverException when it is installed but cannot start."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_binary() or CHROMIUM[0]
    for arg in ARGS:
        options.add_argument(arg)
    return webdriver.Chrome(
        service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options
    )
