"""`make bench`: Postbox's hot paths against PostgreSQL's own ceiling, measured in one run.

The machine is small and shared, so every figure is reported next to a reference measured in the
same run (pgbench doing the same minimum work), as a ratio; repetitions are interleaved and the
median is reported with its min-max. Results go to bench-results/ as JSON and a markdown table; a
full run also rewrites docs/benchmarks-results.md (the committed figures).

    python -m tests.bench [--quick] [--repeat N] [--database-url URL] [--results-page PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from tests.bench import backlog, instructions, load, report
from tests.bench import scripts as sql
from tests.bench.harness import cpu_times, steal_share
from tests.bench.report import RESULTS_PAGE, Run, machine_summary
from tests.bench.workloads import Bench, Drained, interleaved, paced, quantiles

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench-results"

FULL_SIZES = {
    "single": 5000,
    "batch": 50000,
    "drain": 20000,
    "drain_sql": 400000,
    "pg_seconds": 10,
    "relay": 20000,
    "claim_samples": 500,
    "replay": 5000,
    "lat_seconds": 20,
    "peer_cap": 6,
    "bound_seconds": 5,
    "backlog_rows": 10_000_000,
    "ledger_rows": 50_000_000,
    "ledger_receives": 3000,
    "load_seconds": 60,
    "count_batches": 8,
    "count_batches_warm": 50,  # as deep as the middle of the timed batches (100 of 500 per repetition)
    "count_singles": 1000,
}
LATENCY_RATE = 200.0  # messages a second, in the latency workloads

QUICK_SIZES = {
    "single": 300,
    "batch": 5000,
    "drain": 4000,
    "drain_sql": 100000,
    "pg_seconds": 3,
    "relay": 4000,
    "claim_samples": 100,
    "replay": 1000,
    "lat_seconds": 3,
    "peer_cap": 5,
    "bound_seconds": 3,
    "backlog_rows": 200_000,
    "ledger_rows": 500_000,
    "ledger_receives": 1200,
    "load_seconds": 5,
    "count_batches": 2,
    "count_batches_warm": 5,
    "count_singles": 200,
}


def receive_workloads(b: Bench, sizes: dict[str, int], with_peers: bool) -> None:
    """Receive, single and batch, next to what bounds it (pgbench) and to pgqueuer's enqueue."""
    bound = sizes["bound_seconds"]
    b.record(report.SINGLE_INSERT, "tx/s", b.pgbench(sql.PGBENCH_SINGLE_INSERT, 1, 1, sizes["pg_seconds"]))
    compare_receives(b, sizes["single"], 1, with_peers)
    b.record(report.PSYCOPG_INSERT, "tx/s", b.insert_single(sizes["single"]))
    b.record(report.PGBENCH_RECEIVE, "tx/s", b.pgbench(sql.PGBENCH_RECEIVE, 1, 1, bound))
    b.record(report.TWO_ROWS, "tx/s", b.pgbench(sql.PGBENCH_TWO_INSERTS, 1, 1, bound))
    b.record(report.TWO_ROWS_PLAIN, "tx/s", b.pgbench(sql.PGBENCH_TWO_PLAIN_INSERTS, 1, 1, bound))
    b.record(report.ONE_ROW, "tx/s", b.pgbench(sql.PGBENCH_INBOX_ROW, 1, 1, bound))
    b.record(report.RECEIVE_OWN_TX, "msg/s", b.receive_in_transaction(sizes["single"]))
    compare_receives(b, sizes["batch"], 500, with_peers)
    b.record(report.TWO_ROWS_500, "msg/s", 500 * b.pgbench(sql.PGBENCH_TWO_INSERTS_500, 1, 1, bound))


