-- Relay queries: the outbox side of sql/functions/outbox_relay_v1.sql.

-- name: outbox_claim
SELECT id, destination, message_id, key, type, payload, headers, correlation_id, causation_id,
       created_at, attempt, first_failed_at
  FROM postbox.outbox_claim_v1(:destination, :worker, CAST(:limit AS integer),
                               make_interval(secs => CAST(:lease AS double precision)),
                               CAST(:now AS timestamptz));

-- name: outbox_complete
SELECT postbox.outbox_complete_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));

-- name: outbox_retry
SELECT postbox.outbox_retry_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                               CAST(:retry_at AS timestamptz), :error, :error_type, :kind, :traceback,
                               :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: outbox_dead_letter
SELECT postbox.outbox_dead_letter_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                     :reason, :error, :error_type, :traceback, :fingerprint, :policy, :kind,
                                     :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: outbox_release
SELECT postbox.outbox_release_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));
