-- Dead-letter operations for operators and DBAs (SPEC DLQ-3, DLQ-4, REPLAY-1..4): select, explain,
-- discard, resolve, edit, replay (one dead letter; jobs are in replay_v1.sql), unblock a key, halt and
-- resume a consumer. Every action writes postbox.audit_log. Functions that change anything are
-- SECURITY DEFINER with a fixed search_path and are granted to postbox_operator only (roles_v1.sql).

-- Record an operator action. db_role is the role in effect (SET ROLE) or the login.
CREATE OR REPLACE FUNCTION postbox.audit_v1(
    p_action text, p_actor text, p_reason text, p_target jsonb, p_details jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    INSERT INTO postbox.audit_log (db_role, actor, action, reason, target, details)
    VALUES (coalesce(nullif(current_setting('role', true), 'none'), session_user::text), p_actor, p_action,
            p_reason, coalesce(p_target, '{}'::jsonb), coalesce(p_details, '{}'::jsonb))
    RETURNING id
$$;
COMMENT ON FUNCTION postbox.audit_v1(text, text, text, jsonb, jsonb) IS 'Internal: append an operator action to postbox.audit_log.';

-- An operator must say why.
CREATE OR REPLACE FUNCTION postbox.require_reason_v1(p_reason text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        PERFORM postbox.reject_v1('reason', 'is required: say why (it goes to the audit trail)');
    END IF;
    PERFORM postbox.check_text_v1(p_reason, 'reason', 2000, true);
END
$$;

-- Dead letters matching a filter, in replay order (per queue and key, in sequence order).
-- Filter fields (all optional, combined with AND): ids (array of dead letter ids), origin (inbox or
-- outbox), queue (consumer or destination), consumer, destination, type, reason, fingerprint, key,
-- message_id, since and until (dead_lettered_at range, ISO timestamps), status (default open; any).
CREATE OR REPLACE FUNCTION postbox.dlq_select_v1(p_filter jsonb DEFAULT '{}'::jsonb)
RETURNS SETOF postbox.dead_letters
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_field   text;
    v_ids     bigint[];
    v_since   timestamptz;
    v_until   timestamptz;
    v_status  text;
BEGIN
    IF p_filter IS NULL OR jsonb_typeof(p_filter) <> 'object' THEN
        PERFORM postbox.reject_v1('filter', 'must be a JSON object, e.g. {"queue": "orders", "type": "order.paid"}');
    END IF;
    FOR v_field IN SELECT jsonb_object_keys(p_filter) LOOP
        IF v_field NOT IN ('ids', 'origin', 'queue', 'consumer', 'destination', 'type', 'reason', 'fingerprint',
                           'key', 'message_id', 'since', 'until', 'status') THEN
            PERFORM postbox.reject_v1('filter', format('has an unknown field %L (known: ids, origin, queue, consumer, destination, type, reason, fingerprint, key, message_id, since, until, status)', v_field));
        END IF;
        IF v_field NOT IN ('ids') AND jsonb_typeof(p_filter -> v_field) <> 'string' THEN
            PERFORM postbox.reject_v1('filter', format('field %L must be a string', v_field));
        END IF;
    END LOOP;
    IF p_filter ? 'ids' THEN
        IF jsonb_typeof(p_filter -> 'ids') <> 'array' THEN
            PERFORM postbox.reject_v1('filter', 'field ''ids'' must be an array of dead letter ids');
        END IF;
        BEGIN
            SELECT array_agg(e::bigint) INTO v_ids FROM jsonb_array_elements_text(p_filter -> 'ids') AS e;
        EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range THEN
            PERFORM postbox.reject_v1('filter', 'field ''ids'' must be an array of integers');
        END;
        v_ids := coalesce(v_ids, '{}');
    END IF;
    BEGIN
        v_since := (p_filter ->> 'since')::timestamptz;
        v_until := (p_filter ->> 'until')::timestamptz;
    EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow THEN
        PERFORM postbox.reject_v1('filter', 'fields ''since'' and ''until'' must be timestamps, e.g. 2026-11-30T10:00:00Z');
    END;
    v_status := coalesce(p_filter ->> 'status', 'open');
    IF v_status NOT IN ('any', 'open', 'replaying', 'replayed', 'replay_failed', 'discarded', 'resolved') THEN
        PERFORM postbox.reject_v1('filter', 'field ''status'' must be open, replaying, replayed, replay_failed, discarded, resolved or any');
    END IF;
    RETURN QUERY
    SELECT d.* FROM postbox.dead_letters d
     WHERE (v_status = 'any' OR d.status = v_status)
       AND (v_ids IS NULL OR d.id = ANY (v_ids))
       AND (NOT p_filter ? 'origin' OR d.origin = p_filter ->> 'origin')
       AND (NOT p_filter ? 'queue' OR coalesce(d.consumer, d.destination) = p_filter ->> 'queue')
       AND (NOT p_filter ? 'consumer' OR d.consumer = p_filter ->> 'consumer')
       AND (NOT p_filter ? 'destination' OR d.destination = p_filter ->> 'destination')
       AND (NOT p_filter ? 'type' OR d.type = p_filter ->> 'type')
       AND (NOT p_filter ? 'reason' OR d.reason = p_filter ->> 'reason')
       AND (NOT p_filter ? 'fingerprint' OR d.fingerprint = p_filter ->> 'fingerprint')
       AND (NOT p_filter ? 'key' OR d.key = p_filter ->> 'key')
       AND (NOT p_filter ? 'message_id' OR d.message_id = p_filter ->> 'message_id')
       AND (v_since IS NULL OR d.dead_lettered_at >= v_since)
       AND (v_until IS NULL OR d.dead_lettered_at < v_until)
     ORDER BY d.origin, coalesce(d.consumer, d.destination), d.key, d.position, d.id;
END
$$;
COMMENT ON FUNCTION postbox.dlq_select_v1(jsonb)
    IS 'Dead letters matching a filter (ids, origin, queue, consumer, destination, type, reason, fingerprint, key, message_id, since, until, status), in replay order.';

-- A dead letter's whole history, oldest first: receipt, every failed attempt with its decision,
-- dead-lettering, payload edits, operator actions, replays and their outcomes (following the chain
-- of replays that failed again).
CREATE OR REPLACE FUNCTION postbox.dlq_explain_v1(p_dead_letter bigint)
RETURNS TABLE (at timestamptz, event text, detail text)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE up AS (
        SELECT d.id, d.replay_of FROM postbox.dead_letters d WHERE d.id = p_dead_letter
        UNION
        SELECT d.id, d.replay_of FROM postbox.dead_letters d JOIN up ON d.id = up.replay_of),
    chain AS (
        SELECT d.id FROM postbox.dead_letters d WHERE d.id IN (SELECT id FROM up)
        UNION
        SELECT d.id FROM postbox.dead_letters d JOIN chain c ON d.replay_of = c.id),
    dls AS (SELECT d.* FROM postbox.dead_letters d WHERE d.id IN (SELECT id FROM chain)),
    first AS (SELECT * FROM dls ORDER BY id LIMIT 1)
    SELECT * FROM (
        SELECT f.received_at, 'received',
               format('%s %s: message %s, key %s%s, type %s, schema version %s', f.origin,
                      coalesce(f.consumer, f.destination), f.message_id, f.key,
                      CASE WHEN f.sequence IS NOT NULL THEN ', sequence ' || f.sequence ELSE '' END,
                      coalesce(f.type, '-'), f.schema_version)
          FROM first f
        UNION ALL
        SELECT a.failed_at, format('attempt %s failed', a.attempt),
               format('%s%s: %s -> %s%s', a.kind, CASE WHEN a.error_type IS NOT NULL THEN ' ' || a.error_type ELSE '' END,
                      coalesce(a.error, '(no message)'), a.decision,
                      CASE WHEN a.explanation IS NOT NULL THEN ' (' || a.explanation || ')' ELSE '' END)
          FROM postbox.attempts a
         WHERE EXISTS (SELECT 1 FROM dls WHERE dls.message_id = a.message_id AND dls.origin = a.origin
                                            AND coalesce(dls.consumer, dls.destination) = a.queue)
        UNION ALL
        SELECT d.dead_lettered_at, format('dead-lettered as #%s', d.id),
               format('reason %s, key policy %s, after %s attempt(s): %s', d.reason, d.ordering_policy, d.attempt,
                      coalesce(d.last_error, '-'))
          FROM dls d
        UNION ALL
        SELECT e.edited_at, format('payload of #%s edited (version %s)', e.dead_letter_id, e.version),
               format('by %s%s: %s', e.db_user, coalesce(' as ' || e.actor, ''), e.reason)
          FROM postbox.dead_letter_edits e WHERE e.dead_letter_id IN (SELECT id FROM dls)
        UNION ALL
        SELECT l.at, format('operator: %s', l.action),
               format('by %s%s%s', l.db_role, coalesce(' as ' || l.actor, ''), coalesce(': ' || l.reason, ''))
          FROM postbox.audit_log l
         WHERE l.action NOT IN ('dlq_edit')
           AND EXISTS (SELECT 1 FROM dls WHERE l.target -> 'dead_letters' @> to_jsonb(dls.id))
        UNION ALL
        SELECT i.replayed_at, format('replayed #%s (job %s)', i.dead_letter_id, i.job_id), coalesce(i.action, '')
          FROM postbox.replay_items i WHERE i.dead_letter_id IN (SELECT id FROM dls) AND i.replayed_at IS NOT NULL
        UNION ALL
        SELECT d.status_changed_at, format('#%s is %s', d.id, d.status), coalesce(d.status_reason, '')
          FROM dls d WHERE d.status <> 'open' AND d.status_changed_at IS NOT NULL
    ) h (at, event, detail)
    ORDER BY at, event
$$;
COMMENT ON FUNCTION postbox.dlq_explain_v1(bigint) IS 'The whole history of a dead letter and of its replays, oldest first.';

-- Internal: take the blocked live row of a dead letter out of the flow, so its key goes on.
CREATE OR REPLACE FUNCTION postbox.dead_letter_release_key_v1(p_dl postbox.dead_letters, p_now timestamptz)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_dl.origin = 'inbox' THEN
        PERFORM 1 FROM postbox.inbox WHERE id = p_dl.origin_id AND state = 'blocked' FOR UPDATE;
        IF FOUND THEN
            PERFORM postbox.inbox_finish_v1(p_dl.origin_id, 0, p_now, false);
            RETURN 'key released: its next message is the head';
        END IF;
    ELSE
        DELETE FROM postbox.outbox WHERE id = p_dl.origin_id AND state = 'blocked';
        IF FOUND THEN
            PERFORM postbox.outbox_next_v1(p_dl.destination, p_dl.key, p_now);
            RETURN 'key released: its next row is the head';
        END IF;
    END IF;
    RETURN 'no key was held by it';
END
$$;

-- Internal: close open dead letters (discarded or resolved) with a reason; blocked keys go on.
CREATE OR REPLACE FUNCTION postbox.dlq_close_v1(
    p_filter jsonb, p_status text, p_reason text, p_actor text, p_now timestamptz)
RETURNS TABLE (dead_letter_id bigint, action text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id   bigint;
    v_dl   postbox.dead_letters;
    v_ids  bigint[] := '{}';
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    IF coalesce(p_filter ->> 'status', 'open') <> 'open' THEN
        PERFORM postbox.reject_v1('filter', 'only open dead letters can be discarded or resolved');
    END IF;
    FOR v_id IN SELECT s.id FROM postbox.dlq_select_v1(p_filter) s LOOP
        SELECT * INTO v_dl FROM postbox.dead_letters d WHERE d.id = v_id AND d.status = 'open' FOR UPDATE;
        CONTINUE WHEN NOT FOUND;   -- replayed or closed meanwhile
        UPDATE postbox.dead_letters d
           SET status = p_status, status_changed_at = p_now, status_reason = p_reason
         WHERE d.id = v_id;
        dead_letter_id := v_id;
        action := postbox.dead_letter_release_key_v1(v_dl, p_now);
        v_ids := v_ids || v_id;
        RETURN NEXT;
    END LOOP;
    PERFORM postbox.audit_v1(CASE p_status WHEN 'discarded' THEN 'dlq_discard' ELSE 'dlq_resolve' END,
                             p_actor, p_reason, jsonb_build_object('dead_letters', to_jsonb(v_ids)),
                             jsonb_build_object('filter', p_filter, 'count', cardinality(v_ids)));
END
$$;

CREATE OR REPLACE FUNCTION postbox.dlq_discard_v1(
    p_filter jsonb, p_reason text, p_actor text DEFAULT NULL, p_now timestamptz DEFAULT now())
RETURNS TABLE (dead_letter_id bigint, action text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM postbox.dlq_close_v1(p_filter, 'discarded', p_reason, p_actor, p_now)
$$;
COMMENT ON FUNCTION postbox.dlq_discard_v1(jsonb, text, text, timestamptz)
    IS 'Operator: discard the open dead letters matching a filter, with a reason; keys they blocked go on. Audited.';

CREATE OR REPLACE FUNCTION postbox.dlq_resolve_v1(
    p_filter jsonb, p_reason text, p_actor text DEFAULT NULL, p_now timestamptz DEFAULT now())
RETURNS TABLE (dead_letter_id bigint, action text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM postbox.dlq_close_v1(p_filter, 'resolved', p_reason, p_actor, p_now)
$$;
COMMENT ON FUNCTION postbox.dlq_resolve_v1(jsonb, text, text, timestamptz)
    IS 'Operator: mark the open dead letters matching a filter resolved by hand (the effect was applied some other way); keys they blocked go on. Audited.';

-- Edit the payload a replay will send. The original stays in payload; every edit is a new version
-- in postbox.dead_letter_edits. Returns the new version number.
CREATE OR REPLACE FUNCTION postbox.dlq_edit_v1(
    p_dead_letter bigint, p_payload jsonb, p_reason text, p_actor text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_dl       postbox.dead_letters;
    v_version  integer;
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    IF p_payload IS NULL THEN
        PERFORM postbox.reject_v1('payload', 'is required');
    END IF;
    -- The checks a producer's payload passes: size, nesting, numbers.
    PERFORM postbox.check_json_v1(p_payload, p_payload::text, 'payload',
                                  postbox.max_payload_bytes_v1(), 'postbox.max_payload_bytes');
    SELECT * INTO v_dl FROM postbox.dead_letters WHERE id = p_dead_letter FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM postbox.reject_v1('dead_letter', format('%s does not exist', p_dead_letter));
    END IF;
    IF v_dl.status <> 'open' THEN
        PERFORM postbox.reject_v1('dead_letter', format('%s is %s; only open dead letters can be edited', p_dead_letter, v_dl.status));
    END IF;
    v_version := v_dl.payload_version + 1;
    INSERT INTO postbox.dead_letter_edits (dead_letter_id, version, payload, previous, reason, actor)
    VALUES (p_dead_letter, v_version, p_payload, coalesce(v_dl.edited_payload, v_dl.payload), p_reason, p_actor);
    UPDATE postbox.dead_letters SET edited_payload = p_payload, payload_version = v_version WHERE id = p_dead_letter;
    PERFORM postbox.audit_v1('dlq_edit', p_actor, p_reason, jsonb_build_object('dead_letters', jsonb_build_array(p_dead_letter)),
                             jsonb_build_object('version', v_version));
    RETURN v_version;
END
$$;
COMMENT ON FUNCTION postbox.dlq_edit_v1(bigint, jsonb, text, text)
    IS 'Operator: set the payload a replay of this open dead letter sends (versioned; the original is kept). Audited.';

-- Internal: send one open dead letter back (the dead letter must be locked by the caller).
-- in_place: same message_id; a blocked head is replaced by a new row at its place, ready, with fresh
-- attempts (a new row id, so a worker stalled since an old attempt stays fenced out); a message
-- whose key moved on joins its key's queue (sequenced consumers apply their late policy to it).
-- new_message: a new message (message_id '<original>:replay:<dead letter id>') that references the
-- original in causation_id and headers, taking the blocked head's place, or joining the queue.
-- Returns what it did, or NULL if the key is busy right now (try again later: order is kept).
CREATE OR REPLACE FUNCTION postbox.dead_letter_send_back_v1(
    p_dl postbox.dead_letters, p_mode text, p_now timestamptz, p_job bigint)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_payload     jsonb := coalesce(p_dl.edited_payload, p_dl.payload);
    v_queue       text := coalesce(p_dl.consumer, p_dl.destination);
    v_head_id     bigint;
    v_head_pos    bigint;
    v_id          bigint;
    v_message_id  text := p_dl.message_id;
    v_headers     jsonb := p_dl.headers;
    v_causation   text := p_dl.causation_id;
    v_mode        text;
    v_position    bigint;
    v_action      text;
BEGIN
    IF NOT postbox.try_lock_key_v1(CASE p_dl.origin WHEN 'inbox' THEN 1 ELSE 2 END, v_queue, p_dl.key) THEN
        RETURN NULL;
    END IF;
    -- Replaying from here on: if the message fails again within this very call (a late sequence
    -- dead-lettered at once), dead_letter_link_replay_v1 turns this into replay_failed.
    UPDATE postbox.dead_letters
       SET status = 'replaying', status_changed_at = p_now,
           status_reason = CASE WHEN p_job IS NULL THEN 'replayed by an operator' ELSE format('replay job %s', p_job) END
     WHERE id = p_dl.id;
    IF p_mode = 'new_message' THEN
        v_message_id := p_dl.message_id || ':replay:' || p_dl.id;
        v_headers := v_headers || jsonb_build_object('postbox_replay_of', jsonb_build_object(
            'message_id', p_dl.message_id, 'dead_letter_id', p_dl.id));
        v_causation := p_dl.message_id;
    END IF;
    -- One branch per table, written once (postbox.schema.render repeats it for the inbox and outbox).
{{#each}}
    IF p_dl.origin = '{{table}}' THEN
        SELECT id, position INTO v_head_id, v_head_pos FROM postbox.{{table}}
         WHERE id = p_dl.origin_id AND state = 'blocked' FOR UPDATE;
        v_id := nextval(pg_get_serial_sequence('postbox.{{table}}', 'id'));
        IF v_head_id IS NOT NULL THEN
            DELETE FROM postbox.{{table}} WHERE id = v_head_id;
            v_position := v_head_pos;   -- the new message takes the blocked head's place
        ELSE
{{#inbox}}
            SELECT c.sequence_mode INTO v_mode FROM postbox.consumers c WHERE c.name = p_dl.consumer;
{{/inbox}}
            v_position := CASE WHEN coalesce(v_mode, 'arrival') = 'arrival' OR p_dl.sequence IS NULL
                               THEN v_id ELSE p_dl.sequence END;
        END IF;
        INSERT INTO postbox.{{table}} (id, {{queue}}, message_id, key, {{#inbox}}sequence, {{/inbox}}position, type, {{#inbox}}schema_version, {{/inbox}}payload,
                                   headers, correlation_id, causation_id, {{#inbox}}source, received_at{{/inbox}}{{#outbox}}created_at{{/outbox}}, state, available_at, replay_of)
        VALUES (v_id, v_queue, v_message_id, p_dl.key, {{#inbox}}p_dl.sequence, {{/inbox}}v_position, p_dl.type, {{#inbox}}p_dl.schema_version, {{/inbox}}v_payload,
                v_headers, coalesce(p_dl.correlation_id, p_dl.message_id), v_causation, {{#inbox}}p_dl.source, {{/inbox}}
                CASE p_mode WHEN 'in_place' THEN p_dl.received_at ELSE p_now END,
                CASE WHEN v_head_id IS NOT NULL THEN 'ready' ELSE 'pending' END, p_now, p_dl.id);
{{#inbox}}
        IF p_mode = 'new_message' THEN
            INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id, received_at)
            VALUES (p_dl.consumer, v_message_id, decode(md5(v_payload::text), 'hex'), v_id, p_now)
            ON CONFLICT DO NOTHING;
        ELSE
            UPDATE postbox.inbox_dedup SET inbox_id = v_id WHERE consumer = p_dl.consumer AND message_id = v_message_id;
        END IF;
{{/inbox}}
        IF v_head_id IS NULL THEN
            PERFORM postbox.{{table}}_promote_v1(v_queue, p_dl.key, p_now);
        END IF;
        IF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('{{channel}}', v_queue);
        END IF;
    END IF;
{{/each}}
    v_action := CASE p_mode WHEN 'in_place' THEN 'in place' ELSE 'new message ' || v_message_id END
                || CASE WHEN v_head_id IS NOT NULL
                        THEN ': head of its key again (a new row: a stalled worker of an old attempt is fenced out)'
                        ELSE ': joined the queue of its key (the key had moved on)' END;
    RETURN v_action;
END
$$;

-- When a replayed message leaves the live tables without being dead-lettered again, its replay
-- succeeded (a failure re-dead-letters it first, see dead_letter_link_replay_v1).
CREATE OR REPLACE FUNCTION postbox.replay_settled_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE postbox.dead_letters
       SET status = 'replayed', status_changed_at = clock_timestamp(), status_reason = 'the replay succeeded'
     WHERE id = OLD.replay_of AND status = 'replaying';
    RETURN NULL;
END
$$;

-- A replayed message dead-lettered again: the earlier dead letter becomes replay_failed and the new
-- one points at it (replay_of), so explain can follow the chain.
CREATE OR REPLACE FUNCTION postbox.dead_letter_link_replay_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_prev bigint;
BEGIN
{{#each}}
    IF NEW.origin = '{{table}}' THEN
        SELECT replay_of INTO v_prev FROM postbox.{{table}} WHERE id = NEW.origin_id;
    END IF;
{{/each}}
    IF v_prev IS NOT NULL THEN
        UPDATE postbox.dead_letters
           SET status = 'replay_failed', status_changed_at = NEW.dead_lettered_at,
               status_reason = format('the replay failed again: dead letter %s', NEW.id)
         WHERE id = v_prev AND status = 'replaying';
        NEW.replay_of := v_prev;
    END IF;
    RETURN NEW;
END
$$;

-- Unblock a key: skip its dead-lettered head (discarded, with a reason) so held messages follow, or
-- (p_replay) replay the head in place. Returns what was done.
CREATE OR REPLACE FUNCTION postbox.key_unblock_v1(
    p_origin text, p_queue text, p_key text, p_reason text, p_actor text DEFAULT NULL,
    p_replay boolean DEFAULT false, p_now timestamptz DEFAULT now())
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_dl      postbox.dead_letters;
    v_action  text;
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    IF p_origin NOT IN ('inbox', 'outbox') THEN
        PERFORM postbox.reject_v1('origin', 'must be inbox or outbox');
    END IF;
    SELECT d.* INTO v_dl FROM postbox.dead_letters d
      JOIN (SELECT id FROM postbox.inbox WHERE p_origin = 'inbox' AND consumer = p_queue AND key = p_key AND state = 'blocked'
            UNION ALL
            SELECT id FROM postbox.outbox WHERE p_origin = 'outbox' AND destination = p_queue AND key = p_key AND state = 'blocked') h
        ON d.origin = p_origin AND d.origin_id = h.id
     WHERE d.status = 'open'
       FOR UPDATE OF d;
    IF NOT FOUND THEN
        PERFORM postbox.reject_v1('key', format('%s %s/%s is not blocked by an open dead letter', p_origin, p_queue, p_key));
    END IF;
    IF p_replay THEN
        v_action := postbox.dead_letter_send_back_v1(v_dl, 'in_place', p_now, NULL);
        IF v_action IS NULL THEN
            RAISE EXCEPTION 'postbox: key % is busy, try again', p_key USING ERRCODE = '55P03';
        END IF;
        v_action := 'dead letter ' || v_dl.id || ' replayed ' || v_action;
    ELSE
        UPDATE postbox.dead_letters SET status = 'discarded', status_changed_at = p_now, status_reason = p_reason
         WHERE id = v_dl.id;
        v_action := 'dead letter ' || v_dl.id || ' discarded; ' || postbox.dead_letter_release_key_v1(v_dl, p_now);
    END IF;
    PERFORM postbox.audit_v1('key_unblock', p_actor, p_reason,
                             jsonb_build_object('dead_letters', jsonb_build_array(v_dl.id), 'origin', p_origin,
                                                'queue', p_queue, 'key', p_key),
                             jsonb_build_object('replay', p_replay, 'action', v_action));
    RETURN v_action;
END
$$;
COMMENT ON FUNCTION postbox.key_unblock_v1(text, text, text, text, text, boolean, timestamptz)
    IS 'Operator: unblock a key by discarding its dead-lettered head (held messages follow) or by replaying it in place. Audited.';

-- Halt and resume a consumer as an operator (audited); the worker's own halt policy uses
-- consumer_halt_v1 directly.
CREATE OR REPLACE FUNCTION postbox.consumer_halt_op_v1(p_consumer text, p_reason text, p_actor text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    PERFORM postbox.check_text_v1(p_consumer, 'consumer', 200, true);
    PERFORM postbox.consumer_halt_v1(p_consumer, p_reason, now());
    PERFORM postbox.audit_v1('consumer_halt', p_actor, p_reason, jsonb_build_object('consumer', p_consumer));
END
$$;
COMMENT ON FUNCTION postbox.consumer_halt_op_v1(text, text, text) IS 'Operator: halt a consumer (its workers claim nothing). Audited.';

CREATE OR REPLACE FUNCTION postbox.consumer_resume_op_v1(p_consumer text, p_reason text, p_actor text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_was boolean;
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    v_was := postbox.consumer_resume_v1(p_consumer);
    PERFORM postbox.audit_v1('consumer_resume', p_actor, p_reason, jsonb_build_object('consumer', p_consumer),
                             jsonb_build_object('was_halted', v_was));
    IF v_was AND postbox.notify_enabled_v1() THEN
        PERFORM pg_notify('postbox_inbox', p_consumer);
    END IF;
    RETURN v_was;
END
$$;
COMMENT ON FUNCTION postbox.consumer_resume_op_v1(text, text, text) IS 'Operator: resume a halted consumer. Audited.';
