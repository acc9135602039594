"""The operator console in a real browser: Debian's headless Chromium driven by selenium through
chromedriver, the console served by uvicorn on a free port, a worker running, on a real PostgreSQL.

The source case study through the page: the dead letters appear grouped, one is explained, the
payloads are edited (the diff shown first), a canary replay job at a low rate is started and watched
to done, the keys unblock, the audit log shows the actor. A viewer has no button to act and its POST
is refused; a POST without the CSRF token is refused. Screenshots go to docs/console/ when
POSTBOX_SCREENSHOTS=1 (to a temporary folder otherwise, so that a test run leaves the tree clean).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from postbox.console.app import create_app
from tests.helpers import scalar
from tests.test_console import (  # noqa: F401  (fixtures)
    OPERATOR,
    OPERATOR_PASSWORD,
    VIEWER,
    VIEWER_TOKEN,
    console_options,
    operator_url,
    seeded,
    shop,
)
from tests.test_replay import log_of, shop_registry, start_worker, stop

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "console"
FIXED_PAYLOAD = '{"order": "%s", "amount": 12.5}'


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    if os.environ.get("POSTBOX_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        return DOCS
    return tmp_path


@pytest.fixture
def browser() -> Iterator[object]:
    if not (shutil.which("chromium") or Path(CHROMIUM).exists()) or not Path(CHROMEDRIVER).exists():
        pytest.fail(
            "the console's browser tests need Debian's chromium and chromium-driver: "
            "apt-get install chromium chromium-driver (.ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,800", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def served(operator_url, monkeypatch) -> Iterator[str]:  # noqa: F811  (fixtures from tests.test_console)
    """The console (running replay jobs) on a free port of 127.0.0.1; its base URL."""
    app = create_app(operator_url, console_options(monkeypatch), "browser-test-secret", poll_interval=0.1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    ready, deadline = threading.Event(), time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        ready.wait(0.02)  # uvicorn says it listens only through this flag: polled, with a deadline
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _wait(driver, condition, timeout: float = 20, what: str = "") -> object:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # htmx replaces the job's panel every second: an element read as it goes is looked up again.
    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=ignored).until(
        condition, what
    )


def _text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def sign_in(driver, base: str, user: str, secret: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(base + "/login")
    driver.find_element(By.ID, "username").send_keys(user)
    driver.find_element(By.ID, "password").send_keys(secret)
    driver.find_element(By.ID, "sign-in").click()
    _wait(driver, lambda d: user in _text(d, "#whoami"), what="signed in")


def post_from_page(driver, form: dict[str, str], with_token: bool) -> int:
    """POST /act from the page's own origin (cookies included), with or without its CSRF token; the
    status."""
    script = """
        const [form, withToken, done] = arguments;
        const body = new URLSearchParams(form);
        if (withToken) body.set('csrf_token', document.querySelector('input[name=csrf_token]').value);
        fetch('/act', {method: 'POST', body, credentials: 'same-origin', redirect: 'manual'})
            .then(r => done(r.status), e => done(String(e)));
    """
    return int(driver.execute_async_script(script, form, with_token))


def edit_payload(driver, base: str, dead_letter: int, order: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/dead-letters/{dead_letter}")
    editor = driver.find_element(By.ID, "payload-editor")
    editor.clear()
    editor.send_keys(FIXED_PAYLOAD % order)
    driver.find_element(By.ID, "edit-reason").send_keys("amount as a JSON number (the producer's bug)")
    driver.find_element(By.ID, "edit").click()
    diff = _wait(driver, lambda d: _text(d, "#diff"), what="the diff")
    assert '-  "amount": "12.50"' in str(diff) and '+  "amount": 12.5' in str(diff)
    driver.find_element(By.ID, "confirm").click()
    _wait(driver, lambda d: "payload version 1 saved" in _text(d, "#notice"), what="the edit saved")


def test_the_case_study_through_the_page(shop, served, browser, screenshots):  # noqa: F811
    """Two orders whose 'paid' was dead-lettered (amount sent as a string): seen grouped, one
    explained, both payloads edited, a canary replay of the group at 0.25/s watched to done, the keys
    unblocked (each order's held 'shipped' follows), the audit log naming the operator."""
    from selenium.webdriver.common.by import By

    driver, base = browser, served
    worker = start_worker(shop.url, shop_registry(1))  # v1 rejects a string amount, takes a number
    try:
        sign_in(driver, base, OPERATOR, OPERATOR_PASSWORD)
        _wait(driver, lambda d: "orders" in _text(d, "#consumers"), what="the overview")
        row = _text(driver, "tr[data-consumer=orders]")
        assert "2" in row  # two blocked keys, two dead letters open
        driver.save_screenshot(str(screenshots / "overview.png"))

        driver.find_element(By.LINK_TEXT, "Dead letters").click()
        groups = driver.find_elements(By.CSS_SELECTOR, "#groups tr.group")
        assert (
            len(groups) == 1
            and "amount must be a number" in groups[0].text
            and " 2 " in f" {groups[0].text} "
        )
        groups[0].find_element(By.CSS_SELECTOR, "a.open-group").click()
        _wait(driver, lambda d: _text(d, "#group-size") == "2", what="the group")
        group_url = driver.current_url
        members = [int(a.text.lstrip("#")) for a in driver.find_elements(By.CSS_SELECTOR, "#members a.story")]
        assert len(members) == 2
        driver.save_screenshot(str(screenshots / "dead-letter-group.png"))

        driver.find_element(By.CSS_SELECTOR, "#members a.story").click()
        story = _wait(driver, lambda d: _text(d, "#story"), what="the story")
        assert "field amount must be a number" in str(story)
        assert "shipped" in _text(driver, "#held") and "12.50" in _text(driver, "#payload")
        driver.save_screenshot(str(screenshots / "dead-letter-story.png"))

        for dead_letter in members:
            key = str(scalar(shop.url, "SELECT key FROM postbox.dead_letters WHERE id = %s", (dead_letter,)))
            edit_payload(driver, base, dead_letter, key)

        driver.get(group_url)
        driver.find_element(By.ID, "scope-group").click()
        driver.find_element(By.ID, "reason").send_keys("payloads fixed; canary first")
        for field, value in (("rate", "0.25"), ("canary", "1"), ("max_in_flight", "1")):
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        driver.find_element(By.ID, "replay").click()
        _wait(driver, lambda d: "the whole group (2 open" in _text(d, "#summary"), what="the confirmation")
        driver.find_element(By.ID, "confirm").click()
        _wait(driver, lambda d: "replay job" in _text(d, "#notice"), what="the job page")
        _wait(driver, lambda d: _text(d, "#job-state") == "running" and _text(d, "#job-sent") == "1",
              timeout=30, what="the canary sent")  # fmt: skip
        driver.save_screenshot(str(screenshots / "replay-job.png"))
        _wait(driver, lambda d: _text(d, "#job-state") == "done", timeout=60, what="the job done")
        outcome = _wait(
            driver, lambda d: (_text(d, "#job-succeeded"), _text(d, "#job-failed")), what="outcome"
        )
        assert outcome == ("2", "0")
        audit = str(_wait(driver, lambda d: _text(d, "#job-audit"), what="the job's audit"))
        assert "replay" in audit and OPERATOR in audit

        driver.get(base + "/keys")
        _wait(
            driver,
            lambda d: d.refresh() or d.find_elements(By.ID, "no-keys"),
            timeout=30,
            what="keys unblocked",
        )
        for order in ("order-0", "order-1"):
            assert log_of(shop.url, order) == "created,paid,shipped"
        driver.get(base + "/audit")
        rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#audit tr")[1:]]
        assert [r for r in rows if "dlq_edit" in r and OPERATOR in r] and [
            r for r in rows if " replay " in f" {r} " and OPERATOR in r
        ]
    finally:
        stop(worker)


def test_a_viewer_cannot_act_and_a_post_without_the_csrf_token_is_refused(shop, served, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    driver, base = browser, served
    dead_letter = int(scalar(shop.url, "SELECT min(id) FROM postbox.dead_letters"))
    sign_in(driver, base, VIEWER, VIEWER_TOKEN)
    driver.get(f"{base}/dead-letters/{dead_letter}")
    _wait(driver, lambda d: _text(d, "#story"), what="the story")
    assert not driver.find_elements(By.ID, "edit-form") and not driver.find_elements(
        By.XPATH, "//button[@value='discard']"
    )
    assert "[redacted" in _text(driver, "#payload")
    form = {"op": "discard", "ids": str(dead_letter), "reason": "viewer tries", "confirmed": "yes"}
    assert post_from_page(driver, form, with_token=True) == 403

    driver.find_element(By.XPATH, "//button[text()='Sign out']").click()
    sign_in(driver, base, OPERATOR, OPERATOR_PASSWORD)
    driver.get(f"{base}/dead-letters/{dead_letter}")
    assert driver.find_elements(By.ID, "edit-form")
    assert post_from_page(driver, form, with_token=False) == 403
    assert scalar(shop.url, "SELECT count(*) FROM postbox.audit_log") == 0
    assert scalar(shop.url, "SELECT status FROM postbox.dead_letters WHERE id = %s", (dead_letter,)) == "open"
