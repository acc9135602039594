-- Metrics: every database gauge of service/metrics.py in one statement, rows of
-- (metric, label a, label b, value). Run on a timer by each process that serves metrics.

-- name: metrics_snapshot
WITH now_ AS (SELECT CAST(:now AS timestamptz) AS t),
inbox AS (
    SELECT consumer, state, count(*) AS n,
           min(received_at) FILTER (WHERE state <> 'blocked') AS oldest,
           count(*) FILTER (WHERE state <> 'blocked' AND first_failed_at IS NOT NULL) AS retrying,
           min(last_failed_at) FILTER (WHERE state = 'blocked') AS blocked_since
      FROM postbox.inbox GROUP BY consumer, state),
outbox AS (
    SELECT destination, state, count(*) AS n, min(created_at) AS oldest,
           min(last_failed_at) FILTER (WHERE state = 'blocked') AS blocked_since
      FROM postbox.outbox GROUP BY destination, state)
SELECT 'inbox_messages', consumer, state, n::float8 FROM inbox
UNION ALL
SELECT 'inbox_oldest_age_seconds', consumer, NULL,
       coalesce(extract(epoch FROM (SELECT t FROM now_) - min(oldest)), 0)::float8
  FROM inbox GROUP BY consumer
UNION ALL
SELECT 'inbox_retrying', consumer, NULL, sum(retrying)::float8 FROM inbox GROUP BY consumer
UNION ALL
SELECT 'blocked_keys', 'inbox', consumer, sum(n) FILTER (WHERE state = 'blocked')::float8 FROM inbox GROUP BY consumer
UNION ALL
SELECT 'blocked_key_oldest_seconds', 'inbox', consumer,
       coalesce(extract(epoch FROM (SELECT t FROM now_) - min(blocked_since)), 0)::float8
  FROM inbox GROUP BY consumer
UNION ALL
SELECT 'relay_backlog', destination, NULL, sum(n) FILTER (WHERE state <> 'blocked')::float8 FROM outbox GROUP BY destination
UNION ALL
SELECT 'relay_oldest_age_seconds', destination, NULL,
       coalesce(extract(epoch FROM (SELECT t FROM now_) - min(oldest) FILTER (WHERE state <> 'blocked')), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'blocked_keys', 'outbox', destination, coalesce(sum(n) FILTER (WHERE state = 'blocked'), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'blocked_key_oldest_seconds', 'outbox', destination,
       coalesce(extract(epoch FROM (SELECT t FROM now_) - min(blocked_since)), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'dead_letters_open', origin, coalesce(consumer, destination), count(*)::float8
  FROM postbox.dead_letters WHERE status = 'open' GROUP BY origin, coalesce(consumer, destination)
UNION ALL
SELECT 'dead_letter_oldest_age_seconds', origin, coalesce(consumer, destination),
       extract(epoch FROM (SELECT t FROM now_) - min(dead_lettered_at))::float8
  FROM postbox.dead_letters WHERE status = 'open' GROUP BY origin, coalesce(consumer, destination)
UNION ALL
SELECT 'key_gaps_timed_out', k.consumer, NULL, count(*)::float8
  FROM postbox.inbox_keys k JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL AND c.gap_timeout IS NOT NULL
   AND (SELECT t FROM now_) - k.gap_since > c.gap_timeout
 GROUP BY k.consumer
UNION ALL
SELECT CASE WHEN heartbeat_at >= (SELECT t FROM now_) - make_interval(secs => CAST(:stale_after AS float8))
            THEN 'workers_live' ELSE 'workers_stale' END, kind, NULL, count(*)::float8
  FROM postbox.workers GROUP BY 1, kind
UNION ALL
SELECT 'table_dead_tuples', relname, NULL, n_dead_tup::float8 FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL
SELECT 'table_live_tuples', relname, NULL, n_live_tup::float8 FROM pg_stat_user_tables WHERE schemaname = 'postbox'
UNION ALL
SELECT 'xmin_age_transactions', NULL, NULL,
       coalesce(max(greatest(age(backend_xmin), age(backend_xid))), 0)::float8
  FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
UNION ALL
SELECT 'oldest_transaction_seconds', NULL, NULL,
       coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)::float8
  FROM pg_stat_activity WHERE datname = current_database() AND xact_start IS NOT NULL AND pid <> pg_backend_pid();
