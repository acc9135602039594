"""The operator console through Starlette's TestClient on a real PostgreSQL: sign-in, roles, CSRF,
bad form input (nothing changes), and actions recorded with the signed-in actor under the
postbox_operator role. The browser tests are in tests/test_console_browser.py."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from postbox.config.settings import ConsoleOptions, load_settings
from postbox.console.app import create_app
from postbox.console.auth import Users, hash_password
from postbox.errors import ConfigError
from tests.conftest import Database, _cloned, _conninfo_url
from tests.helpers import eventually, role_login, scalar
from tests.test_replay import SHOP_DDL, dead_letter_all_paid

OPERATOR, OPERATOR_PASSWORD = "alice", "correct horse battery"
VIEWER, VIEWER_TOKEN_ENV, VIEWER_TOKEN = "victor", "POSTBOX_TEST_CONSOLE_VIEWER_TOKEN", "viewer-token-5f1c"
_HASH = hash_password(OPERATOR_PASSWORD)


def console_options(monkeypatch: pytest.MonkeyPatch, **kw: object) -> ConsoleOptions:
    """An operator with a password, a viewer with a token from the environment."""
    monkeypatch.setenv(VIEWER_TOKEN_ENV, VIEWER_TOKEN)
    users = {
        OPERATOR: {"role": "operator", "password_hash": _HASH},
        VIEWER: {"role": "viewer", "token_env": VIEWER_TOKEN_ENV},
    }
    return ConsoleOptions.model_validate({"users": users, **kw})


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found, "no CSRF token in the page"
    return found.group(1)


def sign_in(client: TestClient, user: str, secret: str) -> str:
    """Sign in; the session's CSRF token."""
    token = csrf_of(client.get("/login").text)
    r = client.post("/login", data={"username": user, "password": secret, "csrf_token": token})
    assert r.status_code == 200 and user in r.text, r.text[:500]
    return csrf_of(r.text)


@pytest.fixture(scope="session")
def seeded(pg_server, template_db) -> Iterator[str]:
    """A template holding the case study: orders order-0 and order-1 whose 'paid' carries the
    amount as a string, dead-lettered by the v1 handler, their keys blocked (cloned per test)."""
    for db in _cloned(pg_server, "postbox_console_seed", template_db):
        with db.connect(autocommit=True) as c:
            c.execute(SHOP_DDL)
            c.execute("SELECT postbox.declare_consumer_v1('orders', 'monotonic')")
        dead_letter_all_paid(db, ["order-0", "order-1"])
        admin = _conninfo_url(dict(pg_server.params, dbname="postgres"))
        eventually(
            lambda admin=admin, name=db.name: scalar(
                admin, "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = %s", (name,)
            ),
            what="the seeded database's connections closed",
        )
        yield db.name


@pytest.fixture
def shop(pg_server, seeded) -> Iterator[Database]:
    yield from _cloned(pg_server, "postbox_console", seeded)


@pytest.fixture
def operator_url(shop: Database) -> Iterator[str]:
    """A login granted only postbox_operator (what the console runs as), dropped afterwards."""
    yield from role_login(shop, "postbox_operator", "console")


@pytest.fixture
def client(operator_url, monkeypatch) -> Iterator[TestClient]:
    app = create_app(operator_url, console_options(monkeypatch), "test-secret", run_replays=False)
    with TestClient(app, follow_redirects=True) as c:
        yield c


def dead_letter_id(shop: Database, key: str) -> int:
    return int(scalar(shop.url, "SELECT id FROM postbox.dead_letters WHERE key = %s", (key,)))


def changes(shop: Database) -> tuple[object, ...]:
    """What an action would change: audit entries, payload edits, statuses, jobs, halted consumers."""
    return tuple(
        scalar(shop.url, q)
        for q in (
            "SELECT count(*) FROM postbox.audit_log",
            "SELECT count(*) FROM postbox.dead_letter_edits",
            "SELECT string_agg(status, ',' ORDER BY id) FROM postbox.dead_letters",
            "SELECT count(*) FROM postbox.replay_jobs",
            "SELECT count(*) FROM postbox.consumers WHERE halted_at IS NOT NULL",
        )
    )


