-- Revision 0014: the JSON batch functions refuse a field they do not know.
--
-- inbox_receive_batch_v1 and outbox_publish_batch_v1 read the fields they know from each element
-- and ignored the others: a misspelt field ("kye" for "key") was dropped without a word, and the
-- message stored without its key (so without its order). The Python client refuses the same
-- element ("kye: Extra inputs are not permitted"). The _v2 functions check every element's fields
-- first, then do what _v1 does; the unversioned names (inbox_receive_batch, outbox_publish_batch)
-- now call _v2. The _v1 functions stay as they are, for processes of earlier releases.

-- Internal: refuse the first element of ``messages`` (a JSON array) with a field not in ``fields``,
-- naming it as the other checks do (messages[N].field, N from 1), with the field it may stand for.
CREATE OR REPLACE FUNCTION postbox.check_batch_fields_v1(messages jsonb, fields text[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_n      bigint;
    v_field  text;
    v_near   text;
BEGIN
    IF messages IS NULL OR jsonb_typeof(messages) <> 'array' THEN
        RETURN;  -- the _v1 function says what is wrong with it
    END IF;
    SELECT e.ordinality, k.key INTO v_n, v_field
      FROM jsonb_array_elements(messages) WITH ORDINALITY e
     CROSS JOIN LATERAL jsonb_object_keys(CASE jsonb_typeof(e.value) WHEN 'object' THEN e.value ELSE '{}' END) k(key)
     WHERE k.key <> ALL (fields)
     ORDER BY e.ordinality
     LIMIT 1;
    IF v_n IS NOT NULL THEN
        -- The field it may stand for: the same but for case, a plural or the order of its letters.
        SELECT f INTO v_near FROM unnest(fields) f
         WHERE lower(v_field) IN (f, f || 's')
            OR (SELECT string_agg(c, '' ORDER BY c) FROM regexp_split_to_table(f, '') c)
             = (SELECT string_agg(c, '' ORDER BY c) FROM regexp_split_to_table(lower(v_field), '') c)
         LIMIT 1;
        PERFORM postbox.reject_v1(format('messages[%s].%s', v_n, v_field),
            'is not a field' || CASE WHEN v_near IS NOT NULL THEN format(' (did you mean %s?)', v_near) ELSE '' END
            || ': the fields are ' || array_to_string(fields, ', '));
    END IF;
END
$$;
COMMENT ON FUNCTION postbox.check_batch_fields_v1(jsonb, text[])
    IS 'Internal: refuse the first element of a JSON batch with a field not in the list.';

CREATE OR REPLACE FUNCTION postbox.inbox_receive_batch_v2(messages jsonb)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    PERFORM postbox.check_batch_fields_v1(messages, ARRAY['consumer', 'message_id', 'payload', 'key', 'type',
        'sequence', 'headers', 'schema_version', 'correlation_id', 'causation_id', 'source']);
    RETURN QUERY SELECT * FROM postbox.inbox_receive_batch_v1(messages);
END
$$;
COMMENT ON FUNCTION postbox.inbox_receive_batch_v2(jsonb)
    IS 'Receive a JSON array of messages in the caller''s transaction (an unknown field is refused); one (ordinality, status, inbox_id) row each.';

CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch_v2(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    PERFORM postbox.check_batch_fields_v1(messages, ARRAY['destination', 'message_id', 'payload', 'key', 'type',
        'headers', 'correlation_id', 'causation_id']);
    RETURN QUERY SELECT * FROM postbox.outbox_publish_batch_v1(messages);
END
$$;
COMMENT ON FUNCTION postbox.outbox_publish_batch_v2(jsonb)
    IS 'Write a JSON array of outbox events in the caller''s transaction (an unknown field is refused); one (ordinality, outbox_id) row each.';

-- Like every entry point (roles_v1.sql): runs as its owner, callable by the producer roles only.
REVOKE ALL ON FUNCTION postbox.check_batch_fields_v1(jsonb, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION postbox.inbox_receive_batch_v2(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION postbox.outbox_publish_batch_v2(jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.inbox_receive_batch_v2(jsonb) TO postbox_producer, postbox_worker;
GRANT EXECUTE ON FUNCTION postbox.outbox_publish_batch_v2(jsonb) TO postbox_producer, postbox_worker;

-- The unversioned names point at the new version.
CREATE OR REPLACE FUNCTION postbox.inbox_receive_batch(messages jsonb)
RETURNS TABLE (ordinality bigint, status text, inbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.inbox_receive_batch_v2(messages);
END
$$;

CREATE OR REPLACE FUNCTION postbox.outbox_publish_batch(messages jsonb)
RETURNS TABLE (ordinality bigint, outbox_id bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT * FROM postbox.outbox_publish_batch_v2(messages);
END
$$;
