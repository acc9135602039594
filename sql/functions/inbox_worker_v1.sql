-- What workers do to the inbox. Every write after the claim is fenced by (id, attempt): a worker
-- whose lease ran out (it stalled, another worker re-claimed the message) changes nothing.

-- Claim up to p_limit heads of consumer p_consumer that are due, for p_lease. Counts a delivery on
-- each (so a message that kills its worker still uses up attempts). Runs in its own short
-- transaction; heads whose lease ran out are claimed again, with the expiry recorded as the error.
CREATE OR REPLACE FUNCTION postbox.inbox_claim_v1(
    p_consumer text, p_worker text, p_limit integer, p_lease interval, p_now timestamptz)
RETURNS SETOF postbox.inbox
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The claim is bookkeeping: if the server crashes before it reaches disk, the message is simply
    -- claimable again. Any later synchronous commit (the handler's) flushes it too.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM postbox.repair_keys_v1('inbox', p_consumer, p_now, 100);
    RETURN QUERY
    WITH due AS (
        SELECT i.id, i.state AS was_state, i.claimed_by AS was_claimed_by, i.attempt AS was_attempt
          FROM postbox.inbox i
         WHERE i.consumer = p_consumer
           AND i.state IN ('ready', 'running')
           AND i.available_at <= p_now
           AND NOT EXISTS (SELECT 1 FROM postbox.consumers c WHERE c.name = p_consumer AND c.halted_at IS NOT NULL)
         ORDER BY i.available_at, i.id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE postbox.inbox i
           SET state = 'running',
               attempt = i.attempt + 1,
               claimed_by = p_worker,
               claimed_at = p_now,
               available_at = p_now + p_lease,
               first_failed_at = CASE WHEN due.was_state = 'running' THEN coalesce(i.first_failed_at, p_now) ELSE i.first_failed_at END,
               last_failed_at = CASE WHEN due.was_state = 'running' THEN p_now ELSE i.last_failed_at END,
               last_error = CASE WHEN due.was_state = 'running'
                                 THEN format('lease expired: worker %s died or stalled during attempt %s', i.claimed_by, i.attempt)
                                 ELSE i.last_error END,
               last_error_type = CASE WHEN due.was_state = 'running' THEN 'LeaseExpired' ELSE i.last_error_type END
          FROM due
         WHERE i.id = due.id
        RETURNING i.*),
    expired AS (
        -- A lease that ran out is a failed attempt too: the worker died or stalled mid-handler.
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      kind, error_type, error, decision, explanation)
        SELECT 'inbox', c.id, c.consumer, c.message_id, c.key, due.was_attempt, due.was_claimed_by, p_now,
               'lease_expired', 'LeaseExpired', c.last_error, 'retry', 'delivered again after the lease ran out'
          FROM claimed c JOIN due ON due.id = c.id
         WHERE due.was_state = 'running')
    SELECT * FROM claimed;
END
$$;
COMMENT ON FUNCTION postbox.inbox_claim_v1(text, text, integer, interval, timestamptz)
    IS 'Worker: claim due heads of a consumer (SKIP LOCKED), counting a delivery on each.';

-- Mark messages done inside the transaction that holds their handlers' effects: the message leaves
-- the inbox and the next message of its key becomes head. Returns the ids that were NOT completed
-- because their claim is no longer ours (the caller must then roll back those effects).
-- Set-based when every message goes to an arrival-ordered consumer under READ COMMITTED (the usual
-- case): one statement takes the batch's rows out (locked in the same order as one at a time), one
-- try-locks their keys and files repairs for those held by someone else, one makes the next
-- message of each key its head. Otherwise (sequenced consumers track each key's last sequence;
-- REPEATABLE READ must lock the heads it sees) one message at a time through inbox_finish_v1.
-- Either way: the same rows deleted, the same heads made, the same repairs filed.
CREATE OR REPLACE FUNCTION postbox.inbox_complete_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r           record;
    v_lost      bigint[] := '{}';
    v_done      bigint[];
    v_consumers text[];
    v_keys      text[];
    v_woken     text[];
