-- Replay jobs (SPEC REPLAY-1..4). A job is a row: the filter, a snapshot of the dead letters it covers
-- (postbox.replay_items, in per-key sequence order), its pacing and abort rule, progress and state.
-- postbox.replay_step_v1 advances a job by one transaction; any process may call it (the
-- `postbox replay run` runner, the CLI, or a DBA's scheduler), so a job survives restarts and a killed
-- runner replays nothing twice: what a step sent back and the record that it did commit together.

-- Start a replay job over the open dead letters matching p_filter (see dlq_select_v1). Returns its id.
CREATE OR REPLACE FUNCTION postbox.dlq_replay_v1(
    p_filter               jsonb,
    p_reason               text,
    p_actor                text             DEFAULT NULL,
    p_mode                 text             DEFAULT 'in_place',
    p_rate                 double precision DEFAULT 10,
    p_max_in_flight        integer          DEFAULT 100,
    p_batch_size           integer          DEFAULT 50,
    p_canary               integer          DEFAULT 0,
    p_abort_failure_ratio  double precision DEFAULT 0.5,
    p_dry_run              boolean          DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_job    bigint;
    v_total  integer;
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    IF p_mode IS NULL OR p_mode NOT IN ('in_place', 'new_message') THEN
        PERFORM postbox.reject_v1('mode', 'must be in_place or new_message');
    END IF;
    IF p_rate IS NULL OR NOT p_rate > 0 OR p_rate > 100000 THEN
        PERFORM postbox.reject_v1('rate', 'must be a number of messages per second above 0 and at most 100000');
    END IF;
    IF p_max_in_flight IS NULL OR p_max_in_flight < 1 THEN
        PERFORM postbox.reject_v1('max_in_flight', 'must be at least 1');
    END IF;
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 10000 THEN
        PERFORM postbox.reject_v1('batch_size', 'must be between 1 and 10000');
    END IF;
    IF p_canary IS NULL OR p_canary < 0 THEN
        PERFORM postbox.reject_v1('canary', 'must be 0 (none) or more');
    END IF;
    IF p_abort_failure_ratio IS NULL OR p_abort_failure_ratio < 0 OR p_abort_failure_ratio > 1 THEN
        PERFORM postbox.reject_v1('abort_failure_ratio', 'must be between 0 and 1');
    END IF;
    IF coalesce(p_filter ->> 'status', 'open') <> 'open' THEN
        PERFORM postbox.reject_v1('filter', 'only open dead letters can be replayed');
    END IF;
    INSERT INTO postbox.replay_jobs (actor, reason, filter, mode, rate, max_in_flight, batch_size, canary,
                                     abort_failure_ratio, dry_run)
    VALUES (p_actor, p_reason, p_filter, p_mode, p_rate, p_max_in_flight, p_batch_size, p_canary,
            p_abort_failure_ratio, p_dry_run)
    RETURNING id INTO v_job;
    INSERT INTO postbox.replay_items (job_id, ordinal, dead_letter_id)
    SELECT v_job, row_number() OVER (), s.id FROM postbox.dlq_select_v1(p_filter) s;
    GET DIAGNOSTICS v_total = ROW_COUNT;
    IF v_total = 0 THEN
        PERFORM postbox.reject_v1('filter', format('matches no open dead letter: %s', p_filter));
    END IF;
    UPDATE postbox.replay_jobs SET total = v_total WHERE id = v_job;
    PERFORM postbox.audit_v1(CASE WHEN p_dry_run THEN 'replay_dry_run' ELSE 'replay' END, p_actor, p_reason,
                             jsonb_build_object('replay_job', v_job,
                                                'dead_letters', (SELECT jsonb_agg(dead_letter_id ORDER BY ordinal)
                                                                   FROM postbox.replay_items WHERE job_id = v_job)),
                             jsonb_build_object('filter', p_filter, 'mode', p_mode, 'rate', p_rate,
                                                'batch_size', p_batch_size, 'max_in_flight', p_max_in_flight,
                                                'canary', p_canary, 'abort_failure_ratio', p_abort_failure_ratio,
                                                'total', v_total));
    RETURN v_job;
END
$$;
COMMENT ON FUNCTION postbox.dlq_replay_v1(jsonb, text, text, text, double precision, integer, integer, integer, double precision, boolean)
    IS 'Operator: create a replay job over the open dead letters matching a filter (rate per second, batch, max in flight, canary, abort ratio, dry run). Audited. Run it with replay_step_v1 or `postbox replay run`.';

-- Internal: what a replay would do with a dead letter (dry run).
CREATE OR REPLACE FUNCTION postbox.dead_letter_replay_plan_v1(p_dl postbox.dead_letters, p_mode text)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_dl.status <> 'open' THEN 'would skip: the dead letter is ' || p_dl.status
        WHEN EXISTS (SELECT 1 FROM postbox.inbox i WHERE p_dl.origin = 'inbox' AND i.id = p_dl.origin_id AND i.state = 'blocked')
          OR EXISTS (SELECT 1 FROM postbox.outbox o WHERE p_dl.origin = 'outbox' AND o.id = p_dl.origin_id AND o.state = 'blocked')
            THEN format('would send back %s as the head of key %s, which it blocks (%s messages held behind it)',
                        CASE p_mode WHEN 'in_place' THEN 'in place' ELSE 'as a new message' END, p_dl.key,
                        (SELECT count(*) FROM postbox.inbox p WHERE p_dl.origin = 'inbox' AND p.consumer = p_dl.consumer
                            AND p.key = p_dl.key AND p.state = 'pending')
                        + (SELECT count(*) FROM postbox.outbox p WHERE p_dl.origin = 'outbox' AND p.destination = p_dl.destination
                            AND p.key = p_dl.key AND p.state = 'pending'))
        ELSE format('would send back %s into the queue of key %s (the key has moved on%s)',
                    CASE p_mode WHEN 'in_place' THEN 'in place' ELSE 'as a new message' END, p_dl.key,
                    (SELECT CASE WHEN c.sequence_mode <> 'arrival' AND k.last_sequence IS NOT NULL AND p_dl.sequence <= k.last_sequence
                                 THEN format('; sequence %s is not above %s, so late policy %s applies', p_dl.sequence, k.last_sequence, c.late_policy)
                                 ELSE '' END
                       FROM postbox.consumers c LEFT JOIN postbox.inbox_keys k ON k.consumer = c.name AND k.key = p_dl.key
                      WHERE p_dl.origin = 'inbox' AND c.name = p_dl.consumer))
        END
$$;

-- Internal: settle a job's items whose outcome is known: a replay succeeded when its dead letter
-- became replayed, failed when it became replay_failed. Returns how many of each.
CREATE OR REPLACE FUNCTION postbox.replay_settle_v1(p_job bigint, p_now timestamptz,
                                                    OUT succeeded integer, OUT failed integer)
LANGUAGE sql VOLATILE AS $$
    WITH settled AS (
        UPDATE postbox.replay_items it
           SET state = CASE d.status WHEN 'replayed' THEN 'succeeded' ELSE 'failed' END,
               finished_at = coalesce(d.status_changed_at, p_now)
          FROM postbox.dead_letters d
         WHERE it.job_id = p_job AND it.state = 'replaying' AND d.id = it.dead_letter_id
           AND d.status IN ('replayed', 'replay_failed', 'discarded', 'resolved')
        RETURNING it.state)
    SELECT (count(*) FILTER (WHERE state = 'succeeded'))::integer, (count(*) FILTER (WHERE state = 'failed'))::integer
      FROM settled
$$;

-- Advance a replay job by one step, in one transaction: settle the outcomes of messages sent back,
-- apply the canary and the abort rule, then send back as many as the token bucket (rate per second,
-- at most batch_size at once) and max_in_flight allow, per key in order. A key that is busy right
-- now is left, with its later dead letters, for the next step. Returns the job after the step; a job
-- another process is stepping right now is returned unchanged.
CREATE OR REPLACE FUNCTION postbox.replay_step_v1(
    p_job bigint, p_now timestamptz DEFAULT clock_timestamp(), p_runner text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_job        postbox.replay_jobs;
    v_dl         postbox.dead_letters;
    v_item       record;
    v_succeeded  integer;
    v_failed     integer;
    v_in_flight  integer;
    v_allowed    integer;
    v_action     text;
    v_busy       text[] := '{}';
    v_keyref     text;
    v_finished   integer;
    v_canary_open integer;
    v_canary_failed integer;
BEGIN
    SELECT * INTO v_job FROM postbox.replay_jobs WHERE id = p_job FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_job FROM postbox.replay_jobs WHERE id = p_job;
        IF NOT FOUND THEN
            PERFORM postbox.reject_v1('replay_job', format('%s does not exist', p_job));
        END IF;
        RETURN v_job;   -- another process is stepping it
    END IF;
    IF v_job.state <> 'pending' AND v_job.state <> 'running' THEN
        IF v_job.state IN ('paused', 'cancelled', 'aborted') THEN
            -- Nothing is sent, but what was sent still settles, so the counters stay true (a canary
            -- aborts at its first failure, while the rest of the canary may still be running).
            SELECT * INTO v_succeeded, v_failed FROM postbox.replay_settle_v1(p_job, p_now);
            IF v_succeeded + v_failed > 0 THEN
                UPDATE postbox.replay_jobs
                   SET succeeded = succeeded + v_succeeded, failed = failed + v_failed, updated_at = clock_timestamp()
                 WHERE id = p_job
                RETURNING * INTO v_job;
            END IF;
        END IF;
        RETURN v_job;
    END IF;
    IF v_job.state = 'pending' THEN
        v_job.state := 'running';
        v_job.started_at := p_now;
        v_job.tokens := least(v_job.batch_size, greatest(1, v_job.rate));
        v_job.tokens_at := p_now;
    END IF;

    IF v_job.dry_run THEN
        UPDATE postbox.replay_items it
           SET state = 'planned', action = postbox.dead_letter_replay_plan_v1(d, v_job.mode)
          FROM postbox.dead_letters d
         WHERE it.job_id = p_job AND it.state = 'pending' AND d.id = it.dead_letter_id;
        v_job.state := 'done';
        v_job.state_reason := 'dry run: nothing was sent back; see the planned action of each item';
        v_job.finished_at := p_now;
    ELSE
        SELECT * INTO v_succeeded, v_failed FROM postbox.replay_settle_v1(p_job, p_now);
        v_job.succeeded := v_job.succeeded + v_succeeded;
        v_job.failed := v_job.failed + v_failed;
        v_finished := v_job.succeeded + v_job.failed;

        -- The canary, then the abort rule.
        IF v_job.canary > 0 AND NOT v_job.canary_passed THEN
            SELECT count(*) FILTER (WHERE state IN ('pending', 'replaying')), count(*) FILTER (WHERE state = 'failed')
              INTO v_canary_open, v_canary_failed
              FROM postbox.replay_items WHERE job_id = p_job AND ordinal <= v_job.canary;
            IF v_canary_failed > 0 THEN
                v_job.state := 'aborted';
                v_job.state_reason := format('canary failed: %s of the first %s replayed messages failed again',
                                             v_canary_failed, least(v_job.canary, v_job.total));
            ELSIF v_canary_open = 0 THEN
                v_job.canary_passed := true;
            END IF;
        ELSIF v_job.failed > 0 AND v_finished >= least(v_job.abort_min_finished, v_job.total)
              AND v_job.failed::double precision / v_finished > v_job.abort_failure_ratio THEN
            v_job.state := 'aborted';
            v_job.state_reason := format('failure ratio %s of %s finished replays is above the limit %s',
                                         v_job.failed, v_finished, v_job.abort_failure_ratio);
        END IF;

        IF v_job.state = 'aborted' THEN
            UPDATE postbox.replay_items SET state = 'cancelled', action = 'not sent: the job was aborted'
             WHERE job_id = p_job AND state = 'pending';
            v_job.finished_at := p_now;
            PERFORM postbox.audit_v1('replay_abort', 'postbox', v_job.state_reason,
                                     jsonb_build_object('replay_job', p_job));
        ELSE
            -- Refill the bucket (nothing accrues backwards in time) and send back what it allows.
            IF p_now > v_job.tokens_at THEN
                v_job.tokens := least(v_job.batch_size::double precision,
                                      v_job.tokens + v_job.rate * extract(epoch FROM p_now - v_job.tokens_at));
                v_job.tokens_at := p_now;
            END IF;
            SELECT count(*) INTO v_in_flight FROM postbox.replay_items WHERE job_id = p_job AND state = 'replaying';
            v_allowed := least(floor(v_job.tokens)::integer, v_job.batch_size, v_job.max_in_flight - v_in_flight);
            IF v_allowed > 0 THEN
                FOR v_item IN
                    SELECT it.ordinal, it.dead_letter_id, d.origin || '/' || coalesce(d.consumer, d.destination) || '/' || d.key AS keyref
                      FROM postbox.replay_items it JOIN postbox.dead_letters d ON d.id = it.dead_letter_id
                     WHERE it.job_id = p_job AND it.state = 'pending'
                       AND (v_job.canary = 0 OR v_job.canary_passed OR it.ordinal <= v_job.canary)
                     ORDER BY it.ordinal
                LOOP
                    EXIT WHEN v_allowed <= 0;
                    v_keyref := v_item.keyref;
                    CONTINUE WHEN v_keyref = ANY (v_busy);   -- an earlier dead letter of this key waits
                    SELECT * INTO v_dl FROM postbox.dead_letters WHERE id = v_item.dead_letter_id FOR UPDATE;
                    IF v_dl.status <> 'open' THEN
                        UPDATE postbox.replay_items SET state = 'skipped', finished_at = p_now,
                               action = 'skipped: the dead letter is ' || v_dl.status
                         WHERE job_id = p_job AND ordinal = v_item.ordinal;
                        v_job.skipped := v_job.skipped + 1;
                        CONTINUE;
                    END IF;
                    v_action := postbox.dead_letter_send_back_v1(v_dl, v_job.mode, p_now, p_job);
                    IF v_action IS NULL THEN
                        v_busy := v_busy || v_keyref;
                        CONTINUE;
                    END IF;
                    UPDATE postbox.replay_items SET state = 'replaying', replayed_at = p_now, action = v_action
                     WHERE job_id = p_job AND ordinal = v_item.ordinal;
                    v_job.replayed := v_job.replayed + 1;
                    v_job.tokens := v_job.tokens - 1;
                    v_allowed := v_allowed - 1;
                END LOOP;
            END IF;
            IF NOT EXISTS (SELECT 1 FROM postbox.replay_items WHERE job_id = p_job AND state IN ('pending', 'replaying')) THEN
                v_job.state := 'done';
                v_job.finished_at := p_now;
                v_job.state_reason := format('%s succeeded, %s failed again, %s skipped', v_job.succeeded,
                                             v_job.failed, v_job.skipped);
            END IF;
        END IF;
    END IF;
    v_job.last_step_at := p_now;
    v_job.last_runner := coalesce(p_runner, v_job.last_runner);
    v_job.updated_at := clock_timestamp();
    UPDATE postbox.replay_jobs SET
        state = v_job.state, state_reason = v_job.state_reason, canary_passed = v_job.canary_passed,
        replayed = v_job.replayed, succeeded = v_job.succeeded, failed = v_job.failed, skipped = v_job.skipped,
        tokens = v_job.tokens, tokens_at = v_job.tokens_at, started_at = v_job.started_at,
        finished_at = v_job.finished_at, updated_at = v_job.updated_at, last_step_at = v_job.last_step_at,
        last_runner = v_job.last_runner
     WHERE id = p_job;
    RETURN v_job;
END
$$;
COMMENT ON FUNCTION postbox.replay_step_v1(bigint, timestamptz, text)
    IS 'Advance a replay job by one transaction (settle outcomes, canary, abort rule, rate-limited send-back in key order).';

-- Internal: change a job's state as an operator.
CREATE OR REPLACE FUNCTION postbox.replay_control_v1(
    p_job bigint, p_action text, p_reason text, p_actor text, p_now timestamptz)
RETURNS postbox.replay_jobs
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job  postbox.replay_jobs;
BEGIN
    PERFORM postbox.require_reason_v1(p_reason);
    SELECT * INTO v_job FROM postbox.replay_jobs WHERE id = p_job FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM postbox.reject_v1('replay_job', format('%s does not exist', p_job));
    END IF;
    IF p_action = 'pause' AND v_job.state IN ('pending', 'running') THEN
        UPDATE postbox.replay_jobs SET state = 'paused', state_reason = p_reason, updated_at = clock_timestamp()
         WHERE id = p_job RETURNING * INTO v_job;
    ELSIF p_action = 'resume' AND v_job.state = 'paused' THEN
        -- Nothing accrues while paused: the bucket restarts now.
        UPDATE postbox.replay_jobs
           SET state = CASE WHEN started_at IS NULL THEN 'pending' ELSE 'running' END,
               state_reason = NULL, tokens_at = p_now, updated_at = clock_timestamp()
         WHERE id = p_job RETURNING * INTO v_job;
    ELSIF p_action = 'cancel' AND v_job.state IN ('pending', 'running', 'paused') THEN
        UPDATE postbox.replay_items SET state = 'cancelled', action = 'not sent: the job was cancelled'
         WHERE job_id = p_job AND state = 'pending';
        UPDATE postbox.replay_jobs SET state = 'cancelled', state_reason = p_reason, finished_at = p_now,
               updated_at = clock_timestamp()
         WHERE id = p_job RETURNING * INTO v_job;
    ELSE
        PERFORM postbox.reject_v1('replay_job', format('%s is %s: cannot %s it', p_job, v_job.state, p_action));
    END IF;
    PERFORM postbox.audit_v1('replay_' || p_action, p_actor, p_reason, jsonb_build_object('replay_job', p_job));
    RETURN v_job;
END
$$;

CREATE OR REPLACE FUNCTION postbox.replay_pause_v1(p_job bigint, p_reason text, p_actor text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT postbox.replay_control_v1(p_job, 'pause', p_reason, p_actor, clock_timestamp())
$$;
COMMENT ON FUNCTION postbox.replay_pause_v1(bigint, text, text) IS 'Operator: pause a replay job (nothing more is sent back until resumed). Audited.';

CREATE OR REPLACE FUNCTION postbox.replay_resume_v1(
    p_job bigint, p_reason text, p_actor text DEFAULT NULL, p_now timestamptz DEFAULT clock_timestamp())
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT postbox.replay_control_v1(p_job, 'resume', p_reason, p_actor, p_now)
$$;
COMMENT ON FUNCTION postbox.replay_resume_v1(bigint, text, text, timestamptz) IS 'Operator: resume a paused replay job. Audited.';

CREATE OR REPLACE FUNCTION postbox.replay_cancel_v1(p_job bigint, p_reason text, p_actor text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT postbox.replay_control_v1(p_job, 'cancel', p_reason, p_actor, clock_timestamp())
$$;
COMMENT ON FUNCTION postbox.replay_cancel_v1(bigint, text, text) IS 'Operator: cancel a replay job (messages already sent back go on). Audited.';

-- Replay jobs at a glance.
CREATE OR REPLACE VIEW postbox.replay_progress AS
SELECT j.id, j.state, j.state_reason, j.mode, j.dry_run, j.rate, j.batch_size, j.max_in_flight, j.canary,
       j.total, j.replayed, j.succeeded, j.failed, j.skipped, j.tokens,
       (SELECT count(*) FROM postbox.replay_items i WHERE i.job_id = j.id AND i.state = 'replaying') AS in_flight,
       (SELECT count(*) FROM postbox.replay_items i WHERE i.job_id = j.id AND i.state = 'pending') AS waiting,
       CASE WHEN j.total > 0 THEN round(100.0 * (j.succeeded + j.failed + j.skipped) / j.total, 1) END AS percent_done,
       j.created_at, j.started_at, j.finished_at, j.last_step_at, j.db_user, j.actor, j.reason, j.filter
  FROM postbox.replay_jobs j;
COMMENT ON VIEW postbox.replay_progress IS 'Replay jobs with their progress: sent back, succeeded, failed again, skipped, in flight, waiting.';
