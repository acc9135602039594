-- Receive a message into the inbox inside the caller's transaction.
-- Returns status 'new', 'duplicate' (same message_id and payload seen before for this consumer)
-- or 'conflict' (same message_id, different payload: nothing written), and the inbox id.
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
LANGUAGE plpgsql VOLATILE AS $$
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

    SELECT c.sequence_mode, c.first_sequence INTO v_mode, v_first
      FROM postbox.consumers c WHERE c.name = v_consumer;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM postbox.consumers c WHERE c.declared) THEN
            PERFORM postbox.reject_v1('consumer', format('%L is not a declared consumer', v_consumer));
        END IF;
        v_mode := 'arrival';
    END IF;
    IF v_mode <> 'arrival' AND v_seq IS NULL THEN
        PERFORM postbox.reject_v1('sequence', format('is required: consumer %L orders keys by sequence (%s)', v_consumer, v_mode));
    END IF;

    v_hash := decode(md5(v_text), 'hex');
    v_id := nextval('postbox.inbox_id_seq');
    INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id)
    VALUES (v_consumer, inbox_receive_v1.message_id, v_hash, v_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    IF NOT FOUND THEN
        SELECT d.payload_hash, d.inbox_id INTO v_old
          FROM postbox.inbox_dedup d
         WHERE d.consumer = v_consumer AND d.message_id = inbox_receive_v1.message_id;
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
        -- Queued behind the head; the commit trigger re-checks under the key lock, so a head that
        -- finishes while this transaction is open can never leave this message without a head.
        INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                   payload, headers, correlation_id, causation_id, source, state)
        VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
    END IF;
    status := 'new';
    inbox_id := v_id;
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_v1(text, text, jsonb, text, text, bigint, jsonb, integer, text, text, text)
    IS 'Receive one message in the caller''s transaction: (status new|duplicate|conflict, inbox_id). Nothing is visible to workers before the caller commits.';

