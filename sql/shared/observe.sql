-- What operators and exporters read (docs/sql-api.md, "Observability"): every queue with its
-- counts and ages (inbox_queues, inbox_metrics) and one queue's jobs by state (inbox_jobs),
-- written once for both builds. Statements are built per call from the queues' checked shapes
-- (shape.sql): an exporter calls these every few seconds, not once per job.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- The conditions that tell a queue's states apart, `clock` being the SQL of now ($1 here, a
-- literal for the job browser's filters, browse.sql), as inbox_stats counts them: a job waiting
-- behind its group's head is delayed. Unlike the shape's dead_predicate, `dead_at` alone (without
-- group_key) already decides which 'infinity' rows are dead here.
-- Installed by an earlier version: without clock.
DROP FUNCTION IF EXISTS inbox__observed_states(@extschema@.inbox__queue_shape);
CREATE OR REPLACE FUNCTION inbox__observed_states(
    shape @extschema@.inbox__queue_shape, clock text,
    OUT ready text, OUT delayed text, OUT leased text, OUT dead text)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    timed constant text := format('(locked_until > %s AND locked_until < ''infinity'')', clock);
    delivered text;
    in_group text;
BEGIN
    ready := format(CASE WHEN shape.nullable_locked_until
                         THEN '(locked_until IS NULL OR locked_until <= %s)'
                         ELSE '(locked_until <= %s)' END, clock);
    -- Without leased_at a delivered job waiting for its locked_until counts as leased.
    delivered := CASE WHEN shape.has_leased_at THEN 'leased_at IS NOT NULL' ELSE 'attempt > 0' END;
    dead := CASE WHEN shape.has_dead_at
                 THEN '(locked_until = ''infinity'' AND dead_at IS NOT NULL)'
                 ELSE '(locked_until = ''infinity'')' END;
    in_group := CASE WHEN shape.has_dead_at AND shape.has_group_key
                     THEN '(locked_until = ''infinity'' AND dead_at IS NULL)'
                     ELSE 'false' END;
    delayed := format('((%s AND NOT (%s)) OR %s)', timed, delivered, in_group);
    leased := format('(%s AND %s)', timed, delivered);
END
$function$;

-- Seconds of an interval, months counted as 30 days.
CREATE OR REPLACE FUNCTION inbox__interval_seconds(span interval)
RETURNS double precision
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN (extract(year FROM span) * 12 + extract(month FROM span))::double precision
           * 30.0::double precision * 86400.0::double precision
       + extract(day FROM span)::double precision * 86400.0::double precision
       + (extract(hour FROM span) * 3600000000 + extract(minute FROM span) * 60000000
          + extract(microseconds FROM span))::bigint::double precision
           / 1000000.0::double precision;

-- Every table of queue shape that the caller may read, by schema and name, with its counts and
-- ages. Each is locked ACCESS SHARE (as a query of it would be) without waiting: a table another
-- transaction holds ACCESS EXCLUSIVE (DROP, ALTER, TRUNCATE, VACUUM FULL), or one dropped since
-- it was listed, is left out of this call so that a migration never stalls monitoring.
CREATE OR REPLACE FUNCTION inbox__every_queue()
RETURNS TABLE (queue regclass, queue_name text, ready bigint, delayed bigint, leased bigint,
               dead bigint, oldest_ready_age interval, oldest_lease_age interval,
               records_leases boolean)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    candidate record;
    shape @extschema@.inbox__queue_shape;
    states record;
BEGIN
    FOR candidate IN
        SELECT c.oid, quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS name
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
           AND n.nspname <> 'information_schema' AND n.nspname !~ '^pg_(catalog|toast)'
           AND NOT pg_is_other_temp_schema(n.oid)
           AND has_schema_privilege(n.oid, 'USAGE')
           AND has_table_privilege(c.oid, 'SELECT')
           AND 4 = (SELECT count(*) FROM pg_attribute a
                     WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                       AND ((a.attname IN ('id', 'attempt')
                             AND a.atttypid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype))
                         OR (a.attname = 'locked_until' AND a.atttypid = 'timestamptz'::regtype)
                         OR (a.attname = 'payload'
                             AND a.atttypid IN ('jsonb'::regtype, 'bytea'::regtype))))
           AND NOT EXISTS (SELECT FROM pg_attribute a
                     WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                       AND ((a.attname IN ('key', 'last_error', 'group_key')
                             AND a.atttypid NOT IN ('text'::regtype, 'varchar'::regtype))
                         OR (a.attname IN ('leased_at', 'dead_at', 'run_at')
                             AND a.atttypid <> 'timestamptz'::regtype)
                         OR (a.attname = 'priority'
                             AND a.atttypid NOT IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype))
                         -- An outbox is shaped like a queue; its ordering_key tells it apart.
                         OR a.attname = 'ordering_key'))
         ORDER BY n.nspname, c.relname
    LOOP
        BEGIN
            -- ONLY: the partitions are locked by the count itself, as any query would.
            EXECUTE format('LOCK TABLE ONLY %s IN ACCESS SHARE MODE NOWAIT', candidate.name);
        EXCEPTION WHEN lock_not_available OR undefined_table OR invalid_schema_name THEN
            CONTINUE;
        END;
        -- Dropped (or renamed, and its name taken) between the listing and the lock.
        CONTINUE WHEN to_regclass(candidate.name) IS DISTINCT FROM candidate.oid::regclass;
        shape := @extschema@.inbox__queue_shape(candidate.oid::regclass);
        states := @extschema@.inbox__observed_states(shape, '$1');
        queue := candidate.oid::regclass;
        queue_name := candidate.name;
        records_leases := shape.has_leased_at;
        EXECUTE format(
            'SELECT count(*) FILTER (WHERE %s), count(*) FILTER (WHERE %s), '
            '       count(*) FILTER (WHERE %s), count(*) FILTER (WHERE %s), '
            '       $1 - min(locked_until) FILTER (WHERE locked_until <= $1), %s FROM %s',
            states.ready, states.delayed, states.leased, states.dead,
            CASE WHEN shape.has_leased_at
                 THEN format('$1 - min(leased_at) FILTER (WHERE %s)', states.leased)
                 ELSE 'NULL::interval' END,
            shape.table_sql)
          INTO ready, delayed, leased, dead, oldest_ready_age, oldest_lease_age
          USING clock_timestamp();
        RETURN NEXT;
    END LOOP;
