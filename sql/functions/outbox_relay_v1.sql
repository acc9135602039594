-- What relays do to the outbox: the same lease-and-fence protocol as the inbox worker
-- (sql/functions/inbox_worker_v1.sql), per destination, with lock class 2.

-- Claim up to p_limit due heads of p_destination for p_lease. A batch never holds two rows of one
-- key (only heads are claimable), so its rows may be published in parallel without reordering.
CREATE OR REPLACE FUNCTION postbox.outbox_claim_v1(
    p_destination text, p_worker text, p_limit integer, p_lease interval, p_now timestamptz)
RETURNS SETOF postbox.outbox
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM postbox.repair_keys_v1('outbox', p_destination, p_now, 100);
    RETURN QUERY
    WITH due AS (
        SELECT o.id, o.state AS was_state, o.claimed_by AS was_claimed_by, o.attempt AS was_attempt
          FROM postbox.outbox o
         WHERE o.destination = p_destination
           AND o.state IN ('ready', 'running')
           AND o.available_at <= p_now
         ORDER BY o.available_at, o.id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE postbox.outbox o
           SET state = 'running',
               attempt = o.attempt + 1,
               claimed_by = p_worker,
               claimed_at = p_now,
               available_at = p_now + p_lease,
               first_failed_at = CASE WHEN due.was_state = 'running' THEN coalesce(o.first_failed_at, p_now) ELSE o.first_failed_at END,
               last_failed_at = CASE WHEN due.was_state = 'running' THEN p_now ELSE o.last_failed_at END,
               last_error = CASE WHEN due.was_state = 'running'
                                 THEN format('lease expired: relay %s died or stalled during attempt %s', o.claimed_by, o.attempt)
                                 ELSE o.last_error END,
               last_error_type = CASE WHEN due.was_state = 'running' THEN 'LeaseExpired' ELSE o.last_error_type END
          FROM due
         WHERE o.id = due.id
        RETURNING o.*),
    expired AS (
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      kind, error_type, error, decision, explanation)
        SELECT 'outbox', c.id, c.destination, c.message_id, c.key, due.was_attempt, due.was_claimed_by, p_now,
               'lease_expired', 'LeaseExpired', c.last_error, 'retry', 'published again after the lease ran out'
          FROM claimed c JOIN due ON due.id = c.id
         WHERE due.was_state = 'running')
    SELECT * FROM claimed;
END
$$;
COMMENT ON FUNCTION postbox.outbox_claim_v1(text, text, integer, interval, timestamptz)
    IS 'Relay: claim due heads of a destination (SKIP LOCKED), counting an attempt on each.';

-- Mark rows published (confirmed by the destination): they leave the outbox and the next row of
-- each key becomes its head (set-based: a few statements per batch, not per row). Keys whose lock
-- is taken right now get a repair instead. Returns the ids whose claim is no longer ours.
-- Planned for each batch (force_custom_plan): a generic plan cannot see that the ids are few and
-- walks the whole claim index instead of probing the primary key.
CREATE OR REPLACE FUNCTION postbox.outbox_complete_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_lost      bigint[];
    v_notify    text[];
BEGIN
    WITH del AS (
        -- By primary key; the attempt fences out a claim that is no longer ours.
        DELETE FROM postbox.outbox o
         WHERE o.id = ANY (p_ids) AND o.attempt = p_attempts[array_position(p_ids, o.id)]
           AND o.state = 'running'
        RETURNING o.id, o.destination, o.key),
    locked AS MATERIALIZED (
        SELECT k.destination, k.key, postbox.try_lock_key_v1(2, k.destination, k.key) AS ok
          FROM (SELECT DISTINCT destination, key FROM del) k),
    promoted AS (
        UPDATE postbox.outbox o SET state = 'ready', available_at = p_now
          FROM (SELECT nx.id
                  FROM locked k
                  CROSS JOIN LATERAL (
                      -- The first queued row of the key: one index probe, not all of its rows.
                      SELECT p.id FROM postbox.outbox p
                       WHERE p.destination = k.destination AND p.key = k.key AND p.state = 'pending'
                       ORDER BY p.position, p.id
                       LIMIT 1) nx
                 WHERE k.ok) n
         WHERE o.id = n.id
        RETURNING o.destination),
    repairs AS (
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT 'outbox', destination, key FROM locked WHERE NOT ok)
    SELECT coalesce((SELECT array_agg(u.id) FROM unnest(p_ids) AS u(id) WHERE u.id NOT IN (SELECT id FROM del)), '{}'),
           (SELECT array_agg(DISTINCT destination) FROM promoted)
      INTO v_lost, v_notify;
    IF v_notify IS NOT NULL AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('postbox_outbox', d) FROM unnest(v_notify) AS d;
    END IF;
    RETURN v_lost;
