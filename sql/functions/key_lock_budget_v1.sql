-- Revision 0010: a transaction that receives or publishes messages under many keys no longer fills
-- PostgreSQL's lock table.
--
-- A producer holds the lock of each key it queued a message under, shared, to its commit (and,
-- under READ COMMITTED, a batch with keys holds all its keys' locks from the moment it looks for
-- their heads): that is how a head that finishes meanwhile knows to leave the hand-over to the
-- first claim after the commit. Each key is an entry of PostgreSQL's lock table, which has room for
-- max_locks_per_transaction x (max_connections + a few) locks for the whole server (about 7,800 by
-- default). A transaction receiving 20,000 messages under as many keys failed with "out of shared
-- memory", and, while it held thousands of locks, so could any other transaction needing one.
--
-- Now a transaction has a budget of 1,000 key locks, counted in the transaction-local setting
-- postbox.key_locks (each message of a batch that locks its keys, each other message queued behind
-- a head, each key a check at commit locks). Past it, a message queued behind its key's head takes
-- no lock: its key's repair is filed instead (a row of postbox.key_repairs), which the first claim
-- after the commit makes, whatever the head did meanwhile (a key that has a head then is left as it
-- is). Nothing is left without a head and nothing overtakes; what changes past the budget is the
-- cost (a repair row per queued message, made by the workers' claims, 100 keys per claim) instead
-- of a lock. A message that becomes its key's head never needed either, and now takes neither in a
-- large transaction (a batch within the budget still locks all its keys, as before).
--
-- inbox_receive_v1, the batches' core (inbox_receive_rows_v1), the check at commit
-- (inbox_commit_check_v1) and the outbox's per-row check at commit (outbox_pending_commit_v1) keep
-- their signatures and results; their bodies are replaced (revision 0009's receive is in
-- inbox_receive_keyed_v1.sql, 0008's batch core in inbox_receive_queue_lock_v1.sql, 0007's check in
-- inbox_receive_single_v1.sql and 0001's outbox check in queue_v1.sql, which the downgrade
-- restores). The bodies say SECURITY DEFINER and their search_path where the functions had them
-- (CREATE OR REPLACE resets both).

CREATE OR REPLACE FUNCTION postbox.inbox_receive_v1(
    consumer        text,
    message_id      text,
    payload         jsonb,
    key             text    DEFAULT NULL,
    type            text    DEFAULT NULL,
    sequence        bigint  DEFAULT NULL,
    headers         jsonb   DEFAULT '{}'::jsonb,
    schema_version  integer DEFAULT 1,
    correlation_id  text    DEFAULT NULL,
    causation_id    text    DEFAULT NULL,
    source          text    DEFAULT NULL,
    OUT status      text,
    OUT inbox_id    bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_consumer  text   := inbox_receive_v1.consumer;
    v_key       text   := coalesce(inbox_receive_v1.key, inbox_receive_v1.message_id);
    v_seq       bigint := inbox_receive_v1.sequence;
    v_text      text   := inbox_receive_v1.payload::text;
    v_htext     text   := inbox_receive_v1.headers::text;
    v_hash      bytea;
    v_mode      text;
    v_first     bigint;
    v_last      bigint;
    v_id        bigint;
    v_position  bigint;
    v_state     text;
    v_old       record;
    v_refused   boolean;
    v_new       boolean;
    v_head      boolean;
    v_put       text;
    v_slot      smallint;
    v_window    interval;
    v_rc        boolean := current_setting('transaction_isolation') = 'read committed';
BEGIN
    -- One cheap expression checks everything; only bad input pays for finding which field it was.
    IF postbox.message_fields_bad_v1(v_consumer, inbox_receive_v1.message_id, true, inbox_receive_v1.key,
                                     inbox_receive_v1.type, inbox_receive_v1.correlation_id,
                                     inbox_receive_v1.causation_id, inbox_receive_v1.source,
                                     inbox_receive_v1.payload, inbox_receive_v1.headers)
       OR v_seq < 0 OR inbox_receive_v1.schema_version IS NULL OR inbox_receive_v1.schema_version < 1
    THEN
        PERFORM postbox.reject_message_fields_v1('consumer', v_consumer, inbox_receive_v1.message_id, true,
                                                 inbox_receive_v1.key, inbox_receive_v1.type,
                                                 inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id,
                                                 inbox_receive_v1.source, inbox_receive_v1.payload,
                                                 inbox_receive_v1.headers);
        IF v_seq < 0 THEN
            PERFORM postbox.reject_v1('sequence', 'must not be negative');
        END IF;
        PERFORM postbox.reject_v1('schema_version', 'must be a positive integer');
    END IF;
    IF postbox.message_json_large_v1(v_text, v_htext) THEN
        PERFORM postbox.check_message_json_v1(inbox_receive_v1.payload, v_text, inbox_receive_v1.headers, v_htext);
    END IF;

    -- The ledger's slot is read after taking the ledger's lock, held to the end of the transaction:
    -- a rotation (dedup_rotate_v1) waits for us, or we for it and then read the slot it made current.
    LOCK TABLE ONLY postbox.inbox_dedup IN ROW EXCLUSIVE MODE;
    -- One read: the window and current slot, the consumer's mode and, only if it is not declared,
    -- whether any consumer is.
    SELECT c.sequence_mode, c.first_sequence,
           c.name IS NULL AND EXISTS (SELECT 1 FROM postbox.consumers d WHERE d.declared),
           w.current_slot, w.retention
      INTO v_mode, v_first, v_refused, v_slot, v_window
      FROM postbox.dedup_window w LEFT JOIN postbox.consumers c ON c.name = v_consumer;
    IF NOT v_rc THEN
        -- An older snapshot may predate a rotation: locking the row then fails with a
        -- serialization error, which the producer retries.
        PERFORM 1 FROM postbox.dedup_window FOR KEY SHARE;
    END IF;
    IF v_refused THEN
        PERFORM postbox.reject_v1('consumer', format('%L is not a declared consumer', v_consumer));
    END IF;
    v_mode := coalesce(v_mode, 'arrival');
    IF v_mode <> 'arrival' AND v_seq IS NULL THEN
        PERFORM postbox.reject_v1('sequence', format('is required: consumer %L orders keys by sequence (%s)', v_consumer, v_mode));
    END IF;

    v_hash := decode(md5(v_text), 'hex');
    v_id := nextval('postbox.inbox_id_seq');
    IF v_mode = 'arrival' AND inbox_receive_v1.key IS NULL THEN
        -- Without a key (its id is its key), the usual case in one statement: the ledger row and,
        -- unless messages of the same id are queued (never overtake them), the message as its key's
        -- head.
        -- The ledger's slot named, not found by routing: the same rows, without routing a row and
        -- pruning the ledger's partitions in every receive.
        IF v_slot = 0 THEN
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_0 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 0
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_1 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready'
                 WHERE EXISTS (SELECT 1 FROM d)
                   AND NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                    WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                      AND p.position < v_id)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING 1)
            SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM h) INTO v_new, v_head;
        ELSE
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_1 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 1
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_0 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready'
                 WHERE EXISTS (SELECT 1 FROM d)
                   AND NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                    WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                      AND p.position < v_id)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING 1)
            SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM h) INTO v_new, v_head;
        END IF;
        IF v_new AND v_head THEN
            IF postbox.notify_enabled_v1() THEN
                PERFORM pg_notify('postbox_inbox', v_consumer);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        ELSIF v_new THEN
            -- Queued behind the head; its key held and checked now (as below).
            INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                       payload, headers, correlation_id, causation_id, source, state)
            VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                    inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                    inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
            IF NOT v_rc THEN
                INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
            ELSIF set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + 1)::text, true)::integer <= 1000 THEN
                -- Within the transaction's budget of key locks (see the top of this file).
                -- postbox.lock_key_shared_v1(1, ...), inline.
                PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
                PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
                IF NOT FOUND THEN
                    INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
                END IF;
            ELSE
                -- Past the budget: no lock, the key's repair filed instead (made at the first claim after
                -- our commit, whatever the head does meanwhile).
                INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        END IF;
        -- Seen before: new again only outside the window (then on through the general path below).
        v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
    ELSIF v_mode = 'arrival' THEN
        -- With a key, the usual case in one statement too: the ledger row and the message, as its
        -- key's head unless the key has a head or queued messages (never overtake them), else
        -- queued behind them. A queued message is inserted by that statement, not by a second one
        -- after its attempt at the head has failed. (A queued row is not checked against the
        -- heads' index, which only holds heads.)
        IF v_slot = 0 THEN
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_0 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 0
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_1 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source,
                       -- (Under REPEATABLE READ the snapshot may show a head finished since: the
                       -- attempt at the head finds out, as without a key.)
                       CASE WHEN v_rc AND EXISTS (SELECT 1 FROM postbox.inbox p
                                                   WHERE p.consumer = v_consumer AND p.key = v_key
                                                     AND p.state <> 'pending')
                              OR EXISTS (SELECT 1 FROM postbox.inbox p
                                          WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                            AND p.position < v_id)
                            THEN 'pending' ELSE 'ready' END
                 WHERE EXISTS (SELECT 1 FROM d)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING i.state)
            SELECT EXISTS (SELECT 1 FROM d), (SELECT h.state FROM h) INTO v_new, v_put;
        ELSE
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_1 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 1
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_0 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source,
                       -- (Under REPEATABLE READ the snapshot may show a head finished since: the
                       -- attempt at the head finds out, as without a key.)
                       CASE WHEN v_rc AND EXISTS (SELECT 1 FROM postbox.inbox p
                                                   WHERE p.consumer = v_consumer AND p.key = v_key
                                                     AND p.state <> 'pending')
                              OR EXISTS (SELECT 1 FROM postbox.inbox p
                                          WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                            AND p.position < v_id)
                            THEN 'pending' ELSE 'ready' END
                 WHERE EXISTS (SELECT 1 FROM d)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING i.state)
            SELECT EXISTS (SELECT 1 FROM d), (SELECT h.state FROM h) INTO v_new, v_put;
        END IF;
        IF v_put = 'ready' THEN
            IF postbox.notify_enabled_v1() THEN
                PERFORM pg_notify('postbox_inbox', v_consumer);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        ELSIF v_new THEN
            IF v_put IS NULL THEN
                -- The attempt at the head found one: a head another transaction was making, which
                -- committed while the statement waited for it, or (under REPEATABLE READ, where the
                -- statement does not look for the head itself) any head. Queued behind it.
                INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                           payload, headers, correlation_id, causation_id, source, state)
                VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                        inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                        inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
            END IF;
            -- Queued: its key held and checked now (as below).
            IF NOT v_rc THEN
                INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
            ELSIF set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + 1)::text, true)::integer <= 1000 THEN
                -- Within the transaction's budget of key locks (see the top of this file).
                -- postbox.lock_key_shared_v1(1, ...), inline.
                PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
                PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
                IF NOT FOUND THEN
                    INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
                END IF;
            ELSE
                -- Past the budget: no lock, the key's repair filed instead (made at the first claim after
                -- our commit, whatever the head does meanwhile).
                INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        END IF;
        -- Seen before: new again only outside the window (then on through the general path below).
        v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
    ELSE
        INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id, slot)
        SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, v_slot
         WHERE NOT EXISTS (
               -- The previous slot's receipt of the id, if it still counts (inside the window, or
               -- its message live or dead-lettered).
               SELECT 1 FROM postbox.inbox_dedup p
                WHERE p.slot = 1 - v_slot AND p.consumer = v_consumer
                  AND p.message_id = inbox_receive_v1.message_id
                  AND (p.received_at >= now() - v_window
                       OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
        ON CONFLICT DO NOTHING;
        v_new := FOUND;
        IF NOT v_new THEN
            v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
        END IF;
    END IF;
    IF NOT v_new THEN
        -- The latest receipt decides (the previous slot may hold an earlier one).
        SELECT d.payload_hash, d.inbox_id INTO v_old
          FROM postbox.inbox_dedup d
         WHERE d.consumer = v_consumer AND d.message_id = inbox_receive_v1.message_id
         ORDER BY d.received_at DESC
         LIMIT 1;
        status := CASE WHEN v_old.payload_hash = v_hash THEN 'duplicate' ELSE 'conflict' END;
        inbox_id := v_old.inbox_id;
        RETURN;
    END IF;

    v_position := CASE WHEN v_mode = 'arrival' THEN v_id ELSE v_seq END;
    v_state := 'ready';
    IF v_mode = 'gapless' THEN
        SELECT k.last_sequence INTO v_last FROM postbox.inbox_keys k
         WHERE k.consumer = v_consumer AND k.key = v_key;
        IF v_seq <> coalesce(v_last + 1, v_first) THEN
            v_state := 'pending';
        END IF;
    ELSIF v_mode = 'monotonic' THEN
        SELECT k.last_sequence INTO v_last FROM postbox.inbox_keys k
         WHERE k.consumer = v_consumer AND k.key = v_key;
        IF v_seq <= v_last THEN
            v_state := 'pending';   -- late: the promote step applies the consumer's late policy
        END IF;
    END IF;

    IF v_state = 'ready' AND EXISTS (
        SELECT 1 FROM postbox.inbox p
         WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending' AND p.position < v_position) THEN
        -- Earlier messages are queued and wait for their head to be repaired: never overtake them.
        v_state := 'pending';
    END IF;
    IF v_state = 'ready' THEN
        -- Become the head of the key unless it already has one (which we then queue behind).
        INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                        payload, headers, correlation_id, causation_id, source, state)
        VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready')
        ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
        IF NOT FOUND AND v_mode = 'monotonic' THEN
            -- Lowest present sequence first: a head nobody has claimed yet steps back behind us.
            UPDATE postbox.inbox SET state = 'pending'
             WHERE consumer = v_consumer AND key = v_key AND state = 'ready' AND position > v_seq;
            IF FOUND THEN
                INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                           payload, headers, correlation_id, causation_id, source, state)
                VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                        inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                        inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready');
            END IF;
        END IF;
        IF NOT FOUND THEN
            v_state := 'pending';
        ELSIF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_inbox', v_consumer);
        END IF;
    END IF;
    IF v_state = 'pending' THEN
        -- Queued behind the head. So that a head that finishes while this transaction is open can
        -- never leave this message without one: under READ COMMITTED the key's lock is taken shared
        -- now and held to our commit, and the head probed after it (a completion that starts later
        -- cannot take the lock and files a repair, made at the claim after our commit; one that
        -- finished before has its result seen by the probe, and no head means a repair, ours).
        -- Under REPEATABLE READ the snapshot predates the lock: the key's check at commit
        -- (inbox_commit_check_v1) does it there, locking the head to catch a change since the snapshot.
        INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                   payload, headers, correlation_id, causation_id, source, state)
        VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
        IF NOT v_rc THEN
            INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
        ELSIF set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + 1)::text, true)::integer <= 1000 THEN
            -- Within the transaction's budget of key locks (see the top of this file).
            -- postbox.lock_key_shared_v1(1, ...), inline.
            PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
            PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
            IF NOT FOUND THEN
                INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
            END IF;
        ELSE
            -- Past the budget: no lock, the key's repair filed instead (made at the first claim after
            -- our commit, whatever the head does meanwhile).
            INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
        END IF;
    END IF;
    status := 'new';
    inbox_id := v_id;