def test_nothing_without_signing_in(client, shop):
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")
    for path in (
        "/dead-letters",
        "/keys",
        "/jobs",
        "/audit",
        f"/dead-letters/{dead_letter_id(shop, 'order-0')}",
    ):
        assert client.get(path, follow_redirects=False).status_code == 303
    before = changes(shop)
    r = client.post("/act", data={"op": "discard", "ids": "1", "reason": "x", "confirmed": "yes"})
    assert r.status_code == 401 and changes(shop) == before
    token = csrf_of(client.get("/login").text)
    bad = client.post("/login", data={"username": OPERATOR, "password": "wrong", "csrf_token": token})
    assert bad.status_code == 401 and "wrong password" in bad.text
    no_csrf = client.post("/login", data={"username": OPERATOR, "password": OPERATOR_PASSWORD})
    assert no_csrf.status_code == 403
    assert client.get("/healthz").text == "ok"


def test_a_viewer_reads_with_payloads_redacted_and_cannot_act(client, shop):
    token = sign_in(client, VIEWER, VIEWER_TOKEN)
    dl = dead_letter_id(shop, "order-0")
    groups = client.get("/dead-letters?consumer=orders")
    assert "permanent" in groups.text and "amount must be a number" in groups.text
    group = client.get(
        re.search(r'href="(/dead-letters/group\?[^"]+)"', groups.text).group(1).replace("&amp;", "&")
    )
    assert f"#{dl}" in group.text and "Replay…" not in group.text and 'name="ids"' not in group.text
    story = client.get(f"/dead-letters/{dl}")
    assert "order-0-2" in story.text and "[redacted" in story.text and "12.50" not in story.text
    assert 'id="edit-form"' not in story.text
    before = changes(shop)
    for form in (
        {"op": "discard", "ids": str(dl), "reason": "x", "confirmed": "yes"},
        {"op": "edit", "id": str(dl), "payload": "{}", "reason": "x", "confirmed": "yes"},
        {"op": "consumer", "consumer": "orders", "verb": "halt", "reason": "x", "confirmed": "yes"},
    ):
        r = client.post("/act", data={**form, "csrf_token": token})
        assert r.status_code == 403 and "only an operator" in r.text
    assert changes(shop) == before


def test_a_viewer_sees_payloads_when_the_settings_allow(operator_url, shop, monkeypatch):
    app = create_app(
        operator_url, console_options(monkeypatch, viewers_see_payloads=True), "s", run_replays=False
    )
    with TestClient(app) as c:
        sign_in(c, VIEWER, VIEWER_TOKEN)
        assert "12.50" in c.get(f"/dead-letters/{dead_letter_id(shop, 'order-0')}").text


def test_a_post_without_the_csrf_token_is_refused(client, shop):
    token = sign_in(client, OPERATOR, OPERATOR_PASSWORD)
    dl = dead_letter_id(shop, "order-0")
    before = changes(shop)
    form = {"op": "discard", "ids": str(dl), "reason": "not needed", "confirmed": "yes"}
    assert client.post("/act", data=form).status_code == 403
    assert client.post("/act", data={**form, "csrf_token": token[:-2] + "xx"}).status_code == 403
    assert client.post("/logout").status_code == 403
    assert changes(shop) == before


BAD_INPUT = [
    ({"op": "edit", "payload": "{not json", "reason": "fix"}, "the payload is not JSON"),
    ({"op": "edit", "payload": '{"a": NaN}', "reason": "fix"}, "NaN is not a JSON value"),
    ({"op": "edit", "payload": '{"a": 1}', "reason": " "}, "give a reason"),
    ({"op": "edit", "id": "999999", "payload": "{}", "reason": "fix"}, "no dead letter 999999"),
    ({"op": "edit", "id": "abc", "payload": "{}", "reason": "fix"}, "id must be a whole number"),
    ({"op": "replay", "rate": "0"}, "rate: Input should be greater than 0"),
    ({"op": "replay", "rate": "-3"}, "rate: Input should be greater than 0"),
    ({"op": "replay", "rate": "fast"}, "rate must be a number"),
    ({"op": "replay", "max_in_flight": "0"}, "max_in_flight: Input should be greater than or equal to 1"),
    ({"op": "replay", "ids": "999999"}, "no dead letter 999999"),
    ({"op": "discard", "ids": None}, "select at least one dead letter"),
    ({"op": "job", "job": "424242", "verb": "pause", "reason": "x"}, "no replay job 424242"),
    ({"op": "job", "job": "1", "verb": "explode", "reason": "x"}, "not 'explode'"),
    (
        {"op": "consumer", "consumer": "ordres", "verb": "halt", "reason": "x"},
        "unknown consumer 'ordres'",
    ),
]


