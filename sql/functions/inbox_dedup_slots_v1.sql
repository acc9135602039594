-- Revision 0004: the deduplication ledger in two slots, reclaimed by TRUNCATE instead of row
-- deletes, and an exact window.
--
-- The window is exact: a message received again within dedup_retention_seconds of its first
-- receipt is a duplicate; later, it is new again (unless the first is still in the inbox or has an
-- open dead letter, which keep it a duplicate), however long its ledger row stays. The window lives
-- in the database (postbox.dedup_window), set by `postbox maintain` from its configuration; 7 days
-- until then.
--
-- The ledger (postbox.inbox_dedup) is partitioned by slot: inbox_dedup_0 and inbox_dedup_1, each
-- with its own primary key (consumer, message_id). A receive writes the current slot
-- (dedup_window.current_slot) and looks its id up in the previous one as well. Once a window (plus
-- a margin: an hour, or the window if shorter) has passed since the last rotation, `postbox
-- maintain` rotates (dedup_rotate_v1): it carries the previous slot's rows whose message is still
-- live or dead-lettered into the current slot, then, under a brief EXCLUSIVE lock on the ledger
-- (receives wait for it; reads go on), truncates the previous slot and makes it the current one.
-- Every row it drops was received more than a window before: no decision changes. The ledger holds
-- about two windows of ids at most, and is never pruned row by row.
--
-- A receive takes its lock on the ledger (ROW EXCLUSIVE, held to the end of its transaction) before
-- it reads the current slot: a rotation waits for every transaction that may write the slot it
-- passes, and a receive that waited for a rotation reads the slot it made current. (Under
-- REPEATABLE READ, whose snapshot may predate the rotation, the receive locks the window's row,
-- which fails with a serialization error if a rotation changed it; the producer retries.)

CREATE TABLE postbox.dedup_window (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    retention     interval NOT NULL DEFAULT interval '7 days' CHECK (retention > interval '0'),
    set_at        timestamptz NOT NULL DEFAULT now(),
    current_slot  smallint NOT NULL DEFAULT 0 CHECK (current_slot IN (0, 1)),
    rotated_at    timestamptz NOT NULL DEFAULT now()
);
INSERT INTO postbox.dedup_window DEFAULT VALUES;
COMMENT ON TABLE postbox.dedup_window IS 'The deduplication window (one row): a message received again later than retention after its first receipt is new, unless the first is still live or has an open dead letter. Set by postbox maintain (dedup_retention_seconds); current_slot is the ledger slot receives write, rotated_at when the other was last truncated.';

CREATE OR REPLACE FUNCTION postbox.dedup_retention_v1() RETURNS interval
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT w.retention FROM postbox.dedup_window w), interval '7 days')
$$;

CREATE OR REPLACE FUNCTION postbox.dedup_current_slot_v1() RETURNS smallint
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT w.current_slot FROM postbox.dedup_window w), 0::smallint)
$$;

-- Maintenance: the window from its configuration (seconds). Returns the window in force.
CREATE OR REPLACE FUNCTION postbox.dedup_window_set_v1(p_seconds double precision) RETURNS interval
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_seconds IS NULL OR p_seconds <= 0 THEN
        PERFORM postbox.reject_v1('dedup_retention_seconds', 'must be a positive number of seconds');
    END IF;
    UPDATE postbox.dedup_window SET retention = make_interval(secs => p_seconds), set_at = now()
     WHERE retention IS DISTINCT FROM make_interval(secs => p_seconds);
    RETURN postbox.dedup_retention_v1();
END
$$;
COMMENT ON FUNCTION postbox.dedup_window_set_v1(double precision)
    IS 'Maintenance: set the deduplication window (seconds); returns the window in force.';

