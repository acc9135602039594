-- Stable, unversioned names for operators and DBAs (the dead-letter and replay operations), with
-- plain parameter names:  SELECT postbox.dlq_replay('{"queue": "orders"}', reason => 'fixed', rate => 5);
-- Each calls the current version; permissions are those of the versioned function.

CREATE OR REPLACE FUNCTION postbox.dlq_select(filter jsonb DEFAULT '{}'::jsonb)
RETURNS SETOF postbox.dead_letters
LANGUAGE sql STABLE AS $$ SELECT * FROM postbox.dlq_select_v1(filter) $$;
COMMENT ON FUNCTION postbox.dlq_select(jsonb) IS 'Dead letters matching a filter, in replay order (current version: dlq_select_v1).';

CREATE OR REPLACE FUNCTION postbox.dlq_explain(dead_letter bigint)
RETURNS TABLE (at timestamptz, event text, detail text)
LANGUAGE sql STABLE AS $$ SELECT * FROM postbox.dlq_explain_v1(dead_letter) $$;
COMMENT ON FUNCTION postbox.dlq_explain(bigint) IS 'The whole history of a dead letter (current version: dlq_explain_v1).';

CREATE OR REPLACE FUNCTION postbox.dlq_discard(filter jsonb, reason text, actor text DEFAULT NULL)
RETURNS TABLE (dead_letter_id bigint, action text)
LANGUAGE sql VOLATILE AS $$ SELECT * FROM postbox.dlq_discard_v1(filter, reason, actor) $$;
COMMENT ON FUNCTION postbox.dlq_discard(jsonb, text, text) IS 'Discard open dead letters with a reason (current version: dlq_discard_v1).';

CREATE OR REPLACE FUNCTION postbox.dlq_resolve(filter jsonb, reason text, actor text DEFAULT NULL)
RETURNS TABLE (dead_letter_id bigint, action text)
LANGUAGE sql VOLATILE AS $$ SELECT * FROM postbox.dlq_resolve_v1(filter, reason, actor) $$;
COMMENT ON FUNCTION postbox.dlq_resolve(jsonb, text, text) IS 'Mark open dead letters resolved by hand (current version: dlq_resolve_v1).';

CREATE OR REPLACE FUNCTION postbox.dlq_edit(dead_letter bigint, payload jsonb, reason text, actor text DEFAULT NULL)
RETURNS integer
LANGUAGE sql VOLATILE AS $$ SELECT postbox.dlq_edit_v1(dead_letter, payload, reason, actor) $$;
COMMENT ON FUNCTION postbox.dlq_edit(bigint, jsonb, text, text) IS 'Edit the payload a replay sends (current version: dlq_edit_v1).';

CREATE OR REPLACE FUNCTION postbox.dlq_replay(
    filter jsonb, reason text, actor text DEFAULT NULL, mode text DEFAULT 'in_place',
    rate double precision DEFAULT 10, max_in_flight integer DEFAULT 100, batch_size integer DEFAULT 50,
    canary integer DEFAULT 0, abort_failure_ratio double precision DEFAULT 0.5, dry_run boolean DEFAULT false)
RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT postbox.dlq_replay_v1(filter, reason, actor, mode, rate, max_in_flight, batch_size, canary,
                                 abort_failure_ratio, dry_run)
$$;
COMMENT ON FUNCTION postbox.dlq_replay(jsonb, text, text, text, double precision, integer, integer, integer, double precision, boolean)
    IS 'Create a replay job (current version: dlq_replay_v1).';

CREATE OR REPLACE FUNCTION postbox.replay_step(job bigint)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE AS $$ SELECT postbox.replay_step_v1(job, clock_timestamp(), 'sql') $$;
COMMENT ON FUNCTION postbox.replay_step(bigint) IS 'Advance a replay job by one step (current version: replay_step_v1).';

CREATE OR REPLACE FUNCTION postbox.replay_pause(job bigint, reason text, actor text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE AS $$ SELECT postbox.replay_pause_v1(job, reason, actor) $$;

CREATE OR REPLACE FUNCTION postbox.replay_resume(job bigint, reason text, actor text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE AS $$ SELECT postbox.replay_resume_v1(job, reason, actor) $$;

CREATE OR REPLACE FUNCTION postbox.replay_cancel(job bigint, reason text, actor text DEFAULT NULL)
RETURNS postbox.replay_jobs
LANGUAGE sql VOLATILE AS $$ SELECT postbox.replay_cancel_v1(job, reason, actor) $$;

CREATE OR REPLACE FUNCTION postbox.key_unblock(
    origin text, queue text, key text, reason text, actor text DEFAULT NULL, replay boolean DEFAULT false)
RETURNS text
LANGUAGE sql VOLATILE AS $$ SELECT postbox.key_unblock_v1(origin, queue, key, reason, actor, replay) $$;
COMMENT ON FUNCTION postbox.key_unblock(text, text, text, text, text, boolean) IS 'Unblock a key: discard (or replay) its dead-lettered head (current version: key_unblock_v1).';

CREATE OR REPLACE FUNCTION postbox.consumer_halt(consumer text, reason text, actor text DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE AS $$ SELECT postbox.consumer_halt_op_v1(consumer, reason, actor) $$;

CREATE OR REPLACE FUNCTION postbox.consumer_resume(consumer text, reason text, actor text DEFAULT NULL)
RETURNS boolean
LANGUAGE sql VOLATILE AS $$ SELECT postbox.consumer_resume_op_v1(consumer, reason, actor) $$;
