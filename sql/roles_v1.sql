-- Least privilege, enforced by PostgreSQL. Five group roles, created if missing (roles are per
-- cluster), each allowed exactly what its processes do:
--   postbox_producer    receive into the inbox, publish to the outbox: through functions only;
--                       no right on any table (cannot read nor change a message, its own included);
--   postbox_worker      worker, relay and bridge processes: claim, complete, retry, dead-letter and
--                       release inbox and outbox messages, heartbeat, declare its consumer, and what
--                       producers may (handlers publish, bridges receive); reads postbox.consumers;
--   postbox_maintainer  postbox maintain: prune, repair, reap, its bookkeeping, through functions;
--                       reads the small bookkeeping tables it schedules from (no payloads);
--   postbox_operator    reads every table and view; changes things only through the audited
--                       operator functions (replay, discard, resolve, edit, unblock, halt/resume);
--   postbox_reader      reads every table and view (DBAs, dashboards), payloads included; nothing else.
-- No Postbox role may INSERT, UPDATE, DELETE or TRUNCATE any table, or use a sequence: every change
-- goes through a function below that is SECURITY DEFINER with a fixed search_path, so it runs as
-- its owner (the role that ran the migration, which owns the tables). The owner and superusers
-- remain unrestricted. Grant the group roles to your logins:  GRANT postbox_producer TO app_user;
-- Applied last by each migration (idempotent): it covers every table and function present.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['postbox_producer', 'postbox_worker', 'postbox_maintainer', 'postbox_operator',
                             'postbox_reader'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database's migration created it at the same moment
            END;
        END IF;
    END LOOP;
END
$$;

-- Start from nothing: no right for PUBLIC nor any Postbox role on anything in the schema.
REVOKE ALL ON SCHEMA postbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA postbox
    FROM PUBLIC, postbox_producer, postbox_worker, postbox_maintainer, postbox_operator, postbox_reader;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA postbox
    FROM PUBLIC, postbox_producer, postbox_worker, postbox_maintainer, postbox_operator, postbox_reader;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA postbox
    FROM PUBLIC, postbox_producer, postbox_worker, postbox_maintainer, postbox_operator, postbox_reader;
GRANT USAGE ON SCHEMA postbox
    TO postbox_producer, postbox_worker, postbox_maintainer, postbox_operator, postbox_reader;

-- Functions: who may call which. "definer" entry points change tables the callers have no right
-- on, or call internal helpers: they run as their owner, with search_path fixed. The others (the
-- unversioned aliases, the size limits, dlq_explain_v1) run with the caller's rights, and only call
-- entry points or read what their callers may read (a caller's-rights function calling a helper
-- would be refused it). Internal helpers are in no list: callable by no
-- Postbox role (they run inside the entry points, as the owner; they are not SECURITY DEFINER, so
-- that per-row calls stay cheap and inlinable). A function missing here is callable by nobody but
-- the owner (tests/test_roles.py fails until it is placed in its matrix).
DO $$
DECLARE
    r       record;
    v_role  text;
BEGIN
    FOR r IN
        WITH entry (name, definer, roles) AS (VALUES
            -- Producers (and workers: handlers publish in the worker's transaction, bridges receive).
            ('inbox_receive_v1',            true,  '{postbox_producer,postbox_worker}'::text[]),
            ('inbox_receive_batch_v1',      true,  '{postbox_producer,postbox_worker}'),
            ('inbox_receive_columns_v1',    true,  '{postbox_producer,postbox_worker}'),
            ('inbox_receive_arrays_v1',     true,  '{postbox_producer,postbox_worker}'),
            ('outbox_publish_v1',           true,  '{postbox_producer,postbox_worker}'),
            ('outbox_publish_batch_v1',     true,  '{postbox_producer,postbox_worker}'),
            ('inbox_receive',               false, '{postbox_producer,postbox_worker}'),
            ('inbox_receive_batch',         false, '{postbox_producer,postbox_worker}'),
            ('outbox_publish',              false, '{postbox_producer,postbox_worker}'),
            ('outbox_publish_batch',        false, '{postbox_producer,postbox_worker}'),
            -- The size limits in force, read by the Python producer before sending a large message.
            ('max_payload_bytes_v1',        false, '{postbox_producer,postbox_worker}'),
            ('max_headers_bytes_v1',        false, '{postbox_producer,postbox_worker}'),
            -- Workers: the inbox side, declaring the consumer's policies at start.
            ('declare_consumer_v1',         true,  '{postbox_worker}'),
            ('inbox_claim_v1',              true,  '{postbox_worker}'),
            ('inbox_complete_v1',           true,  '{postbox_worker}'),
            ('inbox_retry_v1',              true,  '{postbox_worker}'),
            ('inbox_dead_letter_v1',        true,  '{postbox_worker}'),
            ('inbox_exhaust_v1',            true,  '{postbox_worker}'),
            ('inbox_release_v1',            true,  '{postbox_worker}'),
            -- Relays: the outbox side.
            ('outbox_claim_v1',             true,  '{postbox_worker}'),
            ('outbox_complete_v1',          true,  '{postbox_worker}'),
            ('outbox_retry_v1',             true,  '{postbox_worker}'),
            ('outbox_dead_letter_v1',       true,  '{postbox_worker}'),
            ('outbox_release_v1',           true,  '{postbox_worker}'),
            -- Every long-running process: presence, and recovering the claims of dead ones.
            ('worker_heartbeat_v1',         true,  '{postbox_worker,postbox_maintainer}'),
            ('reap_stale_workers_v1',       true,  '{postbox_worker,postbox_maintainer}'),
            ('worker_unregister_v1',        true,  '{postbox_worker,postbox_maintainer}'),
            -- Gauges for /metrics and dashboards: counts and ages, no payloads.
            ('metrics_snapshot_v1',         true,  '{postbox_worker,postbox_maintainer,postbox_operator,postbox_reader}'),
            -- Maintenance.
            ('maintenance_register_v1',     true,  '{postbox_maintainer}'),
            ('maintenance_claim_v1',        true,  '{postbox_maintainer}'),
            ('maintenance_finish_v1',       true,  '{postbox_maintainer}'),
            ('prune_dedup_v1',              true,  '{postbox_maintainer}'),
            ('prune_attempts_v1',           true,  '{postbox_maintainer}'),
            ('prune_dead_letters_v1',       true,  '{postbox_maintainer}'),
            ('maintenance_repair_keys_v1',  true,  '{postbox_maintainer}'),
            -- Operators: every change audited.
            ('dlq_discard_v1',              true,  '{postbox_operator}'),
            ('dlq_resolve_v1',              true,  '{postbox_operator}'),
            ('dlq_edit_v1',                 true,  '{postbox_operator}'),
            ('dlq_replay_v1',               true,  '{postbox_operator}'),
            ('replay_step_v1',              true,  '{postbox_operator}'),
            ('replay_pause_v1',             true,  '{postbox_operator}'),
            ('replay_resume_v1',            true,  '{postbox_operator}'),
            ('replay_cancel_v1',            true,  '{postbox_operator}'),
            ('key_unblock_v1',              true,  '{postbox_operator}'),
            ('consumer_halt_op_v1',         true,  '{postbox_operator}'),
            ('consumer_resume_op_v1',       true,  '{postbox_operator}'),
            ('dlq_discard',                 false, '{postbox_operator}'),
            ('dlq_resolve',                 false, '{postbox_operator}'),
            ('dlq_edit',                    false, '{postbox_operator}'),
            ('dlq_replay',                  false, '{postbox_operator}'),
            ('replay_step',                 false, '{postbox_operator}'),
            ('replay_pause',                false, '{postbox_operator}'),
            ('replay_resume',               false, '{postbox_operator}'),
            ('replay_cancel',               false, '{postbox_operator}'),
            ('key_unblock',                 false, '{postbox_operator}'),
            ('consumer_halt',               false, '{postbox_operator}'),
            ('consumer_resume',             false, '{postbox_operator}'),
            -- Reading dead letters: what these roles may SELECT anyway (the filter's checks call
            -- internal helpers, hence SECURITY DEFINER).
            ('dlq_select_v1',               true,  '{postbox_operator,postbox_reader}'),
            ('dlq_explain_v1',              false, '{postbox_operator,postbox_reader}'),
            ('dlq_select',                  false, '{postbox_operator,postbox_reader}'),
            ('dlq_explain',                 false, '{postbox_operator,postbox_reader}'))
        SELECT p.oid::regprocedure AS sig, e.definer, e.roles
          FROM entry e
          JOIN pg_proc p ON p.proname = e.name
          JOIN pg_namespace n ON n.oid = p.pronamespace AND n.nspname = 'postbox'
    LOOP
        IF r.definer THEN
            EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp', r.sig);
        END IF;
        FOREACH v_role IN ARRAY r.roles LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', r.sig, v_role);
        END LOOP;
    END LOOP;

    -- Trigger functions run as whoever fires them, and deferred ones (inbox_pending_commit_v1,
    -- outbox_pending_commit_v1) at COMMIT, outside any entry point: as the producer's own login. So
    -- they too run as their owner, with search_path fixed. (Triggers need no EXECUTE grant.)
    FOR r IN SELECT p.oid::regprocedure AS sig
               FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'postbox' AND p.prorettype = 'pg_catalog.trigger'::regtype
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp', r.sig);
    END LOOP;
END
$$;

-- Tables and views: read-only, and only where a process needs to read.
GRANT SELECT ON ALL TABLES IN SCHEMA postbox TO postbox_operator, postbox_reader;
-- Bridges wait until their consumer is declared.
GRANT SELECT ON postbox.consumers TO postbox_worker;
-- postbox maintain: job bookkeeping, orphaned repairs, gapless keys past their gap_timeout.
GRANT SELECT ON postbox.maintenance_runs, postbox.key_repairs, postbox.inbox_keys, postbox.consumers
    TO postbox_maintainer;