def test_bad_input_gets_a_clear_message_and_changes_nothing(client, shop):
    token = sign_in(client, OPERATOR, OPERATOR_PASSWORD)
    dl = dead_letter_id(shop, "order-0")
    base = {"id": str(dl), "ids": str(dl), "reason": "try", "rate": "1", "max_in_flight": "1", "batch_size": "1",
            "canary": "0", "abort_failure_ratio": "0.5", "mode": "in_place"}  # fmt: skip
    before = changes(shop)
    for form, message in BAD_INPUT:
        data = {k: v for k, v in {**base, **form, "csrf_token": token}.items() if v is not None}
        for confirmed in ("", "yes"):
            r = client.post("/act", data={**data, "confirmed": confirmed})
            text = html.unescape(r.text)
            assert r.status_code == 400 and "Nothing changed" in text and message in text, text[-800:]
    assert changes(shop) == before


@pytest.mark.parametrize(
    ("url", "message"),
    [("/dead-letters?page=999999999999999999999", "page must be a whole number from 0 to"),
     ("/dead-letters?page=-1", "page must be a whole number from 0 to"),
     ("/keys?page=99999999999999999999", "page must be a whole number from 0 to"),
     ("/audit?before=99999999999999999999", "before must be a whole number from 0 to"),
     ("/dead-letters?older_than_hours=nan", "older_than_hours must be a number of hours"),
     ("/dead-letters?consumer=%00", "contains NUL"),
     ("/dead-letters?key=a%00b", "contains NUL")],
)  # fmt: skip
def test_odd_query_strings_get_a_400_not_a_server_error(client, shop, url, message):
    """A page number past a bigint, a NUL in a filter, a NaN age: 400 with what is wrong (they
    were 500s, the database's errors in the log)."""
    sign_in(client, OPERATOR, OPERATOR_PASSWORD)
    r = client.get(url)
    assert r.status_code == 400 and message in html.unescape(r.text), (r.status_code, r.text[-500:])


def test_an_edit_shows_its_diff_then_is_recorded_with_the_actor_and_the_operator_role(client, shop):
    token = sign_in(client, OPERATOR, OPERATOR_PASSWORD)
    dl = dead_letter_id(shop, "order-0")
    form = {"op": "edit", "id": str(dl), "payload": '{"order": "order-0", "amount": 12.5}',
            "reason": "amount as a number", "csrf_token": token}  # fmt: skip
    confirm = client.post("/act", data=form)
    assert confirm.status_code == 200 and 'id="confirm"' in confirm.text
    shown = html.unescape(confirm.text)
    assert '-  "amount": "12.50"' in shown and '+  "amount": 12.5' in shown
    assert scalar(shop.url, "SELECT count(*) FROM postbox.dead_letter_edits") == 0  # not yet
    done = client.post("/act", data={**form, "confirmed": "yes"})
    assert done.status_code == 200 and "payload version 1 saved" in done.text
    actor, role, action = (
        scalar(shop.url, f"SELECT {c} FROM postbox.audit_log ORDER BY id DESC LIMIT 1")
        for c in ("actor", "db_role", "action")
    )
    assert (actor, action) == (OPERATOR, "dlq_edit")
    assert str(role).startswith("pbx_console_")  # the console's login, granted only postbox_operator
    assert OPERATOR in client.get("/audit").text


def test_settings_nobody_could_sign_in_with_are_refused():
    with pytest.raises(ConfigError, match="no users"):
        Users(ConsoleOptions())
    with pytest.raises(ConfigError, match="exactly one of password_hash or token_env"):
        Users(ConsoleOptions.model_validate({"users": {"a": {"role": "operator"}}}))
    with pytest.raises(ConfigError, match="not an scrypt hash"):
        Users(ConsoleOptions.model_validate({"users": {"a": {"password_hash": "plain"}}}))
    with pytest.raises(ConfigError, match="role"):
        load_settings(
            document={"postbox": {"console": {"users": {"a": {"role": "admin", "token_env": "X"}}}}}
        )
    with pytest.raises(ConfigError, match=r"console\.bogus"):
        load_settings(document={"postbox": {"console": {"bogus": 1}}})


