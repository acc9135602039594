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
