"""The status page in a real headless browser (Debian's chromium, driven by selenium) against
a real `kvserve serve` of the tiny model with two DP engines and an API key: the browser logs
in with the key, the page shows the engines, its figures move after requests sent with the
openai client, and an engine shows suspect when frozen and dead when killed; on a server
with n-gram speculation, the acceptance shows once drafts were verified. No console error,
every request to the server's own origin, no horizontal overflow on a phone-sized screen."""

from __future__ import annotations

import json
import os
import signal
import urllib.parse

import openai
import pytest

from tests.support.browser import (
    PHONE,
    console_errors,
    emulate_phone,
    headless_chromium,
    requested_urls,
)
from tests.support.server import (
    DP_MODEL_NAME,
    NUM_DP_ENGINES,
    start_dp_front_end,
    start_tiny_server,
)

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-dashboard-admin"
NUM_REQUESTS = 3
MAX_TOKENS = 4
WAIT_S = 30
# Prompt lookup finds drafts in a repetitive prompt, whatever the tiny model's weights.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
# The elements whose right edge is past the screen's, but those in a scroll box (wide tables
# scroll inside their card).
OUTSIDE_THE_SCREEN = """
return [...document.querySelectorAll("body *")]
    .filter((e) => !(e.parentElement && e.parentElement.closest(".scroll")))
    .filter((e) => e.getBoundingClientRect().right > window.innerWidth + 0.5)
    .map((e) => e.tagName + "#" + e.id + "." + e.className);
"""


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dashboard")
    key_file = folder / "keys"
    key_file.write_text(f"admin:{ADMIN_KEY}\n")  # "admin": a --usage-admin-keys name
    process = start_dp_front_end(tiny_llama_dir, folder, "--api-key-file", str(key_file))
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as driver:
        yield driver


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : null",
        element_id,
    )


def wait_for(driver, condition, what: str):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # An element found by a condition may be redrawn before it is read: ask again.
    return WebDriverWait(
        driver, WAIT_S, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda d: condition(d), message=f"the page did not show {what} in {WAIT_S} s")


def log_in(driver, url: str) -> None:
    """Open the page, through the login form unless the session cookie is set already."""
    driver.get(url + "/dashboard")
    wait_for(driver, lambda d: d.current_url.endswith(("/dashboard/login", "/dashboard")), "it")
    if driver.current_url.endswith("/dashboard"):
        return
    field = driver.find_element("id", "key")
    field.send_keys(ADMIN_KEY)
    field.submit()
    wait_for(driver, lambda d: d.current_url.endswith("/dashboard"), "the page after login")


