-- Revision 0012: a keyed batch looks for its keys' heads with an index probe per message whatever
-- the inbox holds, instead of, for a transaction's first 1,000 batched messages under READ
-- COMMITTED, letting the planner read the whole inbox into a hash once per statement. Same
-- statuses, ids and guarantees.
--
-- With the keys locked first (revision 0008's path, for a transaction's first 1,000 batched
-- messages), whether a key has a head was asked as CASE WHEN EXISTS (...) THEN false END. PostgreSQL
-- may run an EXISTS with only equality conditions as a hashed subplan: the subquery's rows, read by
-- a sequential scan of the inbox, are hashed once, and each message looks in the hash. The planner
-- chose it while one scan of the inbox looked cheaper than 500 probes: at 50,000 messages queued
-- under 500 keys, it read all 50,000 rows for each batch of 500 (a one-off auto_explain reading),
-- and the server's instructions per message grew with the queue (a one-off count with the
-- bench's callgrind harness, 500 keys, after 60 batches: 235,148 per message, against 138,709
-- after 2). The same question is now a scalar subquery with LIMIT 1 (false when the key has a
-- head, NULL when not, as before), which PostgreSQL never hashes: one probe of inbox_head_uq per
-- message, whatever the statistics say (148,279 instructions per message after 60 batches, 142,907
-- after 2: with a nearly empty inbox the hash was the cheaper plan). The path past the first 1,000
-- messages was written that way already; both paths now share the one subquery (false with the
-- keys locked first).
--
-- Everything else is as revision 0010 made it (producer_held_keys_v1.sql, which the downgrade
-- restores, says why each step is there). inbox_receive_rows_v1 keeps its signature and results;
-- its body is replaced.

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
    v_done      bigint[];
    v_lead      bigint[];
    v_behind    bigint[];
    v_held_consumers text[];
    v_held_keys      text[];
    v_xid            xid;
    v_locks          integer;
    v_early          boolean := false;
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
        -- The first new message of each key, unless the key has a head already (then the message
        -- queues behind it, below): it becomes the head, or, if the key has queued messages and no
        -- head, queues behind them and files the key's repair. Found from four columns, with an
        -- index probe per message (a subquery per message: never a join over the queue, whatever
        -- the statistics say), and only the messages of keys without a head sorted by their key
        -- (text comparisons cost: a keyed batch behind others' heads sorts nothing). Past the
        -- transaction's first 1,000 messages (below), no lock is taken here: the keys whose head
        -- another transaction made are collected, and locked below once their messages are queued.
        -- A key whose head this transaction made (in this batch or an earlier one) needs nothing:
        -- nobody can finish that head before we commit.
        IF v_rc THEN
            -- A transaction's first 1,000 messages (counted in the transaction-local setting
            -- postbox.batch_key_locks; a batch that would pass them counts none) have their keys
            -- all locked first, shared, as revision 0008 did:
            -- cheaper than looking for the heads twice (an index probe costs more than a lock), and
            -- the heads found below are then their queued messages' check. Past them, the lock
            -- table, shared by the whole server, would fill up with the locks of new keys.
            v_locks := coalesce(nullif(current_setting('postbox.batch_key_locks', true), '')::integer, 0);
            IF v_locks + v_n <= 1000 THEN
                PERFORM set_config('postbox.batch_key_locks', (v_locks + v_n)::text, true);
                -- postbox.lock_key_shared_v1(1, ...), inline; in any order: the key lock is only
                -- ever taken exclusively by trying, so no cycle forms.
                PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(u.consumer || '/' || coalesce(u.key, u.message_id)))
                   FROM unnest(consumers, message_ids, keys) AS u(consumer, message_id, key);
                v_early := true;
            END IF;
        END IF;
        IF NOT v_early THEN
            v_xid := pg_current_xact_id()::xid;
        END IF;
        WITH m AS MATERIALIZED (
            SELECT u.consumer, u.key, u.id,
                   -- The key's head: none (NULL), or whether this transaction made it (its row's
                   -- version is ours: nobody can finish it before we commit; received now too,
                   -- since a frozen head keeps an xid from 2^32 transactions ago). With the keys
                   -- locked first, whose head it is does not matter (false): the index alone
                   -- answers. A scalar subquery, never an EXISTS, which PostgreSQL may run as a hash
                   -- of the whole inbox read by a sequential scan.
                   (SELECT NOT v_early AND x.xmin = v_xid AND x.received_at = now() FROM postbox.inbox x
                     WHERE x.consumer = u.consumer AND x.key = u.key AND x.state <> 'pending'
                     LIMIT 1) AS ours
              FROM (SELECT u.consumer, coalesce(u.key, u.message_id) AS key, u.id
                      FROM unnest(consumers, message_ids, keys, v_ids) AS u(consumer, message_id, key, id)
                     WHERE v_all OR u.id IN (SELECT unnest(v_new))) u)
        SELECT l.lead, l.behind, o.consumers, o.keys
          INTO v_lead, v_behind, v_held_consumers, v_held_keys
          FROM (SELECT array_agg(y.id) AS lead, array_agg(y.id) FILTER (WHERE y.queued) AS behind
                  FROM (SELECT DISTINCT ON (m.consumer, m.key) m.id,
                               EXISTS (SELECT 1 FROM postbox.inbox p
                                        WHERE p.consumer = m.consumer AND p.key = m.key AND p.state = 'pending'
                                          AND p.position < m.id) AS queued
                          FROM m WHERE m.ours IS NULL
                         ORDER BY m.consumer, m.key, m.id) y) l,
               -- Keys whose head another transaction made, once per message (a key twice is
               -- harmless below, and cheaper than sorting every message by its key).
               (SELECT array_agg(m.consumer) AS consumers, array_agg(m.key) AS keys
                  FROM m WHERE NOT m.ours AND NOT v_early) o;
        IF v_lead IS NOT NULL THEN
            -- Keys are taken in one global order, so two batches starting the same keys never wait
            -- for each other in a cycle. A head needs no lock: nobody can finish it before we commit.
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
            IF coalesce(cardinality(v_done), 0) < cardinality(v_lead) AND NOT v_early THEN
                -- A head another transaction was making for the same key committed while ours
                -- waited for it: that key's messages queue behind it, and are locked like the rest
                -- (unless locked first).
                SELECT coalesce(v_held_consumers, '{}') || array_agg(u.consumer),
                       coalesce(v_held_keys, '{}') || array_agg(coalesce(u.key, u.message_id))
                  INTO v_held_consumers, v_held_keys
                  FROM unnest(consumers, message_ids, keys, v_ids) AS u(consumer, message_id, key, id)
                 WHERE u.id IN (SELECT unnest(v_lead)) AND u.id NOT IN (SELECT unnest(coalesce(v_done, '{}')));
            END IF;
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
        -- (A batch without keys whose messages queued behind earlier ones of the same id: each such
        -- key is checked like a key that had a head.)
        SELECT coalesce(v_held_consumers, array_agg(k.consumer)), coalesce(v_held_keys, array_agg(k.key))
          INTO v_held_consumers, v_held_keys
          FROM (SELECT DISTINCT q.consumer, q.key FROM q WHERE v_plain AND v_keyless) k;
    END IF;
    IF v_held_keys IS NOT NULL THEN
        -- Messages queued behind a head another transaction made (found above, or gone since): a head
        -- that finishes while this transaction is open does not see them (not committed yet) and
        -- cannot hand over to them. Only their keys are locked, shared, held to our commit, and then
        -- their heads looked for again (a new statement: a new snapshot): a completion that comes
        -- later cannot take the key's lock (it only ever tries) and files a repair, made at the
        -- first claim after our commit; one that finished before has its result seen here, and a
        -- key left without a head gets its repair from us. Messages behind a head this transaction
        -- made, or behind a repair it filed, need nothing: nobody finishes that head before our commit.
        -- (A transaction holds one lock per key it queues behind another's head, in PostgreSQL's
        -- lock table, which the whole server shares; a key that becomes a head takes none.)
        -- Under REPEATABLE READ the snapshot predates any lock: the keys are checked at commit
        -- (inbox_commit_check_v1) instead, locked, then their heads locked to catch a change.
        IF v_rc THEN
            -- postbox.lock_key_shared_v1(1, ...), inline; in any order: the key lock is only ever
            -- taken exclusively by trying, so no cycle forms.
            PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(u.consumer || '/' || u.key))
               FROM unnest(v_held_consumers, v_held_keys) AS u(consumer, key);
            INSERT INTO postbox.key_repairs (origin, queue, key)
            SELECT DISTINCT 'inbox', u.consumer, u.key
              FROM unnest(v_held_consumers, v_held_keys) AS u(consumer, key)
             WHERE NOT EXISTS (SELECT 1 FROM postbox.inbox x
                                WHERE x.consumer = u.consumer AND x.key = u.key AND x.state <> 'pending'
                               OFFSET 0);
        ELSE
            INSERT INTO postbox.inbox_commit_checks (consumers, keys)
            SELECT array_agg(k.consumer), array_agg(k.key)
              FROM (SELECT DISTINCT u.consumer, u.key FROM unnest(v_held_consumers, v_held_keys) AS u(consumer, key)) k;
        END IF;
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
