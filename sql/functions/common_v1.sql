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

-- Advisory lock on one key of the inbox (class 1) or outbox (class 2). Collisions of the hash only
-- serialise two keys a little more; they never break correctness.
CREATE OR REPLACE FUNCTION postbox.lock_key_v1(lock_class integer, queue text, key text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1349471040 + lock_class, hashtext(queue || '/' || key));
END
$$;
