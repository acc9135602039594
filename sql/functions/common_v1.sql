-- Helpers shared by the inbox and outbox functions.

-- The payload size limit, in bytes of its JSON text. Set it per database, role or session:
--   ALTER DATABASE app SET postbox.max_payload_bytes = 262144;
CREATE OR REPLACE FUNCTION postbox.max_payload_bytes_v1() RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('postbox.max_payload_bytes', true), '')::bigint, 1048576)
$$;
COMMENT ON FUNCTION postbox.max_payload_bytes_v1() IS 'Largest accepted payload (bytes of JSON text): setting postbox.max_payload_bytes, default 1 MiB.';

-- The headers size limit, in bytes of their JSON text (setting postbox.max_headers_bytes). The
-- default, 64 KiB, is far above what headers carry (trace context, routing, a replay's origin:
-- well under 1 KiB), and half of what RabbitMQ's default frame (128 KiB) can carry in the one
-- frame AMQP puts a message's headers in.
CREATE OR REPLACE FUNCTION postbox.max_headers_bytes_v1() RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('postbox.max_headers_bytes', true), '')::bigint, 65536)
$$;
COMMENT ON FUNCTION postbox.max_headers_bytes_v1() IS 'Largest accepted headers (bytes of JSON text): setting postbox.max_headers_bytes, default 64 KiB.';

-- Producers wake workers with one NOTIFY per transaction and consumer unless this is off.
CREATE OR REPLACE FUNCTION postbox.notify_enabled_v1() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('postbox.notify', true), '')::boolean, true)
$$;

