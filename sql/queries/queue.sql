-- Queue queries of workers (inbox) and relays (outbox): the queue protocol of
-- sql/functions/queue_v1.sql. A template, read once for each of the two (postbox.schema.render).

-- name: {{table}}_claim
{{#inbox}}
SELECT id, consumer, message_id, key, sequence, type, schema_version, payload, headers,
       correlation_id, causation_id, source, received_at, attempt, first_failed_at, last_error,
       last_error_type
{{/inbox}}
{{#outbox}}
SELECT id, destination, message_id, key, type, payload, headers, correlation_id, causation_id,
       created_at, attempt, first_failed_at
{{/outbox}}
  FROM postbox.{{table}}_claim_v1(:{{queue}}, :worker, CAST(:limit AS integer),
                                  make_interval(secs => CAST(:lease AS double precision)),
                                  CAST(:now AS timestamptz));

-- name: {{table}}_complete
SELECT postbox.{{table}}_complete_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));

-- name: {{table}}_retry
SELECT postbox.{{table}}_retry_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                  CAST(:retry_at AS timestamptz), :error, :error_type, :kind, :traceback,
                                  :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: {{table}}_dead_letter
SELECT postbox.{{table}}_dead_letter_v1(CAST(:id AS bigint), CAST(:attempt AS integer), CAST(:now AS timestamptz),
                                        :reason, :error, :error_type, :traceback, :fingerprint, :policy, :kind,
                                        :worker, CAST(:duration_ms AS double precision), :explanation);

-- name: {{table}}_release
SELECT postbox.{{table}}_release_v1(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:now AS timestamptz));
