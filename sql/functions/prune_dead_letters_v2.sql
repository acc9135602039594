-- Revision 0014: the dead-letter retention keeps what a replay job has not settled.
--
-- prune_dead_letters_v1 deleted a closed dead letter once it was older than the cutoff, even one a
-- replay job had sent back and not yet settled (the item still replaying): the job then waited for
-- it for ever, and stayed in flight in `postbox status`. The _v2 function leaves a dead letter
-- alone while a replay item of it is pending or replaying; maintenance calls it.

CREATE OR REPLACE FUNCTION postbox.prune_dead_letters_v2(p_cutoff timestamptz, p_limit integer)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
    WITH gone AS (
        DELETE FROM postbox.dead_letters
         WHERE id = ANY (ARRAY(
               SELECT d.id FROM postbox.dead_letters d
                WHERE d.status IN ('replayed', 'discarded', 'resolved')
                  AND coalesce(d.status_changed_at, d.dead_lettered_at) < p_cutoff
                  AND NOT EXISTS (SELECT 1 FROM postbox.replay_items i
                                   WHERE i.dead_letter_id = d.id AND i.state IN ('pending', 'replaying'))
                LIMIT p_limit
                FOR UPDATE OF d SKIP LOCKED))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;
COMMENT ON FUNCTION postbox.prune_dead_letters_v2(timestamptz, integer)
    IS 'Maintenance: delete one batch of closed (replayed, discarded, resolved) dead letters older than the cutoff, but none a replay job has not settled.';
REVOKE ALL ON FUNCTION postbox.prune_dead_letters_v2(timestamptz, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION postbox.prune_dead_letters_v2(timestamptz, integer) TO postbox_maintainer;