def engine_states(driver) -> list[tuple[str, str]]:
    """(DP rank, state) of each row of the engines table, read in one script: the page
    redraws the table every poll, so elements found one call earlier may be gone."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('#engines tbody tr'),"
        " row => Array.from(row.querySelectorAll('td'), c => c.innerText.trim()).slice(0, 2))"
    )
    return [tuple(row) for row in rows]


def slo_row(driver, name: str) -> list[str]:
    """The goodput panel's row of `name` ("all requests" or a tenant), its cells' text."""
    return driver.execute_script(
        "const row = [...document.querySelectorAll('#slo tbody tr')]"
        ".find((r) => r.dataset.tenant === arguments[0]);"
        " return row ? [...row.querySelectorAll('td')].map((c) => c.innerText.trim()) : [];",
        name,
    )


def test_page_shows_the_engines_and_its_figures_move_with_traffic(server, browser):
    log_in(browser, server.url)
    wait_for(browser, lambda d: len(engine_states(d)) == NUM_DP_ENGINES, "the engines")
    assert engine_states(browser) == [(str(i), "serving") for i in range(NUM_DP_ENGINES)]
    assert text_of(browser, "status") == "healthy"
    assert text_of(browser, "finished_requests_total") == "0"
    assert text_of(browser, "generation_tokens_total") == "0"

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    for i in range(NUM_REQUESTS):
        response = client.completions.create(
            model=DP_MODEL_NAME,
            prompt=f"request number {i} for the status page",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
            # The last one has a TTFT target it always meets: the goodput panel counts it.
            extra_headers={"x-slo-ttft-ms": "1e9"} if i == NUM_REQUESTS - 1 else None,
        )
        assert response.choices[0].finish_reason == "length"

    wait_for(
        browser,
        lambda d: text_of(d, "finished_requests_total") == str(NUM_REQUESTS),
        f"{NUM_REQUESTS} finished requests",
    )
    assert text_of(browser, "generation_tokens_total") == str(NUM_REQUESTS * MAX_TOKENS)
    wait_for(browser, lambda d: text_of(d, "ttft").split()[-1] == str(NUM_REQUESTS), "TTFT")
    # The admin key sees its tenant's usage.
    wait_for(
        browser,
        lambda d: "admin" in [c.text for c in d.find_elements("css selector", "#tenants td")],
        "the tenant",
    )
    wait_for(browser, lambda d: slo_row(d, "all requests")[2:] == ["1 / 0", "0 / 0"], "TTFT met")
    assert slo_row(browser, "admin")[2:] == ["1 / 0", "0 / 0"]

    assert console_errors(browser) == []
    origin = urllib.parse.urlsplit(server.url)
    urls = requested_urls(browser)
    assert any(u.endswith("/dashboard/state") for u in urls)
    elsewhere = [
        u for u in urls if urllib.parse.urlsplit(u)[:2] != origin[:2] and not u.startswith("data:")
    ]
    assert elsewhere == [], f"requests that left the server: {elsewhere}"


def test_a_frozen_engine_shows_suspect_and_a_killed_one_dead(server, browser):
    log_in(browser, server.url)
    _, health = server.health()
    victim = health["engines"][1]["pid"]
    os.kill(victim, signal.SIGSTOP)  # silent past the heartbeat timeout (3 s here): suspect
    try:
        wait_for(browser, lambda d: ("1", "suspect") in engine_states(d), "engine 1 suspect")
    finally:
        os.kill(victim, signal.SIGKILL)
    wait_for(browser, lambda d: ("1", "dead") in engine_states(d), "engine 1 dead")
    assert ("0", "serving") in engine_states(browser)
    assert text_of(browser, "status") == "degraded"
    assert console_errors(browser) == []


def test_phone_sized_screen_has_no_horizontal_overflow(server, browser):
    emulate_phone(browser)
    try:
        log_in(browser, server.url)
        wait_for(browser, lambda d: len(engine_states(d)) == NUM_DP_ENGINES, "the engines")
        widths = browser.execute_script(
            "return [document.documentElement.scrollWidth, document.body.scrollWidth,"
            " window.innerWidth]"
        )
        assert widths[2] == PHONE["width"]
        assert max(widths[:2]) <= PHONE["width"], widths
        # Nothing sticks out of the screen, but inside a table's own scroll box.
        outside = browser.execute_script(OUTSIDE_THE_SCREEN)
        assert outside == [], f"elements wider than the screen: {outside}"
        assert console_errors(browser) == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_spec_decode_acceptance_shows_when_enabled(tiny_llama_dir, tmp_path, browser):
    # No API key on this server: the page opens without logging in.
    server = start_tiny_server(tiny_llama_dir, tmp_path, "--speculative-config", json.dumps(NGRAM))
    try:
        server.wait_healthy()
        browser.get(server.url + "/dashboard")
        wait_for(browser, lambda d: len(engine_states(d)) == 1, "the engine")
        assert not browser.find_element("id", "spec_section").is_displayed()  # no draft yet
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        client.completions.create(
            model=DP_MODEL_NAME,
            prompt="a b a b a b a b a b a b",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        wait_for(
            browser, lambda d: d.find_element("id", "spec_section").is_displayed(), "spec decode"
        )
        acceptance = text_of(browser, "spec_acceptance")
        assert acceptance.endswith("%") and 0 <= float(acceptance.split()[0]) <= 100, acceptance
        assert not browser.find_element("id", "logout").is_displayed()  # no key, no session
        assert console_errors(browser) == []
    finally:
        server.stop()