-- The set-based core of a batch: the rows of arrays (one element per message) that
-- inbox_receive_many_v1 has checked (inbox_batch_ok_v1), received as inbox_receive_v1 would one
-- by one, in the arrays' order (ids are taken in that order, so a key keeps its order): one
-- statement writes the ledger rows of the whole batch, one its heads, and one its queued messages
-- if any.
--
-- A fresh batch conflicts with nothing, and a plain INSERT costs far less than ON CONFLICT's
-- speculative insertion (a batch of 500 without keys: about 35% less time in its two inserts).
-- So a batch of 16 or more first tries plain inserts in a subtransaction: the ledger rows and, if
-- no message has a key, the heads. A unique violation (an id seen before, a concurrent receive of
-- the same id, an id that another message uses as its key; an id twice in the batch is filtered
-- out first) undoes the try, and the batch takes the ON CONFLICT path. Both paths take rows in
-- the same global order. At most 32 tries per transaction (counted in the transaction-
-- local setting postbox.plain_batches): PostgreSQL's per-backend cache of subtransactions holds
-- 64, and a transaction past it slows every snapshot in the cluster.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_rows_v1(
    consumers text[], message_ids text[], payloads jsonb[], keys text[], types text[], sequences bigint[],
    headers jsonb[], schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    v_n         integer := coalesce(cardinality(message_ids), 0);
    v_ids       bigint[];
    v_new       bigint[];
    v_all       boolean;
    v_heads     bigint[];
    v_notify    text[];
    v_keyless   boolean := keys IS NULL OR cardinality(array_remove(keys, NULL)) = 0;
    v_plain     boolean := false;
    v_tries     integer;
BEGIN
    IF v_n = 0 THEN
        RETURN;
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
                INSERT INTO postbox.inbox_dedup AS l (consumer, message_id, payload_hash, inbox_id)
                SELECT DISTINCT ON (u.consumer, u.message_id)
                       u.consumer, u.message_id, decode(md5(u.payload::text), 'hex'), u.id
                  FROM unnest(consumers, message_ids, payloads, v_ids) AS u(consumer, message_id, payload, id)
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
                     WHERE (v_all OR u.id IN (SELECT unnest(v_new)))
                       AND NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                        WHERE p.consumer = u.consumer AND p.key = u.message_id
                                          AND p.state = 'pending')
                     ORDER BY u.consumer, u.message_id
                    RETURNING i.id, i.consumer)
                SELECT array_agg(h.id), array_agg(DISTINCT h.consumer) INTO v_heads, v_notify FROM h;
            END IF;
            v_plain := true;
        EXCEPTION WHEN unique_violation THEN
            v_heads := NULL;
            v_notify := NULL;
        END;
    END IF;
    IF NOT v_plain THEN
        -- The ledger keeps the first of each id: a message seen before, or earlier in this batch, is
        -- not new. Only the three columns the ledger needs are read here. Rows go in in one global
        -- order (by id), so batches carrying the same ids in different orders never deadlock.
        WITH d AS (
            INSERT INTO postbox.inbox_dedup AS l (consumer, message_id, payload_hash, inbox_id)
            SELECT u.consumer, u.message_id, decode(md5(u.payload::text), 'hex'), u.id
              FROM unnest(consumers, message_ids, payloads, v_ids) AS u(consumer, message_id, payload, id)
             ORDER BY u.consumer, u.message_id, u.id
            ON CONFLICT (consumer, message_id) DO NOTHING
            RETURNING l.inbox_id)
        SELECT array_agg(d.inbox_id) INTO v_new FROM d;
        v_all := coalesce(cardinality(v_new), 0) = v_n;
    END IF;
    IF NOT (v_plain AND v_keyless) THEN
        -- The first new message of a key becomes its head, unless the key has a head already or
        -- queued messages (never overtake them). Keys are taken in one global order, so two batches
        -- starting the same keys never wait for each other in a cycle.
        WITH f AS (
            SELECT u.id, u.consumer, u.message_id, coalesce(u.key, u.message_id) AS key, u.sequence, u.type,
                   coalesce(u.schema_version, 1) AS schema_version, u.payload, coalesce(u.headers, '{}'::jsonb) AS headers,
                   u.correlation_id, u.causation_id, u.source
              FROM unnest(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                          correlation_ids, causation_ids, sources, v_ids)
                   AS u(consumer, message_id, payload, key, type, sequence, headers, schema_version,
                        correlation_id, causation_id, source, id)
             WHERE v_all OR u.id IN (SELECT unnest(v_new))),
        h AS (
            INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                            payload, headers, correlation_id, causation_id, source, state)
            SELECT DISTINCT ON (f.consumer, f.key)
                   f.id, f.consumer, f.message_id, f.key, f.sequence, f.id, f.type, f.schema_version,
                   f.payload, f.headers, f.correlation_id, f.causation_id, f.source, 'ready'
              FROM f
             WHERE NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                WHERE p.consumer = f.consumer AND p.key = f.key AND p.state = 'pending'
                                  AND p.position < f.id)
             ORDER BY f.consumer, f.key, f.id
            ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
            RETURNING i.id, i.consumer)
        SELECT array_agg(h.id), array_agg(DISTINCT h.consumer) INTO v_heads, v_notify FROM h;
    END IF;
    IF coalesce(cardinality(v_heads), 0) < coalesce(cardinality(v_new), 0) THEN
        -- Everything else new is queued behind its key's head; the commit trigger re-checks it.
        INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                   payload, headers, correlation_id, causation_id, source, state)
        SELECT u.id, u.consumer, u.message_id, coalesce(u.key, u.message_id), u.sequence, u.id, u.type,
               coalesce(u.schema_version, 1), u.payload, coalesce(u.headers, '{}'::jsonb), u.correlation_id,
               u.causation_id, u.source, 'pending'
          FROM unnest(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                      correlation_ids, causation_ids, sources, v_ids)
               AS u(consumer, message_id, payload, key, type, sequence, headers, schema_version,
                    correlation_id, causation_id, source, id)
         WHERE (v_all OR u.id IN (SELECT unnest(v_new)))
           AND u.id NOT IN (SELECT unnest(coalesce(v_heads, '{}')))
         ORDER BY u.id;
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
      LEFT JOIN postbox.inbox_dedup l
        ON NOT x.fresh AND l.consumer = x.consumer AND l.message_id = x.message_id
     ORDER BY x.n;
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_rows_v1(text[], text[], jsonb[], text[], text[], bigint[], jsonb[], integer[], text[], text[], text[])
    IS 'Internal: the set-based core of a checked batch receive.';

