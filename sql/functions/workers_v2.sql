-- Revision 0002: a process keeps its heartbeat while it drains, and says so.
--
-- In 0.1.0 a process stopped beating as soon as it was asked to stop, while its in-flight handlers
-- still ran for up to the grace period; past stale_after, any other process reaped it and made its
-- messages due again, so they ran a second time beside the first (the first one's writes were
-- fenced, but its outside effects were not). From 0.2.0 a process beats until it has finished,
-- with stopping_at set once it drains (postbox status shows it), and records the schema revision
-- its code was written for, so that a rolling deploy shows which processes still run the old release.
-- worker_heartbeat_v1 stays: 0.1.0 processes keep calling it during the deploy.
CREATE OR REPLACE FUNCTION postbox.worker_heartbeat_v2(
    p_id text, p_kind text, p_queue text, p_host text, p_pid integer, p_concurrency integer,
    p_version text, p_schema_revision text, p_stopping boolean, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO postbox.workers AS w (id, kind, queue, host, pid, concurrency, version, schema_revision,
                                      started_at, heartbeat_at, stopping_at)
    VALUES (p_id, p_kind, p_queue, p_host, p_pid, p_concurrency, p_version, p_schema_revision, p_now, p_now,
            CASE WHEN p_stopping THEN p_now END)
    ON CONFLICT (id) DO UPDATE
       SET heartbeat_at = excluded.heartbeat_at,
           stopping_at = CASE WHEN p_stopping THEN coalesce(w.stopping_at, excluded.heartbeat_at) END;
END
$$;
COMMENT ON FUNCTION postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz)
    IS 'Process: register or beat (also while draining: p_stopping sets stopping_at), with the schema revision its code needs.';

-- Like every entry point (roles_v1.sql): runs as its owner, callable by the process roles only.
ALTER FUNCTION postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz)
    SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
REVOKE ALL ON FUNCTION postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz)
    TO postbox_worker, postbox_maintainer;