END
$$;
COMMENT ON FUNCTION postbox.outbox_complete_v1(bigint[], integer[], timestamptz)
    IS 'Relay: mark rows published (fenced by attempt) and promote the next row of each key.';

-- After a key's head left: promote its next row now if the key lock is free, else file a repair.
CREATE OR REPLACE FUNCTION postbox.outbox_next_v1(p_destination text, p_key text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF postbox.try_lock_key_v1(2, p_destination, p_key) THEN
        PERFORM postbox.outbox_promote_v1(p_destination, p_key, p_now);
    ELSE
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('outbox', p_destination, p_key);
    END IF;
END
$$;

-- A failed publish that will be retried: the row stays the head of its key.
CREATE OR REPLACE FUNCTION postbox.outbox_retry_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_retry_at timestamptz,
    p_error text, p_error_type text, p_kind text DEFAULT 'transient', p_traceback text DEFAULT NULL,
    p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL, p_explanation text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_done boolean;
BEGIN
    WITH u AS (
        UPDATE postbox.outbox
           SET state = 'ready', available_at = p_retry_at, next_retry_at = p_retry_at,
               first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
               last_error = p_error, last_error_type = p_error_type
         WHERE id = p_id AND attempt = p_attempt AND state = 'running'
        RETURNING id, destination, message_id, key),
    a AS (
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      duration_ms, kind, error_type, error, traceback, decision, explanation,
                                      next_retry_at)
        SELECT 'outbox', u.id, u.destination, u.message_id, u.key, p_attempt, p_worker, p_now, p_duration_ms,
               p_kind, p_error_type, p_error, p_traceback, 'retry', p_explanation, p_retry_at
          FROM u)
    SELECT EXISTS (SELECT 1 FROM u) INTO v_done;
    RETURN v_done;
END
$$;

-- Dead-letter an outbox row. p_policy: block (default: the key's later rows wait) or skip.
CREATE OR REPLACE FUNCTION postbox.outbox_dead_letter_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_reason text, p_error text,
    p_error_type text, p_traceback text, p_fingerprint text, p_policy text DEFAULT 'block',
    p_kind text DEFAULT 'permanent', p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL,
    p_explanation text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_row  record;
    v_dl   bigint;
BEGIN
    SELECT destination, key, message_id INTO v_row FROM postbox.outbox
     WHERE id = p_id AND attempt = p_attempt AND state = 'running';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM postbox.outbox WHERE id = p_id AND attempt = p_attempt AND state = 'running' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                  duration_ms, kind, error_type, error, traceback, decision, explanation)
    VALUES ('outbox', p_id, v_row.destination, v_row.message_id, v_row.key, p_attempt, p_worker, p_now,
            p_duration_ms, p_kind, p_error_type, p_error, p_traceback, 'dead_letter',
            coalesce(p_explanation, p_reason) || ' (' || coalesce(p_policy, 'block') || ')');
    INSERT INTO postbox.dead_letters (
        origin, origin_id, destination, message_id, key, position, type, payload, headers, correlation_id,
        causation_id, received_at, attempt, first_failed_at, last_failed_at, last_error, last_error_type,
        last_traceback, reason, fingerprint, ordering_policy, dead_lettered_at)
    SELECT 'outbox', o.id, o.destination, o.message_id, o.key, o.position, o.type, o.payload, o.headers,
           o.correlation_id, o.causation_id, o.created_at, o.attempt, coalesce(o.first_failed_at, p_now), p_now,
           p_error, p_error_type, p_traceback, p_reason, p_fingerprint, coalesce(p_policy, 'block'), p_now
      FROM postbox.outbox o WHERE o.id = p_id
    RETURNING id INTO v_dl;
    IF coalesce(p_policy, 'block') = 'skip' THEN
        DELETE FROM postbox.outbox WHERE id = p_id;
        PERFORM postbox.outbox_next_v1(v_row.destination, v_row.key, p_now);
    ELSE
        UPDATE postbox.outbox
           SET state = 'blocked', available_at = p_now, next_retry_at = NULL,
               first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
               last_error = p_error, last_error_type = p_error_type
         WHERE id = p_id;
    END IF;
    RETURN v_dl;
END
$$;

CREATE OR REPLACE FUNCTION postbox.outbox_release_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE postbox.outbox o
       SET state = 'ready', available_at = p_now, attempt = o.attempt - 1
      FROM unnest(p_ids, p_attempts) AS r(id, attempt)
     WHERE o.id = r.id AND o.attempt = r.attempt AND o.state = 'running';
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
