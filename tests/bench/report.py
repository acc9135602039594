"""The figures of a `make bench` run: the tables printed and written to bench-results/, and the page
of results in docs/ (rewritten by every full run and committed).

A run is plain data (:class:`Run`: each workload's figure per repetition, the run's parameters, the
machine), so the tables can be generated, and tested, without measuring anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS_PAGE = REPO / "docs" / "benchmarks-results.md"

# --- the workloads' names (shared by the runner and the checks below) -------------------------

SINGLE_INSERT = "pgbench single INSERT, -c 1"
RECEIVE_SINGLE = "receive, 1 message per transaction"
RECEIVE_SINGLE_KEYED = "receive with a key (500 keys), 1 message per transaction"
PGQUEUER_SINGLE = "pgqueuer enqueue, 1 job per call, autocommit"
PSYCOPG_INSERT = "psycopg single INSERT, autocommit"
PGBENCH_RECEIVE = "pgbench inbox_receive_v1 per transaction, -c 1"
TWO_ROWS = "pgbench ledger + inbox INSERTs with their checks (no function), -c 1"
TWO_ROWS_PLAIN = "pgbench ledger + inbox INSERTs, plain (no ON CONFLICT, no function), -c 1"
ONE_ROW = "pgbench one inbox row, no ledger (no function), -c 1"
RECEIVE_OWN_TX = "receive in the caller's BEGIN/COMMIT"
RECEIVE_MANY_KEYED = "receive_many, 500 per transaction"
RECEIVE_MANY = "receive_many, 500 per transaction, no keys"
PGQUEUER_BATCH = "pgqueuer enqueue, 500 per statement"
PUBLISH_MANY_KEYED = "publish_many (outbox), 500 per transaction"
PUBLISH_MANY = "publish_many (outbox), 500 per transaction, no keys"
PGQUEUER_BATCH_DEDUPE = "pgqueuer enqueue with dedupe keys (skip duplicates), 500 per statement"
TWO_ROWS_500 = "pgbench ledger + inbox rows with their checks, 500 per statement (no function)"
INSERT_UPDATE = "pgbench INSERT+UPDATE, -c 4 -j 2"
DRAIN = "ordered drain, 500 keys, 2 proc x 2 slots"
DRAIN_RSS = "worker peak RSS during drain"
DRAIN_BATCH_RSS = "worker peak RSS during drain with a batch handler"
DRAIN_EACH = "ordered drain, a savepoint per message (the handler not declared database_only), 500 keys, 2 proc x 2 slots"
DRAIN_SQL = "drain in SQL only (claim + effects + complete per 50), pgbench -c 4"
# What bounds a drain (tests/bench/__main__.py record_cpu): the CPU time a message takes, and the rate
# the machine's cores allow at that cost.
DRAIN_CPU = "ordered drain: CPU per message, the worker processes' and the server's"
DRAIN_SERVER_CPU = "ordered drain: the server's CPU per message"
DRAIN_CEILING = "ordered drain the cores allow: the machine's cores / its CPU per message (computed)"
DRAIN_CEILING_SERVER = (
    "ordered drain the cores would allow, were its worker to take no CPU: the machine's cores / the server's"
    " CPU per message (computed)"
)
DRAIN_SQL_CPU = "drain in SQL only: CPU per message, pgbench's and the server's"
DRAIN_SQL_CEILING = "drain in SQL only the cores allow: the machine's cores / its CPU per message (computed)"
DRAIN_BATCH_CPU = (
    "ordered drain with a batch handler: CPU per message, the worker processes' and the server's"
)
DRAIN_BATCH_SERVER_CPU = "ordered drain with a batch handler: the server's CPU per message"
DRAIN_BATCH_CEILING = (
    "ordered drain with a batch handler the cores allow: the machine's cores / its CPU per message (computed)"
)
DRAIN_BATCH_CEILING_SERVER = (
    "ordered drain with a batch handler the cores would allow, were its worker to take no CPU: the machine's"
    " cores / the server's CPU per message (computed)"
)
SUSTAINED_WORKER_BATCH = 25  # the sustained load's workers' batch (tests/bench/load.py)
DRAIN_SUSTAINED_BATCH = f"ordered drain, 500 keys, 2 proc x 2 slots, batch {SUSTAINED_WORKER_BATCH}"
DRAIN_BATCH = "ordered drain, batch handler (one statement per call), 500 keys, 2 proc x 2 slots"
DRAIN_SQL_BATCH = "ordered drain, SQL-function batch handler (one call per claim, messages as JSON), 500 keys, 2 proc x 2 slots"
ROUND_TRIPS = "pgbench empty round trips (SELECT 1), -c 4 -j 2"
RELAY_POSTGRES = "relay to postgres, 500 keys, in order, confirmed"
RELAY_RABBITMQ = "relay to rabbitmq, 500 keys, in order, confirmed"
RELAY_KAFKA = "relay to kafka, 500 keys, in order, confirmed"
TOPOLOGY_RATE = 100  # A's messages a second in the A→C latency workload
CLAIM_10K = "claim+complete, 10k ready"
CLAIM_1M = "claim+complete, 1M backlog (hot key 500k, 1k blocked)"
CLAIM_10M = "claim+complete, 10M backlog (100k keys, hot key 1M, 10k blocked)"
CLAIM_10K_BESIDE = "claim+complete, 10k ready, taking turns with the 10M backlog's"
BACKLOG_BUILD = "building the 10M backlog (INSERT ... SELECT, VACUUM ANALYZE)"
LEDGER_EMPTY = "receive, empty deduplication ledger, time per receive"
LEDGER_BIG = "receive, 50M-row deduplication ledger, time per receive"
LEDGER_FILL = "filling the 50M-row ledger (INSERT ... SELECT, VACUUM ANALYZE)"
SUSTAINED = "sustained load: highest rate with a bounded backlog and p99 < 100 ms"
SUSTAINED_P99 = "sustained load: receive→commit p99 at that rate"
SUSTAINED_RSS = "worker peak RSS under sustained load"
SUSTAINED_BATCH = "sustained load with a batch handler: highest rate with a bounded backlog and p99 < 100 ms"
SUSTAINED_BATCH_P99 = "sustained load with a batch handler: receive→commit p99 at that rate"
SUSTAINED_BATCH_RSS = "worker peak RSS under sustained load with a batch handler"
PRODUCERS_ALONE = (
    "sustained load's producers alone, as fast as they go (2 proc, receive_many of 10 per transaction)"
)
SUSTAINED_CEILING = (
    "sustained load's ceiling: producers and workers sharing the machine, 1 / (1/producers alone + 1/drain at"
    f" batch {SUSTAINED_WORKER_BATCH}) (computed)"
)
REPLAY = "replay send-back, blocked dead letters, batch 500"
LATENCY_LISTEN_P99 = "receive→handler at 200 msg/s, LISTEN/NOTIFY, p99"
PROCRASTINATE_ORDERED = "procrastinate drain, lock=<key>, 500 keys, 2 proc x 2"
PROCRASTINATE = "procrastinate drain, unordered, 2 proc x 2"
PGQUEUER = "pgqueuer drain, unordered, 2 proc x 2"
PGQUEUER_LATENCY_P99 = "pgqueuer enqueue→handler at 200 msg/s, LISTEN/NOTIFY, p99"
# Counted, not timed (tests/bench/instructions.py): the server's instructions per message.
COUNT_RECEIVE_SINGLE = "server instructions per message: receive, 1 message per transaction"
COUNT_RECEIVE_SINGLE_KEYED = (
    "server instructions per message: receive with a key (500 keys), 1 per transaction"
)
COUNT_PGQUEUER_SINGLE = "server instructions per message: pgqueuer enqueue, 1 job per statement"
COUNT_TWO_ROWS = (
    "server instructions per message: ledger + inbox INSERTs with their checks (no function), 1 per statement"
)
COUNT_RECEIVE_MANY_KEYED = "server instructions per message: receive_many, 500 per transaction"
COUNT_RECEIVE_MANY = "server instructions per message: receive_many, 500 per transaction, no keys"
COUNT_PGQUEUER_BATCH = "server instructions per message: pgqueuer enqueue, 500 per statement"
COUNTED = (
    COUNT_TWO_ROWS,
    COUNT_RECEIVE_SINGLE,
    COUNT_RECEIVE_SINGLE_KEYED,
    COUNT_PGQUEUER_SINGLE,
    COUNT_RECEIVE_MANY_KEYED,
    COUNT_RECEIVE_MANY,
    COUNT_PGQUEUER_BATCH,
)


def relay_name(kind: str) -> str:
    return f"relay to {kind}, 500 keys, in order, confirmed"


def relay_rss_name(kind: str) -> str:
    return f"relay peak RSS ({kind})"


def topology_latency_name(quantile: str) -> str:
    return f"A→C through Kafka (3 databases, 2 hops) at {TOPOLOGY_RATE} msg/s, {quantile}"


def latency_name(label: str, quantile: str, peer: bool = False) -> str:
    what = "pgqueuer enqueue→handler" if peer else "receive→handler"
    return f"{what} at 200 msg/s, {label}, {quantile}"


# --- the data of a run ------------------------------------------------------------------------


@dataclass
class Result:
    """One workload's figure, once per repetition (in the order they ran)."""

    name: str
    unit: str
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")

    def span(self) -> str:
        return f"{_number(min(self.runs))}..{_number(max(self.runs))}" if len(self.runs) > 1 else ""


