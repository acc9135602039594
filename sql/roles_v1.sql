-- Least privilege (SPEC SEC-2). Three group roles, created if missing (roles are per cluster):
--   postbox_producer  receive into the inbox and publish to the outbox; cannot read dead letters,
--                     replay, discard or change anything else;
--   postbox_worker    what worker, relay, bridge and maintenance processes need (the live tables);
--   postbox_operator  read everything, and the operator functions (replay, discard, resolve, edit,
--                     unblock, halt/resume), which are SECURITY DEFINER and audited.
-- Grant them to your login roles:  GRANT postbox_producer TO app_user;
-- Applied last by each migration, so it covers every table and function present.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['postbox_producer', 'postbox_worker', 'postbox_operator'] LOOP
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

GRANT USAGE ON SCHEMA postbox TO postbox_producer, postbox_worker, postbox_operator;

-- Functions are executable by PUBLIC by default: not here. SECURITY DEFINER functions (the operator
-- actions) go to operators only; the rest to every Postbox role, guarded by table privileges.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA postbox FROM PUBLIC;
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS sig, p.prosecdef
               FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'postbox'
    LOOP
        IF r.prosecdef THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO postbox_operator', r.sig);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO postbox_producer, postbox_worker, postbox_operator', r.sig);
        END IF;
    END LOOP;
END
$$;

-- Producers: the live tables they write, the policies they read; nothing about failures.
GRANT SELECT, INSERT, UPDATE ON postbox.inbox, postbox.outbox TO postbox_producer;
GRANT SELECT, INSERT ON postbox.inbox_dedup, postbox.key_repairs TO postbox_producer;
GRANT SELECT ON postbox.consumers, postbox.inbox_keys TO postbox_producer;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA postbox TO postbox_producer, postbox_worker;

-- Workers, relays, bridges, maintenance: the live flow, attempts and dead-lettering.
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA postbox TO postbox_worker;
REVOKE INSERT, UPDATE, DELETE ON postbox.audit_log, postbox.dead_letter_edits, postbox.replay_jobs,
    postbox.replay_items, postbox.alembic_version FROM postbox_worker;

-- Operators: read everything (tables and views); change things only through the audited functions.
GRANT SELECT ON ALL TABLES IN SCHEMA postbox TO postbox_operator;
