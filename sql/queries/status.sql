-- postbox status: one screen of what is going on (service/postbox/operations/status.py).

-- name: status_consumers
SELECT c.name,
       c.sequence_mode,
       c.on_dead_letter,
       c.halted_at IS NOT NULL AS halted,
       coalesce(i.ready, 0), coalesce(i.running, 0), coalesce(i.pending, 0), coalesce(i.blocked, 0),
       coalesce(i.retrying, 0),
       coalesce(extract(epoch FROM CAST(:now AS timestamptz) - i.oldest), 0)::float8 AS lag_seconds
  FROM (SELECT name, sequence_mode, on_dead_letter, halted_at FROM postbox.consumers
        UNION SELECT DISTINCT consumer, NULL::text, NULL::text, NULL::timestamptz FROM postbox.inbox
         WHERE consumer NOT IN (SELECT name FROM postbox.consumers)) c
  LEFT JOIN (SELECT consumer,
                    count(*) FILTER (WHERE state = 'ready') AS ready,
                    count(*) FILTER (WHERE state = 'running') AS running,
                    count(*) FILTER (WHERE state = 'pending') AS pending,
                    count(*) FILTER (WHERE state = 'blocked') AS blocked,
                    count(*) FILTER (WHERE state <> 'blocked' AND first_failed_at IS NOT NULL) AS retrying,
                    min(received_at) FILTER (WHERE state <> 'blocked') AS oldest
               FROM postbox.inbox GROUP BY consumer) i ON i.consumer = c.name
 ORDER BY c.name;

-- name: status_workers
SELECT kind, coalesce(queue, ''), host, pid, concurrency,
       extract(epoch FROM CAST(:now AS timestamptz) - heartbeat_at)::float8 AS heartbeat_age,
       (SELECT count(*) FROM postbox.inbox i WHERE i.state = 'running' AND i.claimed_by = w.id) AS in_flight,
       coalesce(version, ''), coalesce(schema_revision, '0001'), stopping_at IS NOT NULL AS stopping
  FROM postbox.workers w ORDER BY kind, queue, host, pid;

-- name: status_dead_letter_groups
SELECT origin, queue, coalesce(type, ''), reason, open,
       extract(epoch FROM CAST(:now AS timestamptz) - oldest_at)::float8 AS oldest_age, coalesce(latest_error, '')
  FROM postbox.dead_letter_groups ORDER BY open DESC, queue LIMIT 20;

-- name: status_relay
SELECT destination, rows, ready, in_flight, retrying, blocked,
       coalesce(extract(epoch FROM CAST(:now AS timestamptz) - oldest_at), 0)::float8
  FROM postbox.outbox_backlog ORDER BY destination;

-- name: status_processed
-- Throughput: per consumer, messages received in the last minute, and how many of them are done.
SELECT d.consumer, count(*),
       count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM postbox.inbox i WHERE i.id = d.inbox_id))
  FROM postbox.inbox_dedup d
 WHERE d.received_at >= CAST(:now AS timestamptz) - interval '60 seconds'
 GROUP BY d.consumer;

-- name: status_maintenance
SELECT job, runs, extract(epoch FROM CAST(:now AS timestamptz) - last_success_at)::float8, last_error
  FROM postbox.maintenance_runs ORDER BY job;

-- name: status_replays_exist
SELECT to_regclass('postbox.replay_jobs') IS NOT NULL;

-- name: status_replays
-- Only run when postbox.replay_jobs exists (status_replays_exist).
SELECT id, state, created_at, total, replayed, succeeded, failed
  FROM postbox.replay_jobs WHERE state IN ('pending', 'running', 'paused') ORDER BY id;
