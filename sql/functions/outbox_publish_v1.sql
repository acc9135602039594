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
    v_text  text := outbox_publish_v1.payload::text;
    v_htext text := outbox_publish_v1.headers::text;
BEGIN
    -- One cheap expression checks everything; only bad input pays for finding which field it was.
    IF postbox.message_fields_bad_v1(outbox_publish_v1.destination, outbox_publish_v1.message_id, false,
                                     outbox_publish_v1.key, outbox_publish_v1.type, outbox_publish_v1.correlation_id,
                                     outbox_publish_v1.causation_id, NULL, outbox_publish_v1.payload,
                                     outbox_publish_v1.headers) THEN
        PERFORM postbox.reject_message_fields_v1('destination', outbox_publish_v1.destination,
                                                 outbox_publish_v1.message_id, false, outbox_publish_v1.key,
                                                 outbox_publish_v1.type, outbox_publish_v1.correlation_id,
                                                 outbox_publish_v1.causation_id, NULL, outbox_publish_v1.payload,
                                                 outbox_publish_v1.headers);
    END IF;
    IF postbox.message_json_large_v1(v_text, v_htext) THEN
        PERFORM postbox.check_message_json_v1(outbox_publish_v1.payload, v_text, outbox_publish_v1.headers, v_htext);
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
