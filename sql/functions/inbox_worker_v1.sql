-- What only workers do to the inbox: finish a message of a sequenced consumer, dead-letter one past
-- its attempts; and what every long-running process does: heartbeat, reap stale workers. The queue
-- protocol itself (claim, complete, retry, dead letter, release) is sql/functions/queue_v1.sql.

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
    v_stale     text[];
    v_count     integer;
    v_released  integer := 0;
BEGIN
    WITH gone AS (
        DELETE FROM postbox.workers WHERE heartbeat_at < p_now - p_stale_after RETURNING id)
    SELECT coalesce(array_agg(id), '{}') INTO v_stale FROM gone;
    IF cardinality(v_stale) = 0 THEN
        RETURN 0;
    END IF;
    -- Make their messages due now: the next claim counts the lost attempt and records why.
{{#each}}
    UPDATE postbox.{{table}} SET available_at = p_now
     WHERE state = 'running' AND claimed_by = ANY (v_stale) AND available_at > p_now;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    v_released := v_released + v_count;
{{/each}}
    RETURN v_released;
END
$$;
COMMENT ON FUNCTION postbox.reap_stale_workers_v1(interval, timestamptz)
    IS 'Forget workers without a recent heartbeat and make their claimed messages due at once.';