def compare_receives(b: Bench, n: int, batch: int, with_peers: bool) -> None:
    """Receive with and without keys, one message per transaction (``batch`` 1) or ``batch`` per
    transaction, and pgqueuer's enqueue of as many (with and without dedupe keys for a batch):
    interleaved, ten chunks of each taking turns, so that the ratios compare the same minutes of
    a machine whose speed drifts. Recorded in the results page's order."""
    if batch == 1:
        ours = [(report.RECEIVE_SINGLE, False), (report.RECEIVE_SINGLE_KEYED, True)]
        theirs = [(report.PGQUEUER_SINGLE, False)]
    else:
        ours = [(report.RECEIVE_MANY_KEYED, True), (report.RECEIVE_MANY, False)]
        theirs = [(report.PGQUEUER_BATCH, False), (report.PGQUEUER_BATCH_DEDUPE, True)]
    with ExitStack() as stack:
        sides = {name: stack.enter_context(b.receive_sides(keyed, batch)) for name, keyed in ours}
        if with_peers:
            from tests.bench import peers

            for name, dedupe in theirs:
                sides[name] = stack.enter_context(
                    peers.pgqueuer_side(b.peer("pgqueuer"), batch, dedupe=dedupe)
                )
        if batch > 1:  # the outbox's batch beside them, with and without keys
            for name, keyed in ((report.PUBLISH_MANY_KEYED, True), (report.PUBLISH_MANY, False)):
                sides[name] = stack.enter_context(b.publish_side(keyed, batch))
        rates = interleaved(sides, n, max(batch, n // 10 // batch * batch))
    for name, rate in rates.items():
        b.record(name, "msg/s", rate)


def processing_workloads(b: Bench, sizes: dict[str, int], first: bool, with_peers: bool) -> None:
    """The drain (next to pgbench's INSERT+UPDATE and to the same work in SQL only), the relay (to
    PostgreSQL, RabbitMQ and Kafka), the claim's cost under a backlog, replay, latency, and the
    A→C latency of three databases linked through Kafka."""
    b.record(report.INSERT_UPDATE, "tx/s", b.pgbench(sql.PGBENCH_INSERT_UPDATE, 4, 2, sizes["pg_seconds"]))
    drained = b.drain(sizes["drain"], 500, processes=2, concurrency=2, batch=50)
    record_drain(b, drained, report.DRAIN, report.DRAIN_RSS, report.DRAIN_CPU, report.DRAIN_CEILING)
    record_cpu(b, drained, report.DRAIN_SERVER_CPU, report.DRAIN_CEILING_SERVER, server=True)
    drained = b.drain_sql(sizes["drain_sql"], 500, 50, sizes["bound_seconds"])
    b.record(report.DRAIN_SQL, "msg/s", drained.rate)
    record_cpu(b, drained, report.DRAIN_SQL_CPU, report.DRAIN_SQL_CEILING)
    # The same handler without its database_only declaration: a savepoint (a round trip) per message.
    b.record(report.DRAIN_EACH, "msg/s", b.drain(sizes["drain"], 500, 2, 2, 50, app="each_registry").rate)
    # The same drain with a batch handler (one INSERT per call, as the SQL-only drain), twice the
    # messages: it takes under half the time.
    drained = b.drain(2 * sizes["drain"], 500, processes=2, concurrency=2, batch=50, app="batch_registry")
    record_drain(
        b,
        drained,
        report.DRAIN_BATCH,
        report.DRAIN_BATCH_RSS,
        report.DRAIN_BATCH_CPU,
        report.DRAIN_BATCH_CEILING,
    )
    record_cpu(b, drained, report.DRAIN_BATCH_SERVER_CPU, report.DRAIN_BATCH_CEILING_SERVER, server=True)
    # The same with the configuration's SQL-function batch handler (no Python handler).
    b.record(
        report.DRAIN_SQL_BATCH, "msg/s", b.drain(2 * sizes["drain"], 500, 2, 2, 50, app="sql_batch").rate
    )
    # What bounds it: the same drain in the sustained load's batches, and the round trips the machine
    # makes with nothing to do (a message costs one, its handler's statement; two without database_only).
    batch = report.SUSTAINED_WORKER_BATCH
    b.record(report.DRAIN_SUSTAINED_BATCH, "msg/s", b.drain(sizes["drain"], 500, 2, 2, batch=batch).rate)
    b.record(report.ROUND_TRIPS, "tx/s", b.pgbench(sql.PGBENCH_ROUND_TRIP, 4, 2, sizes["bound_seconds"]))
    for kind in ("postgres", "rabbitmq", "kafka"):
        try:
            rate, rss = b.relay(sizes["relay"], 500, kind)
        except AssertionError as error:  # rows lost or out of order at the broker: said, not fatal
            b.failed(report.relay_name(kind), error)
            continue
        b.record(report.relay_name(kind), "rows/s", rate)
        b.record(report.relay_rss_name(kind), "MB", rss)
    b.record(report.CLAIM_10K, "ms", b.claim_cost("10k", sizes["claim_samples"]))
    b.record(report.REPLAY, "msg/s", b.replay(sizes["replay"]))
    if first:  # building the 1M backlog is the longest setup: once per run
        b.record(report.CLAIM_1M, "ms", b.claim_cost("1M", sizes["claim_samples"]))
        once_per_run(b, sizes)
    latency_workloads(b, sizes, with_peers)
    lat = b.topology_latency(report.TOPOLOGY_RATE, sizes["lat_seconds"])
    for q in ("p50", "p99", "max"):
        b.record(report.topology_latency_name(q), "ms", lat[q])


def record_drain(b: Bench, drained: Drained, rate: str, rss: str, cpu: str, ceiling: str) -> None:
    """A drain by worker processes: its rate, their peak RSS, and its CPU per message (below)."""
    b.record(rate, "msg/s", drained.rate)
    b.record(rss, "MB", drained.rss)
    record_cpu(b, drained, cpu, ceiling)


def record_cpu(b: Bench, drained: Drained, cpu: str, ceiling: str, *, server: bool = False) -> None:
    """What bounds a drain: its CPU per message, client and server (or the server's alone, if
    ``server``: the worker's cost left out), as ``cpu``, and as ``ceiling`` the rate the machine's
    cores allow at that cost. Nothing when the server is on another machine (its CPU is not seen)."""
    if drained.cpu is None or drained.server_cpu is None:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_message = drained.server_cpu if server else drained.cpu
    b.record(cpu, "µs/msg", per_message)
    b.record(ceiling, "msg/s", cores * 1e6 / per_message)


def latency_workloads(b: Bench, sizes: dict[str, int], with_peers: bool) -> None:
    """Receive-to-handler-start latency at 200 messages/s: polling every 10 ms; then woken by
    LISTEN/NOTIFY, taking turns with pgqueuer's enqueue-to-handler (a second each, on one schedule)."""
    n, chunk = int(LATENCY_RATE * sizes["lat_seconds"]), int(LATENCY_RATE)
    figures: dict[tuple[str, bool], dict[str, float]] = {}
    with b.latency_side(listen=False) as polling:
        paced({"polling": polling.send}, LATENCY_RATE, n, chunk)
        figures["polling 10 ms", False] = quantiles(polling.latencies(n))
    with ExitStack() as stack:
        sides = {("LISTEN/NOTIFY", False): stack.enter_context(b.latency_side(listen=True))}
        if with_peers:
            from tests.bench import peers

            sides["LISTEN/NOTIFY", True] = stack.enter_context(
                peers.pgqueuer_latency_side(b.peer("pgqueuer"))
            )
        paced({side: s.send for side, s in sides.items()}, LATENCY_RATE, n, chunk)
        figures |= {side: quantiles(s.latencies(n)) for side, s in sides.items()}
    for (label, peer), values in figures.items():
        for q, value in values.items():
            b.record(report.latency_name(label, q, peer=peer), "ms", value)


def once_per_run(b: Bench, sizes: dict[str, int]) -> None:
    """The longest ones, in the first repetition only: the claim's cost with the 10M backlog, a
    receive's with a 50M-row ledger (each in a database dropped at once), and the sustained load
    (its ladder of rates made of the ordered drain's figure just measured), with a handler per
    message and with a batch handler."""
    cost, beside, took = backlog.big_backlog_claim(b, sizes["backlog_rows"], sizes["claim_samples"])
    b.record(report.CLAIM_10M, "ms", cost)
    b.record(report.CLAIM_10K_BESIDE, "ms", beside)
    b.record(report.BACKLOG_BUILD, "s", took)
    empty, big, took = backlog.ledger_receive(b, sizes["ledger_rows"], sizes["ledger_receives"])
    b.record(report.LEDGER_EMPTY, "ms", empty)
    b.record(report.LEDGER_BIG, "ms", big)
    b.record(report.LEDGER_FILL, "s", took)
    drain = b.results[report.DRAIN].runs[-1]
    # What bounds the ladder: its producers alone, and with the drain alone at the workers' batch,
    # what the two can do sharing the machine's cores.
    alone = load.producers_alone(b, sizes["drain"])
    b.record(report.PRODUCERS_ALONE, "msg/s", alone)
    drain_batch = b.results[report.DRAIN_SUSTAINED_BATCH].runs[-1]
    b.record(report.SUSTAINED_CEILING, "msg/s", 1 / (1 / alone + 1 / drain_batch))
    names = (report.SUSTAINED, report.SUSTAINED_P99, report.SUSTAINED_RSS)
    sustained(b, drain, sizes["load_seconds"], "registry", names)
    # The same ladder (the same rates) with a batch handler.
    names = (report.SUSTAINED_BATCH, report.SUSTAINED_BATCH_P99, report.SUSTAINED_BATCH_RSS)
    sustained(b, drain, sizes["load_seconds"], "batch_registry", names)


def counted_workloads(b: Bench, sizes: dict[str, int], with_peers: bool) -> None:
    """The receive workloads' server instructions per message, counted by callgrind in a throwaway
    cluster of this machine's PostgreSQL (tests/bench/instructions.py), with pgqueuer's enqueue:
    once per run, since a count does not vary."""
    why = instructions.unavailable()
    if why:
        print(f"server instructions not counted: {why}")
        return
    # (size, warm, more): the batches are counted behind as many queued messages as the timed ones
    # meet halfway through, so that a cost growing with the queue shows here too.
    single = (1, 200, sizes["count_singles"])
    batch = (500, sizes["count_batches_warm"], sizes["count_batches"])
    W, i = instructions.Workload, instructions
    workloads = [
        W(report.COUNT_TWO_ROWS, "postbox", i.two_rows_singles, *single),
        W(report.COUNT_RECEIVE_SINGLE, "postbox", partial(i.postbox_singles, keyed=False), *single),
        W(report.COUNT_RECEIVE_SINGLE_KEYED, "postbox", partial(i.postbox_singles, keyed=True), *single),
        W(report.COUNT_RECEIVE_MANY_KEYED, "postbox", partial(i.postbox_batches, keyed=True), *batch),
        W(report.COUNT_RECEIVE_MANY, "postbox", partial(i.postbox_batches, keyed=False), *batch),
    ]
    if with_peers:
        workloads += [
            W(report.COUNT_PGQUEUER_SINGLE, "pgqueuer", i.pgqueuer_singles, *single),
            W(report.COUNT_PGQUEUER_BATCH, "pgqueuer", i.pgqueuer_batches, *batch),
        ]
    with instructions.cluster() as c:
        instructions.prepare(c, with_peers)
        for w in workloads:
            b.record(w.name, "instructions", instructions.per_message(c, w))


def sustained(b: Bench, drain: float, seconds: int, app: str, names: tuple[str, str, str]) -> None:
    """The sustained-load ladder with the handlers ``app``: its best rate, that rate's p99 and the
    workers' peak RSS, recorded under ``names``."""
    best, rss, _ = load.sustained(b, drain, seconds, app=app)
    rate, p99, peak = names
    if best is not None:
        b.record(rate, "msg/s", best.achieved)
        b.record(p99, "ms", best.p99)
    else:
        print(f"  ! {app}: no rate of the sustained-load ladder kept its backlog bounded with p99 < 100 ms")
        b.record(rate, "msg/s", 0.0)
    b.record(peak, "MB", rss)


def peer_workloads(b: Bench, sizes: dict[str, int]) -> None:
    """The peers on the same workloads: drains are time-capped (rate = effects / elapsed)."""

    n, cap = sizes["drain"], sizes["peer_cap"]
    b.record(report.PROCRASTINATE_ORDERED, "msg/s", b.peer_drain("procrastinate", n, 500, True, cap))
    b.record(report.PROCRASTINATE, "msg/s", b.peer_drain("procrastinate", n, 500, False, cap))
    b.record(report.PGQUEUER, "msg/s", b.peer_drain("pgqueuer", n, 500, False, cap))


def _peers_installed() -> bool:
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
        import procrastinate  # noqa: F401
    except ImportError:
        print("peers skipped: install the bench extra (pip install -e '.[bench]', as `make bench` does)")
        return False
    return True


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about four minutes")
    ap.add_argument(
        "--database-url",
        default=os.environ.get("POSTBOX_BENCH_DATABASE_URL") or os.environ.get("POSTBOX_DATABASE_URL"),
    )
    ap.add_argument("--repeat", type=int, default=None, help="repetitions (default 3, quick 1)")
    ap.add_argument(
        "--results-page",
        type=Path,
        default=None,
        help=f"the generated page of figures (default: {RESULTS_PAGE.relative_to(REPO)} for a full run,"
        " none for a quick one)",
    )
    return ap.parse_args()


def results_page(requested: Path | None, quick: bool, note: str) -> Path | None:
    """Where the run's page goes: where asked, else the committed page for a full run on a quiet
    machine (a noisy run, with its ``note``, must not replace a quiet machine's figures)."""
    if requested is not None:
        return requested
    return None if quick or note else RESULTS_PAGE


def main() -> None:
    args = _arguments()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeat = args.repeat or (1 if args.quick else 3)
    admin = args.database_url
    if not admin:
        from postbox.demo.embedded import embedded_server

        admin = str(embedded_server(REPO / ".pgdata").get_uri())
    with_peers = _peers_installed()
    b = Bench(admin, args.quick)
    measured_at, started, cpu = datetime.now(UTC), time.monotonic(), cpu_times()
    try:
        machine = machine_summary(*b.server())
        for rep in range(repeat):
            print(f"repetition {rep + 1}/{repeat}", flush=True)
            receive_workloads(b, sizes, with_peers)
            processing_workloads(b, sizes, first=rep == 0, with_peers=with_peers)
            if with_peers:
                peer_workloads(b, sizes)
        counted_workloads(b, sizes, with_peers)
    finally:
        b.cleanup()
    steal = steal_share(cpu)
    note = report.machine_noise(b.results, steal)
    run = Run(
        b.results,
        measured_at,
        machine,
        repeat,
        args.quick,
        time.monotonic() - started,
        dict(sizes),
        note=note,
        extra={**b.extra, "steal_share": steal},
    )
    page = results_page(args.results_page, args.quick, note)
    if note and page is None and not args.quick:
        print(
            f"\n{note}\n{RESULTS_PAGE.relative_to(REPO)} left as it was: --results-page PATH writes this run anyway."
        )
    print("\n" + report.run_markdown(run))
    for path in report.write(run, RESULTS, page):
        print(f"written: {path}")
    if b.extra.get("failures"):
        sys.exit(f"{len(b.extra['failures'])} workload(s) broke an invariant: see Failures above")


if __name__ == "__main__":
    random.seed(1)
    main()
