-- Dead letters (dead_letters.rs): list dead jobs, run them again, or delete them.

-- The SET list of a requeue ($2 now): the job runs again from its first attempt, last_error kept;
-- a job of a group goes back to waiting (and is promoted if its group has no head).
CREATE OR REPLACE FUNCTION inbox__requeue_set(shape inbox__queue_shape) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN 'attempt = 0'
    || CASE WHEN shape.groups
            THEN ', locked_until = CASE WHEN group_key IS NULL THEN $2 ELSE ''infinity'' END, dead_at = NULL'
            ELSE ', locked_until = $2' || CASE WHEN shape.has_dead_at THEN ', dead_at = NULL' ELSE '' END END
    || CASE WHEN shape.has_leased_at THEN ', leased_at = NULL' ELSE '' END;

CREATE OR REPLACE FUNCTION inbox__requeued_group(shape inbox__queue_shape) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN CASE WHEN shape.groups THEN ' RETURNING group_key' ELSE ' RETURNING NULL::text' END;

-- Dead jobs, oldest first.
CREATE OR REPLACE FUNCTION inbox__dead_order(shape inbox__queue_shape) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN CASE WHEN shape.has_dead_at THEN 'dead_at, id' ELSE 'id' END;

CREATE OR REPLACE FUNCTION inbox_requeue(queue regclass, id bigint) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    shape inbox__queue_shape;
    requeued bigint;
    groups text[];
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'id must not be NULL';
    END IF;
    shape := inbox__queue_shape(queue);
    EXECUTE format(
        'WITH requeued AS (UPDATE %s SET %s WHERE id = $1 AND %s%s) '
        'SELECT count(*), array_agg(g) FILTER (WHERE g IS NOT NULL) FROM requeued AS r(g)',
        shape.table_sql, inbox__requeue_set(shape), shape.dead_predicate, inbox__requeued_group(shape))
      INTO requeued, groups USING id, clock_timestamp();
    IF groups IS NOT NULL THEN
        PERFORM inbox__groups_settled(queue, shape, groups);
    END IF;
    RETURN requeued = 1;
END
$$;

CREATE OR REPLACE FUNCTION inbox_requeue_dead(queue regclass, max int DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    shape inbox__queue_shape;
    requeued bigint;
    groups text[];
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    shape := inbox__queue_shape(queue);
    -- Skips dead jobs that another transaction is requeueing or discarding.
    EXECUTE format(
        'WITH requeued AS (UPDATE %1$s SET %2$s '
        '  WHERE id = ANY (ARRAY(SELECT id FROM %1$s WHERE %3$s ORDER BY %4$s LIMIT $1 '
        '                        FOR UPDATE SKIP LOCKED)) '
        '    AND %3$s%5$s) '
        'SELECT count(*), array_agg(g) FILTER (WHERE g IS NOT NULL) FROM requeued AS r(g)',
        shape.table_sql, inbox__requeue_set(shape), shape.dead_predicate, inbox__dead_order(shape),
        inbox__requeued_group(shape))
      INTO requeued, groups USING max::int8, clock_timestamp();
    IF groups IS NOT NULL THEN
        PERFORM inbox__groups_settled(queue, shape, groups);
    END IF;
    RETURN requeued;
END
$$;

CREATE OR REPLACE FUNCTION inbox_discard(queue regclass, id bigint) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    shape inbox__queue_shape;
    discarded bigint;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'id must not be NULL';
    END IF;
    shape := inbox__queue_shape(queue);
    EXECUTE format('DELETE FROM %s WHERE id = $1 AND %s', shape.table_sql, shape.dead_predicate)
      USING id;
    GET DIAGNOSTICS discarded = ROW_COUNT;
    RETURN discarded = 1;
END
$$;

-- The statement runs in a volatile function, so that it reads the latest committed state with a
-- snapshot of its own, as the pgrx build's statements do.
CREATE OR REPLACE FUNCTION inbox__dead_jobs(queue regclass, max int)
RETURNS TABLE(id bigint, attempt int, last_error text, dead_at timestamptz, payload jsonb, payload_bytes bytea)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    shape inbox__queue_shape;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    IF max IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'max must not be NULL';
    END IF;
    IF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    shape := inbox__queue_shape(queue);
    RETURN QUERY EXECUTE format(
        'SELECT id::int8, attempt::int4, %s, %s, %s FROM %s WHERE %s ORDER BY %s LIMIT $1',
        CASE WHEN shape.has_last_error THEN 'last_error::text' ELSE 'NULL::text' END,
        CASE WHEN shape.has_dead_at THEN 'dead_at' ELSE 'NULL::timestamptz' END,
        CASE WHEN shape.payload = 'jsonb' THEN 'payload, NULL::bytea' ELSE 'NULL::jsonb, payload' END,
        shape.table_sql, shape.dead_predicate, inbox__dead_order(shape))
      USING max;
END
$$;

CREATE OR REPLACE FUNCTION inbox_dead_jobs(queue regclass, max int DEFAULT 100)
RETURNS TABLE(id bigint, attempt int, last_error text, dead_at timestamptz, payload jsonb, payload_bytes bytea)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    RETURN QUERY SELECT * FROM inbox__dead_jobs(queue, max);
END
$$;

