-- Revision 0006: the commit check of a batch receive (inbox_commit_check_v1, revision 0004's
-- trigger function) takes its keys' locks in the order the batch stored them, without sorting
-- them first. Same signature and results; only the body is replaced.
--
-- The order of these locks never mattered: they are shared, and the key lock is only ever held
-- exclusively by trying (workers and relays never wait for it, postbox.try_lock_key_v1), so a
-- producer waits only for processes that wait for no one, and no cycle can form whatever the
-- order. Sorting the batch's (consumer, key) pairs by the database's collation cost more than
-- taking the locks: about 5 % of a keyed batch's server instructions.
CREATE OR REPLACE FUNCTION postbox.inbox_commit_check_v1() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
BEGIN
    -- postbox.lock_key_shared_v1(1, ...) for every key, inline (one statement, no call per key).
    PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(k.consumer || '/' || k.key))
       FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Under REPEATABLE READ a head that changed after our snapshot must not be trusted: locking
        -- it fails with a serialization error instead, which the producer retries.
        PERFORM 1
           FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key),
                LATERAL (SELECT 1 FROM postbox.inbox i
                          WHERE i.consumer = k.consumer AND i.key = k.key AND i.state <> 'pending'
                            FOR KEY SHARE) h;
    END IF;
    -- Index probes per key (the heads' unique index), never a scan of the queue; a new snapshot,
    -- taken after the locks, sees every head decided before them.
    INSERT INTO postbox.key_repairs (origin, queue, key)
    SELECT 'inbox', k.consumer, k.key
      FROM unnest(NEW.consumers, NEW.keys) AS k(consumer, key)
      LEFT JOIN LATERAL (SELECT true AS present FROM postbox.inbox i
                          WHERE i.consumer = k.consumer AND i.key = k.key AND i.state <> 'pending'
                          LIMIT 1) h ON true
     WHERE h.present IS NULL
     ORDER BY 2, 3;
    DELETE FROM postbox.inbox_commit_checks WHERE id = NEW.id;
    RETURN NULL;
END
$$;