END
$$;

CREATE OR REPLACE FUNCTION postbox.inbox_receive_rows_v1(
    consumers text[], message_ids text[], payloads jsonb[], keys text[], types text[], sequences bigint[],
    headers jsonb[], schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_n         integer := coalesce(cardinality(message_ids), 0);
    v_ids       bigint[];
    v_new       bigint[];
    v_all       boolean;
    v_notify    text[];
    v_keyless   boolean := keys IS NULL OR cardinality(array_remove(keys, NULL)) = 0;
    v_plain     boolean := false;
    v_tries     integer;
    v_slot      smallint;
    v_window    interval;
    v_rc        boolean := current_setting('transaction_isolation') = 'read committed';
    v_locked    boolean := false;
    v_done      bigint[];
    v_lead      bigint[];
    v_behind    bigint[];
BEGIN
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- The ledger's slot, read under the ledger's lock (as inbox_receive_v1 does).
    LOCK TABLE ONLY postbox.inbox_dedup IN ROW EXCLUSIVE MODE;
    SELECT w.current_slot, w.retention INTO v_slot, v_window FROM postbox.dedup_window w;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM 1 FROM postbox.dedup_window FOR KEY SHARE;
    END IF;
    -- Ids are taken in the arrays' order, so a key keeps its order.
    v_ids := ARRAY(SELECT s.id FROM (SELECT nextval('postbox.inbox_id_seq') AS id FROM generate_series(1, v_n)) s
                    ORDER BY s.id);
    v_tries := coalesce(nullif(current_setting('postbox.plain_batches', true), '')::integer, 0);
    IF v_n >= 16 AND v_tries < 32 THEN
        PERFORM set_config('postbox.plain_batches', (v_tries + 1)::text, true);
        BEGIN
            -- The first of each id, in the ledger's global order.
            WITH d AS (
                INSERT INTO postbox.inbox_dedup AS l (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT DISTINCT ON (u.consumer, u.message_id)
                       u.consumer, u.message_id, decode(md5(u.payload::text), 'hex'), u.id, v_slot
                  FROM unnest(consumers, message_ids, payloads, v_ids) AS u(consumer, message_id, payload, id)
                 LEFT JOIN LATERAL (
                      -- The previous slot's receipt of the id (an index probe), which counts inside the
                      -- window, or while its message is live or dead-lettered.
                      SELECT p.received_at, p.inbox_id FROM postbox.inbox_dedup p
                       WHERE p.slot = 1 - v_slot AND p.consumer = u.consumer
                         AND p.message_id = u.message_id
                       LIMIT 1) prev ON true
                 WHERE prev.received_at IS NULL
                    OR (prev.received_at < now() - v_window
                        AND NOT postbox.inbox_receipt_live_v1(u.consumer, u.message_id, prev.inbox_id))
                 ORDER BY u.consumer, u.message_id, u.id
                RETURNING l.inbox_id)
            SELECT array_agg(d.inbox_id) INTO v_new FROM d;
            v_all := coalesce(cardinality(v_new), 0) = v_n;
            IF v_keyless THEN
                -- Each new message is its own key (its id): its head, in the same global order
                -- as below, unless messages queued under that key wait for theirs.
                WITH h AS (
                    INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type,
                                                    schema_version, payload, headers, correlation_id,
                                                    causation_id, source, state)
                    SELECT u.id, u.consumer, u.message_id, u.message_id, u.sequence, u.id, u.type,
                           coalesce(u.schema_version, 1), u.payload, coalesce(u.headers, '{}'::jsonb),
                           u.correlation_id, u.causation_id, u.source, 'ready'
                      FROM unnest(consumers, message_ids, payloads, types, sequences, headers, schema_versions,
                                  correlation_ids, causation_ids, sources, v_ids)
                           AS u(consumer, message_id, payload, type, sequence, headers, schema_version,
                                correlation_id, causation_id, source, id)
                      LEFT JOIN LATERAL (  -- an index probe per message (never a scan of the queue)
                           SELECT true AS queued FROM postbox.inbox p
                            WHERE p.consumer = u.consumer AND p.key = u.message_id AND p.state = 'pending'
                            LIMIT 1) pend ON true
                     WHERE (v_all OR u.id IN (SELECT unnest(v_new))) AND pend.queued IS NULL
                     ORDER BY u.consumer, u.message_id
                    RETURNING i.id, i.consumer)
                SELECT array_agg(h.id), array_agg(DISTINCT h.consumer) INTO v_done, v_notify FROM h;
            END IF;
            v_plain := true;
        EXCEPTION WHEN unique_violation THEN
            v_done := NULL;
            v_notify := NULL;
        END;
    END IF;
    IF NOT v_plain THEN
        -- The ledger keeps the first of each id: a message seen before, or earlier in this batch, is
        -- not new. Only the three columns the ledger needs are read here. Rows go in in one global
        -- order (by id), so batches carrying the same ids in different orders never deadlock.
        WITH d AS (
            INSERT INTO postbox.inbox_dedup AS l (consumer, message_id, payload_hash, inbox_id, slot)
            SELECT u.consumer, u.message_id, decode(md5(u.payload::text), 'hex'), u.id, v_slot
              FROM unnest(consumers, message_ids, payloads, v_ids) AS u(consumer, message_id, payload, id)
             LEFT JOIN LATERAL (
                  -- The previous slot's receipt of the id (an index probe), which counts inside the
                  -- window, or while its message is live or dead-lettered.
                  SELECT p.received_at, p.inbox_id FROM postbox.inbox_dedup p
                   WHERE p.slot = 1 - v_slot AND p.consumer = u.consumer
                     AND p.message_id = u.message_id
                   LIMIT 1) prev ON true
             WHERE prev.received_at IS NULL
                OR (prev.received_at < now() - v_window
                    AND NOT postbox.inbox_receipt_live_v1(u.consumer, u.message_id, prev.inbox_id))
             ORDER BY u.consumer, u.message_id, u.id
            ON CONFLICT DO NOTHING
            RETURNING l.inbox_id)
        SELECT array_agg(d.inbox_id) INTO v_new FROM d;
        v_all := coalesce(cardinality(v_new), 0) = v_n;
        IF NOT v_all THEN
            -- Ids seen before outside the window (their message gone) are new again: the first of
            -- each in the batch takes its ledger row over (one probe each; only redeliveries pay).
            SELECT coalesce(v_new, '{}') || coalesce(array_agg(x.id) FILTER (
                       WHERE postbox.inbox_dedup_take_expired_v1(x.consumer, x.message_id, x.hash, x.id,
                                                                 v_slot, v_window)), '{}')
              INTO v_new
              FROM (SELECT DISTINCT ON (u.consumer, u.message_id)
                           u.consumer, u.message_id, decode(md5(u.payload::text), 'hex') AS hash, u.id
                      FROM unnest(consumers, message_ids, payloads, v_ids) AS u(consumer, message_id, payload, id)
                     WHERE u.id <> ALL (coalesce(v_new, '{}'))
                     ORDER BY u.consumer, u.message_id, u.id) x;
            v_all := cardinality(v_new) = v_n;
        END IF;
    END IF;
    IF NOT (v_plain AND v_keyless) THEN
        IF v_rc AND set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + v_n)::text, true)::integer <= 1000 THEN
            -- Each message's key (a duplicate's too: harmless, and cheaper than leaving it out) is
            -- locked shared first and held to our commit, so the heads
            -- found below are the check a queued message needs: a head seen after the lock cannot
            -- finish without handing over after our commit (a completion only tries the key's lock,
            -- and files a repair when it cannot take it). postbox.lock_key_shared_v1(1, ...), inline;
            -- in any order: the key lock is only ever taken exclusively by trying, so no cycle forms.
            -- Only within the transaction's budget of key locks (see the top of this file), each
            -- message counted: past it, the keys its messages queue under are checked at commit
            -- (below), where the budget, spent, files their repairs instead of locking them.
            PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(u.consumer || '/' || coalesce(u.key, u.message_id)))
               FROM unnest(consumers, message_ids, keys) AS u(consumer, message_id, key);
            v_locked := true;
        END IF;
        -- The first new message of each key, unless the key has a head already (then the message
        -- queues behind it, below): it becomes the head, or, if the key has queued messages and no
        -- head, queues behind them and files the key's repair. Found from four columns, with index
        -- probes per message (OFFSET 0 keeps the head's a probe per message: never a join over the
        -- queue, whatever the statistics say); only such messages pay for a second pass.
        SELECT array_agg(x.id), array_agg(x.id) FILTER (WHERE x.queued)
          INTO v_lead, v_behind
          FROM (SELECT DISTINCT ON (u.consumer, u.key) u.id,
                       EXISTS (SELECT 1 FROM postbox.inbox p
                                WHERE p.consumer = u.consumer AND p.key = u.key AND p.state = 'pending'
                                  AND p.position < u.id) AS queued
                  FROM (SELECT u.consumer, coalesce(u.key, u.message_id) AS key, u.id
                          FROM unnest(consumers, message_ids, keys, v_ids) AS u(consumer, message_id, key, id)
                         WHERE v_all OR u.id IN (SELECT unnest(v_new))) u
                 WHERE NOT EXISTS (SELECT 1 FROM postbox.inbox x
                                    WHERE x.consumer = u.consumer AND x.key = u.key AND x.state <> 'pending'
                                   OFFSET 0)
                 ORDER BY u.consumer, u.key, u.id) x;
        IF v_lead IS NOT NULL THEN
            -- Keys are taken in one global order, so two batches starting the same keys never wait
            -- for each other in a cycle.
            WITH h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT u.id, u.consumer, u.message_id, coalesce(u.key, u.message_id), u.sequence, u.id, u.type,
                       coalesce(u.schema_version, 1), u.payload, coalesce(u.headers, '{}'::jsonb), u.correlation_id,
                       u.causation_id, u.source,
                       CASE WHEN u.id = ANY (coalesce(v_behind, '{}')) THEN 'pending' ELSE 'ready' END
                  FROM unnest(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                              correlation_ids, causation_ids, sources, v_ids)
                       AS u(consumer, message_id, payload, key, type, sequence, headers, schema_version,
                            correlation_id, causation_id, source, id)
                 WHERE u.id IN (SELECT unnest(v_lead))
                 ORDER BY u.consumer, coalesce(u.key, u.message_id), u.id
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING i.id, i.consumer, i.key, i.state),
            r AS (
                INSERT INTO postbox.key_repairs (origin, queue, key)
                SELECT 'inbox', h.consumer, h.key FROM h WHERE h.state = 'pending')
            SELECT array_agg(h.id), array_agg(DISTINCT h.consumer) FILTER (WHERE h.state <> 'pending')
              INTO v_done, v_notify FROM h;
        END IF;
    END IF;
    IF coalesce(cardinality(v_done), 0) < coalesce(cardinality(v_new), 0) THEN
        -- Everything else new is queued behind its key's head (in this batch or before it), in any
        -- order: a queued row conflicts with nothing (its position, its id, orders its key).
        WITH q AS (
            INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                            payload, headers, correlation_id, causation_id, source, state)
            SELECT u.id, u.consumer, u.message_id, coalesce(u.key, u.message_id), u.sequence, u.id, u.type,
                   coalesce(u.schema_version, 1), u.payload, coalesce(u.headers, '{}'::jsonb), u.correlation_id,
                   u.causation_id, u.source, 'pending'
              FROM unnest(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                          correlation_ids, causation_ids, sources, v_ids)
                   AS u(consumer, message_id, payload, key, type, sequence, headers, schema_version,
                        correlation_id, causation_id, source, id)
             WHERE (v_all OR u.id IN (SELECT unnest(v_new)))
               AND (v_done IS NULL OR u.id NOT IN (SELECT unnest(v_done)))
            RETURNING i.consumer, i.key)
        -- Keys not locked above (under REPEATABLE READ, whose snapshot predates any lock, past the
        -- budget of key locks, or a batch without keys whose messages queued behind earlier ones of
        -- the same id) are checked at commit instead (inbox_commit_check_v1): locked, then their
        -- heads looked for, or, past the budget, their repairs filed.
        INSERT INTO postbox.inbox_commit_checks (consumers, keys)
        SELECT array_agg(k.consumer), array_agg(k.key) FROM (SELECT DISTINCT q.consumer, q.key FROM q) k
        WHERE NOT v_locked
        HAVING count(*) > 0;
    END IF;
    IF v_notify IS NOT NULL AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('postbox_inbox', c) FROM unnest(v_notify) AS c;
    END IF;
    IF v_all THEN
        RETURN QUERY SELECT u.n, 'new'::text, u.id FROM unnest(v_ids) WITH ORDINALITY AS u(id, n);
        RETURN;
    END IF;
    -- Not new: a duplicate or a conflict with what the ledger holds (a fresh snapshot sees a
    -- concurrent receive of the same id that committed while this one waited for it).
    RETURN QUERY
    SELECT x.n, CASE WHEN x.fresh THEN 'new'
                     WHEN l.payload_hash = decode(md5(x.payload::text), 'hex') THEN 'duplicate'
                     ELSE 'conflict' END,
           CASE WHEN x.fresh THEN x.id ELSE l.inbox_id END
      FROM (SELECT u.n, u.id, u.consumer, u.message_id, u.payload, u.id IN (SELECT unnest(v_new)) AS fresh
              FROM unnest(v_ids, consumers, message_ids, payloads) WITH ORDINALITY
                   AS u(id, consumer, message_id, payload, n)) x
      LEFT JOIN LATERAL (
           -- The latest receipt decides (the previous slot may hold an earlier one).
           SELECT d.payload_hash, d.inbox_id FROM postbox.inbox_dedup d
            WHERE NOT x.fresh AND d.consumer = x.consumer AND d.message_id = x.message_id
            ORDER BY d.received_at DESC
            LIMIT 1) l ON true
     ORDER BY x.n;
