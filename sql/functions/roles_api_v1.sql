-- Entry points for what Postbox processes used to do with plain SQL on the tables: a worker leaving
-- postbox.workers, the metrics snapshot, and the maintenance jobs. Postbox roles hold no INSERT,
-- UPDATE or DELETE on any table (sql/roles_v1.sql): these run as the owner of the schema (SECURITY
-- DEFINER, with a fixed search_path) and are granted to the roles that call them.

-- A process leaving at a clean stop (postbox_worker, postbox_maintainer); whether its row was there.
CREATE OR REPLACE FUNCTION postbox.worker_unregister_v1(p_id text)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    WITH gone AS (DELETE FROM postbox.workers WHERE id = p_id RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM gone)
$$;
COMMENT ON FUNCTION postbox.worker_unregister_v1(text) IS 'Process: remove its own row from postbox.workers at a clean stop.';

-- Every database gauge of service/postbox/operations/metrics.py, as rows of (metric, label a, label b, value): counts,
-- ages and table statistics, never a payload. For every process that serves /metrics, and for
-- dashboards (postbox_reader).
CREATE OR REPLACE FUNCTION postbox.metrics_snapshot_v1(p_now timestamptz, p_stale_after double precision)
RETURNS TABLE (metric text, label_a text, label_b text, value double precision)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
WITH inbox AS (
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
SELECT 'inbox_oldest_age_seconds', consumer, NULL, coalesce(extract(epoch FROM p_now - min(oldest)), 0)::float8
  FROM inbox GROUP BY consumer
UNION ALL
SELECT 'inbox_retrying', consumer, NULL, sum(retrying)::float8 FROM inbox GROUP BY consumer
UNION ALL
SELECT 'blocked_keys', 'inbox', consumer, sum(n) FILTER (WHERE state = 'blocked')::float8 FROM inbox GROUP BY consumer
UNION ALL
SELECT 'blocked_key_oldest_seconds', 'inbox', consumer,
       coalesce(extract(epoch FROM p_now - min(blocked_since)), 0)::float8
  FROM inbox GROUP BY consumer
UNION ALL
SELECT 'relay_backlog', destination, NULL, sum(n) FILTER (WHERE state <> 'blocked')::float8 FROM outbox GROUP BY destination
UNION ALL
SELECT 'relay_oldest_age_seconds', destination, NULL,
       coalesce(extract(epoch FROM p_now - min(oldest) FILTER (WHERE state <> 'blocked')), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'blocked_keys', 'outbox', destination, coalesce(sum(n) FILTER (WHERE state = 'blocked'), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'blocked_key_oldest_seconds', 'outbox', destination,
       coalesce(extract(epoch FROM p_now - min(blocked_since)), 0)::float8
  FROM outbox GROUP BY destination
UNION ALL
SELECT 'dead_letters_open', origin, coalesce(consumer, destination), count(*)::float8
  FROM postbox.dead_letters WHERE status = 'open' GROUP BY origin, coalesce(consumer, destination)
UNION ALL
SELECT 'dead_letter_oldest_age_seconds', origin, coalesce(consumer, destination),
       extract(epoch FROM p_now - min(dead_lettered_at))::float8
  FROM postbox.dead_letters WHERE status = 'open' GROUP BY origin, coalesce(consumer, destination)
UNION ALL
SELECT 'key_gaps_timed_out', k.consumer, NULL, count(*)::float8
  FROM postbox.inbox_keys k JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL AND c.gap_timeout IS NOT NULL AND p_now - k.gap_since > c.gap_timeout
 GROUP BY k.consumer
UNION ALL
SELECT CASE WHEN heartbeat_at >= p_now - make_interval(secs => p_stale_after)
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
  FROM pg_stat_activity WHERE datname = current_database() AND xact_start IS NOT NULL AND pid <> pg_backend_pid()
$$;
COMMENT ON FUNCTION postbox.metrics_snapshot_v1(timestamptz, double precision)
    IS 'Metrics: every database gauge as (metric, label_a, label_b, value); counts and ages only, no payloads.';

-- Maintenance (postbox maintain, role postbox_maintainer): each job's bookkeeping row, and the jobs
-- that delete, each one small batch per call (SKIP LOCKED), returning how many rows it deleted.

CREATE OR REPLACE FUNCTION postbox.maintenance_register_v1(p_jobs text[])
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    INSERT INTO postbox.maintenance_runs (job) SELECT unnest(p_jobs) ON CONFLICT (job) DO NOTHING
$$;
COMMENT ON FUNCTION postbox.maintenance_register_v1(text[]) IS 'Maintenance: make sure each job has its row in postbox.maintenance_runs.';

-- Claim a run of p_job if its last start is at least p_min_gap seconds before p_now: one row (the
-- job's run count) if claimed, none if not due or another process holds the row.
CREATE OR REPLACE FUNCTION postbox.maintenance_claim_v1(
    p_job text, p_now timestamptz, p_runner text, p_min_gap double precision)
RETURNS SETOF bigint
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    UPDATE postbox.maintenance_runs
       SET last_started_at = p_now, last_runner = p_runner, runs = runs + 1
     WHERE job = (SELECT job FROM postbox.maintenance_runs
                   WHERE job = p_job
                     AND (last_started_at IS NULL OR last_started_at <= p_now - make_interval(secs => p_min_gap))
                   FOR UPDATE SKIP LOCKED)
    RETURNING runs
$$;
COMMENT ON FUNCTION postbox.maintenance_claim_v1(text, timestamptz, text, double precision)
    IS 'Maintenance: claim a due run of a job (at most once per period across processes).';

CREATE OR REPLACE FUNCTION postbox.maintenance_finish_v1(p_job text, p_now timestamptz, p_rows bigint, p_error text)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    UPDATE postbox.maintenance_runs
       SET last_finished_at = p_now,
           last_success_at = CASE WHEN p_error IS NULL THEN p_now ELSE last_success_at END,
           last_rows = p_rows, last_error = p_error
     WHERE job = p_job
$$;
COMMENT ON FUNCTION postbox.maintenance_finish_v1(text, timestamptz, bigint, text)
    IS 'Maintenance: record the end of a job''s run (rows touched, error if it failed).';

-- Ledger rows older than p_cutoff whose message has left the inbox and has no open dead letter (a
-- replay may still bring it back).
CREATE OR REPLACE FUNCTION postbox.prune_dedup_v1(p_cutoff timestamptz, p_limit integer)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    WITH gone AS (
        DELETE FROM postbox.inbox_dedup
         WHERE ctid = ANY (ARRAY(
               SELECT d.ctid FROM postbox.inbox_dedup d
                WHERE d.received_at < p_cutoff
                  AND NOT EXISTS (SELECT 1 FROM postbox.inbox i WHERE i.id = d.inbox_id)
                  AND NOT EXISTS (SELECT 1 FROM postbox.dead_letters x
                                   WHERE x.message_id = d.message_id AND x.consumer = d.consumer
                                     AND x.status IN ('open', 'replaying'))
                LIMIT p_limit
                FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;
COMMENT ON FUNCTION postbox.prune_dedup_v1(timestamptz, integer)
    IS 'Maintenance: delete one batch of deduplication-ledger rows older than the cutoff whose message is gone.';

-- Failed-attempt history older than p_cutoff, except that of open dead letters.
CREATE OR REPLACE FUNCTION postbox.prune_attempts_v1(p_cutoff timestamptz, p_limit integer)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    WITH gone AS (
        DELETE FROM postbox.attempts
         WHERE id = ANY (ARRAY(
               SELECT a.id FROM postbox.attempts a
                WHERE a.failed_at < p_cutoff
                  AND NOT EXISTS (SELECT 1 FROM postbox.dead_letters x
                                   WHERE x.origin = a.origin AND x.origin_id = a.origin_id
                                     AND x.status IN ('open', 'replaying'))
                LIMIT p_limit
                FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;
COMMENT ON FUNCTION postbox.prune_attempts_v1(timestamptz, integer)
    IS 'Maintenance: delete one batch of failed-attempt history older than the cutoff (not that of open dead letters).';

-- Closed dead letters (replayed, discarded, resolved) older than p_cutoff. Open ones never.
CREATE OR REPLACE FUNCTION postbox.prune_dead_letters_v1(p_cutoff timestamptz, p_limit integer)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    WITH gone AS (
        DELETE FROM postbox.dead_letters
         WHERE id = ANY (ARRAY(
               SELECT id FROM postbox.dead_letters
                WHERE status IN ('replayed', 'discarded', 'resolved')
                  AND coalesce(status_changed_at, dead_lettered_at) < p_cutoff
                LIMIT p_limit
                FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;
COMMENT ON FUNCTION postbox.prune_dead_letters_v1(timestamptz, integer)
    IS 'Maintenance: delete one batch of closed (replayed, discarded, resolved) dead letters older than the cutoff.';

-- The safety net for orphaned keys: the repair a claim does, for one queue whose repairs were left.
CREATE OR REPLACE FUNCTION postbox.maintenance_repair_keys_v1(
    p_origin text, p_queue text, p_now timestamptz, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    IF p_origin IS NULL OR p_origin NOT IN ('inbox', 'outbox') THEN
        PERFORM postbox.reject_v1('origin', 'must be inbox or outbox');
    END IF;
    RETURN postbox.repair_keys_v1(p_origin, p_queue, p_now, p_limit);
END
$$;
COMMENT ON FUNCTION postbox.maintenance_repair_keys_v1(text, text, timestamptz, integer)
    IS 'Maintenance: give the orphaned keys of one queue their next head.';
