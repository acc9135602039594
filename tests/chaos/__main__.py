"""``python -m tests.chaos`` (``make chaos``): every fault F1..F7 for ``CHAOS_ITERATIONS`` cycles
(default 20) under steady load, then a table of the figures; results go to
``bench-results/chaos-<time>.json``. ``CHAOS_FAULTS`` (e.g. ``F1,F4``; ``F5`` is F5 for RabbitMQ
and for Kafka, ``F5-kafka`` the latter only) picks faults;
``CHAOS_KEYS`` sets the keys per producer thread (default 40);
``CHAOS_KEEP_DB=1`` keeps each run's database for a post-mortem.

The database: a fresh one on ``POSTBOX_TEST_DATABASE_URL``'s server (never restarted), or on the
harness's private cluster when unset; F4 always uses the private cluster, the only one it restarts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postbox.schema import migrate
from tests.chaos.faults import ALL
from tests.chaos.harness import Result, run_fault
from tests.chaos.pgcluster import PrivateCluster
from tests.helpers import REPO

COLUMNS = [
    ("fault", "fault"),
    ("iterations", "iter"),
    ("produced", "produced"),
    ("ok", "ok"),
    ("failed", "failed"),
    ("unknown", "unknown"),
    ("done", "done"),
    ("dead_lettered", "dead"),
    ("lost", "lost"),
    ("duplicate_effects", "dup effects"),
    ("order_violations", "order viol."),
    ("events_delivered", "events"),
    ("events_missing", "ev. missing"),
    ("event_order_violations", "ev. order viol."),
    ("drain_seconds", "drain s"),
    ("misbehaviours", "misbehaved"),
    ("late_writes", "late writes"),
    ("wait_max_s", "wait max s"),
    ("wait_p99_s", "wait p99 s"),
    ("latency_p99_s", "latency p99 s"),
]


def _database(server_url: str, *, migrated: bool = True) -> str:
    """A new database on the server of ``server_url``, migrated unless not ``migrated``; its URL."""
    name = f"postbox_chaos_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    params["dbname"] = name
    user = params.get("user", "postgres")
    auth = f"{user}:{params['password']}@" if params.get("password") else f"{user}@"
    url = f"postgresql://{auth}{params.get('host', '127.0.0.1')}:{params.get('port', '5432')}/{name}"
    if migrated:
        migrate.upgrade(url)
    return url


def _drop(server_url: str, url: str) -> None:
    name = conninfo_to_dict(url)["dbname"]
    with psycopg.connect(server_url, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[str(r.get(k, "")) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(COLUMNS)]
    line = "| " + " | ".join(h.ljust(w) for (_, h), w in zip(COLUMNS, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join([line, sep, *body])


def main() -> int:
    # SIGTERM ends the run like Ctrl-C: the finally blocks stop the processes and drop what was made.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    iterations = int(os.environ.get("CHAOS_ITERATIONS", "20"))
    keys = int(os.environ.get("CHAOS_KEYS", "40"))  # per producer thread; fewer keys are hotter
    wanted = [f.strip() for f in os.environ.get("CHAOS_FAULTS", "").split(",") if f.strip()]
    faults = [f for f in ALL if not wanted or f.name.split()[0] in wanted or f.ident in wanted]
    shared = os.environ.get("POSTBOX_TEST_DATABASE_URL")
    cluster = PrivateCluster()
    results: list[Result] = []
    failures: list[str] = []
    try:
        for fault in faults:
            server = cluster.url() if fault.needs_cluster or not shared else make_conninfo(shared)
            url = _database(server, migrated=not fault.from_previous_release)
            print(f"{fault.name}: {fault.description} x {iterations} ...", flush=True)
            try:
                result = run_fault(fault, url, iterations=iterations, cluster=cluster, keys=keys)
                results.append(result)
                print(f"  {json.dumps(result.row())}", flush=True)
                if result.verdict.problems():
                    failures.append(f"{fault.name}: {result.verdict.problems()}")
            except AssertionError as error:
                failures.append(f"{fault.name}: {error}")
                print(f"  FAILED: {error}", flush=True)
            finally:
                if os.environ.get("CHAOS_KEEP_DB"):
                    print(f"  kept {url}", flush=True)
                else:
                    _drop(server, url)
    finally:
        cluster.destroy()
    rows = [r.row() for r in results]
    print()
    print(table(rows))
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    path = Path(out / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.write_text(json.dumps({"iterations": iterations, "results": rows, "failures": failures}, indent=2))
    print(f"\nwritten to {path.relative_to(REPO)}")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
