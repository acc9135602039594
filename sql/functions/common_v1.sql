-- Helpers shared by the inbox and outbox functions.

-- The payload size limit, in bytes of its JSON text. Set it per database, role or session:
--   ALTER DATABASE app SET postbox.max_payload_bytes = 262144;
CREATE OR REPLACE FUNCTION postbox.max_payload_bytes_v1() RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('postbox.max_payload_bytes', true), '')::bigint, 1048576)
$$;
COMMENT ON FUNCTION postbox.max_payload_bytes_v1() IS 'Largest accepted payload (bytes of JSON text): setting postbox.max_payload_bytes, default 1 MiB.';

-- Producers wake workers with one NOTIFY per transaction and consumer unless this is off.
CREATE OR REPLACE FUNCTION postbox.notify_enabled_v1() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('postbox.notify', true), '')::boolean, true)
$$;

-- Raise a bad-input error naming the field (SQLSTATE 22023, error field COLUMN).
CREATE OR REPLACE FUNCTION postbox.reject_v1(field text, problem text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RAISE EXCEPTION 'postbox: % %', field, problem
        USING ERRCODE = '22023', COLUMN = field;
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
