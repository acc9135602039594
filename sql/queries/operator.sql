-- Operator queries: dead letters, replay jobs, blocked keys, consumers
-- (sql/functions/dead_letter_ops_v1.sql and replay_v1.sql).

-- name: dlq_select
SELECT id, origin, coalesce(consumer, destination) AS queue, message_id, key, sequence, type, reason,
       fingerprint, attempt, status, dead_lettered_at, last_error_type, last_error, payload_version
  FROM postbox.dlq_select_v1(CAST(:filter AS jsonb))
 LIMIT CAST(:limit AS integer);

-- name: dlq_show
SELECT d.*, coalesce(d.edited_payload, d.payload) AS replay_payload
  FROM postbox.dead_letters d WHERE d.id = CAST(:id AS bigint);

-- name: dlq_latest_for_message
SELECT id FROM postbox.dead_letters WHERE message_id = :message_id ORDER BY id DESC LIMIT 1;

-- name: dlq_edits
SELECT version, payload, previous, reason, actor, db_user, edited_at
  FROM postbox.dead_letter_edits WHERE dead_letter_id = CAST(:id AS bigint) ORDER BY version;

-- name: dlq_groups
SELECT origin, queue, type, reason, fingerprint, open, keys, oldest_at, now() - oldest_at AS oldest_age,
       latest_error
  FROM postbox.dead_letter_groups ORDER BY open DESC, oldest_at;

-- name: dlq_summary
SELECT origin, queue, open, oldest_at, oldest_age FROM postbox.dead_letter_summary ORDER BY queue;

-- name: dlq_explain
SELECT at, event, detail FROM postbox.dlq_explain_v1(CAST(:id AS bigint));

-- name: dlq_discard
SELECT dead_letter_id, action FROM postbox.dlq_discard_v1(CAST(:filter AS jsonb), :reason, :actor);

-- name: dlq_resolve
SELECT dead_letter_id, action FROM postbox.dlq_resolve_v1(CAST(:filter AS jsonb), :reason, :actor);

-- name: dlq_edit
SELECT postbox.dlq_edit_v1(CAST(:id AS bigint), CAST(:payload AS jsonb), :reason, :actor);

-- name: dlq_replay
SELECT postbox.dlq_replay_v1(CAST(:filter AS jsonb), :reason, :actor, :mode, CAST(:rate AS double precision),
                             CAST(:max_in_flight AS integer), CAST(:batch_size AS integer),
                             CAST(:canary AS integer), CAST(:abort_failure_ratio AS double precision),
                             CAST(:dry_run AS boolean));

-- name: replay_step
SELECT (postbox.replay_step_v1(CAST(:job AS bigint), CAST(:now AS timestamptz), :runner)).id;

-- name: replay_get
SELECT * FROM postbox.replay_progress WHERE id = CAST(:job AS bigint);

-- name: replay_list
SELECT * FROM postbox.replay_progress
 WHERE NOT CAST(:active_only AS boolean) OR state IN ('pending', 'running', 'paused')
 ORDER BY id DESC LIMIT CAST(:limit AS integer);

-- name: replay_runnable
SELECT id FROM postbox.replay_jobs
 WHERE state IN ('pending', 'running', 'paused')
    OR (state = 'cancelled' AND EXISTS (SELECT 1 FROM postbox.replay_items i WHERE i.job_id = replay_jobs.id AND i.state = 'replaying'))
 ORDER BY id;

-- name: replay_items
SELECT ordinal, dead_letter_id, state, action, replayed_at, finished_at
  FROM postbox.replay_items WHERE job_id = CAST(:job AS bigint) ORDER BY ordinal LIMIT CAST(:limit AS integer);

-- name: replay_pause
SELECT (postbox.replay_pause_v1(CAST(:job AS bigint), :reason, :actor)).id;

-- name: replay_resume
SELECT (postbox.replay_resume_v1(CAST(:job AS bigint), :reason, :actor, CAST(:now AS timestamptz))).id;

-- name: replay_cancel
SELECT (postbox.replay_cancel_v1(CAST(:job AS bigint), :reason, :actor)).id;

-- name: keys_blocked
SELECT origin, coalesce(consumer, destination) AS queue, key, blocking_message_id, blocking_sequence, type,
       dead_letter_id, reason, blocked_since, blocked_for, held_messages, last_error
  FROM postbox.blocked_keys ORDER BY blocked_since;

-- name: key_unblock
SELECT postbox.key_unblock_v1(:origin, :queue, :key, :reason, :actor, CAST(:replay AS boolean));

-- name: consumer_names
-- Every consumer Postbox knows of: declared or halted, with received messages (every live message
-- has its deduplication entry; read by a skip scan of its primary key, one probe per consumer),
-- dead letters or workers.
WITH RECURSIVE received AS (
    SELECT min(consumer) AS name FROM postbox.inbox_dedup
    UNION ALL
    SELECT (SELECT min(d.consumer) FROM postbox.inbox_dedup d WHERE d.consumer > r.name)
      FROM received r WHERE r.name IS NOT NULL)
SELECT name FROM received WHERE name IS NOT NULL
UNION SELECT name FROM postbox.consumers
UNION SELECT queue FROM postbox.workers WHERE kind IN ('worker', 'bridge') AND queue IS NOT NULL
UNION SELECT DISTINCT consumer FROM postbox.dead_letters WHERE consumer IS NOT NULL
UNION SELECT :consumer WHERE EXISTS (SELECT 1 FROM postbox.inbox WHERE consumer = :consumer)
ORDER BY 1;

-- name: consumer_halt
SELECT postbox.consumer_halt_op_v1(:consumer, :reason, :actor);

-- name: consumer_halted
-- Since when and why the consumer is halted (no row: it is not).
SELECT halted_at, halted_reason FROM postbox.consumers WHERE name = :consumer AND halted_at IS NOT NULL;

-- name: consumer_resume
SELECT postbox.consumer_resume_op_v1(:consumer, :reason, :actor);

-- name: audit_list
SELECT id, at, db_user, db_role, actor, action, reason, target, details
  FROM postbox.audit_log ORDER BY id DESC LIMIT CAST(:limit AS integer);