@dataclass(frozen=True)
class Check:
    """A figure compared with a target: ``numerator / denominator`` (both measured in the same run)
    or, without a denominator, the numerator's own median. ``target`` is ``(">=", 0.75)`` or
    ``("<=", 1.5)``; a check without one is shown for explanation."""

    label: str
    numerator: str
    denominator: str | None = None
    target: tuple[str, float] | None = None
    detail: bool = False  # explains the check above it (marked ↳ in the table)

    def value(self, results: Mapping[str, Result]) -> float:
        top = results[self.numerator].median
        return top / results[self.denominator].median if self.denominator else top

    def per_repetition(self, results: Mapping[str, Result]) -> list[float]:
        """The ratio in each repetition (the numerator's and denominator's figures of that repetition);
        empty when the two were not measured the same number of times, or for an absolute figure."""
        if self.denominator is None:
            return []
        top, bottom = results[self.numerator].runs, results[self.denominator].runs
        if len(top) != len(bottom) or len(top) < 2:
            return []
        return [a / b for a, b in zip(top, bottom, strict=True)]

    def met(self, value: float) -> bool | None:
        if self.target is None:
            return None
        op, bound = self.target
        return value >= bound if op == ">=" else value <= bound


CHECKS: tuple[Check, ...] = (
    Check("ordered drain / pgbench INSERT+UPDATE", DRAIN, INSERT_UPDATE, (">=", 0.75)),
    Check(
        "drain in SQL only / pgbench INSERT+UPDATE (what the SQL allows)",
        DRAIN_SQL,
        INSERT_UPDATE,
        detail=True,
    ),
    Check(
        "ordered drain / drain in SQL only (the same work without a client)", DRAIN, DRAIN_SQL, (">=", 0.8)
    ),
    Check(
        "ordered drain / what the cores allow it (1: it keeps every core busy)",
        DRAIN,
        DRAIN_CEILING,
        detail=True,
    ),
    Check(
        "what the cores would allow the ordered drain, were its worker to take no CPU / drain in SQL only (the"
        " most the ratio above could be)",
        DRAIN_CEILING_SERVER,
        DRAIN_SQL,
        detail=True,
    ),
    Check(
        "drain in SQL only / what the cores allow it (under 1: it waits on more than the CPU)",
        DRAIN_SQL,
        DRAIN_SQL_CEILING,
        detail=True,
    ),
    Check(
        "ordered drain / the same handler not declared database_only (a savepoint per message)",
        DRAIN,
        DRAIN_EACH,
        detail=True,
    ),
    Check(
        "ordered drain with a batch handler / drain in SQL only (both one statement per batch)",
        DRAIN_BATCH,
        DRAIN_SQL,
        (">=", 0.8),
    ),
    Check(
        "ordered drain with a batch handler / what the cores allow it",
        DRAIN_BATCH,
        DRAIN_BATCH_CEILING,
        detail=True,
    ),
    Check(
        "what the cores would allow the batch-handler drain, were its worker to take no CPU / drain in SQL only"
        " (the most the ratio above could be)",
        DRAIN_BATCH_CEILING_SERVER,
        DRAIN_SQL,
        detail=True,
    ),
    Check(
        "ordered drain with a batch handler / with a handler per message",
        DRAIN_BATCH,
        DRAIN,
        detail=True,
    ),
    Check(
        "ordered drain with a SQL-function batch handler / drain in SQL only",
        DRAIN_SQL_BATCH,
        DRAIN_SQL,
        detail=True,
    ),
    Check(
        "ordered drain / pgbench empty round trips, -c 4 (a message takes one, its handler's statement; its"
        " neighbours share a savepoint)",
        DRAIN,
        ROUND_TRIPS,
        detail=True,
    ),
    Check("ordered drain / procrastinate ordered drain", DRAIN, PROCRASTINATE_ORDERED, (">=", 2.0)),
    Check("ordered drain / pgqueuer unordered drain", DRAIN, PGQUEUER, (">=", 1.5)),
    Check("receive_many, no keys / pgqueuer batch enqueue", RECEIVE_MANY, PGQUEUER_BATCH, (">=", 1.0)),
    Check(
        "pgqueuer's server instructions per message / receive_many's, no keys (counted: a busy machine"
        " does not move it)",
        COUNT_PGQUEUER_BATCH,
        COUNT_RECEIVE_MANY,
        detail=True,
    ),
    Check(
        "receive_many, no keys / pgqueuer batch enqueue with dedupe keys",
        RECEIVE_MANY,
        PGQUEUER_BATCH_DEDUPE,
        detail=True,
    ),
    Check(
        "receive_many over 500 keys / pgqueuer batch enqueue", RECEIVE_MANY_KEYED, PGQUEUER_BATCH, (">=", 1.0)
    ),
    Check(
        "pgqueuer's server instructions per message / receive_many's over 500 keys (counted)",
        COUNT_PGQUEUER_BATCH,
        COUNT_RECEIVE_MANY_KEYED,
        detail=True,
    ),
    Check(
        "pgbench ledger + inbox rows, 500 per statement / pgqueuer batch enqueue (storage floor)",
        TWO_ROWS_500,
        PGQUEUER_BATCH,
        detail=True,
    ),
    Check("publish_many over 500 keys / receive_many over 500 keys", PUBLISH_MANY_KEYED, RECEIVE_MANY_KEYED),
    Check("publish_many, no keys / receive_many, no keys", PUBLISH_MANY, RECEIVE_MANY, detail=True),
    Check("publish_many, no keys / pgqueuer batch enqueue", PUBLISH_MANY, PGQUEUER_BATCH, detail=True),
    Check(
        "p99 receive→handler / pgqueuer p99 (LISTEN/NOTIFY)",
        LATENCY_LISTEN_P99,
        PGQUEUER_LATENCY_P99,
        ("<=", 1.0),
    ),
    Check("claim cost with the 1M backlog / with 10k", CLAIM_1M, CLAIM_10K, ("<=", 1.5)),
    Check(
        "claim cost with the 10M backlog / with 10k (taking turns with it)",
        CLAIM_10M,
        CLAIM_10K_BESIDE,
        ("<=", 1.5),
    ),
    Check(
        "receive with the 50M-row ledger / with an empty ledger (time per receive)",
        LEDGER_BIG,
        LEDGER_EMPTY,
        ("<=", 1.2),
    ),
    Check("sustained rate (bounded backlog, p99 < 100 ms) / ordered drain", SUSTAINED, DRAIN, (">=", 0.8)),
    Check(
        f"sustained rate / ordered drain at batch {SUSTAINED_WORKER_BATCH} (the batch its workers use)",
        SUSTAINED,
        DRAIN_SUSTAINED_BATCH,
        detail=True,
    ),
    Check(
        f"ordered drain at batch {SUSTAINED_WORKER_BATCH} / at batch 50 (a batch's own cost: claim, complete, commit)",
        DRAIN_SUSTAINED_BATCH,
        DRAIN,
        detail=True,
    ),
    Check(
        f"sustained load's ceiling (producers alone and drain at batch {SUSTAINED_WORKER_BATCH} sharing the machine) / ordered drain",
        SUSTAINED_CEILING,
        DRAIN,
        detail=True,
    ),
    Check("sustained rate / that ceiling", SUSTAINED, SUSTAINED_CEILING, detail=True),
    Check("worker peak RSS under sustained load, MB", SUSTAINED_RSS, target=("<=", 100)),
    Check(
        "sustained rate with a batch handler / ordered drain with a batch handler",
        SUSTAINED_BATCH,
        DRAIN_BATCH,
        (">=", 0.8),
    ),
    Check(
        "sustained rate with a batch handler / ordered drain with a handler per message",
        SUSTAINED_BATCH,
        DRAIN,
        detail=True,
    ),
    Check(
        "worker peak RSS under sustained load with a batch handler, MB",
        SUSTAINED_BATCH_RSS,
        target=("<=", 100),
    ),
    Check("relay to PostgreSQL, rows/s", RELAY_POSTGRES, target=(">=", 5000)),
    Check("relay to RabbitMQ, rows/s", RELAY_RABBITMQ, target=(">=", 3000)),
    Check("relay to Kafka / relay to RabbitMQ", RELAY_KAFKA, RELAY_RABBITMQ, (">=", 1.0)),
    Check("worker peak RSS, MB", DRAIN_RSS, target=("<=", 150)),
    Check("worker peak RSS with a batch handler, MB", DRAIN_BATCH_RSS, target=("<=", 150)),
    Check("single receive / pgqueuer single enqueue", RECEIVE_SINGLE, PGQUEUER_SINGLE, (">=", 1.0)),
    Check(
        "pgqueuer's server instructions per message / single receive's (counted)",
        COUNT_PGQUEUER_SINGLE,
        COUNT_RECEIVE_SINGLE,
        detail=True,
    ),
    Check(
        "the two rows' server instructions alone (no function) / single receive's (counted: what the"
        " receive function adds)",
        COUNT_TWO_ROWS,
        COUNT_RECEIVE_SINGLE,
        detail=True,
    ),
    Check(
        "single receive with a key / pgqueuer single enqueue",
        RECEIVE_SINGLE_KEYED,
        PGQUEUER_SINGLE,
        (">=", 1.0),
    ),
    Check(
        "pgqueuer's server instructions per message / single receive's with a key (counted)",
        COUNT_PGQUEUER_SINGLE,
        COUNT_RECEIVE_SINGLE_KEYED,
        detail=True,
    ),
    Check("single receive / pgbench single INSERT", RECEIVE_SINGLE, SINGLE_INSERT, detail=True),
    Check(
        "single receive / psycopg single INSERT (same Python client)",
        RECEIVE_SINGLE,
        PSYCOPG_INSERT,
        detail=True,
    ),
    Check(
        "pgbench calling inbox_receive_v1 / pgbench single INSERT (no client)",
        PGBENCH_RECEIVE,
        SINGLE_INSERT,
        detail=True,
    ),
    Check(
        "pgbench ledger + inbox rows / pgbench single INSERT (storage floor)",
        TWO_ROWS,
        SINGLE_INSERT,
        detail=True,
    ),
    Check(
        "the same rows as plain INSERTs / pgbench single INSERT", TWO_ROWS_PLAIN, SINGLE_INSERT, detail=True
    ),
    Check(
        "pgbench one inbox row, no ledger / pgbench single INSERT (single-table floor)",
        ONE_ROW,
        SINGLE_INSERT,
        detail=True,
    ),
)


