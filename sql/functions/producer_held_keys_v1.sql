-- Revision 0010: a producer transaction locks only the keys it queues a message under behind
-- another transaction's head, and a key's repair is never taken away unmade.
--
-- * The batches' core (inbox_receive_rows_v1), under READ COMMITTED, took the lock of every key of
--   its new messages, shared, before it looked for their heads, and held them to its commit
--   (revision 0008). Each lock is an entry of PostgreSQL's lock table, which the whole server
--   shares (about 7,800 entries with the default settings): one transaction receiving 20,000
--   messages under new keys failed with "out of shared memory", and while such a transaction held
--   thousands of locks other sessions could fail the same way. The keys of a transaction's first
--   1,000 messages are still locked that way (counted in the transaction-local setting postbox.batch_key_locks):
--   an index probe costs more than a lock, and looking for the heads only once keeps a keyed batch
--   as cheap as before. Past them, a batch looks for the heads first, without a lock, and locks
--   only the keys whose messages it queues behind a head another transaction made (or behind
--   messages of the same id, without keys), after queuing them, then looks for those heads again
--   under the locks, as a single receive does. A message that becomes its key's head, and those
--   queued behind a head the same transaction made (in this batch or an earlier one: the head's
--   row version is the transaction's), take no lock: nobody can finish that head before the
--   commit. Under REPEATABLE READ the keys queued behind others' heads, and only they, get the
--   check at commit.
-- * repair_keys_v1 made a key's head, then deleted the key's repairs, in a later snapshot: it could
--   delete a repair filed in between (by a completion that found the key locked by it), which its
--   look for the head had not seen, and leave the key with queued messages, no head and no repair.
--   It now deletes the key's repairs first, then looks for the head.
-- * The outbox's check at commit (outbox_pending_commit_v1, a deferred trigger per queued row) took
--   the key's lock for every queued row, including rows queued behind a head the same transaction
--   made: publishing two messages under each of 20,000 new keys in one transaction failed at its
--   commit with "out of shared memory". Such rows now need no lock and no check.
--
-- All three keep their signatures and results; their bodies are replaced (0008's batch core is in
-- inbox_receive_queue_lock_v1.sql, 0001's repair in inbox_flow_v1.sql, the outbox's check in 0001's
-- queue template, queue_v1.sql: the downgrade restores them). The batch core and the repair run
-- inside the entry points and are not SECURITY DEFINER; the outbox's check runs at commit as the
-- producer's login, and says SECURITY DEFINER and its search_path itself (as roles_v1.sql made it:
-- CREATE OR REPLACE resets both).

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
                   -- locked first, whose head it is does not matter: the index alone answers.
                   CASE WHEN v_early
                        THEN CASE WHEN EXISTS (SELECT 1 FROM postbox.inbox x
                                                WHERE x.consumer = u.consumer AND x.key = u.key
                                                  AND x.state <> 'pending') THEN false END
                        ELSE (SELECT x.xmin = v_xid AND x.received_at = now() FROM postbox.inbox x
                               WHERE x.consumer = u.consumer AND x.key = u.key AND x.state <> 'pending'
                               LIMIT 1) END AS ours
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
            -- The key's repairs are taken first, then its head looked for (a new statement, a new
            -- snapshot): a repair filed after the DELETE looked (by a completion that found the key
            -- locked by us) stays for the next claim. Deleting after the head was looked for could
            -- take away a repair whose completion that look did not see, leaving the key without a
            -- head and without a repair.
            DELETE FROM postbox.key_repairs WHERE origin = p_origin AND queue = p_queue AND key = r.key;
            IF p_origin = 'inbox' THEN
                PERFORM postbox.inbox_promote_v1(p_queue, r.key, p_now);
            ELSE
                PERFORM postbox.outbox_promote_v1(p_queue, r.key, p_now);
            END IF;
            v_done := v_done + 1;
        EXCEPTION WHEN lock_not_available OR unique_violation THEN
            NULL;  -- a producer is inserting a head for this key right now: it is not orphaned
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN v_done;
END
$$;

-- The outbox's check at commit, for a row queued behind its key's head (deferred, once per row):
-- a row behind a head this transaction made (the head's row version is the transaction's) needs no
-- check and no lock, since nobody can finish that head before the commit; so publishing several
-- messages under each of tens of thousands of new keys in one transaction holds no key lock. The
-- rest is as before: the key's lock, shared, then its head looked for.
CREATE OR REPLACE FUNCTION postbox.outbox_pending_commit_v1() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    -- (Created now too: a frozen head keeps an xid from 2^32 transactions ago.)
    PERFORM 1 FROM postbox.outbox
     WHERE destination = NEW.destination AND key = NEW.key AND state <> 'pending'
       AND xmin = pg_current_xact_id()::xid AND created_at = now();
    IF FOUND THEN
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
