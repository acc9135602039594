-- Write an event to the outbox inside the caller's transaction (atomically with its business change).
-- Returns the outbox row's id. message_id defaults to a random UUID; key defaults to message_id.
CREATE OR REPLACE FUNCTION postbox.outbox_publish_v1(
    destination     text,
    payload         jsonb,
    key             text   DEFAULT NULL,
    type            text   DEFAULT NULL,
    message_id      text   DEFAULT NULL,
    headers         jsonb  DEFAULT '{}'::jsonb,
    correlation_id  text   DEFAULT NULL,
    causation_id    text   DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_id    bigint;
    v_mid   text := coalesce(outbox_publish_v1.message_id, gen_random_uuid()::text);
    v_key   text;
    v_text  text;
BEGIN
    IF outbox_publish_v1.destination IS NULL OR octet_length(outbox_publish_v1.destination) NOT BETWEEN 1 AND 200
       OR octet_length(outbox_publish_v1.message_id) NOT BETWEEN 1 AND 512
       OR octet_length(outbox_publish_v1.key) NOT BETWEEN 1 AND 1024
       OR octet_length(outbox_publish_v1.type) NOT BETWEEN 1 AND 200
       OR octet_length(outbox_publish_v1.correlation_id) NOT BETWEEN 1 AND 512
       OR octet_length(outbox_publish_v1.causation_id) NOT BETWEEN 1 AND 512
       OR outbox_publish_v1.payload IS NULL
       OR jsonb_typeof(outbox_publish_v1.headers) <> 'object'
    THEN
        PERFORM postbox.check_text_v1(outbox_publish_v1.destination, 'destination', 200, true);
        PERFORM postbox.check_text_v1(outbox_publish_v1.message_id, 'message_id', 512, false);
        PERFORM postbox.check_text_v1(outbox_publish_v1.key, 'key', 1024, false);
        PERFORM postbox.check_text_v1(outbox_publish_v1.type, 'type', 200, false);
        PERFORM postbox.check_text_v1(outbox_publish_v1.correlation_id, 'correlation_id', 512, false);
        PERFORM postbox.check_text_v1(outbox_publish_v1.causation_id, 'causation_id', 512, false);
        IF outbox_publish_v1.payload IS NULL THEN
            PERFORM postbox.reject_v1('payload', 'is required');
        END IF;
        PERFORM postbox.reject_v1('headers', 'must be a JSON object');
    END IF;
    -- Payload and headers: size, nesting and numbers (a short text can only break the size limit).
    v_text := outbox_publish_v1.payload::text;
    IF octet_length(v_text) > 128 OR octet_length(v_text) > postbox.max_payload_bytes_v1() THEN
        PERFORM postbox.check_json_v1(outbox_publish_v1.payload, v_text, 'payload',
                                      postbox.max_payload_bytes_v1(), 'postbox.max_payload_bytes');
    END IF;
    v_text := outbox_publish_v1.headers::text;
    IF octet_length(v_text) > 128 OR octet_length(v_text) > postbox.max_headers_bytes_v1() THEN
        PERFORM postbox.check_json_v1(outbox_publish_v1.headers, v_text, 'headers',
                                      postbox.max_headers_bytes_v1(), 'postbox.max_headers_bytes');
    END IF;
    v_key := coalesce(outbox_publish_v1.key, v_mid);
    v_id := nextval('postbox.outbox_id_seq');
    -- Rows already queued for this key (waiting for their head to be repaired) go first.
    IF NOT EXISTS (SELECT 1 FROM postbox.outbox p
                    WHERE p.destination = outbox_publish_v1.destination AND p.key = v_key AND p.state = 'pending') THEN
        INSERT INTO postbox.outbox (id, destination, message_id, key, position, type, payload, headers,
                                    correlation_id, causation_id, state)
        VALUES (v_id, outbox_publish_v1.destination, v_mid, v_key, v_id, outbox_publish_v1.type,
                outbox_publish_v1.payload, coalesce(outbox_publish_v1.headers, '{}'),
                outbox_publish_v1.correlation_id, outbox_publish_v1.causation_id, 'ready')
        ON CONFLICT (destination, key) WHERE state <> 'pending' DO NOTHING;
    ELSE
        PERFORM 1 WHERE false;  -- FOUND := false: queue behind them
    END IF;
    IF FOUND THEN
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_outbox', outbox_publish_v1.destination);
        END IF;
    ELSE
        INSERT INTO postbox.outbox (id, destination, message_id, key, position, type, payload, headers,
                                    correlation_id, causation_id, state)
        VALUES (v_id, outbox_publish_v1.destination, v_mid, v_key, v_id, outbox_publish_v1.type,
                outbox_publish_v1.payload, coalesce(outbox_publish_v1.headers, '{}'),
                outbox_publish_v1.correlation_id, outbox_publish_v1.causation_id, 'pending');
    END IF;
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION postbox.outbox_publish_v1(text, jsonb, text, text, text, jsonb, text, text)
    IS 'Write one outbox event in the caller''s transaction; returns its id. The relay publishes it after the caller commits.';

-- Batch form: a JSON array of objects with the fields of outbox_publish_v1; one row per element.
CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch_v1(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    m    jsonb;
    n    bigint;
    f    text;
BEGIN
    IF messages IS NULL OR jsonb_typeof(messages) <> 'array' THEN
        PERFORM postbox.reject_v1('messages', 'must be a JSON array');
    END IF;
    -- Keys in one global order (destination, key), each key's rows in their given order: two batches
    -- that each start several idle keys then wait for each other's head inserts in the same order,
    -- so they cannot deadlock.
    FOR m, n IN SELECT e.value, e.ordinality FROM jsonb_array_elements(messages) WITH ORDINALITY e
                 ORDER BY CASE WHEN jsonb_typeof(e.value) = 'object' THEN e.value ->> 'destination' END,
                          CASE WHEN jsonb_typeof(e.value) = 'object' THEN coalesce(e.value ->> 'key', e.value ->> 'message_id') END,
                          e.ordinality LOOP
        IF jsonb_typeof(m) <> 'object' THEN
            PERFORM postbox.reject_v1(format('messages[%s]', n), 'must be a JSON object');
        END IF;
        FOREACH f IN ARRAY ARRAY['destination', 'message_id', 'key', 'type', 'correlation_id', 'causation_id'] LOOP
            IF jsonb_typeof(m -> f) NOT IN ('string', 'null') THEN
                PERFORM postbox.reject_v1(format('messages[%s].%s', n, f), 'must be a string');
            END IF;
        END LOOP;
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
END
$$;

-- After a key's head left: promote its next row now if the key lock is free, else file a repair.
CREATE OR REPLACE FUNCTION postbox.outbox_next_v1(p_destination text, p_key text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF postbox.try_lock_key_v1(2, p_destination, p_key) THEN
        PERFORM postbox.outbox_promote_v1(p_destination, p_key, p_now);
    ELSE
        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('outbox', p_destination, p_key);
    END IF;
END
$$;