@dataclass
class Run:
    """What a run measured and how: the figures, when, on what, with which parameters."""

    results: dict[str, Result]
    measured_at: datetime  # when the run started (UTC)
    machine: str  # one line: cores, memory, PostgreSQL, Python
    repetitions: int
    quick: bool = False
    seconds: float | None = None  # how long the run took
    sizes: dict[str, int] = field(default_factory=dict)
    note: str = ""  # anything the figures' reader must know (shown under the header)
    extra: dict[str, Any] = field(default_factory=dict)
    # A check's ratio in each repetition, by label, where the figures' runs are not in repetition
    # order (figures transcribed from a published table); otherwise computed from the runs.
    per_repetition: dict[str, list[float]] | None = None

    def checks(self) -> list[tuple[Check, float, list[float]]]:
        """The checks whose figures this run has: (check, value, value per repetition)."""
        if self.per_repetition is not None:
            known = self.per_repetition
            return [(c, v, known.get(c.label, [])) for c, v, _ in self._checks()]
        return self._checks()

    def _checks(self) -> list[tuple[Check, float, list[float]]]:
        have = [
            c
            for c in CHECKS
            if c.numerator in self.results and (c.denominator or c.numerator) in self.results
        ]
        return [(c, c.value(self.results), c.per_repetition(self.results)) for c in have]