BEGIN
    IF current_setting('transaction_isolation') = 'read committed'
       AND NOT EXISTS (SELECT 1 FROM postbox.inbox i JOIN postbox.consumers c ON c.name = i.consumer
                        WHERE i.id = ANY(p_ids) AND c.sequence_mode <> 'arrival') THEN
        -- Fenced: still ours (same attempt, still running); locked in one global order.
        WITH t AS (
            SELECT i.id FROM postbox.inbox i
              JOIN unnest(p_ids, p_attempts) AS u(id, attempt) ON i.id = u.id AND i.attempt = u.attempt
             WHERE i.state = 'running'
             ORDER BY hashtext(i.consumer || '/' || i.key), i.id
               FOR UPDATE OF i),
        d AS (
            DELETE FROM postbox.inbox i USING t WHERE i.id = t.id RETURNING i.id, i.consumer, i.key)
        SELECT array_agg(d.id), array_agg(d.consumer), array_agg(d.key) INTO v_done, v_consumers, v_keys FROM d;
        v_lost := ARRAY(SELECT u.id FROM unnest(p_ids) AS u(id) WHERE u.id <> ALL(coalesce(v_done, '{}')));
        IF v_done IS NULL THEN
            RETURN v_lost;
        END IF;
        -- Each key's lock, only ever tried (never waited for): a key held by someone else gets a
        -- repair, and the next claim makes its head; the others get their next message as head
        -- now, unless one appeared meanwhile.
        WITH k AS MATERIALIZED (
            SELECT x.consumer, x.key, postbox.try_lock_key_v1(1, x.consumer, x.key) AS locked
              FROM unnest(v_consumers, v_keys) AS x(consumer, key)),
        repairs AS (
            INSERT INTO postbox.key_repairs (origin, queue, key)
            SELECT 'inbox', k.consumer, k.key FROM k WHERE NOT k.locked),
        heads AS (
            UPDATE postbox.inbox i SET state = 'ready', available_at = p_now
              FROM (SELECT n.id
                      FROM k, LATERAL (SELECT p.id FROM postbox.inbox p
                                        WHERE p.consumer = k.consumer AND p.key = k.key AND p.state = 'pending'
                                        ORDER BY p.position, p.id LIMIT 1) n
                     WHERE k.locked
                       AND NOT EXISTS (SELECT 1 FROM postbox.inbox h
                                        WHERE h.consumer = k.consumer AND h.key = k.key AND h.state <> 'pending')) nx
             WHERE i.id = nx.id
            RETURNING i.consumer)
        SELECT array_agg(DISTINCT heads.consumer) INTO v_woken FROM heads;
        IF v_woken IS NOT NULL AND postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_inbox', c) FROM unnest(v_woken) AS c;
        END IF;
        RETURN v_lost;
    END IF;
    FOR r IN
        SELECT u.id, u.attempt, i.consumer, i.key
          FROM unnest(p_ids, p_attempts) AS u(id, attempt)
          LEFT JOIN postbox.inbox i ON i.id = u.id
         ORDER BY hashtext(i.consumer || '/' || i.key), u.id   -- one lock order, no deadlocks
    LOOP
        IF r.consumer IS NULL THEN
            v_lost := v_lost || r.id;
            CONTINUE;
        END IF;
        IF NOT postbox.inbox_finish_v1(r.id, r.attempt, p_now, true) THEN
            v_lost := v_lost || r.id;
        END IF;
    END LOOP;
    RETURN v_lost;
END
$$;
COMMENT ON FUNCTION postbox.inbox_complete_v1(bigint[], integer[], timestamptz)
    IS 'Worker: mark messages done (fenced by attempt) and promote the next message of each key; returns ids no longer held.';

-- Internal: take a finished (done or skipped) message out of the inbox, record its sequence for
-- sequenced consumers, and promote the next one if the key lock is free right now (else file a
-- repair, done at the next claim). False if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.inbox_finish_v1(p_id bigint, p_attempt integer, p_now timestamptz, p_fenced boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_row  record;
    v_mode text;
BEGIN
    IF p_fenced THEN
        DELETE FROM postbox.inbox WHERE id = p_id AND attempt = p_attempt AND state = 'running'
        RETURNING consumer, key, sequence INTO v_row;
    ELSE
        DELETE FROM postbox.inbox WHERE id = p_id RETURNING consumer, key, sequence INTO v_row;
    END IF;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT c.sequence_mode INTO v_mode FROM postbox.consumers c WHERE c.name = v_row.consumer;
    IF coalesce(v_mode, 'arrival') <> 'arrival' AND v_row.sequence IS NOT NULL THEN
        INSERT INTO postbox.inbox_keys AS k (consumer, key, last_sequence, last_done_at)
        VALUES (v_row.consumer, v_row.key, v_row.sequence, p_now)
        ON CONFLICT (consumer, key) DO UPDATE
           SET last_sequence = greatest(k.last_sequence, excluded.last_sequence), last_done_at = excluded.last_done_at;
    END IF;
    IF postbox.try_lock_key_v1(1, v_row.consumer, v_row.key) THEN
        PERFORM postbox.inbox_promote_v1(v_row.consumer, v_row.key, p_now);
    ELSE
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_row.consumer, v_row.key);
    END IF;
    RETURN true;
