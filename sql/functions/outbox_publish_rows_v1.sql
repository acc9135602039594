-- Revision 0013: a batch publish (outbox_publish_batch_v1, what publish_many calls) writes its events
-- in a few statements for the whole batch, instead of calling outbox_publish_v1 once per event. Same
-- ids, order, checks, errors and guarantees.
--
-- Until now each event of a batch took a turn of a plpgsql loop and a call of the single publish,
-- with its own statements (a batch of 500 events ran about 1,500), and each event it queued behind
-- a head had its own check at commit (outbox_pending_commit_v1: the key's lock, then its head looked
-- for). Now:
--
-- * The checks: one pass over the batch finds the events that may be wrong (or whose JSON is long
--   enough to need its own check), and only those are checked one by one, in the order and with the
--   functions of the loop this replaces, so a bad batch is refused with the same error as before.
-- * Ids are taken in the batch's order (an event's id is its position: a key's events keep the
--   order given).
-- * The first event of each key looks for its key's head (one index probe; an event without
--   message_id and key is under a new UUID nobody has used, and needs none). A key without a head:
--   the event tries to become it, in one statement, keys taken in one global order (two batches
--   starting the same keys wait for each other's heads in the same order, so they cannot
--   deadlock), as the loop took them. Then, in a new statement (under READ COMMITTED a new
--   snapshot, taken after any wait for another transaction's head), a head just made whose key has
--   earlier events queued (a key waiting for its repair) steps back behind them, and the key's
--   repair is filed: an event never overtakes one queued before it. The loop looked for queued
--   events before each attempt at a head; this looks after the attempt, so it also sees an event
--   queued and committed while the batch waited for another key's head.
-- * Every other event is queued behind its key's head, in one statement. Under READ COMMITTED the
--   keys the batch queued events under behind another transaction's head are then locked, shared,
--   held to the commit, and their heads looked for again (as the check at commit did, once per key
--   instead of once per row, and as a batch receive does); the per-row trigger skips the rows the
--   batch checked (the batch says so in the transaction-local setting postbox.outbox_check while it
--   inserts them). Under REPEATABLE READ and SERIALIZABLE each queued row keeps its check at commit,
--   which locks the head it saw to catch a change since the snapshot.
--
-- outbox_publish_batch_v1 keeps its signature and results; its body is replaced (the loop is in
-- outbox_publish_v1.sql, which the downgrade restores, with 0001's trigger). It is an entry point
-- that runs as its owner (roles_v1.sql made it so; CREATE OR REPLACE resets that, so it says it
-- here).

CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch_v1(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
#variable_conflict use_column
DECLARE
    m           jsonb;
    n           bigint;
    v_n         integer;
    v_ids       bigint[];
    v_dests     text[];
    v_mids      text[];
    v_keys      text[];
    v_fresh     boolean[];
    v_heads     bigint[];
    v_lead      bigint[];
    v_back      bigint[];
    v_rc        boolean;
    v_xid       xid;
    v_held_dests text[];
    v_held_keys  text[];
BEGIN
    IF messages IS NULL OR jsonb_typeof(messages) <> 'array' THEN
        PERFORM postbox.reject_v1('messages', 'must be a JSON array');
    END IF;
    v_n := jsonb_array_length(messages);
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- The events that may be wrong, or need their JSON checked, one by one in the loop's order (by
    -- destination and key, then as given): the first wrong one is refused, as before.
    FOR m, n IN
        SELECT e.value, e.ordinality FROM jsonb_array_elements(messages) WITH ORDINALITY e
         WHERE jsonb_typeof(e.value) <> 'object'
            OR jsonb_typeof(e.value -> 'destination') NOT IN ('string', 'null')
            OR jsonb_typeof(e.value -> 'message_id') NOT IN ('string', 'null')
            OR jsonb_typeof(e.value -> 'key') NOT IN ('string', 'null')
            OR jsonb_typeof(e.value -> 'type') NOT IN ('string', 'null')
            OR jsonb_typeof(e.value -> 'correlation_id') NOT IN ('string', 'null')
            OR jsonb_typeof(e.value -> 'causation_id') NOT IN ('string', 'null')
            OR postbox.message_fields_bad_v1(e.value ->> 'destination', e.value ->> 'message_id', false,
                                             e.value ->> 'key', e.value ->> 'type', e.value ->> 'correlation_id',
                                             e.value ->> 'causation_id', NULL, e.value -> 'payload',
                                             coalesce(e.value -> 'headers', '{}'::jsonb))
            OR postbox.message_json_large_v1((e.value -> 'payload')::text,
                                             coalesce(e.value -> 'headers', '{}'::jsonb)::text)
         ORDER BY CASE WHEN jsonb_typeof(e.value) = 'object' THEN e.value ->> 'destination' END,
                  CASE WHEN jsonb_typeof(e.value) = 'object' THEN coalesce(e.value ->> 'key', e.value ->> 'message_id') END,
                  e.ordinality
    LOOP
        PERFORM postbox.check_message_element_v1(
            m, n, ARRAY['destination', 'message_id', 'key', 'type', 'correlation_id', 'causation_id']);
        -- (Raises on the first wrong field, as message_fields_bad_v1 finds them; nothing if none is.)
        PERFORM postbox.reject_message_fields_v1('destination', m ->> 'destination', m ->> 'message_id', false,
                                                 m ->> 'key', m ->> 'type', m ->> 'correlation_id',
                                                 m ->> 'causation_id', NULL, m -> 'payload',
                                                 coalesce(m -> 'headers', '{}'::jsonb));
        IF postbox.message_json_large_v1((m -> 'payload')::text, coalesce(m -> 'headers', '{}'::jsonb)::text) THEN
            PERFORM postbox.check_message_json_v1(m -> 'payload', (m -> 'payload')::text,
                                                  coalesce(m -> 'headers', '{}'::jsonb),
                                                  coalesce(m -> 'headers', '{}'::jsonb)::text);
        END IF;
    END LOOP;

    -- Ids in the batch's order; a missing message_id is a new UUID, a missing key the message_id.
    v_ids := ARRAY(SELECT s.id FROM (SELECT nextval('postbox.outbox_id_seq') AS id FROM generate_series(1, v_n)) s
                    ORDER BY s.id);
    -- An event with neither (fresh) is under a key nobody has used: it needs no probe.
    SELECT array_agg(x.destination ORDER BY x.n), array_agg(x.mid ORDER BY x.n),
           array_agg(coalesce(x.key, x.mid) ORDER BY x.n), array_agg(x.fresh ORDER BY x.n)
      INTO v_dests, v_mids, v_keys, v_fresh
      FROM (SELECT e.ordinality AS n, e.value ->> 'destination' AS destination, e.value ->> 'key' AS key,
                   coalesce(e.value ->> 'message_id', gen_random_uuid()::text) AS mid,
                   e.value ->> 'message_id' IS NULL AND e.value ->> 'key' IS NULL AS fresh
              FROM jsonb_array_elements(messages) WITH ORDINALITY e) x;

    v_rc := current_setting('transaction_isolation') = 'read committed';
    IF v_rc THEN
        v_xid := pg_current_xact_id()::xid;
    END IF;
    -- The first event of each key, and its key's head: none (NULL), one this transaction made (true:
    -- its row version is ours, and it was made now, since a frozen row keeps an xid from 2^32
    -- transactions ago), or another's (false; under REPEATABLE READ and SERIALIZABLE every head is
    -- another's: the check per row at commit decides). One index probe per key (a scalar subquery:
    -- never a scan of the queue), and only the batch's keys sorted.
    WITH f AS MATERIALIZED (
        SELECT DISTINCT ON (u.destination COLLATE "C", u.key COLLATE "C") u.destination, u.key, u.id, u.fresh
          FROM unnest(v_dests, v_keys, v_ids, v_fresh) AS u(destination, key, id, fresh)
         ORDER BY u.destination COLLATE "C", u.key COLLATE "C", u.id),
    g AS MATERIALIZED (
        SELECT f.destination, f.key, f.id,
               CASE WHEN NOT f.fresh THEN
                   (SELECT v_rc AND x.xmin = v_xid AND x.created_at = now() FROM postbox.outbox x
                     WHERE x.destination = f.destination AND x.key = f.key AND x.state <> 'pending'
                     LIMIT 1) END AS ours
          FROM f)
    SELECT array_agg(g.id) FILTER (WHERE g.ours IS NULL),
           array_agg(g.destination) FILTER (WHERE NOT g.ours), array_agg(g.key) FILTER (WHERE NOT g.ours)
      INTO v_lead, v_held_dests, v_held_keys
      FROM g;

    IF v_lead IS NOT NULL THEN
        -- The first event of each key without a head tries to become it, keys in one global order
        -- (two batches starting the same keys wait for each other's heads in the same order).
        WITH h AS (
            INSERT INTO postbox.outbox AS o (id, destination, message_id, key, position, type, payload, headers,
                                             correlation_id, causation_id, state)
            SELECT u.id, u.destination, u.mid, u.key, u.id, e.value ->> 'type', e.value -> 'payload',
                   coalesce(e.value -> 'headers', '{}'::jsonb), e.value ->> 'correlation_id',
                   e.value ->> 'causation_id', 'ready'
              FROM unnest(v_dests, v_keys, v_mids, v_ids) WITH ORDINALITY AS u(destination, key, mid, id, n)
              JOIN LATERAL (SELECT messages -> (u.n::integer - 1) AS value) e ON true
             WHERE u.id IN (SELECT unnest(v_lead))
             ORDER BY u.destination COLLATE "C", u.key COLLATE "C"
            ON CONFLICT (destination, key) WHERE state <> 'pending' DO NOTHING
            RETURNING o.id)
        SELECT array_agg(h.id) INTO v_heads FROM h;
    END IF;

    IF v_heads IS NOT NULL THEN
        -- A new statement, after any wait above: a head just made whose key has earlier events queued
        -- (waiting for their head's repair) steps back behind them, and the key's repair is filed.
        -- One index probe per head (a subquery per head: never a scan of the queue).
        WITH b AS (
            UPDATE postbox.outbox o SET state = 'pending'
             WHERE o.id = ANY (ARRAY(
                   SELECT u.id FROM unnest(v_dests, v_keys, v_ids, v_fresh) AS u(destination, key, id, fresh)
                    WHERE NOT u.fresh AND u.id IN (SELECT unnest(v_heads))
                      AND (SELECT true FROM postbox.outbox p
                            WHERE p.destination = u.destination AND p.key = u.key AND p.state = 'pending'
                              AND p.position < u.id
                            LIMIT 1)))
            RETURNING o.id, o.destination, o.key),
        r AS (
            INSERT INTO postbox.key_repairs (origin, queue, key)
            SELECT 'outbox', b.destination, b.key FROM b)
        SELECT array_agg(b.id) INTO v_back FROM b;
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_outbox', d)
               FROM (SELECT DISTINCT u.destination AS d
                       FROM unnest(v_dests, v_ids) AS u(destination, id)
                      WHERE u.id IN (SELECT unnest(v_heads))
                        AND u.id NOT IN (SELECT unnest(coalesce(v_back, '{}')))) s;
        END IF;
    END IF;
    IF v_rc AND coalesce(cardinality(v_heads), 0) < coalesce(cardinality(v_lead), 0) THEN
        -- A head another transaction was making for the same key committed while ours waited for
        -- it: that key's events queue behind it, and its key is checked like the rest.
        SELECT coalesce(v_held_dests, '{}') || array_agg(u.destination),
               coalesce(v_held_keys, '{}') || array_agg(u.key)
          INTO v_held_dests, v_held_keys
          FROM unnest(v_dests, v_keys, v_ids) AS u(destination, key, id)
         WHERE u.id IN (SELECT unnest(v_lead)) AND u.id NOT IN (SELECT unnest(coalesce(v_heads, '{}')));
    END IF;

    IF coalesce(cardinality(v_heads), 0) < v_n THEN
        -- Every other event queued behind its key's head (in this batch or before it): a queued row
        -- conflicts with nothing (its position orders its key). Under READ COMMITTED the batch checks
        -- their keys itself, below, once per key, instead of a check per row at commit.
        IF v_rc THEN
            PERFORM set_config('postbox.outbox_check', 'batch', true);
        END IF;
        INSERT INTO postbox.outbox (id, destination, message_id, key, position, type, payload, headers,
                                    correlation_id, causation_id, state)
        SELECT u.id, u.destination, u.mid, u.key, u.id, e.value ->> 'type', e.value -> 'payload',
               coalesce(e.value -> 'headers', '{}'::jsonb), e.value ->> 'correlation_id', e.value ->> 'causation_id',
               'pending'
          FROM unnest(v_dests, v_keys, v_mids, v_ids) WITH ORDINALITY AS u(destination, key, mid, id, n)
          JOIN LATERAL (SELECT messages -> (u.n::integer - 1) AS value) e ON true
         WHERE u.id NOT IN (SELECT unnest(coalesce(v_heads, '{}')));
        IF v_rc THEN
            PERFORM set_config('postbox.outbox_check', '', true);
        END IF;
    END IF;
    IF v_rc AND v_held_keys IS NOT NULL THEN
        -- Events queued behind another transaction's head: a head that finishes while this
        -- transaction is open cannot see them (uncommitted) to hand over. Their keys are locked,
        -- shared, held to our commit, then their heads looked for again in a new statement (a new
        -- snapshot): a completion that comes later cannot take the key's lock (it only ever tries)
        -- and files a repair; one that finished before is seen here, and a key left without a head
        -- gets its repair from us. Events behind a head this transaction made, or behind a repair
        -- it filed, need nothing: nobody can finish that head before we commit.
        -- postbox.lock_key_shared_v1(2, ...), inline; in any order: the key lock is only ever taken
        -- exclusively by trying, so no cycle forms.
        PERFORM pg_advisory_xact_lock_shared(1349471042, hashtext(u.destination || '/' || u.key))
           FROM unnest(v_held_dests, v_held_keys) AS u(destination, key);
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT 'outbox', u.destination, u.key
          FROM unnest(v_held_dests, v_held_keys) AS u(destination, key)
         WHERE NOT EXISTS (SELECT 1 FROM postbox.outbox x
                            WHERE x.destination = u.destination AND x.key = u.key AND x.state <> 'pending'
                           OFFSET 0);
    END IF;
    RETURN QUERY SELECT u.n, u.id FROM unnest(v_ids) WITH ORDINALITY AS u(id, n);
END
$$;

-- The per-row check at commit skips the rows a batch checked itself (it says so in the
-- transaction-local setting postbox.outbox_check while it inserts them).
DROP TRIGGER outbox_pending_commit ON postbox.outbox;
CREATE CONSTRAINT TRIGGER outbox_pending_commit AFTER INSERT ON postbox.outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.state = 'pending' AND current_setting('postbox.outbox_check', true) IS DISTINCT FROM 'batch')
    EXECUTE FUNCTION postbox.outbox_pending_commit_v1();