END
$$;

CREATE OR REPLACE FUNCTION postbox.inbox_commit_check_v1() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
DECLARE
    v_consumer  text;
    v_key       text;
BEGIN
    IF set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + cardinality(NEW.keys))::text, true)::integer > 1000 THEN
        -- Past the transaction's budget of key locks (see the top of this file): no lock and no
        -- look at the heads, each key's repair filed instead (made at the first claim after our
        -- commit, whatever the head does meanwhile).
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT 'inbox', k.consumer, k.key FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key);
        DELETE FROM postbox.inbox_commit_checks WHERE id = NEW.id;
        RETURN NULL;
    END IF;
    IF cardinality(NEW.keys) = 1 THEN
        v_consumer := NEW.consumers[1];
        v_key := NEW.keys[1];
        -- postbox.lock_key_shared_v1(1, ...), inline.
        PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
        IF current_setting('transaction_isolation') = 'read committed' THEN
            PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
        ELSE
            -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted:
            -- locking it fails with a serialization error instead, which the producer retries.
            PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending'
                FOR KEY SHARE;
        END IF;
        IF NOT FOUND THEN
            INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
        END IF;
        DELETE FROM postbox.inbox_commit_checks WHERE id = NEW.id;
        RETURN NULL;
    END IF;
    -- postbox.lock_key_shared_v1(1, ...) for every key, inline (one statement, no call per key).
    PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(k.consumer || '/' || k.key))
       FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted: locking
        -- it fails with a serialization error instead, which the producer retries.
        PERFORM 1
           FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key),
                LATERAL (SELECT 1 FROM postbox.inbox i
                          WHERE i.consumer = k.consumer AND i.key = k.key AND i.state <> 'pending'
                            FOR KEY SHARE) h;
    END IF;
    -- Index probes per key (the heads' unique index), never a scan of the queue; a new snapshot,
    -- taken after the locks, sees every head decided before them.
    INSERT INTO postbox.key_repairs (origin, queue, key)
    SELECT 'inbox', k.consumer, k.key
      FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key)
      LEFT JOIN LATERAL (SELECT true AS present FROM postbox.inbox i
                          WHERE i.consumer = k.consumer AND i.key = k.key AND i.state <> 'pending'
                          LIMIT 1) h ON true
     WHERE h.present IS NULL
     ORDER BY 2, 3;
    DELETE FROM postbox.inbox_commit_checks WHERE id = NEW.id;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION postbox.outbox_pending_commit_v1() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    IF set_config('postbox.key_locks', (coalesce(nullif(current_setting('postbox.key_locks', true), '')::integer, 0) + 1)::text, true)::integer > 1000 THEN
        -- Past the transaction's budget of key locks (see the top of this file): no lock, the
        -- key's repair filed instead.
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('outbox', NEW.destination, NEW.key);
        RETURN NULL;
    END IF;
    PERFORM postbox.lock_key_shared_v1(2, NEW.destination, NEW.key);
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM postbox.outbox WHERE destination = NEW.destination AND key = NEW.key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted: locking
        -- it fails with a serialization error instead, which the producer retries.
        PERFORM 1 FROM postbox.outbox WHERE destination = NEW.destination AND key = NEW.key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('outbox', NEW.destination, NEW.key);
    END IF;
    RETURN NULL;
END
$$;
