-- How a key's head moves on. Callers hold the key lock exclusively (postbox.try_lock_key_v1(1, ...)).

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

-- Make the next message of a key its head, if the key has none. Applies the consumer's sequence
-- mode: gapless waits for the expected sequence (recording gap_since), monotonic and gapless apply
-- the late policy to messages at or below the last processed sequence. Returns the new head's id.
CREATE OR REPLACE FUNCTION postbox.inbox_promote_v1(p_consumer text, p_key text, p_now timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_rc      boolean := current_setting('transaction_isolation') = 'read committed';
    v_mode    text := 'arrival';
    v_first   bigint := 1;
    v_late    text := 'dead_letter';
    v_last    bigint;
    v_gap     timestamptz;
    r         record;
BEGIN
    IF v_rc THEN
        PERFORM 1 FROM postbox.inbox WHERE consumer = p_consumer AND key = p_key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head committed after our snapshot is invisible; locking the one we
        -- see fails with a serialization error if it changed, which the caller retries.
        PERFORM 1 FROM postbox.inbox WHERE consumer = p_consumer AND key = p_key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT c.sequence_mode, c.first_sequence, c.late_policy INTO v_mode, v_first, v_late
      FROM postbox.consumers c WHERE c.name = p_consumer;
    v_mode := coalesce(v_mode, 'arrival');
    IF v_mode <> 'arrival' THEN
        SELECT k.last_sequence, k.gap_since INTO v_last, v_gap
          FROM postbox.inbox_keys k WHERE k.consumer = p_consumer AND k.key = p_key;
    END IF;
    LOOP
        SELECT i.id, i.position INTO r FROM postbox.inbox i
         WHERE i.consumer = p_consumer AND i.key = p_key AND i.state = 'pending'
         ORDER BY i.position, i.id LIMIT 1;
        IF NOT FOUND THEN
            IF v_gap IS NOT NULL THEN
                UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
            END IF;
            RETURN NULL;
        END IF;
        IF v_mode <> 'arrival' AND r.position <= v_last AND v_late <> 'process' THEN
            -- Late: a sequence at or below one already processed. Recorded, and the key goes on.
            PERFORM postbox.inbox_copy_to_dead_letters_v1(
                r.id, 'late', format('sequence %s is not above the last processed sequence %s of the key', r.position, v_last),
                'LateSequence', NULL, 'LateSequence', 'skip', p_now,
                CASE WHEN v_late = 'skip' THEN 'discarded' ELSE 'open' END);
            DELETE FROM postbox.inbox WHERE id = r.id;
            CONTINUE;
        END IF;
        IF v_mode = 'gapless' AND r.position > coalesce(v_last + 1, v_first) THEN
            IF v_gap IS NULL THEN
                INSERT INTO postbox.inbox_keys AS k (consumer, key, gap_since) VALUES (p_consumer, p_key, p_now)
                ON CONFLICT (consumer, key) DO UPDATE SET gap_since = coalesce(k.gap_since, excluded.gap_since);
            END IF;
            RETURN NULL;
        END IF;
        -- No head can appear meanwhile: a producer's insert-as-head waits on the old head's
        -- deletion (or sees pending rows and queues); repairs guard against the rest.
        UPDATE postbox.inbox SET state = 'ready', available_at = p_now WHERE id = r.id;
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_inbox', p_consumer);
        END IF;
        IF v_gap IS NOT NULL THEN
            UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
        END IF;
        RETURN r.id;
    END LOOP;
END
$$;
COMMENT ON FUNCTION postbox.inbox_promote_v1(text, text, timestamptz)
    IS 'Internal: make the next message of a key its head. Caller holds the key lock.';

-- Deferred to the producer's commit: a message queued behind a head re-checks, holding the key lock
-- shared (so that no worker decides the key's head meanwhile), that its key still has a head. If the
-- head finished while this transaction was open, it files a repair: the next claim of a worker
-- makes the key's next message its head. Producers never promote (no waits between producers).
CREATE OR REPLACE FUNCTION postbox.inbox_pending_commit_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM postbox.lock_key_shared_v1(1, NEW.consumer, NEW.key);
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM postbox.inbox WHERE consumer = NEW.consumer AND key = NEW.key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted: locking
        -- it fails with a serialization error instead, which the producer retries.
        PERFORM 1 FROM postbox.inbox WHERE consumer = NEW.consumer AND key = NEW.key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', NEW.consumer, NEW.key);
    END IF;
    RETURN NULL;
END
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
