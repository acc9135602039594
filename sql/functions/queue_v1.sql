-- The queue protocol of the inbox (workers, per consumer) and the outbox (relays, per destination),
-- written once: the migration renders this file for each (postbox.schema.render), filling in the
-- table, the column naming a row's queue (consumer or destination), the class of its key locks
-- (postbox.try_lock_key_v1: 1 inbox, 2 outbox), and keeping the parts only the inbox has (consumer
-- policies: halt, sequence modes, the consumer's dead-letter policy).
--
-- A row is claimed with a lease (available_at while running) and its attempt counted; every write
-- after the claim is fenced by (id, attempt): an agent whose lease ran out (it stalled, another one
-- re-claimed the row) changes nothing. Only a key's head (state ready, running or blocked) is
-- claimable; when it leaves, the key's next pending row becomes its head.

-- Claim up to p_limit due heads of one queue for p_lease. Counts an attempt on each (so a row that
-- kills its agent still uses up attempts). A batch never holds two rows of one key (only heads are
-- claimable), so its rows may be handled in parallel without reordering. Runs in its own short
-- transaction; heads whose lease ran out are claimed again, with the expiry recorded as the error.
CREATE OR REPLACE FUNCTION postbox.{{table}}_claim_v1(
    p_{{queue}} text, p_worker text, p_limit integer, p_lease interval, p_now timestamptz)
RETURNS SETOF postbox.{{table}}
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The claim is bookkeeping: if the server crashes before it reaches disk, the row is simply
    -- claimable again. Any later synchronous commit flushes it too.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM postbox.repair_keys_v1('{{table}}', p_{{queue}}, p_now, 100);
    RETURN QUERY
    WITH due AS (
        SELECT q.id, q.state AS was_state, q.claimed_by AS was_claimed_by, q.attempt AS was_attempt
          FROM postbox.{{table}} q
         WHERE q.{{queue}} = p_{{queue}}
           AND q.state IN ('ready', 'running')
           AND q.available_at <= p_now
{{#inbox}}
           AND NOT EXISTS (SELECT 1 FROM postbox.consumers c WHERE c.name = p_consumer AND c.halted_at IS NOT NULL)
{{/inbox}}
         ORDER BY q.available_at, q.id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE postbox.{{table}} q
           SET state = 'running',
               attempt = q.attempt + 1,
               claimed_by = p_worker,
               claimed_at = p_now,
               available_at = p_now + p_lease,
               first_failed_at = CASE WHEN due.was_state = 'running' THEN coalesce(q.first_failed_at, p_now) ELSE q.first_failed_at END,
               last_failed_at = CASE WHEN due.was_state = 'running' THEN p_now ELSE q.last_failed_at END,
               last_error = CASE WHEN due.was_state = 'running'
                                 THEN format('lease expired: {{agent}} %s died or stalled during attempt %s', q.claimed_by, q.attempt)
                                 ELSE q.last_error END,
               last_error_type = CASE WHEN due.was_state = 'running' THEN 'LeaseExpired' ELSE q.last_error_type END
          FROM due
         WHERE q.id = due.id
        RETURNING q.*),
    expired AS (
        -- A lease that ran out is a failed attempt too: the agent died or stalled mid-attempt.
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      kind, error_type, error, decision, explanation)
        SELECT '{{table}}', c.id, c.{{queue}}, c.message_id, c.key, due.was_attempt, due.was_claimed_by, p_now,
               'lease_expired', 'LeaseExpired', c.last_error, 'retry', '{{redone}} again after the lease ran out'
          FROM claimed c JOIN due ON due.id = c.id
         WHERE due.was_state = 'running')
    SELECT * FROM claimed;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_claim_v1(text, text, integer, interval, timestamptz)
    IS '{{Agent}}: claim due heads of a {{queue}} (SKIP LOCKED), counting an attempt on each.';

-- Mark rows done (the inbox: inside the transaction that holds their handlers' effects; the outbox:
-- once the destination confirmed them): they leave the table and the next row of each key becomes
-- its head. Returns the ids that were NOT completed because their claim is no longer ours (the
-- caller must then roll back their effects).
-- Set-based: one statement takes the batch's rows out (fenced, locked in one global order, the
-- order of one at a time), one try-locks their keys (never waits), files repairs for keys held by
-- someone else (the next claim makes their heads) and makes the next row of each other key its
-- head, unless one appeared meanwhile. The ids are joined to the table row by row, so the plan
-- probes the primary key whatever the batch size.
{{#inbox}}
-- Sequenced consumers (they track each key's last sequence) and REPEATABLE READ (it must lock the
-- heads it sees) go one message at a time through inbox_finish_v1 instead: the same rows deleted,
-- the same heads made, the same repairs filed.
{{/inbox}}
CREATE OR REPLACE FUNCTION postbox.{{table}}_complete_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
{{#inbox}}
    r           record;
{{/inbox}}
    v_lost      bigint[] := '{}';
    v_done      bigint[];
    v_queues    text[];
    v_keys      text[];
    v_woken     text[];
BEGIN
{{#inbox}}
    IF current_setting('transaction_isolation') <> 'read committed'
       OR EXISTS (SELECT 1 FROM postbox.inbox i JOIN postbox.consumers c ON c.name = i.consumer
                   WHERE i.id = ANY(p_ids) AND c.sequence_mode <> 'arrival') THEN
        FOR r IN
            SELECT u.id, u.attempt, i.consumer, i.key
              FROM unnest(p_ids, p_attempts) AS u(id, attempt)
              LEFT JOIN postbox.inbox i ON i.id = u.id
             ORDER BY hashtext(i.consumer || '/' || i.key), u.id   -- one lock order, no deadlocks
        LOOP
            IF r.consumer IS NULL OR NOT postbox.inbox_finish_v1(r.id, r.attempt, p_now, true) THEN
                v_lost := v_lost || r.id;
            END IF;
        END LOOP;
        RETURN v_lost;
    END IF;
{{/inbox}}
    -- Fenced: still ours (same attempt, still running); locked in one global order.
    WITH t AS (
        SELECT q.id FROM postbox.{{table}} q
          JOIN unnest(p_ids, p_attempts) AS u(id, attempt) ON q.id = u.id AND q.attempt = u.attempt
         WHERE q.state = 'running'
         ORDER BY hashtext(q.{{queue}} || '/' || q.key), q.id
           FOR UPDATE OF q),
    d AS (
        DELETE FROM postbox.{{table}} q USING t WHERE q.id = t.id RETURNING q.id, q.{{queue}}, q.key)
    SELECT array_agg(d.id), array_agg(d.{{queue}}), array_agg(d.key) INTO v_done, v_queues, v_keys FROM d;
    IF v_done IS NULL THEN
        RETURN coalesce(p_ids, '{}');
    END IF;
    IF cardinality(v_done) < cardinality(p_ids) THEN
        v_lost := ARRAY(SELECT u.id FROM unnest(p_ids) AS u(id) WHERE u.id <> ALL(v_done));
    END IF;
    -- The key locks first, in a statement of their own: the next statement's snapshot is taken after
    -- them, so it sees every producer that committed before we locked (one committing later holds
    -- the lock shared meanwhile, waits for ours, and then files a repair itself).
    WITH k AS MATERIALIZED (
        SELECT x.queue, x.key, postbox.try_lock_key_v1({{lock}}, x.queue, x.key) AS locked
          FROM unnest(v_queues, v_keys) AS x(queue, key)),
    repairs AS (
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT '{{table}}', k.queue, k.key FROM k WHERE NOT k.locked)
    SELECT array_agg(k.queue), array_agg(k.key) INTO v_queues, v_keys FROM k WHERE k.locked;
    WITH heads AS (
        UPDATE postbox.{{table}} q SET state = 'ready', available_at = p_now
          FROM (SELECT n.id
                  FROM unnest(v_queues, v_keys) AS k(queue, key),
                       LATERAL (SELECT p.id FROM postbox.{{table}} p  -- the first queued row: one index probe
                                 WHERE p.{{queue}} = k.queue AND p.key = k.key AND p.state = 'pending'
                                 ORDER BY p.position, p.id LIMIT 1) n
                 WHERE NOT EXISTS (SELECT 1 FROM postbox.{{table}} h
                                    WHERE h.{{queue}} = k.queue AND h.key = k.key AND h.state <> 'pending')) nx
         WHERE q.id = nx.id
        RETURNING q.{{queue}})
    SELECT array_agg(DISTINCT heads.{{queue}}) INTO v_woken FROM heads;
    IF v_woken IS NOT NULL AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('{{channel}}', w) FROM unnest(v_woken) AS w;
    END IF;
    RETURN v_lost;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_complete_v1(bigint[], integer[], timestamptz)
    IS '{{Agent}}: mark {{item}}s done (fenced by attempt) and promote the next {{item}} of each key; returns ids no longer held.';

-- A failed attempt that will be retried: the row stays the head of its key (later rows stay behind
-- it) and becomes claimable again at p_retry_at. The attempt is recorded in postbox.attempts with
-- its explanation. Returns false if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.{{table}}_retry_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_retry_at timestamptz,
    p_error text, p_error_type text, p_kind text DEFAULT 'transient', p_traceback text DEFAULT NULL,
    p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL, p_explanation text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_done boolean;
BEGIN
    WITH u AS (
        UPDATE postbox.{{table}}
           SET state = 'ready', available_at = p_retry_at, next_retry_at = p_retry_at,
               first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
               last_error = p_error, last_error_type = p_error_type
         WHERE id = p_id AND attempt = p_attempt AND state = 'running'
        RETURNING id, {{queue}}, message_id, key),
    a AS (
        INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                      duration_ms, kind, error_type, error, traceback, decision, explanation,
                                      next_retry_at)
        SELECT '{{table}}', u.id, u.{{queue}}, u.message_id, u.key, p_attempt, p_worker, p_now, p_duration_ms,
               p_kind, p_error_type, p_error, p_traceback, 'retry', p_explanation, p_retry_at
          FROM u)
    SELECT EXISTS (SELECT 1 FROM u) INTO v_done;
    RETURN v_done;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_retry_v1(bigint, integer, timestamptz, timestamptz, text, text, text, text, text, double precision, text)
    IS '{{Agent}}: record a failed attempt and schedule the next at p_retry_at; the key stays held.';

-- Move a claimed row to postbox.dead_letters, atomically with taking it out of the live flow, and
-- apply the ordering policy (p_policy{{#inbox}}, or the consumer's on_dead_letter{{/inbox}}): block keeps the key held
-- behind a 'blocked' head, skip lets the key go on{{#inbox}}, halt blocks the key and halts the consumer{{/inbox}}.
-- Returns the dead letter's id, or NULL if the claim is no longer ours.
CREATE OR REPLACE FUNCTION postbox.{{table}}_dead_letter_v1(
    p_id bigint, p_attempt integer, p_now timestamptz, p_reason text, p_error text,
    p_error_type text, p_traceback text, p_fingerprint text, p_policy text DEFAULT {{#inbox}}NULL{{/inbox}}{{#outbox}}'block'{{/outbox}},
    p_kind text DEFAULT 'permanent', p_worker text DEFAULT NULL, p_duration_ms double precision DEFAULT NULL,
    p_explanation text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_row     record;
    v_policy  text := coalesce(p_policy, 'block');
    v_dl      bigint;
BEGIN
    SELECT {{queue}} AS queue, key, message_id INTO v_row FROM postbox.{{table}}
     WHERE id = p_id AND attempt = p_attempt AND state = 'running';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM postbox.{{table}} WHERE id = p_id AND attempt = p_attempt AND state = 'running' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
{{#inbox}}
    SELECT coalesce(p_policy, c.on_dead_letter) INTO v_policy FROM postbox.consumers c WHERE c.name = v_row.queue;
    v_policy := coalesce(v_policy, p_policy, 'block');
{{/inbox}}
    INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, worker, failed_at,
                                  duration_ms, kind, error_type, error, traceback, decision, explanation)
    VALUES ('{{table}}', p_id, v_row.queue, v_row.message_id, v_row.key, p_attempt, p_worker, p_now,
            p_duration_ms, p_kind, p_error_type, p_error, p_traceback, 'dead_letter',
            coalesce(p_explanation, p_reason) || ' (' || v_policy || ')');
{{#inbox}}
    v_dl := postbox.inbox_copy_to_dead_letters_v1(p_id, p_reason, p_error, p_error_type, p_traceback,
                                                  p_fingerprint, v_policy, p_now);
{{/inbox}}
{{#outbox}}
    INSERT INTO postbox.dead_letters (
        origin, origin_id, destination, message_id, key, position, type, payload, headers, correlation_id,
        causation_id, received_at, attempt, first_failed_at, last_failed_at, last_error, last_error_type,
        last_traceback, reason, fingerprint, ordering_policy, dead_lettered_at)
    SELECT 'outbox', o.id, o.destination, o.message_id, o.key, o.position, o.type, o.payload, o.headers,
           o.correlation_id, o.causation_id, o.created_at, o.attempt, coalesce(o.first_failed_at, p_now), p_now,
           p_error, p_error_type, p_traceback, p_reason, p_fingerprint, v_policy, p_now
      FROM postbox.outbox o WHERE o.id = p_id
    RETURNING id INTO v_dl;
{{/outbox}}
    IF v_policy = 'skip' THEN
{{#inbox}}
        PERFORM postbox.inbox_finish_v1(p_id, p_attempt, p_now, true);
{{/inbox}}
{{#outbox}}
        DELETE FROM postbox.outbox WHERE id = p_id;
        PERFORM postbox.outbox_next_v1(v_row.queue, v_row.key, p_now);
{{/outbox}}
        RETURN v_dl;
    END IF;
    UPDATE postbox.{{table}}
       SET state = 'blocked', available_at = p_now, next_retry_at = NULL,
           first_failed_at = coalesce(first_failed_at, p_now), last_failed_at = p_now,
           last_error = coalesce(p_error, last_error), last_error_type = coalesce(p_error_type, last_error_type)
     WHERE id = p_id;
{{#inbox}}
    IF v_policy = 'halt' THEN
        PERFORM postbox.consumer_halt_v1(v_row.queue, format('dead letter %s (inbox %s): %s', v_dl, p_id, p_reason), p_now);
    END IF;
{{/inbox}}
    RETURN v_dl;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_dead_letter_v1(bigint, integer, timestamptz, text, text, text, text, text, text, text, text, double precision, text)
    IS '{{Agent}}: dead-letter a claimed {{item}} and apply the ordering policy (block, skip{{#inbox}}, halt{{/inbox}}).';

-- Give claimed rows back without counting the attempt (shutdown, or a batch that could not run).
CREATE OR REPLACE FUNCTION postbox.{{table}}_release_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE postbox.{{table}} q
       SET state = 'ready', available_at = p_now, attempt = q.attempt - 1
      FROM unnest(p_ids, p_attempts) AS r(id, attempt)
     WHERE q.id = r.id AND q.attempt = r.attempt AND q.state = 'running';
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_release_v1(bigint[], integer[], timestamptz)
    IS '{{Agent}}: hand claimed {{item}}s back untouched (attempt not counted).';

-- Deferred to the producer's commit: a row queued behind a head re-checks, holding the key lock
-- shared (so that no agent decides the key's head meanwhile), that its key still has a head. If the
-- head finished while this transaction was open, it files a repair: the next claim makes the key's
-- next row its head. Producers never promote (no waits between producers).
CREATE OR REPLACE FUNCTION postbox.{{table}}_pending_commit_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM postbox.lock_key_shared_v1({{lock}}, NEW.{{queue}}, NEW.key);
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM postbox.{{table}} WHERE {{queue}} = NEW.{{queue}} AND key = NEW.key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted: locking
        -- it fails with a serialization error instead, which the producer retries.
        PERFORM 1 FROM postbox.{{table}} WHERE {{queue}} = NEW.{{queue}} AND key = NEW.key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('{{table}}', NEW.{{queue}}, NEW.key);
    END IF;
    RETURN NULL;
END
$$;

-- Make the next row of a key its head, if the key has none. Callers hold the key lock exclusively
-- (postbox.try_lock_key_v1({{lock}}, ...)). Returns the new head's id.
{{#inbox}}
-- Applies the consumer's sequence mode: gapless waits for the expected sequence (recording
-- gap_since), monotonic and gapless apply the late policy to messages at or below the last
-- processed sequence.
{{/inbox}}
CREATE OR REPLACE FUNCTION postbox.{{table}}_promote_v1(p_{{queue}} text, p_key text, p_now timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r         record;
{{#inbox}}
    v_mode    text := 'arrival';
    v_first   bigint := 1;
    v_late    text := 'dead_letter';
    v_last    bigint;
    v_gap     timestamptz;
{{/inbox}}
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM postbox.{{table}} WHERE {{queue}} = p_{{queue}} AND key = p_key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head committed after our snapshot is invisible; locking the one we
        -- see fails with a serialization error if it changed, which the caller retries.
        PERFORM 1 FROM postbox.{{table}} WHERE {{queue}} = p_{{queue}} AND key = p_key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF FOUND THEN
        RETURN NULL;
    END IF;
{{#inbox}}
    SELECT c.sequence_mode, c.first_sequence, c.late_policy INTO v_mode, v_first, v_late
      FROM postbox.consumers c WHERE c.name = p_consumer;
    v_mode := coalesce(v_mode, 'arrival');
    IF v_mode <> 'arrival' THEN
        SELECT k.last_sequence, k.gap_since INTO v_last, v_gap
          FROM postbox.inbox_keys k WHERE k.consumer = p_consumer AND k.key = p_key;
    END IF;
{{/inbox}}
    LOOP
        SELECT q.id, q.position INTO r FROM postbox.{{table}} q
         WHERE q.{{queue}} = p_{{queue}} AND q.key = p_key AND q.state = 'pending'
         ORDER BY q.position, q.id LIMIT 1;
        IF NOT FOUND THEN
{{#inbox}}
            IF v_gap IS NOT NULL THEN
                UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
            END IF;
{{/inbox}}
            RETURN NULL;
        END IF;
{{#inbox}}
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
{{/inbox}}
        -- No head can appear meanwhile: a producer's insert-as-head waits on the old head's
        -- deletion (or sees pending rows and queues); repairs guard against the rest.
        UPDATE postbox.{{table}} SET state = 'ready', available_at = p_now WHERE id = r.id;
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('{{channel}}', p_{{queue}});
        END IF;
{{#inbox}}
        IF v_gap IS NOT NULL THEN
            UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
        END IF;
{{/inbox}}
        RETURN r.id;
    END LOOP;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_promote_v1(text, text, timestamptz)
    IS 'Internal: make the next {{item}} of a key its head. Caller holds the key lock.';