END
$$;

-- A failed attempt that will be retried: the message stays the head of its key (later messages
-- stay behind it) and becomes claimable again at p_retry_at. The attempt is recorded in
-- postbox.attempts with its explanation. Returns false if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.inbox_retry_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_retry_at timestamptz,
    p_error text, p_error_type text, p_kind text DEFAULT 'transient', p_traceback text DEFAULT NULL,
    p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL, p_explanation text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_done boolean;
BEGIN
    WITH u AS (
        UPDATE postbox.inbox
           SET state = 'ready', available_at = p_retry_at, next_retry_at = p_retry_at,
               first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
               last_error = p_error, last_error_type = p_error_type
         WHERE id = p_id AND attempt = p_attempt AND state = 'running'
        RETURNING id, consumer, message_id, key),
    a AS (
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      duration_ms, kind, error_type, error, traceback, decision, explanation,
                                      next_retry_at)
        SELECT 'inbox', u.id, u.consumer, u.message_id, u.key, p_attempt, p_worker, p_now, p_duration_ms,
               p_kind, p_error_type, p_error, p_traceback, 'retry', p_explanation, p_retry_at
          FROM u)
    SELECT EXISTS (SELECT 1 FROM u) INTO v_done;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION postbox.inbox_retry_v1(bigint, integer, timestamptz, timestamptz, text, text, text, text, text, double precision, text)
    IS 'Worker: record a failed attempt and schedule the next at p_retry_at; the key stays held.';

-- Move a message to postbox.dead_letters, atomically with taking it out of the live flow, and apply
-- the ordering policy (p_policy, or the consumer's on_dead_letter): block keeps the key held behind
-- a 'blocked' head, skip lets the key go on, halt blocks the key and halts the consumer.
-- Returns the dead letter's id, or NULL if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.inbox_dead_letter_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_reason text, p_error text,
    p_error_type text, p_traceback text, p_fingerprint text, p_policy text DEFAULT NULL,
    p_kind text DEFAULT 'permanent', p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL,
    p_explanation text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_row     record;
    v_policy  text;
    v_dl      bigint;
BEGIN
    SELECT consumer, key, message_id INTO v_row FROM postbox.inbox
     WHERE id = p_id AND attempt = p_attempt AND state = 'running';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM postbox.inbox WHERE id = p_id AND attempt = p_attempt AND state = 'running' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT coalesce(p_policy, c.on_dead_letter) INTO v_policy FROM postbox.consumers c WHERE c.name = v_row.consumer;
    v_policy := coalesce(v_policy, p_policy, 'block');
    INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                  duration_ms, kind, error_type, error, traceback, decision, explanation)
    VALUES ('inbox', p_id, v_row.consumer, v_row.message_id, v_row.key, p_attempt, p_worker, p_now,
            p_duration_ms, p_kind, p_error_type, p_error, p_traceback, 'dead_letter',
            coalesce(p_explanation, p_reason) || ' (' || v_policy || ')');
    v_dl := postbox.inbox_copy_to_dead_letters_v1(p_id, p_reason, p_error, p_error_type, p_traceback,
                                                  p_fingerprint, v_policy, p_now);
    IF v_policy = 'skip' THEN
        PERFORM postbox.inbox_finish_v1(p_id, p_attempt, p_now, true);
    ELSE
        UPDATE postbox.inbox
           SET state = 'blocked', available_at = p_now, next_retry_at = NULL,
               first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
               last_error = coalesce(p_error, last_error), last_error_type = coalesce(p_error_type, last_error_type)
         WHERE id = p_id;
        IF v_policy = 'halt' THEN
            PERFORM postbox.consumer_halt_v1(v_row.consumer, format('dead letter %s (inbox %s): %s', v_dl, p_id, p_reason), p_now);
        END IF;
    END IF;
    RETURN v_dl;
END
$$;
COMMENT ON FUNCTION postbox.inbox_dead_letter_v1(bigint, integer, timestamptz, text, text, text, text, text, text, text, text, double precision, text)
    IS 'Worker: dead-letter a claimed message and apply the ordering policy (block, skip, halt).';

