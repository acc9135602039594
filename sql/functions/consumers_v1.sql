-- Declare a consumer and its ordering policies (idempotent: a second call updates them).
-- Once any consumer is declared, receiving for an undeclared one is refused.
CREATE OR REPLACE FUNCTION postbox.declare_consumer_v1(
    name            text,
    sequence_mode   text     DEFAULT 'arrival',
    first_sequence  bigint   DEFAULT 1,
    late_policy     text     DEFAULT 'dead_letter',
    on_dead_letter  text     DEFAULT 'block',
    gap_timeout     interval DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_variable
BEGIN
    PERFORM postbox.check_text_v1(name, 'name', 200, true);
    IF sequence_mode IS NULL OR sequence_mode NOT IN ('arrival', 'monotonic', 'gapless') THEN
        PERFORM postbox.reject_v1('sequence_mode', 'must be arrival, monotonic or gapless');
    END IF;
    IF late_policy IS NULL OR late_policy NOT IN ('dead_letter', 'skip', 'process') THEN
        PERFORM postbox.reject_v1('late_policy', 'must be dead_letter, skip or process');
    END IF;
    IF on_dead_letter IS NULL OR on_dead_letter NOT IN ('block', 'skip', 'halt') THEN
        PERFORM postbox.reject_v1('on_dead_letter', 'must be block, skip or halt');
    END IF;
    IF first_sequence IS NULL OR first_sequence < 0 THEN
        PERFORM postbox.reject_v1('first_sequence', 'must be a non-negative integer');
    END IF;
    INSERT INTO postbox.consumers AS c (name, sequence_mode, first_sequence, late_policy, on_dead_letter, gap_timeout)
    VALUES (name, sequence_mode, first_sequence, late_policy, on_dead_letter, gap_timeout)
    ON CONFLICT ON CONSTRAINT consumers_pkey DO UPDATE
       SET sequence_mode = excluded.sequence_mode, first_sequence = excluded.first_sequence,
           late_policy = excluded.late_policy, on_dead_letter = excluded.on_dead_letter,
           gap_timeout = excluded.gap_timeout, declared = true, updated_at = now();
END
$$;
COMMENT ON FUNCTION postbox.declare_consumer_v1(text, text, bigint, text, text, interval)
    IS 'Declare (or update) a consumer and its ordering policies.';

-- Halt a consumer: workers claim nothing for it until it is resumed. Idempotent.
CREATE OR REPLACE FUNCTION postbox.consumer_halt_v1(name text, reason text, halted_at timestamptz DEFAULT now())
RETURNS void
LANGUAGE sql VOLATILE AS $$
    INSERT INTO postbox.consumers AS c (name, declared, halted_at, halted_reason)
    VALUES (consumer_halt_v1.name, false, consumer_halt_v1.halted_at, consumer_halt_v1.reason)
    ON CONFLICT ON CONSTRAINT consumers_pkey DO UPDATE
       SET halted_at = coalesce(c.halted_at, excluded.halted_at),
           halted_reason = coalesce(c.halted_reason, excluded.halted_reason), updated_at = now()
$$;
COMMENT ON FUNCTION postbox.consumer_halt_v1(text, text, timestamptz) IS 'Halt a consumer (its workers claim nothing) until consumer_resume_v1.';

-- Resume a halted consumer; returns whether it was halted.
CREATE OR REPLACE FUNCTION postbox.consumer_resume_v1(name text)
RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    WITH u AS (
        UPDATE postbox.consumers c SET halted_at = NULL, halted_reason = NULL, updated_at = now()
         WHERE c.name = consumer_resume_v1.name AND c.halted_at IS NOT NULL
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM u)
$$;
COMMENT ON FUNCTION postbox.consumer_resume_v1(text) IS 'Resume a halted consumer.';