-- The ledger becomes slot 0 of the partitioned ledger as it is (no rewrite; one scan checks the
-- slot of its rows), and slot 1 starts empty.
ALTER TABLE postbox.inbox_dedup RENAME TO inbox_dedup_0;
ALTER INDEX postbox.inbox_dedup_pkey RENAME TO inbox_dedup_0_pkey;
DROP INDEX postbox.inbox_dedup_received_at_brin;
ALTER TABLE postbox.inbox_dedup_0 ADD COLUMN slot smallint NOT NULL DEFAULT 0;
ALTER TABLE postbox.inbox_dedup_0 ADD CONSTRAINT inbox_dedup_0_slot CHECK (slot = 0);
CREATE TABLE postbox.inbox_dedup (
    consumer      text COLLATE "C" NOT NULL,
    message_id    text COLLATE "C" NOT NULL,
    payload_hash  bytea NOT NULL,
    inbox_id      bigint NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now(),
    slot          smallint NOT NULL DEFAULT postbox.dedup_current_slot_v1()
) PARTITION BY LIST (slot);
ALTER TABLE postbox.inbox_dedup ATTACH PARTITION postbox.inbox_dedup_0 FOR VALUES IN (0);
ALTER TABLE postbox.inbox_dedup_0 DROP CONSTRAINT inbox_dedup_0_slot;
ALTER TABLE postbox.inbox_dedup_0 ALTER COLUMN slot SET DEFAULT postbox.dedup_current_slot_v1();
CREATE TABLE postbox.inbox_dedup_1 PARTITION OF postbox.inbox_dedup FOR VALUES IN (1);
ALTER TABLE postbox.inbox_dedup_1 ADD CONSTRAINT inbox_dedup_1_pkey PRIMARY KEY (consumer, message_id);
COMMENT ON TABLE postbox.inbox_dedup IS 'Deduplication ledger: one row per (consumer, message_id) received, in two slots (inbox_dedup_0, inbox_dedup_1): receives write the current one and look in both; a rotation truncates the older one once a window has passed (postbox.dedup_window).';
COMMENT ON COLUMN postbox.inbox_dedup.payload_hash IS 'md5 of the canonical jsonb text of the payload; a second receive with another hash is a conflict.';
COMMENT ON COLUMN postbox.inbox_dedup.inbox_id IS 'postbox.inbox.id the message was given (the row is gone once processed).';
COMMENT ON COLUMN postbox.inbox_dedup.slot IS 'The ledger slot (partition) the row is in: postbox.dedup_window.current_slot when it was received.';
COMMENT ON TABLE postbox.inbox_dedup_0 IS 'Deduplication ledger, slot 0 (see postbox.inbox_dedup).';
COMMENT ON TABLE postbox.inbox_dedup_1 IS 'Deduplication ledger, slot 1 (see postbox.inbox_dedup).';

-- Whether a receipt's message is still live (in the inbox) or dead-lettered (open, or being
-- replayed): such a receipt counts past the window. plpgsql, so its two index probes are planned
-- once per session (a SQL function with subqueries is planned at every call).
CREATE OR REPLACE FUNCTION postbox.inbox_receipt_live_v1(p_consumer text, p_message_id text, p_inbox_id bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM postbox.inbox i WHERE i.id = p_inbox_id)
        OR EXISTS (SELECT 1 FROM postbox.dead_letters x
                    WHERE x.message_id = p_message_id AND x.consumer = p_consumer
                      AND x.status IN ('open', 'replaying'));
END
$$;

-- A ledger row of the current slot (p_slot) outside the window (p_window), whose message is
-- neither live nor dead-lettered, is taken over by a new receipt of its id (given the new payload's
-- hash and inbox id): true if it was. A concurrent receipt of the same id waits for the row, then finds it inside
-- the window.
CREATE OR REPLACE FUNCTION postbox.inbox_dedup_take_expired_v1(
    p_consumer text, p_message_id text, p_hash bytea, p_inbox_id bigint, p_slot smallint, p_window interval)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE postbox.inbox_dedup d
       SET payload_hash = p_hash, inbox_id = p_inbox_id, received_at = now()
     WHERE d.slot = p_slot AND d.consumer = p_consumer AND d.message_id = p_message_id
       AND d.received_at < now() - p_window
       AND NOT postbox.inbox_receipt_live_v1(d.consumer, d.message_id, d.inbox_id);
    RETURN FOUND;
END
$$;

