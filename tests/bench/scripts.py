"""The SQL the benchmark runs besides Postbox's own: its tables, and the pgbench scripts of the
references (what bounds a receive, a batch receive and the drain)."""

BENCH_DDL = """
CREATE TABLE IF NOT EXISTS bench_effects (
    id bigserial PRIMARY KEY, message_id text NOT NULL, key text NOT NULL, seq bigint, latency_ms double precision,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS bench_rows (id integer PRIMARY KEY, n bigint NOT NULL DEFAULT 0);
INSERT INTO bench_rows (id) SELECT g FROM generate_series(1, 20000) g ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS bench_single (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
CREATE SEQUENCE IF NOT EXISTS bench_ids;
"""


PGBENCH_INSERT_UPDATE = """\\set k random(1, 20000)
BEGIN;
INSERT INTO bench_effects (message_id, key, seq) VALUES ('x', 'k', :k);
UPDATE bench_rows SET n = n + 1 WHERE id = :k;
COMMIT;
"""
# The drain's effect rows as a SQL-function batch handler (kind = "sql", batch = true): one
# statement per call, over the call's messages as JSON.
SQL_BATCH_HANDLER = """CREATE FUNCTION bench_effects_batch(messages jsonb, contexts jsonb) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO bench_effects (message_id, key, seq, latency_ms)
    SELECT m ->> 'message_id', m ->> 'key', (m ->> 'sequence')::bigint,
           extract(epoch FROM clock_timestamp() - (m ->> 'received_at')::timestamptz) * 1000
      FROM jsonb_array_elements(messages) AS m
$$"""
SQL_BATCH_CONFIG = (
    '[consumers.bench.handlers."*"]\nkind = "sql"\nfunction = "public.bench_effects_batch"\nbatch = true\n'
)

# One batch of the drain in SQL: claim, one effect row per message, complete (bench_drain_batch).
DRAIN_SQL_FUNCTION = """CREATE FUNCTION bench_drain_batch(n integer) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE ids bigint[]; attempts integer[];
BEGIN
    SELECT array_agg(id), array_agg(attempt) INTO ids, attempts
      FROM postbox.inbox_claim_v1('bench', 'sql', n, interval '60 seconds', now());
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    INSERT INTO bench_effects (message_id, key, seq)
    SELECT message_id, key, sequence FROM postbox.inbox WHERE id = ANY(ids);
    PERFORM postbox.inbox_complete_v1(ids, attempts, now());
    RETURN cardinality(ids);
END $$"""
PGBENCH_SINGLE_INSERT = "INSERT INTO bench_single (payload) VALUES ('{\"i\": 1}');\n"
PGBENCH_ROUND_TRIP = "SELECT 1;\n"  # a round trip with nothing to do: what each statement costs at least

# What bounds a single receive: the receive function itself without the Python client, and the two
# rows every receive must write (the deduplication ledger and the inbox row, with their indexes)
# with the uniqueness checks that deduplication and the one-head-per-key rule need (ON CONFLICT).
PGBENCH_RECEIVE = "SELECT postbox.inbox_receive_v1('bench', nextval('bench_ids')::text, '{\"i\": 1}');\n"
PGBENCH_TWO_INSERTS = """WITH n AS (SELECT nextval('bench_ids')::text AS id), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id, '\\x00', 0 FROM n \
ON CONFLICT DO NOTHING) \
INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""
# The same two rows as plain INSERTs (no ON CONFLICT; the unique indexes still check): the most
# generous bound for any design that writes them, since a receive must handle a conflict somehow.
PGBENCH_TWO_PLAIN_INSERTS = """WITH n AS (SELECT nextval('bench_ids')::text AS id), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id, '\\x00', 0 FROM n) \
INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM n;
"""
# Even one row per message (no ledger: what a single-table design would write at best) costs more
# than pgbench's single INSERT, because of the indexes a claimable, one-head-per-key row needs.
PGBENCH_INBOX_ROW = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) \
SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM (SELECT nextval('bench_ids')::text AS id) n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""
# The batch floor: the same two rows and checks for 500 messages in one statement (tx/s x 500).
PGBENCH_TWO_INSERTS_500 = """WITH n AS (SELECT nextval('bench_ids') AS id FROM generate_series(1, 500)), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id::text, '\\x00', id FROM n \
ON CONFLICT DO NOTHING) \
INSERT INTO postbox.inbox (id, consumer, message_id, key, position, payload, state) SELECT id, 'bench', id::text, id::text, id, '{"i": 1}', 'ready' FROM n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""

# The large backlog of the claim-cost workload, built set-based (psycopg parameters): one hot key
# (its head ready, the rest pending), keys whose head is blocked (four pending rows behind each),
# and cold keys, each with a ready head and ``per`` pending rows behind it (a range of them per
# statement). Keys are zero-padded so that each statement appends to the pending index in order.
BACKLOG_HOT = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
SELECT 'bench', 'hot-' || g, 'hot', g, '{}', CASE WHEN g = 1 THEN 'ready' ELSE 'pending' END
  FROM generate_series(1, %(hot)s::int) g"""
BACKLOG_BLOCKED = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
SELECT 'bench', 'blocked-' || g, 'b' || lpad((g / 5)::text, 7, '0'), g, '{}',
       CASE WHEN g %% 5 = 0 THEN 'blocked' ELSE 'pending' END
  FROM generate_series(0, %(blocked)s::int * 5 - 1) g"""
BACKLOG_COLD = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
SELECT 'bench', 'cold-' || k || '-' || j, 'c' || lpad(k::text, 7, '0'), j, '{}',
       CASE WHEN j = 0 THEN 'ready' ELSE 'pending' END
  FROM generate_series(%(lo)s::int, %(hi)s::int) k, generate_series(0, %(per)s::int) j"""

# Old entries of the deduplication ledger, as two weeks of traffic leave them between rotations:
# rows {start}+1 .. {start}+{rows}, half in the current slot (received over the last 6 days), half
# in the previous one (7 to 13 days ago), so a receive looks up both. One statement per chunk, in
# its own transaction. The one place that knows the ledger's layout for filling it.
LEDGER_FILL = """SET LOCAL synchronous_commit = off;
INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id, received_at, slot)
SELECT 'bench', 'old-' || g, decode(md5(g::text), 'hex'), g,
       now() - random() * interval '6 days' - (g % 2) * interval '7 days', (g % 2)::smallint
  FROM generate_series({start} + 1, {start} + {rows}) g"""
LEDGER_VACUUM = "VACUUM ANALYZE postbox.inbox_dedup"

# The sustained-load workload's "done": each effect row also gets, at its transaction's commit (a
# deferred trigger runs after the worker's complete, just before the commit record), the time from
# the message's received_at to then. latency_ms (set by the handler) is only receive→handler start,
# and a worker commits a whole batch at once.
EFFECT_DONE_TRIGGER = """ALTER TABLE bench_effects ADD COLUMN done_ms double precision;
CREATE FUNCTION bench_effect_done() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE bench_effects SET done_ms = NEW.latency_ms + extract(epoch FROM clock_timestamp() - NEW.at) * 1000
     WHERE id = NEW.id;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER bench_effect_done AFTER INSERT ON bench_effects DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION bench_effect_done();"""
