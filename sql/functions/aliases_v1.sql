-- Stable, unversioned names for producers in any language. Each migration that adds a new version
-- points these at it; code that needs a fixed contract calls the _vN name directly.
CREATE OR REPLACE FUNCTION postbox.inbox_receive(
    consumer text, message_id text, payload jsonb, key text DEFAULT NULL, type text DEFAULT NULL,
    sequence bigint DEFAULT NULL, headers jsonb DEFAULT '{}'::jsonb, schema_version integer DEFAULT 1,
    correlation_id text DEFAULT NULL, causation_id text DEFAULT NULL, source text DEFAULT NULL,
    OUT status text, OUT inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    SELECT r.status, r.inbox_id INTO status, inbox_id
      FROM postbox.inbox_receive_v1(consumer, message_id, payload, key, type, sequence, headers,
                                    schema_version, correlation_id, causation_id, source) r;
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive(text, text, jsonb, text, text, bigint, jsonb, integer, text, text, text)
    IS 'Receive one message (current version: inbox_receive_v1).';

CREATE OR REPLACE FUNCTION postbox.inbox_receive_batch(messages jsonb)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.inbox_receive_batch_v1(messages);
END
$$;

CREATE OR REPLACE FUNCTION postbox.outbox_publish(
    destination text, payload jsonb, key text DEFAULT NULL, type text DEFAULT NULL,
    message_id text DEFAULT NULL, headers jsonb DEFAULT '{}'::jsonb, correlation_id text DEFAULT NULL,
    causation_id text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN postbox.outbox_publish_v1(destination, payload, key, type, message_id, headers, correlation_id, causation_id);
END
$$;
COMMENT ON FUNCTION postbox.outbox_publish(text, jsonb, text, text, text, jsonb, text, text)
    IS 'Write one outbox event (current version: outbox_publish_v1).';

CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.outbox_publish_batch_v1(messages);
END
$$;
