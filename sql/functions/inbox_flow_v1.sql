-- How a key's head moves on: dead-lettering an inbox row, and repairs of keys whose head finished
-- while a producer added to them. Promotion itself (inbox_promote_v1, outbox_promote_v1) is queue_v1.sql.

-- Copy an inbox row into postbox.dead_letters; returns the dead letter's id. The caller decides what
-- happens to the inbox row (blocked head, or deleted and the key moves on).
CREATE OR REPLACE FUNCTION postbox.inbox_copy_to_dead_letters_v1(
    p_id bigint, p_reason text, p_error text, p_error_type text, p_traceback text,
    p_fingerprint text, p_policy text, p_now timestamptz, p_status text DEFAULT 'open')
RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    INSERT INTO postbox.dead_letters (
        origin, origin_id, consumer, message_id, key, sequence, position, type, schema_version, payload,
        headers, correlation_id, causation_id, source, received_at, attempt, first_failed_at,
        last_failed_at, last_error, last_error_type, last_traceback, reason, fingerprint,
        ordering_policy, status, dead_lettered_at, status_changed_at)
    SELECT 'inbox', i.id, i.consumer, i.message_id, i.key, i.sequence, i.position, i.type, i.schema_version,
           i.payload, i.headers, i.correlation_id, i.causation_id, i.source, i.received_at, i.attempt,
           coalesce(i.first_failed_at, CASE WHEN p_error IS NOT NULL THEN p_now END),
           CASE WHEN p_error IS NOT NULL THEN p_now ELSE i.last_failed_at END,
           coalesce(p_error, i.last_error), coalesce(p_error_type, i.last_error_type), p_traceback,
           p_reason, p_fingerprint, p_policy, p_status, p_now,
           CASE WHEN p_status <> 'open' THEN p_now END
      FROM postbox.inbox i WHERE i.id = p_id
    RETURNING id
$$;

-- Make heads for keys whose repair was filed (see inbox_pending_commit_v1 and the worker's
-- complete). Called at the start of every claim; never waits: a key locked by someone else, or with
-- a producer's head still uncommitted, is left for the next claim.
CREATE OR REPLACE FUNCTION postbox.repair_keys_v1(p_origin text, p_queue text, p_now timestamptz, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r         record;
    v_done    integer := 0;
    v_timeout text := current_setting('lock_timeout');
BEGIN
    IF NOT EXISTS (SELECT 1 FROM postbox.key_repairs WHERE origin = p_origin AND queue = p_queue) THEN
        RETURN 0;
    END IF;
    PERFORM set_config('lock_timeout', '50ms', true);
    FOR r IN SELECT DISTINCT key FROM postbox.key_repairs
              WHERE origin = p_origin AND queue = p_queue LIMIT p_limit
    LOOP
        IF NOT postbox.try_lock_key_v1(CASE p_origin WHEN 'inbox' THEN 1 ELSE 2 END, p_queue, r.key) THEN
            CONTINUE;
        END IF;
        BEGIN
            IF p_origin = 'inbox' THEN
                PERFORM postbox.inbox_promote_v1(p_queue, r.key, p_now);
            ELSE
                PERFORM postbox.outbox_promote_v1(p_queue, r.key, p_now);
            END IF;
            DELETE FROM postbox.key_repairs WHERE origin = p_origin AND queue = p_queue AND key = r.key;
            v_done := v_done + 1;
        EXCEPTION WHEN lock_not_available OR unique_violation THEN
            NULL;  -- a producer is inserting a head for this key right now: it is not orphaned
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION postbox.repair_keys_v1(text, text, timestamptz, integer)
    IS 'Internal: give keys whose head finished during a producer''s transaction their next head.';
