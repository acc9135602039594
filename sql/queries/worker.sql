-- Worker queries besides the queue protocol (sql/queries/queue.sql): exhausting a message, heartbeats,
-- savepoints around handlers.

-- name: inbox_exhaust
SELECT postbox.inbox_exhaust_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                CAST(:max_attempts AS integer), :fingerprint, :policy, :worker);

-- name: worker_heartbeat
SELECT postbox.worker_heartbeat_v2(:id, :kind, :queue, :host, CAST(:pid AS integer),
                                   CAST(:concurrency AS integer), :version, :schema_revision,
                                   CAST(:stopping AS boolean), CAST(:now AS timestamptz));

-- name: reap_stale_workers
SELECT postbox.reap_stale_workers_v1(make_interval(secs => CAST(:stale_after AS double precision)),
                                     CAST(:now AS timestamptz));

-- name: consumer_declaration
-- Whether the consumer is declared, and a few of the consumers that are (any declared one makes
-- the database refuse messages for an undeclared consumer).
SELECT EXISTS (SELECT 1 FROM postbox.consumers WHERE name = :consumer AND declared),
       array(SELECT name FROM postbox.consumers WHERE declared ORDER BY name LIMIT 4);

-- name: worker_unregister
SELECT postbox.worker_unregister_v1(:id);

-- Around every handler: the message's savepoint in the batch's transaction, sent straight through
-- libpq. The first one begins the transaction in the same round trip.

-- name: worker_savepoint
-- The transaction's id, assigned now (the batch writes at least its completion anyway): if a
-- handler ends the transaction, or hangs or dies after ending it, the id tells whether what ran
-- before was committed or rolled back.
BEGIN; SAVEPOINT postbox_m; SELECT pg_current_xact_id();

-- name: worker_savepoint_rollback
ROLLBACK TO SAVEPOINT postbox_m;

-- name: worker_savepoint_next
RELEASE SAVEPOINT postbox_m; SAVEPOINT postbox_m;

-- name: worker_terminate_backend
SELECT pg_terminate_backend(CAST(:pid AS integer), 5000);

-- name: worker_transaction_status
SELECT pg_xact_status(CAST(:xid AS xid8));
