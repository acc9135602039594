-- Maintenance queries (service/maintenance.py): the bookkeeping that makes each job run once per
-- period across processes, and the jobs themselves, each deleting one small batch per call.

-- name: maintenance_register
INSERT INTO postbox.maintenance_runs (job) SELECT unnest(CAST(:jobs AS text[])) ON CONFLICT (job) DO NOTHING;

-- name: maintenance_try_lock
SELECT pg_try_advisory_lock(hashtext('postbox.maintenance'), hashtext(:job));

-- name: maintenance_unlock
SELECT pg_advisory_unlock(hashtext('postbox.maintenance'), hashtext(:job));

-- name: maintenance_claim
UPDATE postbox.maintenance_runs
   SET last_started_at = CAST(:now AS timestamptz), last_runner = :runner, runs = runs + 1
 WHERE job = (SELECT job FROM postbox.maintenance_runs
               WHERE job = :job
                 AND (last_started_at IS NULL
                      OR last_started_at <= CAST(:now AS timestamptz) - make_interval(secs => CAST(:min_gap AS float8)))
               FOR UPDATE SKIP LOCKED)
RETURNING runs;

-- name: maintenance_finish
UPDATE postbox.maintenance_runs
   SET last_finished_at = CAST(:now AS timestamptz),
       last_success_at = CASE WHEN CAST(:error AS text) IS NULL THEN CAST(:now AS timestamptz) ELSE last_success_at END,
       last_rows = CAST(:rows AS bigint), last_error = CAST(:error AS text)
 WHERE job = :job;

-- name: maintenance_last_success
SELECT job, extract(epoch FROM last_success_at)::float8 FROM postbox.maintenance_runs WHERE last_success_at IS NOT NULL;

-- name: prune_dedup
-- Ledger rows older than the deduplication window whose message has left the inbox and has no
-- open dead letter (a replay may still bring it back).
DELETE FROM postbox.inbox_dedup
 WHERE ctid = ANY (ARRAY(
       SELECT d.ctid FROM postbox.inbox_dedup d
        WHERE d.received_at < CAST(:cutoff AS timestamptz)
          AND NOT EXISTS (SELECT 1 FROM postbox.inbox i WHERE i.id = d.inbox_id)
          AND NOT EXISTS (SELECT 1 FROM postbox.dead_letters x
                           WHERE x.message_id = d.message_id AND x.consumer = d.consumer
                             AND x.status IN ('open', 'replaying'))
        LIMIT CAST(:limit AS integer)
        FOR UPDATE SKIP LOCKED));

-- name: prune_attempts
-- Failed-attempt history older than the retention, except that of open dead letters.
DELETE FROM postbox.attempts
 WHERE id = ANY (ARRAY(
       SELECT a.id FROM postbox.attempts a
        WHERE a.failed_at < CAST(:cutoff AS timestamptz)
          AND NOT EXISTS (SELECT 1 FROM postbox.dead_letters x
                           WHERE x.origin = a.origin AND x.origin_id = a.origin_id
                             AND x.status IN ('open', 'replaying'))
        LIMIT CAST(:limit AS integer)
        FOR UPDATE SKIP LOCKED));

-- name: prune_dead_letters
-- Closed dead letters (replayed, discarded, resolved) older than the retention.
DELETE FROM postbox.dead_letters
 WHERE id = ANY (ARRAY(
       SELECT id FROM postbox.dead_letters
        WHERE status IN ('replayed', 'discarded', 'resolved')
          AND coalesce(status_changed_at, dead_lettered_at) < CAST(:cutoff AS timestamptz)
        LIMIT CAST(:limit AS integer)
        FOR UPDATE SKIP LOCKED));

-- name: orphan_repairs
SELECT DISTINCT origin, queue FROM postbox.key_repairs WHERE created_at < CAST(:before AS timestamptz);

-- name: repair_keys
SELECT postbox.repair_keys_v1(:origin, :queue, CAST(:now AS timestamptz), CAST(:limit AS integer));

-- name: timed_out_gaps
SELECT k.consumer, count(*), min(k.gap_since)
  FROM postbox.inbox_keys k JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL AND c.gap_timeout IS NOT NULL
   AND CAST(:now AS timestamptz) - k.gap_since > c.gap_timeout
 GROUP BY k.consumer;
