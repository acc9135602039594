-- Producer queries: thin calls of the versioned SQL functions, so that Python and any other
-- language go through exactly the same code in the database.

-- name: inbox_receive
SELECT status, inbox_id FROM postbox.inbox_receive_v1(
    consumer => :consumer, message_id => :message_id, payload => CAST(:payload AS jsonb),
    key => :key, type => :type, sequence => CAST(:sequence AS bigint),
    headers => CAST(:headers AS jsonb), schema_version => CAST(:schema_version AS integer),
    correlation_id => :correlation_id, causation_id => :causation_id, source => :source);

-- name: input_limits
-- The size limits in force for this session (payload, headers), read before sending a large message.
SELECT postbox.max_payload_bytes_v1(), postbox.max_headers_bytes_v1();

-- name: inbox_receive_columns
-- A batch to one consumer; inbox_receive_arrays is the same batch mixing consumers. Each
-- message's status and id, in the batch's order (the order is all the client needs of ordinality).
SELECT status, inbox_id FROM postbox.inbox_receive_columns_v1(
    consumer => :consumer, message_ids => CAST(:message_ids AS text[]), payloads => CAST(:payloads AS jsonb),
    keys => CAST(:keys AS text[]), types => CAST(:types AS text[]), sequences => CAST(:sequences AS bigint[]),
    headers => CAST(:headers AS jsonb), schema_versions => CAST(:schema_versions AS integer[]),
    correlation_ids => CAST(:correlation_ids AS text[]), causation_ids => CAST(:causation_ids AS text[]),
    sources => CAST(:sources AS text[]))
ORDER BY ordinality;

-- name: inbox_receive_arrays
SELECT status, inbox_id FROM postbox.inbox_receive_arrays_v1(
    CAST(:consumers AS text[]), CAST(:message_ids AS text[]), CAST(:payloads AS jsonb[]), CAST(:keys AS text[]),
    CAST(:types AS text[]), CAST(:sequences AS bigint[]), CAST(:headers AS jsonb[]),
    CAST(:schema_versions AS integer[]), CAST(:correlation_ids AS text[]), CAST(:causation_ids AS text[]),
    CAST(:sources AS text[]))
ORDER BY ordinality;

-- name: outbox_publish
SELECT postbox.outbox_publish_v1(
    destination => :destination, payload => CAST(:payload AS jsonb), key => :key, type => :type,
    message_id => :message_id, headers => CAST(:headers AS jsonb),
    correlation_id => :correlation_id, causation_id => :causation_id);

-- name: outbox_publish_batch
SELECT ordinality, outbox_id FROM postbox.outbox_publish_batch_v1(CAST(:messages AS jsonb))
ORDER BY ordinality;

-- name: declare_consumer
SELECT postbox.declare_consumer_v1(
    name => :name, sequence_mode => :sequence_mode, first_sequence => CAST(:first_sequence AS bigint),
    late_policy => :late_policy, on_dead_letter => :on_dead_letter,
    gap_timeout => CAST(:gap_timeout AS interval));
