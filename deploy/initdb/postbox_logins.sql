-- The logins of the compose deployment: one per service, each in the least-privileged Postbox group
-- role for what it runs (docs/operations.md, "Roles"); the password is the login's name (an example:
-- change them for anything else). The compose PostgreSQL runs this file at its first start, after
-- orders_example.sql (docker-entrypoint-initdb.d runs its files in name order); it is idempotent.
--
--   compose_owner        postbox migrate: owns the postbox schema (not a superuser)
--   compose_worker       worker-orders, worker-shipping (postbox_worker, and the example's tables)
--   compose_relay        relay   (postbox_worker)
--   compose_bridge       bridge  (postbox_worker)
--   compose_maintenance  maintenance (postbox_maintainer)
--   compose_replay       replay-runner (postbox_operator)
--   compose_console      console (postbox_operator)
DO $$
DECLARE
    r record;
BEGIN
    -- The group roles: the migration creates them when missing; made here first so that the logins
    -- can join them before the migration runs.
    FOR r IN SELECT unnest(ARRAY['postbox_producer', 'postbox_worker', 'postbox_maintainer',
                                 'postbox_operator', 'postbox_reader']) AS name LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r.name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r.name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created at the same moment elsewhere
            END;
        END IF;
    END LOOP;
    FOR r IN SELECT * FROM (VALUES
            ('compose_owner', NULL),
            ('compose_worker', 'postbox_worker'),
            ('compose_relay', 'postbox_worker'),
            ('compose_bridge', 'postbox_worker'),
            ('compose_maintenance', 'postbox_maintainer'),
            ('compose_replay', 'postbox_operator'),
            ('compose_console', 'postbox_operator')) AS logins (name, member_of) LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r.name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN', r.name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
        EXECUTE format('ALTER ROLE %I LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB PASSWORD %L', r.name, r.name);
        IF r.member_of IS NOT NULL AND NOT pg_has_role(r.name, r.member_of, 'MEMBER') THEN
            EXECUTE format('GRANT %I TO %I', r.member_of, r.name);
        END IF;
    END LOOP;
    -- The migration creates the postbox schema, which it then owns.
    EXECUTE format('GRANT CREATE ON DATABASE %I TO compose_owner', current_database());
END
$$;

-- The example's handlers write these tables in the worker's transaction.
GRANT SELECT, INSERT, UPDATE ON example_orders TO compose_worker;
GRANT SELECT, INSERT ON example_shipments TO compose_worker;
GRANT USAGE ON SEQUENCE example_shipments_id_seq TO compose_worker;
