-- Durable steps (the client's Job::step): the result of each named step of a job, recorded in a
-- transaction of its own as soon as the step returned, so that a later delivery of the job (a
-- retry, a lost lease, a crash) gets the result back instead of running the step again. A
-- record lives while its job is in its queue; inbox_purge_results deletes those of jobs that are
-- gone (acked, discarded, purged) and of queues that were dropped.
CREATE TABLE IF NOT EXISTS inbox_steps (
    queue pg_catalog.regclass NOT NULL,
    job pg_catalog.int8 NOT NULL,
    name pg_catalog.text NOT NULL,
    result pg_catalog.jsonb NOT NULL,
    -- The delivery that ran the step.
    attempt pg_catalog.int4 NOT NULL,
    recorded_at pg_catalog.timestamptz NOT NULL,
    PRIMARY KEY (queue, job, name)
);
COMMENT ON TABLE inbox_steps IS
    'The recorded results of jobs'' durable steps (inbox_record_step), kept while the job is in its queue.';
-- UPDATE for the purge's FOR UPDATE, which any role may run (inbox_purge_results).
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_steps TO PUBLIC;

-- The longest step name, in characters: a name is a label in code ("charge-card"), not data.
CREATE OR REPLACE FUNCTION inbox__step_name_max_chars() RETURNS pg_catalog.int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN 200;

-- Records `result` as step `name` of job `id`, run by delivery `attempt`, unless that step is
-- recorded already; returns the record that stands (this one, or the one that was there first,
-- with inserted false). Called outside the delivery's transaction, which may roll back, and
-- fenced by nothing but the key: a delivery whose lease was lost has made its step's call all
-- the same, and its record spares the next holder a second one. Two deliveries recording the
-- same step at once: the second waits for the first and gets its record.
CREATE OR REPLACE FUNCTION inbox_record_step(queue pg_catalog.regclass, id pg_catalog.int8,
                                             attempt pg_catalog.int4, name pg_catalog.text,
                                             result pg_catalog.jsonb)
RETURNS TABLE(recorded pg_catalog.jsonb, recorded_attempt pg_catalog.int4,
              recorded_at pg_catalog.timestamptz, inserted pg_catalog.bool)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    PERFORM @extschema@.inbox__required(attempt, 'attempt');
    PERFORM @extschema@.inbox__required(name, 'name');
    PERFORM @extschema@.inbox__required(result, 'result');
    IF attempt OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'attempt must be at least 1';
    END IF;
    IF pg_catalog.length(name) OPERATOR(pg_catalog.<) 1
       OR pg_catalog.length(name) OPERATOR(pg_catalog.>) @extschema@.inbox__step_name_max_chars() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('a step''s name must be 1 to %s characters',
                                        @extschema@.inbox__step_name_max_chars());
    END IF;
    RETURN QUERY
        INSERT INTO @extschema@.inbox_steps AS s (queue, job, name, result, attempt, recorded_at)
        VALUES (queue, id, name, result, attempt, pg_catalog.clock_timestamp())
        ON CONFLICT ON CONSTRAINT inbox_steps_pkey DO NOTHING
        RETURNING s.result, s.attempt, s.recorded_at, true;
    IF NOT FOUND THEN
        -- A new statement, so a new snapshot: it sees the record the insert met.
        RETURN QUERY
            SELECT s.result, s.attempt, s.recorded_at, false
              FROM @extschema@.inbox_steps s
             WHERE s.queue OPERATOR(pg_catalog.=) inbox_record_step.queue
               AND s.job OPERATOR(pg_catalog.=) inbox_record_step.id
               AND s.name OPERATOR(pg_catalog.=) inbox_record_step.name;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox_record_step(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int4, pg_catalog.text, pg_catalog.jsonb) IS
    'Records a job''s durable step once; returns the record that stands.';

-- The recorded steps of job `id`, oldest first.
CREATE OR REPLACE FUNCTION inbox_job_steps(queue pg_catalog.regclass, id pg_catalog.int8)
RETURNS TABLE(name pg_catalog.text, result pg_catalog.jsonb, attempt pg_catalog.int4,
              recorded_at pg_catalog.timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    RETURN QUERY
        SELECT s.name, s.result, s.attempt, s.recorded_at
          FROM @extschema@.inbox_steps s
         WHERE s.queue OPERATOR(pg_catalog.=) inbox_job_steps.queue
           AND s.job OPERATOR(pg_catalog.=) inbox_job_steps.id
         ORDER BY s.recorded_at, s.name;
END
$$;
COMMENT ON FUNCTION inbox_job_steps(pg_catalog.regclass, pg_catalog.int8) IS
    'A job''s recorded durable steps, oldest first.';

-- Deletes up to `max` step records whose job is no longer in its queue (acked, discarded,
-- purged) or whose queue was dropped; how many. A job's id is never reused, so a record whose
-- job is gone is never needed again. Run by inbox_purge_results, which any role may call: a
-- queue dropped meanwhile, or one the caller may not read, is left for another purge.
CREATE OR REPLACE FUNCTION inbox__purge_steps(max pg_catalog.int4) RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q pg_catalog.regclass;
    tab pg_catalog.text;
    deleted pg_catalog.int8;
    total pg_catalog.int8;
BEGIN
    DELETE FROM @extschema@.inbox_steps s
     WHERE s.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(
        SELECT e.ctid FROM @extschema@.inbox_steps e
         WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) e.queue)
         LIMIT max FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS total = ROW_COUNT;
    FOR q IN SELECT DISTINCT e.queue FROM @extschema@.inbox_steps e LOOP
        EXIT WHEN total OPERATOR(pg_catalog.>=) max;
        -- The name, not the regclass: a queue dropped from here on is then an undefined table.
        tab := (SELECT pg_catalog.format('%I.%I', n.nspname, c.relname)
                  FROM pg_catalog.pg_class c
                  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
                 WHERE c.oid OPERATOR(pg_catalog.=) q);
        CONTINUE WHEN tab IS NULL;
        BEGIN
            EXECUTE pg_catalog.format(
                'DELETE FROM @extschema@.inbox_steps s WHERE s.ctid OPERATOR(pg_catalog.=) ANY (ARRAY('
                '    SELECT e.ctid FROM @extschema@.inbox_steps e'
                '     WHERE e.queue OPERATOR(pg_catalog.=) $1'
                '       AND NOT EXISTS (SELECT FROM %s j WHERE j.id OPERATOR(pg_catalog.=) e.job)'
                '     LIMIT $2 FOR UPDATE OF e SKIP LOCKED))', tab)
              USING q, max OPERATOR(pg_catalog.-) total;
            GET DIAGNOSTICS deleted = ROW_COUNT;
            total := total OPERATOR(pg_catalog.+) deleted;
        EXCEPTION WHEN undefined_table OR insufficient_privilege THEN
            NULL;
        END;
    END LOOP;
    RETURN total;
END
$$;
COMMENT ON FUNCTION inbox__purge_steps(pg_catalog.int4) IS
    'Deletes up to max step records of jobs that are gone; how many.';
