-- Worker queries: the inbox side of the SQL functions in sql/functions/inbox_worker_v1.sql.

-- name: inbox_claim
SELECT id, consumer, message_id, key, sequence, type, schema_version, payload, headers,
       correlation_id, causation_id, source, received_at, attempt, first_failed_at, last_error,
       last_error_type
  FROM postbox.inbox_claim_v1(:consumer, :worker, CAST(:limit AS integer),
                              make_interval(secs => CAST(:lease AS double precision)),
                              CAST(:now AS timestamptz));

-- name: inbox_complete
SELECT postbox.inbox_complete_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));

-- name: inbox_retry
SELECT postbox.inbox_retry_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                              CAST(:retry_at AS timestamptz), :error, :error_type, :kind, :traceback,
                              :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: inbox_dead_letter
SELECT postbox.inbox_dead_letter_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                    :reason, :error, :error_type, :traceback, :fingerprint, :policy, :kind,
                                    :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: inbox_exhaust
SELECT postbox.inbox_exhaust_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                CAST(:max_attempts AS integer), :fingerprint, :policy, :worker);

-- name: inbox_release
SELECT postbox.inbox_release_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));

-- name: worker_heartbeat
SELECT postbox.worker_heartbeat_v1(:id, :kind, :queue, :host, CAST(:pid AS integer),
                                   CAST(:concurrency AS integer), :version, CAST(:now AS timestamptz));

-- name: reap_stale_workers
SELECT postbox.reap_stale_workers_v1(make_interval(secs => CAST(:stale_after AS double precision)),
                                     CAST(:now AS timestamptz));

-- name: worker_unregister
SELECT postbox.worker_unregister_v1(:id);

-- Around every handler: the message's savepoint in the batch's transaction. The first one goes
-- through psycopg (which begins the transaction); the others are sent straight through libpq.

-- name: worker_savepoint
SAVEPOINT postbox_m;

-- name: worker_savepoint_rollback
ROLLBACK TO SAVEPOINT postbox_m;

-- name: worker_savepoint_release
RELEASE SAVEPOINT postbox_m;

-- name: worker_savepoint_next
RELEASE SAVEPOINT postbox_m; SAVEPOINT postbox_m;

-- name: worker_savepoint_next_xid
RELEASE SAVEPOINT postbox_m; SAVEPOINT postbox_m; SELECT pg_current_xact_id_if_assigned();

-- name: worker_terminate_backend
SELECT pg_terminate_backend(CAST(:pid AS integer), 5000);

-- name: worker_transaction_status
SELECT pg_xact_status(CAST(:xid AS xid8));