def _confirm(client: TestClient, form: dict[str, str]) -> str:
    """Post an action, check that it asks first and changed nothing yet, confirm; the page after."""
    asked = client.post("/act", data=form)
    assert asked.status_code == 200 and 'id="confirm"' in asked.text, asked.text[-600:]
    done = client.post("/act", data={**form, "confirmed": "yes"})
    assert done.status_code == 200, done.text[-600:]
    return html.unescape(done.text)


def test_operators_halt_and_resume_a_consumer_resolve_discard_and_steer_a_replay_job(client, shop):
    token = sign_in(client, OPERATOR, OPERATOR_PASSWORD)
    act = {"csrf_token": token, "reason": "console test"}
    halted = _confirm(client, {**act, "op": "consumer", "consumer": "orders", "verb": "halt"})
    assert "consumer orders halted" in halted and 'class="halted"' in client.get("/overview/panel").text
    again = _confirm(
        client, {**act, "reason": "twice", "op": "consumer", "consumer": "orders", "verb": "halt"}
    )
    assert "consumer orders was already halted (console test)" in again
    assert "consumer orders resumed" in _confirm(
        client, {**act, "op": "consumer", "consumer": "orders", "verb": "resume"}
    )

    first, second = dead_letter_id(shop, "order-0"), dead_letter_id(shop, "order-1")
    options = {
        "rate": "1",
        "max_in_flight": "1",
        "batch_size": "1",
        "canary": "0",
        "abort_failure_ratio": "0.5",
    }
    started = _confirm(client, {**act, **options, "op": "replay", "ids": str(first), "mode": "in_place"})
    job = int(re.search(r"replay job (\d+) started", started).group(1))
    for verb, state in (("pause", "paused"), ("resume", "pending"), ("cancel", "cancelled")):
        page = _confirm(client, {**act, "op": "job", "job": str(job), "verb": verb})
        assert f"replay job {job}: {state}" in page
    audit = client.get(f"/jobs/{job}").text
    assert all(a in audit for a in ("replay_pause", "replay_resume", "replay_cancel")) and OPERATOR in audit

    assert "1 dead letter(s) resolved" in _confirm(client, {**act, "op": "resolve", "ids": str(first)})
    group = {"g_origin": "inbox", "g_queue": "orders", "g_reason": "permanent"}
    group |= {
        "g_type": "paid",
        "g_fingerprint": str(
            scalar(shop.url, "SELECT fingerprint FROM postbox.dead_letters WHERE id = %s", (second,))
        ),
    }
    assert "1 dead letter(s) discarded" in _confirm(
        client, {**act, **group, "op": "discard", "scope": "group"}
    )
    statuses = scalar(shop.url, "SELECT string_agg(status, ',' ORDER BY id) FROM postbox.dead_letters")
    assert statuses == "resolved,discarded" or statuses == "discarded,resolved"
    actors = scalar(shop.url, "SELECT string_agg(DISTINCT actor, ',') FROM postbox.audit_log")
    assert actors == OPERATOR


def test_the_command_refuses_to_serve_without_users(database, tmp_path):
    config = tmp_path / "postbox.toml"
    config.write_text("[postbox.console]\nviewers_see_payloads = false\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "postbox", "--config", str(config), "--database-url", database.url, "console"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "the console has no users" in done.stderr and "never runs without sign-in" in done.stderr


@pytest.mark.parametrize(
    "target", ["//evil.example/", "/\\evil.example/", "https://evil.example/", "/x\r\nSet-Cookie: a=b"]
)
def test_sign_in_never_sends_the_browser_to_another_site(client, shop, target):
    token = csrf_of(client.get("/login").text)
    r = client.post(
        "/login",
        data={"username": OPERATOR, "password": OPERATOR_PASSWORD, "csrf_token": token, "next": target},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == "/"