-- Raise a bad-input error naming the field: SQLSTATE 22PB1 (Postbox's own code in class 22, data
-- exception), the field in the message text and in the error's COLUMN field.
CREATE OR REPLACE FUNCTION postbox.reject_v1(field text, problem text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RAISE EXCEPTION 'postbox: % %', field, problem
        USING ERRCODE = '22PB1', COLUMN = field;
END
$$;

-- What is wrong with a free-form JSON value (a payload or headers), or NULL. value_text is its
-- JSON text (value::text, which the caller has at hand). Besides the size limit, a value nests at
-- most 64 levels (the value itself is level 1: {"a": [1]} has 3), and its numbers have at most
-- 4300 digits before the decimal point (what JSON readers such as Python's read by default: a
-- worker could not load more). Each walk only runs on a text that can break its rule: 64 levels
-- take more than 128 bytes, and 4301 digits a run of digits in the text (which PostgreSQL prints
-- without exponents), found first by a regular expression, much cheaper than a walk.
CREATE OR REPLACE FUNCTION postbox.json_problem_v1(value jsonb, value_text text, max_bytes bigint, setting text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_bytes bigint := octet_length(value_text);
BEGIN
    IF v_bytes > max_bytes THEN
        RETURN format('is %s bytes, over the limit of %s (%s)', v_bytes, max_bytes, setting);
    END IF;
    IF v_bytes > 128 AND jsonb_path_exists(value, 'strict $.**{64}') THEN
        RETURN 'nests deeper than 64 levels (the value itself is level 1)';
    END IF;
    IF v_bytes > 4300 AND value_text ~ '[0-9]{255}'
       AND jsonb_path_exists(value, 'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
        RETURN 'has a number with more than 4300 digits before the decimal point';
    END IF;
    RETURN NULL;
END
$$;

-- Refuse a free-form JSON value that postbox.json_problem_v1 finds wrong, naming the field.
CREATE OR REPLACE FUNCTION postbox.check_json_v1(value jsonb, value_text text, field text, max_bytes bigint, setting text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_problem text := postbox.json_problem_v1(value, value_text, max_bytes, setting);
BEGIN
    IF v_problem IS NOT NULL THEN
        PERFORM postbox.reject_v1(field, v_problem);
    END IF;
END
$$;

-- Every element of a JSON array of free-form values (a batch's payloads or headers, one per
-- message) passes postbox.json_problem_v1. Checked on the whole array first: no element's text is
-- longer than the array's, and an element's level n is the array's n + 1. Only an array over the
-- size limit has its elements measured one by one.
CREATE OR REPLACE FUNCTION postbox.json_array_ok_v1(vals jsonb, max_bytes bigint) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_text  text := vals::text;
    v_bytes bigint := octet_length(v_text);
BEGIN
    IF v_bytes > max_bytes
       AND EXISTS (SELECT 1 FROM jsonb_array_elements(vals) AS e WHERE octet_length(e.value::text) > max_bytes) THEN
        RETURN false;
    END IF;
    IF v_bytes > 129 AND jsonb_path_exists(vals, 'strict $.**{65}') THEN
        RETURN false;
    END IF;
    IF v_bytes > 4300 AND v_text ~ '[0-9]{255}'
       AND jsonb_path_exists(vals, 'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
        RETURN false;
    END IF;
    RETURN true;
END
$$;

-- Every element of an array of free-form values passes postbox.json_problem_v1 (NULL elements
-- too: they are checked elsewhere), each measured as its own text.
CREATE OR REPLACE FUNCTION postbox.jsonb_values_ok_v1(vals jsonb[], max_bytes bigint) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN coalesce((SELECT bool_and(octet_length(t.txt) <= max_bytes
                                     AND (octet_length(t.txt) <= 128 OR NOT jsonb_path_exists(t.v, 'strict $.**{64}'))
                                     AND (octet_length(t.txt) <= 4300 OR t.txt !~ '[0-9]{255}' OR NOT jsonb_path_exists(
                                              t.v, 'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))')))
                       FROM (SELECT v, v::text AS txt FROM unnest(vals) AS v WHERE v IS NOT NULL) t), true);
END
$$;

-- A required or optional text field: not empty, at most max_bytes UTF-8 bytes.
CREATE OR REPLACE FUNCTION postbox.check_text_v1(value text, field text, max_bytes integer, required boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL THEN
        IF required THEN
            PERFORM postbox.reject_v1(field, 'is required');
        END IF;
    ELSIF value = '' THEN
        PERFORM postbox.reject_v1(field, 'must not be empty');
    ELSIF octet_length(value) > max_bytes THEN
        PERFORM postbox.reject_v1(field, format('is %s bytes, over the limit of %s', octet_length(value), max_bytes));
    END IF;
END
$$;

-- A message's fields, all within their limits, in one expression: inlined into the caller's IF, so
-- the good path pays for nothing more; only bad input calls postbox.reject_message_fields_v1 to learn
-- which field it was. (queue is the consumer or the destination; a NULL source or
-- message_id_required = false stand for fields the caller does not have or may omit.)
CREATE OR REPLACE FUNCTION postbox.message_fields_bad_v1(
    queue text, message_id text, message_id_required boolean, key text, type text,
    correlation_id text, causation_id text, source text, payload jsonb, headers jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(queue IS NULL OR octet_length(queue) NOT BETWEEN 1 AND 200
                    OR (message_id IS NULL AND message_id_required)
                    OR octet_length(message_id) NOT BETWEEN 1 AND 512
                    OR octet_length(key) NOT BETWEEN 1 AND 1024
                    OR octet_length(type) NOT BETWEEN 1 AND 200
                    OR octet_length(correlation_id) NOT BETWEEN 1 AND 512
                    OR octet_length(causation_id) NOT BETWEEN 1 AND 512
                    OR octet_length(source) NOT BETWEEN 1 AND 512
                    OR payload IS NULL
                    OR jsonb_typeof(headers) <> 'object', false)
$$;

-- Raise the error of the first field postbox.message_fields_bad_v1 finds wrong (queue_field names
-- the queue: consumer or destination).
CREATE OR REPLACE FUNCTION postbox.reject_message_fields_v1(
    queue_field text, queue text, message_id text, message_id_required boolean, key text, type text,
    correlation_id text, causation_id text, source text, payload jsonb, headers jsonb)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    PERFORM postbox.check_text_v1(queue, queue_field, 200, true);
    PERFORM postbox.check_text_v1(message_id, 'message_id', 512, message_id_required);
    PERFORM postbox.check_text_v1(key, 'key', 1024, false);
    PERFORM postbox.check_text_v1(type, 'type', 200, false);
    PERFORM postbox.check_text_v1(correlation_id, 'correlation_id', 512, false);
    PERFORM postbox.check_text_v1(causation_id, 'causation_id', 512, false);
    PERFORM postbox.check_text_v1(source, 'source', 512, false);
    IF payload IS NULL THEN
        PERFORM postbox.reject_v1('payload', 'is required');
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        PERFORM postbox.reject_v1('headers', 'must be a JSON object');
    END IF;
END
$$;

-- Whether a message's payload or headers text needs postbox.check_message_json_v1: a short text can
-- only break the size limit. (Inlined into the caller's IF.)
CREATE OR REPLACE FUNCTION postbox.message_json_large_v1(payload_text text, headers_text text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT octet_length(payload_text) > 128 OR octet_length(headers_text) > 128
           OR octet_length(payload_text) > postbox.max_payload_bytes_v1()
           OR octet_length(headers_text) > postbox.max_headers_bytes_v1()
$$;

-- A message's payload and headers (as jsonb and as text): size, nesting and numbers. Called when
-- postbox.message_json_large_v1 says so.
CREATE OR REPLACE FUNCTION postbox.check_message_json_v1(payload jsonb, payload_text text, headers jsonb, headers_text text)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM postbox.check_json_v1(payload, payload_text, 'payload', postbox.max_payload_bytes_v1(), 'postbox.max_payload_bytes');
    PERFORM postbox.check_json_v1(headers, headers_text, 'headers', postbox.max_headers_bytes_v1(), 'postbox.max_headers_bytes');
END
$$;

-- One element of a JSON array of messages (messages[n]) is an object whose text fields are strings
-- or null; the first that is not is refused, named.
CREATE OR REPLACE FUNCTION postbox.check_message_element_v1(m jsonb, n bigint, text_fields text[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    f text;
BEGIN
    IF jsonb_typeof(m) <> 'object' THEN
        PERFORM postbox.reject_v1(format('messages[%s]', n), 'must be a JSON object');
    END IF;
    FOREACH f IN ARRAY text_fields LOOP
        IF jsonb_typeof(m -> f) NOT IN ('string', 'null') THEN
            PERFORM postbox.reject_v1(format('messages[%s].%s', n, f), 'must be a string');
        END IF;
    END LOOP;
END
$$;

-- Every element of an array of text fields is valid: NULL only if not required (a NULL array is
-- a field no element has), otherwise 1 to max_bytes bytes.
-- (plpgsql, not sql: a sql function with a subquery is planned again in every transaction, a
-- plpgsql one once per session.)
CREATE OR REPLACE FUNCTION postbox.texts_ok_v1(vals text[], max_bytes integer, required boolean) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF vals IS NULL THEN
        RETURN NOT required;
    END IF;
    RETURN coalesce((SELECT bool_and(CASE WHEN v IS NULL THEN NOT required
                                          ELSE octet_length(v) BETWEEN 1 AND max_bytes END)
                       FROM unnest(vals) AS v), true);
END
$$;

-- A batch given as one array per field: every array that is not NULL has one element per message.
CREATE OR REPLACE FUNCTION postbox.check_batch_arrays_v1(n integer, lengths integer[], fields text[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    i integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(lengths), 0) LOOP
        IF lengths[i] <> n THEN
            PERFORM postbox.reject_v1(fields[i], format('has %s elements for %s messages', lengths[i], n));
        END IF;
    END LOOP;
END
$$;

-- The key lock: an advisory lock on one key of the inbox (class 1) or outbox (class 2). Whoever
-- decides which message becomes a key's head holds it exclusively, and only ever by trying
-- (workers, relays: pg_try_advisory_xact_lock, never waiting); a producer's commit holds it shared
-- while it checks that its queued message still has a head. So producers never wait for each
-- other, a worker never waits for anyone, and no lock cycle (deadlock) can form. A hash collision
-- only makes two keys share a lock.
CREATE OR REPLACE FUNCTION postbox.try_lock_key_v1(lock_class integer, queue text, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN pg_try_advisory_xact_lock(1349471040 + lock_class, hashtext(queue || '/' || key));
END
$$;

CREATE OR REPLACE FUNCTION postbox.lock_key_shared_v1(lock_class integer, queue text, key text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1349471040 + lock_class, hashtext(queue || '/' || key));
END
$$;