-- The one check of a batch: whether every message is valid exactly as inbox_receive_v1 checks it
-- (text lengths, payload and headers sizes, nesting, numbers, headers objects) and goes to a
-- consumer in arrival mode (or an undeclared one while none is declared). If so, the batch is
-- received set-based; if not, element by element, which names the bad element and field. Checked
-- column by column (a NULL column is a field no message has), each consumer once, and payloads
-- and headers on their whole JSON arrays: one check covers the usual batch. The same id twice
-- needs no special path: the ledger insert keeps the first, and the later ones come back
-- duplicate or conflict. (plpgsql, not sql: a sql function with a subquery is planned again in
-- every transaction, a plpgsql one once per session.)
CREATE OR REPLACE FUNCTION postbox.inbox_batch_ok_v1(
    consumers text[], message_ids text[], payloads jsonb, keys text[], types text[], sequences bigint[],
    headers jsonb, schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT coalesce(bool_and(coalesce(
               octet_length(u.name) BETWEEN 1 AND 200
               AND CASE WHEN c.name IS NULL THEN NOT EXISTS (SELECT 1 FROM postbox.consumers d WHERE d.declared)
                        ELSE c.sequence_mode = 'arrival' END, false)), consumers IS NOT NULL)
              FROM (SELECT DISTINCT u.name FROM unnest(consumers) AS u(name)) u
              LEFT JOIN postbox.consumers c ON c.name = u.name)
       AND postbox.json_array_ok_v1(payloads, postbox.max_payload_bytes_v1())
       AND (headers IS NULL
            OR (postbox.json_array_ok_v1(headers, postbox.max_headers_bytes_v1())
                AND NOT jsonb_path_exists(headers, 'strict $[*] ? (@.type() != "object")')))
       AND postbox.texts_ok_v1(message_ids, 512, true)
       AND (keys IS NULL OR postbox.texts_ok_v1(keys, 1024, false))
       AND (types IS NULL OR postbox.texts_ok_v1(types, 200, false))
       AND (correlation_ids IS NULL OR postbox.texts_ok_v1(correlation_ids, 512, false))
       AND (causation_ids IS NULL OR postbox.texts_ok_v1(causation_ids, 512, false))
       AND (sources IS NULL OR postbox.texts_ok_v1(sources, 512, false))
       AND (sequences IS NULL OR coalesce((SELECT bool_and(s >= 0) FROM unnest(sequences) AS s), true))
       AND (schema_versions IS NULL OR coalesce((SELECT bool_and(v >= 1) FROM unnest(schema_versions) AS v), true));
END
$$;

