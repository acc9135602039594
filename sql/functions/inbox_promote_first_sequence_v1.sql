-- Revision 0015: a gapless consumer's key starts at its first_sequence.
--
-- A message whose sequence is below the consumer's first_sequence, on a key that had processed
-- nothing yet, was taken for the key's start: it ran first, and the key then waited for the
-- sequence after it, which never came (first_sequence 5: 3 ran, then 5 waited for 4 for ever).
-- Such a message is late now, as one at or below the key's last processed sequence is: the
-- consumer's late_policy applies (dead_letter, skip or process), and the key goes on with
-- first_sequence. The sequence a key expects is never below first_sequence, in the promotion and
-- in postbox.key_gaps, also after a late message was processed (late_policy process).
--
-- inbox_promote_v1 keeps its signature; its body is replaced (0001's is in queue_v1.sql, which
-- the downgrade restores, and the view's in views_v1.sql).

CREATE OR REPLACE FUNCTION postbox.inbox_promote_v1(p_consumer text, p_key text, p_now timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r         record;
    v_mode    text := 'arrival';
    v_first   bigint := 1;
    v_late    text := 'dead_letter';
    v_last    bigint;
    v_next    bigint;
    v_gap     timestamptz;
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM postbox.inbox WHERE consumer = p_consumer AND key = p_key AND state <> 'pending';
    ELSE
        -- Under REPEATABLE READ a head committed after our snapshot is invisible; locking the one we
        -- see fails with a serialization error if it changed, which the caller retries.
        PERFORM 1 FROM postbox.inbox WHERE consumer = p_consumer AND key = p_key AND state <> 'pending'
            FOR KEY SHARE;
    END IF;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT c.sequence_mode, c.first_sequence, c.late_policy INTO v_mode, v_first, v_late
      FROM postbox.consumers c WHERE c.name = p_consumer;
    v_mode := coalesce(v_mode, 'arrival');
    IF v_mode <> 'arrival' THEN
        SELECT k.last_sequence, k.gap_since INTO v_last, v_gap
          FROM postbox.inbox_keys k WHERE k.consumer = p_consumer AND k.key = p_key;
        -- gapless: the sequence the key expects, never below the consumer's first_sequence.
        v_next := greatest(v_last + 1, v_first);
    END IF;
    LOOP
        SELECT q.id, q.position INTO r FROM postbox.inbox q
         WHERE q.consumer = p_consumer AND q.key = p_key AND q.state = 'pending'
         ORDER BY q.position, q.id LIMIT 1;
        IF NOT FOUND THEN
            IF v_gap IS NOT NULL THEN
                UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
            END IF;
            RETURN NULL;
        END IF;
        IF v_mode <> 'arrival' AND v_late <> 'process'
           AND (r.position <= v_last OR (v_mode = 'gapless' AND r.position < v_first)) THEN
            -- Late: a sequence at or below one already processed, or for a gapless consumer below
            -- its first_sequence. Recorded, and the key goes on.
            PERFORM postbox.inbox_copy_to_dead_letters_v1(
                r.id, 'late',
                CASE WHEN r.position <= v_last
                     THEN format('sequence %s is not above the last processed sequence %s of the key', r.position, v_last)
                     ELSE format('sequence %s is below the first_sequence %s of consumer %s', r.position, v_first, p_consumer)
                END,
                'LateSequence', NULL, 'LateSequence', 'skip', p_now,
                CASE WHEN v_late = 'skip' THEN 'discarded' ELSE 'open' END);
            DELETE FROM postbox.inbox WHERE id = r.id;
            CONTINUE;
        END IF;
        IF v_mode = 'gapless' AND r.position > v_next THEN
            IF v_gap IS NULL THEN
                INSERT INTO postbox.inbox_keys AS k (consumer, key, gap_since) VALUES (p_consumer, p_key, p_now)
                ON CONFLICT (consumer, key) DO UPDATE SET gap_since = coalesce(k.gap_since, excluded.gap_since);
            END IF;
            RETURN NULL;
        END IF;
        -- No head can appear meanwhile: a producer's insert-as-head waits on the old head's
        -- deletion (or sees pending rows and queues); repairs guard against the rest.
        UPDATE postbox.inbox SET state = 'ready', available_at = p_now WHERE id = r.id;
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_inbox', p_consumer);
        END IF;
        IF v_gap IS NOT NULL THEN
            UPDATE postbox.inbox_keys SET gap_since = NULL WHERE consumer = p_consumer AND key = p_key;
        END IF;
        RETURN r.id;
    END LOOP;
END
$$;


CREATE OR REPLACE VIEW postbox.key_gaps AS
SELECT k.consumer,
       k.key,
       k.last_sequence,
       greatest(k.last_sequence + 1, c.first_sequence) AS expected_sequence,
       (SELECT min(p.position) FROM postbox.inbox p
         WHERE p.consumer = k.consumer AND p.key = k.key AND p.state = 'pending') AS next_present_sequence,
       k.gap_since,
       now() - k.gap_since AS waiting_for,
       c.gap_timeout,
       c.gap_timeout IS NOT NULL AND now() - k.gap_since > c.gap_timeout AS timed_out
  FROM postbox.inbox_keys k
  JOIN postbox.consumers c ON c.name = k.consumer
 WHERE k.gap_since IS NOT NULL;
