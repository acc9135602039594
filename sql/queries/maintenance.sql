-- Maintenance queries (service/postbox/operations/maintenance.py): the bookkeeping that makes each job run once per
-- period across processes, and the jobs themselves, each deleting one small batch per call. Changes
-- go through functions (sql/functions/roles_api_v1.sql): postbox_maintainer has no right to change
-- a table itself.

-- name: maintenance_register
SELECT postbox.maintenance_register_v1(CAST(:jobs AS text[]));

-- name: maintenance_try_lock
SELECT pg_try_advisory_lock(hashtext('postbox.maintenance'), hashtext(:job));

-- name: maintenance_unlock
SELECT pg_advisory_unlock(hashtext('postbox.maintenance'), hashtext(:job));

-- name: maintenance_claim
-- One row (the job's run count) if the run is claimed, none if it is not due or another process has it.
SELECT runs FROM postbox.maintenance_claim_v1(:job, CAST(:now AS timestamptz), :runner,
                                              CAST(:min_gap AS float8)) AS runs;

-- name: maintenance_finish
SELECT postbox.maintenance_finish_v1(:job, CAST(:now AS timestamptz), CAST(:rows AS bigint), CAST(:error AS text));

-- name: maintenance_last_success
SELECT job, extract(epoch FROM last_success_at)::float8 FROM postbox.maintenance_runs WHERE last_success_at IS NOT NULL;

-- name: dedup_rotate
-- Truncate the deduplication ledger's older slot and make it the one receives write, once a window
-- (and a margin) has passed since the last rotation. Returns about how many rows it dropped.
SELECT postbox.dedup_rotate_v1(CAST(:now AS timestamptz));

-- name: prune_attempts
-- Failed-attempt history older than the retention, except that of open dead letters.
SELECT postbox.prune_attempts_v1(CAST(:cutoff AS timestamptz), CAST(:limit AS integer));

-- name: prune_dead_letters
-- Closed dead letters (replayed, discarded, resolved) older than the retention.
SELECT postbox.prune_dead_letters_v2(CAST(:cutoff AS timestamptz), CAST(:limit AS integer));

-- name: orphan_repairs
SELECT DISTINCT origin, queue FROM postbox.key_repairs WHERE created_at < CAST(:before AS timestamptz);

-- name: repair_keys
SELECT postbox.maintenance_repair_keys_v1(:origin, :queue, CAST(:now AS timestamptz), CAST(:limit AS integer));

-- name: timed_out_gaps
SELECT k.consumer, count(*), min(k.gap_since)
  FROM postbox.inbox_keys k JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL AND c.gap_timeout IS NOT NULL
   AND CAST(:now AS timestamptz) - k.gap_since > c.gap_timeout
 GROUP BY k.consumer;

-- name: dedup_window_seconds
-- The deduplication window in force, in seconds (read before setting it, to log a change).
SELECT extract(epoch FROM retention)::float8 FROM postbox.dedup_window;

-- name: dedup_window_set
-- The deduplication window from the configuration (receives use it: a message received again later
-- than this after its first receipt is new). Returns the window in force.
SELECT postbox.dedup_window_set_v1(CAST(:seconds AS double precision));

-- name: vacuum_candidates
-- The queue tables with at least :min_dead dead row versions (the statistics', a second or so
-- behind), and whether this role may vacuum them: on PostgreSQL 15, their owner, the database's
-- owner or a superuser (a member of one counts).
SELECT c.relname::text,
       r.rolsuper OR pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE'),
       pg_stat_get_dead_tuples(c.oid)
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_roles r ON r.rolname = current_user
  JOIN pg_database d ON d.datname = current_database()
 WHERE n.nspname = 'postbox' AND c.relname IN ('inbox', 'outbox')
   AND pg_stat_get_dead_tuples(c.oid) >= CAST(:min_dead AS bigint)
 ORDER BY c.relname;

-- name: autovacuum_enabled
SELECT current_setting('autovacuum')::boolean;