-- A batch given as arrays, received element by element (inbox_receive_each_v1), which names the
-- first bad element and field: the path of batches that are not valid as a whole or go to a
-- consumer ordered by sequence.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_arrays_each_v1(
    consumers text[], message_ids text[], payloads jsonb[], keys text[], types text[], sequences bigint[],
    headers jsonb[], schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.inbox_receive_each_v1((
        SELECT coalesce(jsonb_agg(
                   jsonb_build_object('consumer', u.consumer, 'message_id', u.message_id, 'key', u.key,
                                      'type', u.type, 'sequence', u.sequence, 'headers', coalesce(u.headers, '{}'),
                                      'schema_version', u.schema_version, 'correlation_id', u.correlation_id,
                                      'causation_id', u.causation_id, 'source', u.source)
                   || CASE WHEN u.payload IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('payload', u.payload) END
                   ORDER BY u.n), '[]')
          FROM unnest(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                      correlation_ids, causation_ids, sources) WITH ORDINALITY
               AS u(consumer, message_id, payload, key, type, sequence, headers, schema_version,
                    correlation_id, causation_id, source, n)));
END
$$;

-- The one batch path, column by column: consumers, message_ids and every other field an array of
-- one element per message (or NULL when no message has the field), payloads (and headers, or
-- NULL) one JSON array each, which PostgreSQL reads much faster than an array of jsonb values.
-- Checked by inbox_batch_ok_v1, then received set-based (inbox_receive_rows_v1), or else element
-- by element, naming the first bad element and field. Element i of every column is message i: a
-- column of another length would shift or drop fields silently (unnest pads the shorter ones), so
-- it is refused, naming it. The batch entry points below are thin aliases of this.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_many_v1(
    consumers text[], message_ids text[], payloads jsonb, keys text[], types text[], sequences bigint[],
    headers jsonb, schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_n        integer := coalesce(cardinality(message_ids), 0);
    v_payloads jsonb[];
    v_headers  jsonb[];
BEGIN
    IF message_ids IS NULL THEN
        PERFORM postbox.reject_v1('message_ids', 'is required');
    END IF;
    IF payloads IS NULL OR jsonb_typeof(payloads) <> 'array' OR jsonb_array_length(payloads) <> v_n THEN
        PERFORM postbox.reject_v1('payloads', format('must be a JSON array of %s elements, one per message id', v_n));
    END IF;
    IF headers IS NOT NULL AND (jsonb_typeof(headers) <> 'array' OR jsonb_array_length(headers) <> v_n) THEN
        PERFORM postbox.reject_v1('headers', format('must be NULL or a JSON array of %s objects, one per message id', v_n));
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    PERFORM postbox.check_batch_arrays_v1(v_n, ARRAY[
        cardinality(consumers), cardinality(keys), cardinality(types), cardinality(sequences),
        cardinality(schema_versions), cardinality(correlation_ids), cardinality(causation_ids), cardinality(sources)],
        ARRAY['consumers', 'keys', 'types', 'sequences', 'schema_versions', 'correlation_ids', 'causation_ids',
              'sources']);
    v_payloads := ARRAY(SELECT e.value FROM jsonb_array_elements(payloads) WITH ORDINALITY AS e(value, n) ORDER BY e.n);
    IF headers IS NOT NULL THEN
        v_headers := ARRAY(SELECT e.value FROM jsonb_array_elements(headers) WITH ORDINALITY AS e(value, n) ORDER BY e.n);
    END IF;
    IF postbox.inbox_batch_ok_v1(consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
                                 correlation_ids, causation_ids, sources) THEN
        RETURN QUERY SELECT * FROM postbox.inbox_receive_rows_v1(
            consumers, message_ids, v_payloads, keys, types, sequences, v_headers, schema_versions,
            correlation_ids, causation_ids, sources);
    ELSE
        RETURN QUERY SELECT * FROM postbox.inbox_receive_arrays_each_v1(
            consumers, message_ids, v_payloads, keys, types, sequences, v_headers, schema_versions,
            correlation_ids, causation_ids, sources);
    END IF;
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_many_v1(text[], text[], jsonb, text[], text[], bigint[], jsonb, integer[], text[], text[], text[])
    IS 'Internal: the one batch path (columns, payloads and headers as JSON arrays), behind every batch entry point.';

-- Batch form for one consumer, one column per field: what the Python client sends for a batch to
-- one consumer. Payloads and headers (or NULL) are one JSON array each; every other column is
-- NULL (no message has the field) or has one element per message.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_columns_v1(
    consumer        text,
    message_ids     text[],
    payloads        jsonb,
    keys            text[]    DEFAULT NULL,
    types           text[]    DEFAULT NULL,
    sequences       bigint[]  DEFAULT NULL,
    headers         jsonb     DEFAULT NULL,
    schema_versions integer[] DEFAULT NULL,
    correlation_ids text[]    DEFAULT NULL,
    causation_ids   text[]    DEFAULT NULL,
    sources         text[]    DEFAULT NULL)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM postbox.inbox_receive_many_v1(
        array_fill(consumer, ARRAY[coalesce(cardinality(message_ids), 0)]), message_ids, payloads, keys, types,
        sequences, headers, schema_versions, correlation_ids, causation_ids, sources)
$$;
COMMENT ON FUNCTION postbox.inbox_receive_columns_v1(text, text[], jsonb, text[], text[], bigint[], jsonb, integer[], text[], text[], text[])
    IS 'Receive a batch for one consumer given column by column (payloads and headers as JSON arrays), in the caller''s transaction; one (ordinality, status, inbox_id) row each.';

-- Batch form with one array per field, payloads and headers as arrays of jsonb (several consumers
-- at once); element i of every array is message i. A NULL headers element stands for {}; a NULL
-- payload cannot travel in a JSON array, so such a batch goes element by element, which refuses it.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_arrays_v1(
    consumers text[], message_ids text[], payloads jsonb[], keys text[], types text[], sequences bigint[],
    headers jsonb[], schema_versions integer[], correlation_ids text[], causation_ids text[], sources text[])
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM postbox.check_batch_arrays_v1(coalesce(cardinality(message_ids), 0),
                                          ARRAY[cardinality(payloads), cardinality(headers)], ARRAY['payloads', 'headers']);
    IF array_position(payloads, NULL) IS NOT NULL THEN
        RETURN QUERY SELECT * FROM postbox.inbox_receive_arrays_each_v1(
            consumers, message_ids, payloads, keys, types, sequences, headers, schema_versions,
            correlation_ids, causation_ids, sources);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM postbox.inbox_receive_many_v1(
        consumers, message_ids, to_jsonb(payloads), keys, types, sequences,
        to_jsonb(array_replace(headers, NULL, '{}'::jsonb)), schema_versions, correlation_ids, causation_ids, sources);
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_arrays_v1(text[], text[], jsonb[], text[], text[], bigint[], jsonb[], integer[], text[], text[], text[])
    IS 'Receive a batch given as one array per field, in the caller''s transaction; one (ordinality, status, inbox_id) row each.';

-- A JSON array of messages as the columns of inbox_receive_many_v1, or a row of NULLs if an
-- element is not an object of the JSON types the fields take (text fields strings or null,
-- sequence and schema_version integers that fit their columns, a payload present); such a batch
-- goes element by element, which names the element and field.
CREATE OR REPLACE FUNCTION postbox.inbox_batch_columns_v1(
    messages jsonb, OUT consumers text[], OUT message_ids text[], OUT payloads jsonb, OUT keys text[],
    OUT types text[], OUT sequences bigint[], OUT headers jsonb, OUT schema_versions integer[],
    OUT correlation_ids text[], OUT causation_ids text[], OUT sources text[])
LANGUAGE sql STABLE AS $$
    SELECT array_agg(m.v ->> 'consumer' ORDER BY m.n),
           array_agg(m.v ->> 'message_id' ORDER BY m.n),
           jsonb_agg(m.v -> 'payload' ORDER BY m.n),
           array_agg(m.v ->> 'key' ORDER BY m.n),
           array_agg(m.v ->> 'type' ORDER BY m.n),
           array_agg(CASE WHEN m.seq ~ '^-?[0-9]{1,18}$' THEN m.seq::bigint END ORDER BY m.n),
           jsonb_agg(coalesce(m.v -> 'headers', '{}'::jsonb) ORDER BY m.n),
           array_agg(CASE WHEN m.ver ~ '^-?[0-9]{1,9}$' THEN m.ver::integer ELSE 1 END ORDER BY m.n),
           array_agg(m.v ->> 'correlation_id' ORDER BY m.n),
           array_agg(m.v ->> 'causation_id' ORDER BY m.n),
           array_agg(m.v ->> 'source' ORDER BY m.n)
      FROM (SELECT e.value AS v, e.n, e.value ->> 'sequence' AS seq, e.value ->> 'schema_version' AS ver
              FROM jsonb_array_elements(messages) WITH ORDINALITY AS e(value, n)) m
    HAVING bool_and(
               jsonb_typeof(m.v) = 'object'
               AND m.v ? 'payload'
               AND coalesce(jsonb_typeof(m.v -> 'consumer'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'message_id'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'key'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'type'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'correlation_id'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'causation_id'), 'null') IN ('string', 'null')
               AND coalesce(jsonb_typeof(m.v -> 'source'), 'null') IN ('string', 'null')
               AND CASE coalesce(jsonb_typeof(m.v -> 'sequence'), 'null')
                       WHEN 'null' THEN true WHEN 'number' THEN m.seq ~ '^-?[0-9]{1,18}$' ELSE false END
               AND CASE coalesce(jsonb_typeof(m.v -> 'schema_version'), 'null')
                       WHEN 'null' THEN true WHEN 'number' THEN m.ver ~ '^-?[0-9]{1,9}$' ELSE false END)
$$;

-- Batch form: messages is a JSON array of objects with the same fields as inbox_receive_v1.
-- Returns one row per element, in order, with its 1-based ordinality.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_batch_v1(messages jsonb)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    IF messages IS NULL OR jsonb_typeof(messages) <> 'array' THEN
        PERFORM postbox.reject_v1('messages', 'must be a JSON array');
    END IF;
    SELECT * INTO c FROM postbox.inbox_batch_columns_v1(messages);
    IF c.message_ids IS NULL THEN
        RETURN QUERY SELECT * FROM postbox.inbox_receive_each_v1(messages);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM postbox.inbox_receive_many_v1(
        c.consumers, c.message_ids, c.payloads, c.keys, c.types, c.sequences, c.headers, c.schema_versions,
        c.correlation_ids, c.causation_ids, c.sources);
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_batch_v1(jsonb)
    IS 'Receive a JSON array of messages in the caller''s transaction; one (ordinality, status, inbox_id) row each.';

-- A JSON array of messages received one at a time through inbox_receive_v1, in order: the first
-- bad element is refused with its position and field named (messages[3].key).
CREATE OR REPLACE FUNCTION postbox.inbox_receive_each_v1(messages jsonb)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    m    jsonb;
    n    bigint;
    f    text;
    r    record;
BEGIN
    FOR m, n IN SELECT e.value, e.ordinality FROM jsonb_array_elements(messages) WITH ORDINALITY e LOOP
        PERFORM postbox.check_message_element_v1(
            m, n, ARRAY['consumer', 'message_id', 'key', 'type', 'correlation_id', 'causation_id', 'source']);
        FOREACH f IN ARRAY ARRAY['sequence', 'schema_version'] LOOP
            IF jsonb_typeof(m -> f) NOT IN ('number', 'null') OR (m ->> f) ~ '[.eE]' THEN
                PERFORM postbox.reject_v1(format('messages[%s].%s', n, f), 'must be an integer');
            END IF;
        END LOOP;
        -- Before the casts below, which would fail with PostgreSQL's own out-of-range error.
        IF (m ->> 'sequence')::numeric NOT BETWEEN -9223372036854775808 AND 9223372036854775807 THEN
            PERFORM postbox.reject_v1(format('messages[%s].sequence', n),
                                      'is out of range: at most 9223372036854775807 (a bigint)');
        END IF;
        IF (m ->> 'schema_version')::numeric NOT BETWEEN -2147483648 AND 2147483647 THEN
            PERFORM postbox.reject_v1(format('messages[%s].schema_version', n),
                                      'is out of range: at most 2147483647 (an integer)');
        END IF;
        SELECT * INTO r FROM postbox.inbox_receive_v1(
            consumer       => m ->> 'consumer',
            message_id     => m ->> 'message_id',
            payload        => m -> 'payload',
            key            => m ->> 'key',
            type           => m ->> 'type',
            sequence       => (m ->> 'sequence')::bigint,
            headers        => coalesce(m -> 'headers', '{}'::jsonb),
            schema_version => coalesce((m ->> 'schema_version')::integer, 1),
            correlation_id => m ->> 'correlation_id',
            causation_id   => m ->> 'causation_id',
            source         => m ->> 'source');
        ordinality := n;
        status := r.status;
        inbox_id := r.inbox_id;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_each_v1(jsonb)
    IS 'Internal: receive a JSON array of messages one at a time, naming the first bad element.';
