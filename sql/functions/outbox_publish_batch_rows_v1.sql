-- Revision 0013: a batch publish (publish_many) writes its rows in one statement instead of one
-- function call per row. Same ids, order, heads, errors and guarantees.
--
-- Until now outbox_publish_batch_v1 looped over its messages and called outbox_publish_v1 for each:
-- four statements per row (the element's check, the call, its look for queued rows, its INSERT),
-- about three times the time of a batch receive of as many messages (a one-off timing, 500 per
-- batch). Now, when every message is well formed (one statement checks them all, another the JSON
-- of the large ones, as the loop did), the batch takes its ids in the loop's order (destination,
-- key, then the order given), makes the first message of each key its head unless the key has
-- queued rows or a head already (INSERT ... ON CONFLICT, in the same order, so two batches starting
-- the same keys never wait for each other in a cycle), and queues the rest behind it, in one
-- statement. A batch with a malformed message runs the loop, as before, which names the first bad
-- field (or the JSON of a large message before it).
--
-- What the loop did for each row, the statement does for each key:
-- * a key with rows queued (waiting for their head's repair): every message queues behind them;
-- * a key with a head (another transaction's, or one being made: ON CONFLICT waits for it): every
--   message queues behind it, and the check at commit (outbox_pending_commit_v1, unchanged) holds
--   the key;
-- * otherwise its first message becomes the head, the rest queue behind it (no check: nobody can
--   finish that head before the commit).
-- Whether a key has queued rows is asked with a scalar subquery (one index probe), never an
-- EXISTS, which PostgreSQL may run as a hash of the whole outbox. The statement looks at every
-- key's queued rows in one snapshot, where the loop took a new one for each row; under READ
-- COMMITTED, a row committed while the statement waited for another transaction's head (behind a
-- head that finished meanwhile) would then come after this batch's head of its key. So each head
-- the batch made under a key it was given is looked at again, in a new statement: behind such a
-- row it queues instead, and the key gets a repair, as the loop would have left it.
--
-- outbox_publish_batch_v1 keeps its signature and results; its body is replaced (0001's is in
-- outbox_publish_v1.sql, which the downgrade restores).

CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch_v1(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
#variable_conflict use_column
DECLARE
    m        jsonb;
    n        bigint;
    v_n      integer;
    v_ok     boolean;
    v_ids    bigint[];
    v_ns     bigint[];
    v_out    bigint[];
    v_dests  text[];
    v_given  bigint[];
BEGIN
    IF messages IS NULL OR jsonb_typeof(messages) <> 'array' THEN
        PERFORM postbox.reject_v1('messages', 'must be a JSON array');
    END IF;
    v_n := jsonb_array_length(messages);
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- Every message well formed, as the loop below checks each (its element, then its fields).
    SELECT coalesce(bool_and(
               jsonb_typeof(e.value) = 'object'
               AND coalesce(jsonb_typeof(e.value -> 'destination'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(e.value -> 'message_id'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(e.value -> 'key'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(e.value -> 'type'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(e.value -> 'correlation_id'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(e.value -> 'causation_id'), 'null') IN ('string', 'null')
               AND NOT postbox.message_fields_bad_v1(
                       e.value ->> 'destination', e.value ->> 'message_id', false, e.value ->> 'key',
                       e.value ->> 'type', e.value ->> 'correlation_id', e.value ->> 'causation_id', NULL,
                       e.value -> 'payload', coalesce(e.value -> 'headers', '{}'::jsonb))), true)
      INTO v_ok
      FROM jsonb_array_elements(messages) AS e;
    IF NOT v_ok THEN
        -- A malformed message: each in turn, as outbox_publish_v1 takes it (it names the first bad
        -- field, or the JSON of a large message before it).
        FOR m, n IN SELECT e.value, e.ordinality FROM jsonb_array_elements(messages) WITH ORDINALITY e
                     ORDER BY CASE WHEN jsonb_typeof(e.value) = 'object' THEN e.value ->> 'destination' END,
                              CASE WHEN jsonb_typeof(e.value) = 'object' THEN coalesce(e.value ->> 'key', e.value ->> 'message_id') END,
                              e.ordinality LOOP
            PERFORM postbox.check_message_element_v1(
                m, n, ARRAY['destination', 'message_id', 'key', 'type', 'correlation_id', 'causation_id']);
            ordinality := n;
            outbox_id := postbox.outbox_publish_v1(
                destination    => m ->> 'destination',
                payload        => m -> 'payload',
                key            => m ->> 'key',
                type           => m ->> 'type',
                message_id     => m ->> 'message_id',
                headers        => coalesce(m -> 'headers', '{}'::jsonb),
                correlation_id => m ->> 'correlation_id',
                causation_id   => m ->> 'causation_id');
            RETURN NEXT;
        END LOOP;
        RETURN;
    END IF;
    -- The JSON of each large message (over 128 bytes, or over a limit) checked, in the loop's order,
    -- so that the first bad one raises what the loop would.
    PERFORM postbox.check_message_json_v1(x.payload, x.payload::text, x.headers, x.headers::text)
       FROM (SELECT e.value -> 'payload' AS payload, coalesce(e.value -> 'headers', '{}'::jsonb) AS headers
               FROM jsonb_array_elements(messages) WITH ORDINALITY AS e
              ORDER BY e.value ->> 'destination', coalesce(e.value ->> 'key', e.value ->> 'message_id'),
                       e.ordinality) x
      WHERE postbox.message_json_large_v1(x.payload::text, x.headers::text);
    -- Ids in the loop's order: by destination, key (a message without one: its message_id, or
    -- last if it has none either, and its key a new UUID), then as given; so a key's messages keep
    -- their order, and its heads go in in one global order.
    v_ids := ARRAY(SELECT s.id FROM (SELECT nextval('postbox.outbox_id_seq') AS id FROM generate_series(1, v_n)) s
                    ORDER BY s.id);
    WITH r AS MATERIALIZED (
        SELECT x.n, x.destination, x.message_id, coalesce(x.key, x.message_id) AS key, x.m,
               x.sort_key IS NOT NULL AS given,
               v_ids[row_number() OVER (ORDER BY x.destination, x.sort_key, x.n)] AS id
          FROM (SELECT e.ordinality AS n, e.value AS m, e.value ->> 'destination' AS destination,
                       e.value ->> 'key' AS key,
                       coalesce(e.value ->> 'message_id', gen_random_uuid()::text) AS message_id,
                       coalesce(e.value ->> 'key', e.value ->> 'message_id') AS sort_key
                  FROM jsonb_array_elements(messages) WITH ORDINALITY AS e) x),
    h AS (
        -- Each key's first message, its head unless the key has rows queued (an index probe each,
        -- never a hash of the outbox) or a head (ON CONFLICT: then it queues, below).
        INSERT INTO postbox.outbox AS o (id, destination, message_id, key, position, type, payload, headers,
                                         correlation_id, causation_id, state)
        SELECT f.id, f.destination, f.message_id, f.key, f.id, f.m ->> 'type', f.m -> 'payload',
               coalesce(f.m -> 'headers', '{}'::jsonb), f.m ->> 'correlation_id', f.m ->> 'causation_id', 'ready'
          FROM (SELECT DISTINCT ON (r.destination, r.key) r.* FROM r ORDER BY r.destination, r.key, r.id) f
         WHERE (SELECT true FROM postbox.outbox p
                 WHERE p.destination = f.destination AND p.key = f.key AND p.state = 'pending'
                 LIMIT 1) IS NULL
         ORDER BY f.id
        ON CONFLICT (destination, key) WHERE state <> 'pending' DO NOTHING
        RETURNING o.id, o.destination),
    q AS (
        -- Everything else queues behind its key's head (its position, its id, orders the key).
        INSERT INTO postbox.outbox AS o (id, destination, message_id, key, position, type, payload, headers,
                                         correlation_id, causation_id, state)
        SELECT r.id, r.destination, r.message_id, r.key, r.id, r.m ->> 'type', r.m -> 'payload',
               coalesce(r.m -> 'headers', '{}'::jsonb), r.m ->> 'correlation_id', r.m ->> 'causation_id', 'pending'
          FROM r
         WHERE r.id NOT IN (SELECT h.id FROM h)
         ORDER BY r.id
        RETURNING o.id)
    SELECT (SELECT array_agg(DISTINCT h.destination) FROM h),
           (SELECT array_agg(h.id) FROM h JOIN r g ON g.id = h.id WHERE g.given),
           array_agg(r.n ORDER BY r.n), array_agg(r.id ORDER BY r.n)
      INTO v_dests, v_given, v_ns, v_out
      FROM r;
    IF v_given IS NOT NULL AND current_setting('transaction_isolation') = 'read committed' THEN
        -- The statement above looked for each key's queued rows in one snapshot, taken before it
        -- waited, if it did, for another transaction's head of some key (ON CONFLICT); the loop
        -- looked again for each row. A row queued behind a head that finished meanwhile, committed
        -- while the statement waited, is not in that snapshot, and the head made after it would go
        -- first. Looked for again (a new statement: a new snapshot), such a key's head made here
        -- queues instead, behind that row, and the key gets a repair (the loop's outcome). A key
        -- this batch made up (a new UUID) has no other rows: not looked at.
        WITH late AS (
            UPDATE postbox.outbox o SET state = 'pending'
             WHERE o.id = ANY (v_given)
               AND (SELECT true FROM postbox.outbox p
                     WHERE p.destination = o.destination AND p.key = o.key AND p.state = 'pending'
                       AND p.position < o.position
                     LIMIT 1)
            RETURNING o.destination, o.key)
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT 'outbox', late.destination, late.key FROM late;
    END IF;
    IF v_dests IS NOT NULL AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('postbox_outbox', d) FROM unnest(v_dests) AS d;
    END IF;
    RETURN QUERY SELECT u.n, u.id FROM unnest(v_ns, v_out) AS u(n, id);
END
$$;
