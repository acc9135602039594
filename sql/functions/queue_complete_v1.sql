-- Revision 0005: completing a batch reads each row by its primary key, whatever the planner's
-- statistics say. The bodies of revision 0001's inbox_complete_v1 and outbox_complete_v1 (queue_v1.sql) joined the ids
-- to the table with the row's state in the condition; with few ready heads in the statistics, the
-- planner chose to read the partial indexes whole (a BitmapAnd of inbox_head_uq and
-- inbox_claim_idx), and between two vacuums those hold every dead entry the queue left behind, so
-- each completion read more pages than the last. Same signature and results; only the body
-- changes, so processes of earlier releases call it unchanged.

{{#each}}
-- Mark rows done (the inbox: inside the transaction that holds their handlers' effects; the outbox:
-- once the destination confirmed them): they leave the table and the next row of each key becomes
-- its head. Returns the ids that were NOT completed because their claim is no longer ours (the
-- caller must then roll back their effects).
-- Set-based: one statement takes the batch's rows out (fenced, locked in one global order, the
-- order of one at a time), one try-locks their keys (never waits), files repairs for keys held by
-- someone else (the next claim makes their heads) and makes the next row of each other key its
-- head, unless one appeared meanwhile. Every row is reached by a primary-key probe, whatever the
-- batch size, the table's statistics or the dead index entries a busy queue leaves between
-- vacuums.
{{#inbox}}
-- Sequenced consumers (they track each key's last sequence) and REPEATABLE READ (it must lock the
-- heads it sees) go one message at a time through inbox_finish_v1 instead: the same rows deleted,
-- the same heads made, the same repairs filed.
{{/inbox}}
CREATE OR REPLACE FUNCTION postbox.{{table}}_complete_v1(p_ids bigint[], p_attempts integer[], p_now timestamptz)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
-- An entry point of the worker role (roles_v1.sql): it runs as its owner, with search_path fixed.
SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
DECLARE
{{#inbox}}
    r           record;
{{/inbox}}
    v_lost      bigint[] := '{}';
    v_done      bigint[];
    v_queues    text[];
    v_keys      text[];
    v_woken     text[];
BEGIN
{{#inbox}}
    IF current_setting('transaction_isolation') <> 'read committed'
       OR EXISTS (SELECT 1 FROM postbox.inbox i JOIN postbox.consumers c ON c.name = i.consumer
                   WHERE i.id = ANY(p_ids) AND c.sequence_mode <> 'arrival') THEN
        FOR r IN
            SELECT u.id, u.attempt, i.consumer, i.key
              FROM unnest(p_ids, p_attempts) AS u(id, attempt)
              LEFT JOIN postbox.inbox i ON i.id = u.id
             ORDER BY hashtext(i.consumer || '/' || i.key), u.id   -- one lock order, no deadlocks
        LOOP
            IF r.consumer IS NULL OR NOT postbox.inbox_finish_v1(r.id, r.attempt, p_now, true) THEN
                v_lost := v_lost || r.id;
            END IF;
        END LOOP;
        RETURN v_lost;
    END IF;
{{/inbox}}
    -- Each id's row by its primary key (a probe per id), in one global order; then each locked in
    -- that order and fenced: still ours (same attempt, still running), re-checked on the locked
    -- version. No plan may read the partial indexes instead: between two vacuums a busy queue
    -- leaves their dead entries behind, and reading them all costs more the longer it runs.
    WITH ordered AS MATERIALIZED (
        SELECT u.id, u.attempt
          FROM unnest(p_ids, p_attempts) AS u(id, attempt)
          CROSS JOIN LATERAL (SELECT q.{{queue}}, q.key FROM postbox.{{table}} q WHERE q.id = u.id LIMIT 1) x
         ORDER BY hashtext(x.{{queue}} || '/' || x.key), u.id),
    t AS (
        SELECT l.id
          FROM ordered o CROSS JOIN LATERAL (
               SELECT q.id FROM postbox.{{table}} q
                WHERE q.id = o.id AND q.attempt = o.attempt AND q.state = 'running'
                  FOR UPDATE) l),
    d AS (
        DELETE FROM postbox.{{table}} q USING t WHERE q.id = t.id RETURNING q.id, q.{{queue}}, q.key)
    SELECT array_agg(d.id), array_agg(d.{{queue}}), array_agg(d.key) INTO v_done, v_queues, v_keys FROM d;
    IF v_done IS NULL THEN
        RETURN coalesce(p_ids, '{}');
    END IF;
    IF cardinality(v_done) < cardinality(p_ids) THEN
        v_lost := ARRAY(SELECT u.id FROM unnest(p_ids) AS u(id) WHERE u.id <> ALL(v_done));
    END IF;
    -- The key locks first, in a statement of their own: the next statement's snapshot is taken after
    -- them, so it sees every producer that committed before we locked (one committing later holds
    -- the lock shared meanwhile, waits for ours, and then files a repair itself).
    WITH k AS MATERIALIZED (
        SELECT x.queue, x.key, postbox.try_lock_key_v1({{lock}}, x.queue, x.key) AS locked
          FROM unnest(v_queues, v_keys) AS x(queue, key)),
    repairs AS (
        INSERT INTO postbox.key_repairs (origin, queue, key)
        SELECT '{{table}}', k.queue, k.key FROM k WHERE NOT k.locked)
    SELECT array_agg(k.queue), array_agg(k.key) INTO v_queues, v_keys FROM k WHERE k.locked;
    WITH heads AS (
        UPDATE postbox.{{table}} q SET state = 'ready', available_at = p_now
          FROM (SELECT n.id
                  FROM unnest(v_queues, v_keys) AS k(queue, key),
                       LATERAL (SELECT p.id FROM postbox.{{table}} p  -- the first queued row: one index probe
                                 WHERE p.{{queue}} = k.queue AND p.key = k.key AND p.state = 'pending'
                                 ORDER BY p.position, p.id LIMIT 1) n
                 WHERE NOT EXISTS (SELECT 1 FROM postbox.{{table}} h
                                    WHERE h.{{queue}} = k.queue AND h.key = k.key AND h.state <> 'pending')) nx
         WHERE q.id = nx.id
        RETURNING q.{{queue}})
    SELECT array_agg(DISTINCT heads.{{queue}}) INTO v_woken FROM heads;
    IF v_woken IS NOT NULL AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('{{channel}}', w) FROM unnest(v_woken) AS w;
    END IF;
    RETURN v_lost;
END
$$;
COMMENT ON FUNCTION postbox.{{table}}_complete_v1(bigint[], integer[], timestamptz)
    IS '{{Agent}}: mark {{item}}s done (fenced by attempt) and promote the next {{item}} of each key; returns ids no longer held.';
{{/each}}
