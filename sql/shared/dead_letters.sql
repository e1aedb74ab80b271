-- Dead letters (docs/sql-api.md, "Dead letters"): list dead jobs, run them again, or delete them,
-- written once for both builds. Statements are built per call from the queue's checked shape
-- (shape.sql): an operator calls these now and then, not once per job.
--
-- A dead job stays in its queue with locked_until = 'infinity' (and, where the table has the
-- column, the time it died in dead_at). A requeued job runs again from its first attempt, its
-- last_error kept; one of a group goes back to waiting, and is promoted if its group has no head
-- (inbox__groups_settled: groups.rs in the pgrx build, sql/sql-only/25-groups.sql in the other).
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- The SET list of a requeue ($2 now).
CREATE OR REPLACE FUNCTION inbox__requeue_set(shape @extschema@.inbox__queue_shape) RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN 'attempt = 0'
    || CASE WHEN shape.groups
            THEN ', locked_until = CASE WHEN group_key IS NULL THEN $2 ELSE ''infinity'' END, dead_at = NULL'
            ELSE ', locked_until = $2' || CASE WHEN shape.has_dead_at THEN ', dead_at = NULL' ELSE '' END END
    || CASE WHEN shape.has_leased_at THEN ', leased_at = NULL' ELSE '' END;

CREATE OR REPLACE FUNCTION inbox__requeued_group(shape @extschema@.inbox__queue_shape) RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN shape.groups THEN ' RETURNING group_key' ELSE ' RETURNING NULL::pg_catalog.text' END;

-- Dead jobs, oldest first.
CREATE OR REPLACE FUNCTION inbox__dead_order(shape @extschema@.inbox__queue_shape) RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN shape.has_dead_at THEN 'dead_at, id' ELSE 'id' END;

-- Requeues the dead jobs of `queue` that `target` picks (a condition on $1, `value`) and promotes
-- the heads of the groups they rejoin; returns how many. The body of both requeues.
CREATE OR REPLACE FUNCTION inbox__requeue(queue pg_catalog.regclass, target pg_catalog.text, value pg_catalog.int8)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    shape constant @extschema@.inbox__queue_shape := @extschema@.inbox__queue_shape(queue);
    requeued bigint;
    groups text[];
BEGIN
    EXECUTE format(
        'WITH requeued AS (UPDATE %1$s SET %2$s WHERE %3$s AND %4$s%5$s) '
        'SELECT count(*), array_agg(g) FILTER (WHERE g IS NOT NULL) FROM requeued AS r(g)',
        shape.table_sql, @extschema@.inbox__requeue_set(shape),
        format(target, shape.table_sql, shape.dead_predicate, @extschema@.inbox__dead_order(shape)),
        shape.dead_predicate, @extschema@.inbox__requeued_group(shape))
      INTO requeued, groups USING value, clock_timestamp();
    IF groups IS NOT NULL THEN
        PERFORM @extschema@.inbox__groups_settled(queue, groups);
    END IF;
    RETURN requeued;
END
$$;

-- Runs dead job `id` again: due now, its attempts counted from zero. False when the job is not
-- dead (or not there).
CREATE OR REPLACE FUNCTION inbox_requeue(queue pg_catalog.regclass, id pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    PERFORM @extschema@.inbox__required(id, 'id');
    RETURN @extschema@.inbox__requeue(queue, 'id = $1', id) = 1;
END
$$;
COMMENT ON FUNCTION inbox_requeue(pg_catalog.regclass, pg_catalog.int8) IS
    'Runs a dead job again from its first attempt; false when it is not dead.';

-- Runs all dead jobs again (or the `max` oldest); returns how many.
CREATE OR REPLACE FUNCTION inbox_requeue_dead(queue pg_catalog.regclass, max pg_catalog.int4 DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    IF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    -- The oldest first (the table %1$s, the dead %2$s, their order %3$s), skipping dead jobs that
    -- another transaction is requeueing or discarding.
    RETURN @extschema@.inbox__requeue(queue,
        'id = ANY (ARRAY(SELECT id FROM %1$s WHERE %2$s ORDER BY %3$s LIMIT $1 FOR UPDATE SKIP LOCKED))',
        max);
END
$$;
COMMENT ON FUNCTION inbox_requeue_dead(pg_catalog.regclass, pg_catalog.int4) IS
    'Runs the dead jobs again (all, or the max oldest); returns how many.';

-- Deletes dead job `id`; false when the job is not dead (or not there).
CREATE OR REPLACE FUNCTION inbox_discard(queue pg_catalog.regclass, id pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    shape @extschema@.inbox__queue_shape;
    discarded bigint;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    PERFORM @extschema@.inbox__required(id, 'id');
    shape := @extschema@.inbox__queue_shape(queue);
    EXECUTE format('DELETE FROM %s WHERE id = $1 AND %s', shape.table_sql, shape.dead_predicate)
      USING id;
    GET DIAGNOSTICS discarded = ROW_COUNT;
    RETURN discarded = 1;
END
$$;
COMMENT ON FUNCTION inbox_discard(pg_catalog.regclass, pg_catalog.int8) IS
    'Deletes a dead job; false when it is not dead.';

-- The body of inbox_dead_jobs. Volatile, so that its statement reads the latest committed state
-- with a snapshot of its own, as the job path's statements do.
CREATE OR REPLACE FUNCTION inbox__dead_jobs(queue pg_catalog.regclass, max pg_catalog.int4)
RETURNS TABLE(id pg_catalog.int8, attempt pg_catalog.int4, last_error pg_catalog.text,
              dead_at pg_catalog.timestamptz, payload pg_catalog.jsonb, payload_bytes pg_catalog.bytea)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    shape @extschema@.inbox__queue_shape;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    IF @extschema@.inbox__required(max, 'max') < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    shape := @extschema@.inbox__queue_shape(queue);
    RETURN QUERY EXECUTE format(
        'SELECT id::int8, attempt::int4, %s, %s, %s FROM %s WHERE %s ORDER BY %s LIMIT $1',
        CASE WHEN shape.has_last_error THEN 'last_error::text' ELSE 'NULL::text' END,
        CASE WHEN shape.has_dead_at THEN 'dead_at' ELSE 'NULL::timestamptz' END,
        CASE WHEN shape.payload = 'jsonb' THEN 'payload, NULL::bytea' ELSE 'NULL::jsonb, payload' END,
        shape.table_sql, shape.dead_predicate, @extschema@.inbox__dead_order(shape))
      USING max;
END
$$;

-- Up to `max` dead jobs, oldest first.
CREATE OR REPLACE FUNCTION inbox_dead_jobs(queue pg_catalog.regclass, max pg_catalog.int4 DEFAULT 100)
RETURNS TABLE(id pg_catalog.int8, attempt pg_catalog.int4, last_error pg_catalog.text,
              dead_at pg_catalog.timestamptz, payload pg_catalog.jsonb, payload_bytes pg_catalog.bytea)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY SELECT * FROM @extschema@.inbox__dead_jobs(queue, max);
END
$$;
COMMENT ON FUNCTION inbox_dead_jobs(pg_catalog.regclass, pg_catalog.int4) IS
    'Up to max dead jobs of the queue, oldest first.';