-- A claim that found a message past its policy's max_attempts: dead-letter it as of its last real
-- attempt, without inventing one. Every delivery is counted at claim, so a message whose handler
-- kept killing its worker arrives here one delivery past the limit: that delivery is taken back
-- (no handler ran), and the last attempt's record (its lease expiry, or a failure decided under a
-- looser policy) becomes the one that dead-letters it, keeping its error.
-- Returns the dead letter's id, or NULL if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.inbox_exhaust_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_max_attempts integer, p_fingerprint text,
    p_policy text DEFAULT NULL, p_worker text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_last integer := p_attempt - 1;
    v_old  record;
BEGIN
    UPDATE postbox.inbox SET attempt = v_last
     WHERE id = p_id AND attempt = p_attempt AND state = 'running';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    WITH gone AS (
        DELETE FROM postbox.attempts
         WHERE origin = 'inbox' AND origin_id = p_id AND attempt = v_last AND decision = 'retry'
        RETURNING kind, error_type, error, traceback, worker, duration_ms)
    SELECT * INTO v_old FROM gone LIMIT 1;
    RETURN postbox.inbox_dead_letter_v1(
        p_id, v_last, p_now, 'attempts_exhausted',
        coalesce(v_old.error, (SELECT last_error FROM postbox.inbox WHERE id = p_id), 'no error recorded'),
        coalesce(v_old.error_type, (SELECT last_error_type FROM postbox.inbox WHERE id = p_id)),
        v_old.traceback, p_fingerprint, p_policy, coalesce(v_old.kind, 'transient'),
        coalesce(v_old.worker, p_worker), v_old.duration_ms,
        format('attempt %s of %s was the last', v_last, p_max_attempts));
END
$$;
COMMENT ON FUNCTION postbox.inbox_exhaust_v1(bigint, integer, timestamptz, integer, text, text, text)
    IS 'Worker: dead-letter a claimed message already past max_attempts, as of its last real attempt.';

-- Give claimed messages back without counting the attempt (shutdown, or a batch that could not run).
CREATE OR REPLACE FUNCTION postbox.inbox_release_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE postbox.inbox i
       SET state = 'ready', available_at = p_now, attempt = i.attempt - 1
      FROM unnest(p_ids, p_attempts) AS r(id, attempt)
     WHERE i.id = r.id AND i.attempt = r.attempt AND i.state = 'running';
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION postbox.inbox_release_v1(bigint[], integer[], timestamptz)
    IS 'Worker: hand claimed messages back untouched (attempt not counted).';

-- Workers register, beat, and recover the messages of workers that stopped beating.
CREATE OR REPLACE FUNCTION postbox.worker_heartbeat_v1(
    p_id text, p_kind text, p_queue text, p_host text, p_pid integer, p_concurrency integer,
    p_version text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO postbox.workers AS w (id, kind, queue, host, pid, concurrency, version, started_at, heartbeat_at)
    VALUES (p_id, p_kind, p_queue, p_host, p_pid, p_concurrency, p_version, p_now, p_now)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at;
END
$$;

-- Release the claims of workers whose heartbeat is older than p_stale_after, and forget them.
-- Safe to run from many processes at once. Returns the number of messages released.
CREATE OR REPLACE FUNCTION postbox.reap_stale_workers_v1(p_stale_after interval, p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_stale  text[];
    v_inbox  integer;
    v_outbox integer;
BEGIN
    WITH gone AS (
        DELETE FROM postbox.workers WHERE heartbeat_at < p_now - p_stale_after RETURNING id)
    SELECT coalesce(array_agg(id), '{}') INTO v_stale FROM gone;
    IF cardinality(v_stale) = 0 THEN
        RETURN 0;
    END IF;
    -- Make their messages due now: the next claim counts the lost attempt and records why.
    UPDATE postbox.inbox SET available_at = p_now
     WHERE state = 'running' AND claimed_by = ANY (v_stale) AND available_at > p_now;
    GET DIAGNOSTICS v_inbox = ROW_COUNT;
    UPDATE postbox.outbox SET available_at = p_now
     WHERE state = 'running' AND claimed_by = ANY (v_stale) AND available_at > p_now;
    GET DIAGNOSTICS v_outbox = ROW_COUNT;
    RETURN v_inbox + v_outbox;
END
$$;
COMMENT ON FUNCTION postbox.reap_stale_workers_v1(interval, timestamptz)
    IS 'Forget workers without a recent heartbeat and make their claimed messages due at once.';