def machine_summary(server_version: str, synchronous_commit: str, autovacuum: str = "?") -> str:
    """This machine in one line: cores, CPU model, memory, the PostgreSQL server, Python."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = f" ({line.split(':', 1)[1].strip()})"
                break
        kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
        memory = f", {kib / 1024 / 1024:.1f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        memory = ""
    return (
        f"{os.cpu_count()} cores{model}{memory}; {platform.system()} {platform.release()}; "
        f"PostgreSQL {server_version}, synchronous_commit {synchronous_commit}, autovacuum {autovacuum}; "
        f"Python {platform.python_version()}"
    )


# --- rendering --------------------------------------------------------------------------------


def _number(value: float) -> str:
    """Figures as people read them: thousands separated, a decimal only where it carries meaning."""
    if value != value:  # NaN
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    return f"{value:,.2f}"


def _parameters(run: Run) -> str:
    kind = "quick" if run.quick else "full"
    took = f", {run.seconds:,.0f} s" if run.seconds is not None else ""
    sizes = ", ".join(f"{k} {v:,}" for k, v in run.sizes.items())
    return f"{kind} run, {run.repetitions} interleaved repetition(s){took}" + (
        f"; sizes: {sizes}" if sizes else ""
    )


def figures_table(run: Run) -> list[str]:
    lines = ["| workload | median | min..max | unit |", "|---|---:|---:|---|"]
    lines += [f"| {r.name} | {_number(r.median)} | {r.span()} | {r.unit} |" for r in run.results.values()]
    return lines


def checks_table(run: Run) -> list[str]:
    lines = ["| check, same run | value | per repetition | target | met |", "|---|---:|---:|---:|---|"]
    for check, value, each in run.checks():
        label = f"↳ {check.label}" if check.detail else check.label
        target = f"{'≥' if check.target[0] == '>=' else '≤'} {check.target[1]:,g}" if check.target else ""
        met = {True: "yes", False: "**no**", None: ""}[check.met(value)]
        per = ", ".join(_number(x) for x in each)
        lines.append(f"| {label} | {_number(value)} | {per} | {target} | {met} |")
    return lines


# Whether the machine was quiet: the hypervisor's share of CPU time (steal) over the run, and how
# far pgbench's own references (the same fixed work every repetition) moved between repetitions.
# On a quiet machine (the run of 2026-12-03 16:44) they moved by 3 % and 6 %; on one shared with a
# busy host (the same day, 19:14) by 48 % and 83 %.
STEAL_LIMIT = 0.05
SPREAD_LIMIT = 1.25
STEADY_REFERENCES = (SINGLE_INSERT, INSERT_UPDATE)


def machine_noise(results: Mapping[str, Result], steal_share: float | None) -> str:
    """What made the machine noisy during the run, in one sentence; empty if it was quiet."""
    found = []
    if steal_share is not None and steal_share > STEAL_LIMIT:
        found.append(f"the hypervisor took {steal_share:.0%} of its CPU time (steal)")
    for name in STEADY_REFERENCES:
        r = results.get(name)
        if r is None or len(r.runs) < 2 or min(r.runs) <= 0:
            continue
        spread = max(r.runs) / min(r.runs)
        if spread > SPREAD_LIMIT:
            found.append(f"{name} ranged over {r.span()} {r.unit} ({spread:.2f}x) between repetitions")
    if not found:
        return ""
    counted = any(name in results for name in COUNTED)
    return (
        "**The machine was not quiet during this run**: "
        + "; ".join(found)
        + ". Its ratios are noisy: compare them with a run on a quiet machine before reading anything into them."
        + (" The counted rows (server instructions per message) are not timed: they hold." if counted else "")
    )


def run_markdown(run: Run) -> str:
    """The table printed at the end of a run and written to bench-results/bench-<time>.md."""
    lines = [
        f"# Postbox benchmark ({'quick' if run.quick else 'full'}), {run.measured_at:%Y-%m-%d %H:%M} UTC",
        "",
        f"{run.machine}. {_parameters(run)}. Medians with min..max.",
        *(["", run.note] if run.note else []),
        "",
        *figures_table(run),
        "",
        *checks_table(run),
        *failures_section(run),
    ]
    return "\n".join(lines) + "\n"


def failures_section(run: Run) -> list[str]:
    """The workloads that broke an invariant in some repetition (their figures are left out)."""
    failures = run.extra.get("failures") or []
    if not failures:
        return []
    return ["", "## Failures", "", *(f"- {f}" for f in failures)]


RESULTS_HEADER = (
    "<!-- Generated by `make bench` (tests/bench/report.py): do not edit; a full run rewrites it. -->"
)


def results_page(run: Run) -> str:
    """docs/benchmarks-results.md: the figures of the last full run, with when, where and how."""
    lines = [
        RESULTS_HEADER,
        "",
        "# Benchmark results",
        "",
        f"Generated by `make bench`. Measured {run.measured_at:%Y-%m-%d %H:%M} UTC on: {run.machine}.",
        f"Parameters: {_parameters(run)}.",
        "What each workload does, and why these references: [benchmarks.md](benchmarks.md).",
    ]
    if run.note:
        lines += ["", run.note]
    lines += [
        "",
        "## Figures",
        "",
        "Medians of the repetitions, with their range.",
        "",
        *figures_table(run),
        "",
        "## Checks",
        "",
        "Each ratio divides two figures of this run; a target applies to the median's ratio.",
        "",
        *checks_table(run),
        *failures_section(run),
    ]
    return "\n".join(lines) + "\n"


def run_json(run: Run) -> str:
    return json.dumps(
        {
            "quick": run.quick,
            "measured_at": run.measured_at.isoformat(),
            "machine": run.machine,
            "repetitions": run.repetitions,
            "seconds": run.seconds,
            "sizes": run.sizes,
            "results": {
                k: {"unit": v.unit, "runs": v.runs, "median": v.median} for k, v in run.results.items()
            },
            "checks": {c.label: {"value": v, "per_repetition": each} for c, v, each in run.checks()},
            "extra": run.extra,
        },
        indent=2,
    )


def write(run: Run, results_dir: Path, page: Path | None) -> list[Path]:
    """Write the run to ``results_dir`` (markdown and JSON, named by its time) and, if ``page`` is
    given, the results page; returns the files written."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = run.measured_at.strftime("%Y%m%dT%H%M%S")
    written = [results_dir / f"bench-{stamp}.md", results_dir / f"bench-{stamp}.json"]
    written[0].write_text(run_markdown(run), encoding="utf-8")
    written[1].write_text(run_json(run), encoding="utf-8")
    if page is not None:
        page.write_text(results_page(run), encoding="utf-8")
        written.append(page)
    return written