-- Maintenance: rotate the ledger's slots if a window (and the margin) has passed since the last
-- rotation by p_now. Returns about how many rows it dropped (the truncated slot's estimate), 0 if
-- not due. Gives up (lock_timeout) rather than stall receives behind a long transaction; the next
-- run tries again.
CREATE OR REPLACE FUNCTION postbox.dedup_rotate_v1(p_now timestamptz) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w        record;
    v_prev   smallint;
    v_rows   bigint;
BEGIN
    SELECT * INTO w FROM postbox.dedup_window;
    IF NOT FOUND OR p_now < w.rotated_at + w.retention + least(w.retention, interval '1 hour') THEN
        RETURN 0;
    END IF;
    v_prev := 1 - w.current_slot;
    -- Messages of the previous slot still live or dead-lettered keep their receipt: into the
    -- current slot first, without the lock (nothing is written to the previous slot any more, and
    -- a message cannot become live again without being dead-lettered, which this includes).
    INSERT INTO postbox.inbox_dedup AS d (consumer, message_id, payload_hash, inbox_id, received_at, slot)
    SELECT p.consumer, p.message_id, p.payload_hash, p.inbox_id, p.received_at, w.current_slot
      FROM postbox.inbox i
      JOIN postbox.inbox_dedup p ON p.slot = v_prev AND p.consumer = i.consumer AND p.message_id = i.message_id
                                AND p.inbox_id = i.id
    UNION
    SELECT p.consumer, p.message_id, p.payload_hash, p.inbox_id, p.received_at, w.current_slot
      FROM postbox.dead_letters x
      JOIN postbox.inbox_dedup p ON p.slot = v_prev AND p.consumer = x.consumer AND p.message_id = x.message_id
     WHERE x.origin = 'inbox' AND x.status IN ('open', 'replaying')
    ON CONFLICT DO NOTHING;
    PERFORM set_config('lock_timeout', '5s', true);
    LOCK TABLE postbox.inbox_dedup IN EXCLUSIVE MODE;
    SELECT * INTO w FROM postbox.dedup_window FOR UPDATE;
    IF p_now < w.rotated_at + w.retention + least(w.retention, interval '1 hour') THEN
        RETURN 0;  -- another maintenance process rotated meanwhile
    END IF;
    SELECT c.reltuples::bigint INTO v_rows FROM pg_class c WHERE c.oid = format('postbox.inbox_dedup_%s', v_prev)::regclass;
    EXECUTE format('TRUNCATE postbox.%I', 'inbox_dedup_' || v_prev);
    UPDATE postbox.dedup_window SET current_slot = v_prev, rotated_at = p_now;
    RETURN greatest(coalesce(v_rows, 0), 0);
END
$$;
COMMENT ON FUNCTION postbox.dedup_rotate_v1(timestamptz)
    IS 'Maintenance: truncate the older ledger slot and make it the current one, once a window has passed since the last rotation; about how many rows it dropped.';

-- What 0.1.0 and 0.2.0 maintenance processes call: the rotation (rows are no longer deleted one
-- by one; p_cutoff and p_limit are the window and batch of those releases, unused).
CREATE OR REPLACE FUNCTION postbox.prune_dedup_v1(p_cutoff timestamptz, p_limit integer)
RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT least(postbox.dedup_rotate_v1(now()), 2147483647)::integer
$$;
COMMENT ON FUNCTION postbox.prune_dedup_v1(timestamptz, integer)
    IS 'Maintenance (earlier releases): rotate the deduplication ledger (postbox.dedup_rotate_v1).';

-- Rights (CREATE OR REPLACE and new objects start without roles_v1.sql's).
ALTER FUNCTION postbox.dedup_window_set_v1(double precision) SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
ALTER FUNCTION postbox.dedup_rotate_v1(timestamptz) SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
ALTER FUNCTION postbox.prune_dedup_v1(timestamptz, integer) SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
REVOKE ALL ON FUNCTION postbox.dedup_window_set_v1(double precision), postbox.dedup_rotate_v1(timestamptz),
    postbox.dedup_retention_v1(), postbox.dedup_current_slot_v1(),
    postbox.inbox_receipt_live_v1(text, text, bigint),
    postbox.inbox_dedup_take_expired_v1(text, text, bytea, bigint, smallint, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.dedup_window_set_v1(double precision), postbox.dedup_rotate_v1(timestamptz)
    TO postbox_maintainer;
REVOKE ALL ON postbox.dedup_window, postbox.inbox_dedup, postbox.inbox_dedup_0, postbox.inbox_dedup_1 FROM PUBLIC;
GRANT SELECT ON postbox.dedup_window TO postbox_operator, postbox_reader, postbox_maintainer;
GRANT SELECT ON postbox.inbox_dedup, postbox.inbox_dedup_0, postbox.inbox_dedup_1 TO postbox_operator, postbox_reader;