END
$function$;

CREATE OR REPLACE FUNCTION inbox_queues()
RETURNS TABLE (queue regclass, ready bigint, delayed bigint, leased bigint, dead bigint,
               oldest_ready_age interval, oldest_lease_age interval, paused bool)
LANGUAGE sql STRICT VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
    SELECT q.queue, q.ready, q.delayed, q.leased, q.dead, q.oldest_ready_age, q.oldest_lease_age,
           @extschema@.inbox_paused_since(q.queue) IS NOT NULL
      FROM @extschema@.inbox__every_queue() q
$function$;

CREATE OR REPLACE FUNCTION inbox_metrics()
RETURNS TABLE (queue text, ready bigint, delayed bigint, leased bigint, dead bigint,
               oldest_ready_age_seconds double precision,
               oldest_lease_age_seconds double precision, paused bool)
LANGUAGE sql STRICT VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
    SELECT q.queue_name, q.ready, q.delayed, q.leased, q.dead,
           coalesce(@extschema@.inbox__interval_seconds(q.oldest_ready_age), 0),
           CASE WHEN q.records_leases
                THEN coalesce(@extschema@.inbox__interval_seconds(q.oldest_lease_age), 0) END,
           @extschema@.inbox_paused_since(q.queue) IS NOT NULL
      FROM @extschema@.inbox__every_queue() q
$function$;

-- inbox_jobs's body: PL/pgSQL cannot name an argument and a result column both `state`.
-- Installed by an earlier version: without the column progress.
DROP FUNCTION IF EXISTS inbox_jobs(regclass, text, int);
DROP FUNCTION IF EXISTS inbox__jobs(regclass, text, int);
CREATE OR REPLACE FUNCTION inbox__jobs(queue regclass, wanted text, max int)
RETURNS TABLE (id bigint, state text, attempt int, due timestamptz, last_error text,
               payload jsonb, payload_bytes bytea, progress jsonb)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    shape @extschema@.inbox__queue_shape;
    states record;
    filter text;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    IF wanted IS NOT NULL AND wanted NOT IN ('ready', 'delayed', 'leased', 'dead') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('unknown job state "%s": expected ready, delayed, leased or dead',
                             wanted);
    END IF;
    IF @extschema@.inbox__required(max, 'max') < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'max must be at least 1';
    END IF;
    shape := @extschema@.inbox__queue_shape(queue);
    states := @extschema@.inbox__observed_states(shape, '$1');
    filter := CASE wanted WHEN 'ready' THEN states.ready WHEN 'delayed' THEN states.delayed
                         WHEN 'leased' THEN states.leased WHEN 'dead' THEN states.dead
                         ELSE 'true' END;
    RETURN QUERY EXECUTE format(
        'SELECT id::int8, CASE WHEN %s THEN ''dead'' WHEN %s THEN ''ready'' '
        '                      WHEN %s THEN ''leased'' ELSE ''delayed'' END, '
        '       attempt::int4, locked_until, %s, %s, '
        '       NULLIF(pg_catalog.to_jsonb(q) OPERATOR(pg_catalog.->) ''progress'', '
        '                         ''null''::pg_catalog.jsonb) '
        '  FROM %s AS q WHERE %s ORDER BY locked_until%s, id LIMIT $2',
        states.dead, states.ready, states.leased,
        CASE WHEN shape.has_last_error THEN 'last_error::text' ELSE 'NULL::text' END,
        CASE shape.payload WHEN 'bytea' THEN 'NULL::jsonb, payload' ELSE 'payload, NULL::bytea' END,
        shape.table_sql, filter,
        CASE WHEN shape.nullable_locked_until THEN ' NULLS FIRST' ELSE '' END)
      USING clock_timestamp(), max::bigint;
END
$function$;

CREATE OR REPLACE FUNCTION inbox_jobs(queue regclass, state text DEFAULT NULL, max int DEFAULT 100)
RETURNS TABLE (id bigint, state text, attempt int, due timestamptz, last_error text,
               payload jsonb, payload_bytes bytea, progress jsonb)
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
    SELECT * FROM @extschema@.inbox__jobs(queue, state, max)
$function$;
