-- Revision 0013: a batch publish (outbox_publish_batch_v1, what publish_many calls) writes its events
-- in a few statements for the whole batch, instead of calling outbox_publish_v1 once per event. Same
-- ids, order, checks, errors and guarantees.
--
-- Until now each event of a batch took a turn of a plpgsql loop and a call of the single publish,
-- with its own statements: a batch of 500 events ran about 1,500 statements. Now:
--
-- * The checks: one pass over the batch finds the events that may be wrong (or whose JSON is long
--   enough to need its own check), and only those are checked one by one, in the order and with the
--   functions of the loop this replaces, so a bad batch is refused with the same error as before.
-- * Ids are taken in the batch's order (an event's id is its position: a key's events keep the
--   order given).
-- * The first event of each key tries to become its key's head, in one statement, keys taken in one
--   global order (two batches starting the same keys wait for each other's heads in the same
--   order, so they cannot deadlock), as the loop took them; a key that has a head already keeps it,
--   and the event queues behind it.
-- * Then, in a new statement (under READ COMMITTED a new snapshot, taken after any wait for
--   another transaction's head), a head just made whose key has earlier events queued (a key
--   waiting for its repair) steps back behind them, and the key's repair is filed: an event never
--   overtakes one queued before it. The loop looked for queued events before each attempt at a
--   head; this looks after the attempt, so it also sees an event queued and committed while the
--   batch waited for another key's head.
-- * Every other event is queued behind its key's head, in one statement; each queued row's check
--   at commit is unchanged (outbox_pending_commit_v1).
--
-- outbox_publish_batch_v1 keeps its signature and results; its body is replaced (the loop is in
-- outbox_publish_v1.sql, which the downgrade restores). It is an entry point that runs as its owner
-- (roles_v1.sql made it so; CREATE OR REPLACE resets that, so it says it here).

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
    v_heads     bigint[];
    v_back      bigint[];
    v_notify    text[];
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
        IF postbox.message_fields_bad_v1(m ->> 'destination', m ->> 'message_id', false, m ->> 'key', m ->> 'type',
                                         m ->> 'correlation_id', m ->> 'causation_id', NULL, m -> 'payload',
                                         coalesce(m -> 'headers', '{}'::jsonb)) THEN
            PERFORM postbox.reject_message_fields_v1('destination', m ->> 'destination', m ->> 'message_id', false,
                                                     m ->> 'key', m ->> 'type', m ->> 'correlation_id',
                                                     m ->> 'causation_id', NULL, m -> 'payload',
                                                     coalesce(m -> 'headers', '{}'::jsonb));
        END IF;
        IF postbox.message_json_large_v1((m -> 'payload')::text, coalesce(m -> 'headers', '{}'::jsonb)::text) THEN
            PERFORM postbox.check_message_json_v1(m -> 'payload', (m -> 'payload')::text,
                                                  coalesce(m -> 'headers', '{}'::jsonb),
                                                  coalesce(m -> 'headers', '{}'::jsonb)::text);
        END IF;
    END LOOP;

    -- Ids in the batch's order; a missing message_id is a new UUID, a missing key the message_id.
    v_ids := ARRAY(SELECT s.id FROM (SELECT nextval('postbox.outbox_id_seq') AS id FROM generate_series(1, v_n)) s
                    ORDER BY s.id);
    SELECT array_agg(x.destination ORDER BY x.n), array_agg(x.mid ORDER BY x.n),
           array_agg(coalesce(x.key, x.mid) ORDER BY x.n)
      INTO v_dests, v_mids, v_keys
      FROM (SELECT e.ordinality AS n, e.value ->> 'destination' AS destination, e.value ->> 'key' AS key,
                   coalesce(e.value ->> 'message_id', gen_random_uuid()::text) AS mid
              FROM jsonb_array_elements(messages) WITH ORDINALITY e) x;

    -- The first event of each key tries to become its head, keys in one global order.
    WITH h AS (
        INSERT INTO postbox.outbox AS o (id, destination, message_id, key, position, type, payload, headers,
                                         correlation_id, causation_id, state)
        SELECT f.id, f.destination, f.mid, f.key, f.id, e.value ->> 'type', e.value -> 'payload',
               coalesce(e.value -> 'headers', '{}'::jsonb), e.value ->> 'correlation_id', e.value ->> 'causation_id',
               'ready'
          FROM (SELECT DISTINCT ON (u.destination COLLATE "C", u.key COLLATE "C") u.destination, u.key, u.mid, u.id, u.n
                  FROM unnest(v_dests, v_keys, v_mids, v_ids) WITH ORDINALITY AS u(destination, key, mid, id, n)
                 ORDER BY u.destination COLLATE "C", u.key COLLATE "C", u.id) f
          JOIN LATERAL (SELECT messages -> (f.n::integer - 1) AS value) e ON true
         ORDER BY f.destination COLLATE "C", f.key COLLATE "C"
        ON CONFLICT (destination, key) WHERE state <> 'pending' DO NOTHING
        RETURNING o.id)
    SELECT array_agg(h.id) INTO v_heads FROM h;

    IF v_heads IS NOT NULL THEN
        -- A new statement, after any wait above: a head just made whose key has earlier events queued
        -- (waiting for their head's repair) steps back behind them, and the key's repair is filed.
        -- One index probe per head (a subquery per head: never a scan of the queue).
        WITH b AS (
            UPDATE postbox.outbox o SET state = 'pending'
             WHERE o.id = ANY (ARRAY(
                   SELECT u.id FROM unnest(v_dests, v_keys, v_ids) AS u(destination, key, id)
                    WHERE u.id IN (SELECT unnest(v_heads))
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

    IF coalesce(cardinality(v_heads), 0) < v_n THEN
        -- Every other event queued behind its key's head (in this batch or before it): a queued row
        -- conflicts with nothing (its position orders its key).
        INSERT INTO postbox.outbox (id, destination, message_id, key, position, type, payload, headers,
                                    correlation_id, causation_id, state)
        SELECT u.id, u.destination, u.mid, u.key, u.id, e.value ->> 'type', e.value -> 'payload',
               coalesce(e.value -> 'headers', '{}'::jsonb), e.value ->> 'correlation_id', e.value ->> 'causation_id',
               'pending'
          FROM unnest(v_dests, v_keys, v_mids, v_ids) WITH ORDINALITY AS u(destination, key, mid, id, n)
          JOIN LATERAL (SELECT messages -> (u.n::integer - 1) AS value) e ON true
         WHERE u.id NOT IN (SELECT unnest(coalesce(v_heads, '{}')));
    END IF;
    RETURN QUERY SELECT u.n, u.id FROM unnest(v_ids) WITH ORDINALITY AS u(id, n);
END
$$;
