-- The calls with which a worker commits a group of deliveries in one transaction without a
-- savepoint (worker_calls.rs): settle all or nothing (inbox_ack_all), fence a replayed group
-- (inbox_fence).

CREATE OR REPLACE FUNCTION inbox_fence(queue regclass, ids bigint[], tokens bigint[]) RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    statement text;
    shape inbox__queue_shape;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ids must not be NULL';
    END IF;
    IF tokens IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'tokens must not be NULL';
    END IF;
    PERFORM inbox__same_length(ids, tokens);
    statement := inbox__session_statement(queue, 'fence');
    IF statement IS NULL THEN
        shape := inbox__queue_shape(queue);
        -- Waits for a lock held by another transaction (a heartbeat's, or a worker's that will
        -- settle the job, after which it is no longer the token's).
        statement := inbox__keep_statement(queue, 'fence', shape.table_sql, inbox__prepared(format(
            'SELECT q.id::int8 FROM %s AS q JOIN unnest($1::int8[], $2::int8[]) AS s(id, token) '
            '    ON q.id = s.id '
            ' WHERE q.attempt = CASE WHEN s.token < 0 THEN -s.token - 1 ELSE s.token END '
            '   AND q.locked_until IS DISTINCT FROM ''infinity'' '
            ' ORDER BY q.id FOR UPDATE OF q', shape.table_sql), 'int8[], int8[]'));
    END IF;
    RETURN QUERY EXECUTE format('EXECUTE %I(%L, %L)', statement, ids, tokens);
END
$$;

CREATE OR REPLACE FUNCTION inbox_ack_all(queue regclass, ids bigint[], tokens bigint[]) RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    given bigint;
    acked bigint;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ids must not be NULL';
    END IF;
    IF tokens IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'tokens must not be NULL';
    END IF;
    -- inbox__ack_batch checks the arrays (one dimension, as many ids as tokens) first.
    acked := inbox__ack_batch(queue, ids, tokens);
    given := cardinality(ids);
    IF acked <> given THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = format('%s of %s jobs are no longer held by their tokens', given - acked, given);
    END IF;
    RETURN acked;
END
$$;
