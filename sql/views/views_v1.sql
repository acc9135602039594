-- Views for DBAs and operators: what is stuck, and why.

CREATE OR REPLACE VIEW postbox.blocked_keys AS
SELECT 'inbox'::text                 AS origin,
       i.consumer                    AS consumer,
       NULL::text                    AS destination,
       i.key,
       i.id                          AS blocking_id,
       i.message_id                  AS blocking_message_id,
       i.sequence                    AS blocking_sequence,
       i.type,
       d.id                          AS dead_letter_id,
       d.reason,
       d.last_error,
       coalesce(d.dead_lettered_at, i.last_failed_at) AS blocked_since,
       now() - coalesce(d.dead_lettered_at, i.last_failed_at) AS blocked_for,
       (SELECT count(*) FROM postbox.inbox p
         WHERE p.consumer = i.consumer AND p.key = i.key AND p.state = 'pending') AS held_messages
  FROM postbox.inbox i
  LEFT JOIN postbox.dead_letters d
         ON d.origin = 'inbox' AND d.origin_id = i.id AND d.status IN ('open', 'replaying')
 WHERE i.state = 'blocked'
UNION ALL
SELECT 'outbox', NULL, o.destination, o.key, o.id, o.message_id, NULL, o.type, d.id, d.reason,
       d.last_error, coalesce(d.dead_lettered_at, o.last_failed_at),
       now() - coalesce(d.dead_lettered_at, o.last_failed_at),
       (SELECT count(*) FROM postbox.outbox p
         WHERE p.destination = o.destination AND p.key = o.key AND p.state = 'pending')
  FROM postbox.outbox o
  LEFT JOIN postbox.dead_letters d
         ON d.origin = 'outbox' AND d.origin_id = o.id AND d.status IN ('open', 'replaying')
 WHERE o.state = 'blocked';
COMMENT ON VIEW postbox.blocked_keys IS 'Keys held behind a dead-lettered head: since when, by which message and dead letter, and how many messages wait behind it.';

CREATE OR REPLACE VIEW postbox.key_gaps AS
SELECT k.consumer,
       k.key,
       k.last_sequence,
       coalesce(k.last_sequence + 1, c.first_sequence) AS expected_sequence,
       (SELECT min(p.position) FROM postbox.inbox p
         WHERE p.consumer = k.consumer AND p.key = k.key AND p.state = 'pending') AS next_present_sequence,
       k.gap_since,
       now() - k.gap_since AS waiting_for,
       c.gap_timeout,
       c.gap_timeout IS NOT NULL AND now() - k.gap_since > c.gap_timeout AS timed_out
  FROM postbox.inbox_keys k
  JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL;
COMMENT ON VIEW postbox.key_gaps IS 'gapless consumers: keys waiting for a missing sequence, for how long, and whether past the gap timeout.';

CREATE OR REPLACE VIEW postbox.live_workers AS
SELECT w.*, now() - w.heartbeat_at AS since_heartbeat,
       (SELECT count(*) FROM postbox.inbox i WHERE i.state = 'running' AND i.claimed_by = w.id) AS inbox_in_flight
  FROM postbox.workers w;
COMMENT ON VIEW postbox.live_workers IS 'Registered processes with their heartbeat age and in-flight inbox messages.';

-- Dead letters for DBAs (DLQ-3): how many, how old, grouped by cause.
CREATE OR REPLACE VIEW postbox.dead_letter_summary AS
SELECT origin,
       coalesce(consumer, destination)          AS queue,
       count(*)                                 AS open,
       min(dead_lettered_at)                    AS oldest_at,
       now() - min(dead_lettered_at)            AS oldest_age,
       max(dead_lettered_at)                    AS newest_at
  FROM postbox.dead_letters
 WHERE status = 'open'
 GROUP BY origin, coalesce(consumer, destination);
COMMENT ON VIEW postbox.dead_letter_summary IS 'Open dead letters per consumer or destination: count and age of the oldest (alert on these).';

CREATE OR REPLACE VIEW postbox.dead_letter_groups AS
SELECT origin,
       coalesce(consumer, destination)          AS queue,
       type,
       reason,
       fingerprint,
       count(*)                                 AS open,
       min(dead_lettered_at)                    AS oldest_at,
       max(dead_lettered_at)                    AS newest_at,
       count(DISTINCT key)                      AS keys,
       (array_agg(last_error ORDER BY dead_lettered_at DESC))[1] AS latest_error
  FROM postbox.dead_letters
 WHERE status = 'open'
 GROUP BY origin, coalesce(consumer, destination), type, reason, fingerprint;
COMMENT ON VIEW postbox.dead_letter_groups IS 'Open dead letters grouped by queue, type, reason and error fingerprint, with the newest error text.';

CREATE OR REPLACE VIEW postbox.inbox_by_attempt AS
SELECT consumer, attempt, state, count(*) AS messages,
       min(first_failed_at) AS earliest_first_failure
  FROM postbox.inbox
 WHERE attempt > 0 OR state <> 'pending'
 GROUP BY consumer, attempt, state;
COMMENT ON VIEW postbox.inbox_by_attempt IS 'Live messages by consumer, attempt number and state (retries in flight show attempt > 1 or a next_retry_at).';

CREATE OR REPLACE VIEW postbox.outbox_backlog AS
SELECT destination,
       count(*)                                              AS rows,
       count(*) FILTER (WHERE state = 'ready')               AS ready,
       count(*) FILTER (WHERE state = 'running')             AS in_flight,
       count(*) FILTER (WHERE state = 'ready' AND attempt > 0) AS retrying,
       count(*) FILTER (WHERE state = 'blocked')             AS blocked,
       min(created_at)                                       AS oldest_at,
       now() - min(created_at)                               AS oldest_age
  FROM postbox.outbox
 GROUP BY destination;
COMMENT ON VIEW postbox.outbox_backlog IS 'Relay lag per destination: rows waiting, in flight, retrying, blocked, and the age of the oldest unpublished row.';
