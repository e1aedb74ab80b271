-- Browsing a queue as an operator does, on a queue of millions of jobs (docs/sql-api.md,
-- "Browsing jobs"), written once for both builds: pages of jobs by id under a filter, a count
-- that is exact up to a bound and the planner's estimate beyond it, one job in full, dead
-- letters grouped by their error with a requeue per group, a queue's activity from the
-- statistics views, the ordered groups blocked and their heads, the ledgers with their sizes,
-- and one action on every job a filter matches. `inbox ui` and the CLI call these; none of it is
-- on a job's path.
--
-- A filter is built as SQL text with its values quoted (pg_catalog.format's %L), because the
-- estimate is read from EXPLAIN, which takes no parameters. The states are those of inbox_stats:
-- a job waiting behind its group's head is delayed, a cancelled job is dead with last_error
-- 'cancelled'.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- Raises 42703 unless `queue` has column `name`, which a filter names.
CREATE OR REPLACE FUNCTION inbox__filter_column(queue pg_catalog.regclass, name pg_catalog.text) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT @extschema@.inbox__has_column(queue, name) THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('queue %s has no column "%s" to filter on', queue, name);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__filter_column(pg_catalog.regclass, pg_catalog.text) IS
    'Raises 42703 unless the queue has the column a filter names.';

-- The condition on a row of `queue` that keeps the jobs in `state` (NULL: all) with the given
-- priority, group and key (NULL: any), as of `now`. Raises 22023 for an unknown state, 42703
-- for a filter on a column the queue does not have.
CREATE OR REPLACE FUNCTION inbox__job_filter(queue pg_catalog.regclass, state pg_catalog.text,
                                             priority pg_catalog.int4, group_key pg_catalog.text,
                                             key pg_catalog.text, now pg_catalog.timestamptz)
RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    shape @extschema@.inbox__queue_shape;
    states record;
    conditions pg_catalog.text[] := ARRAY['true'];
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    IF state IS NOT NULL AND state NOT IN ('ready', 'delayed', 'leased', 'dead', 'cancelled') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('unknown job state "%s": expected ready, delayed, leased, dead or cancelled', state);
    END IF;
    -- The states as inbox_jobs and inbox_queues tell them apart (observe.sql).
    shape := @extschema@.inbox__queue_shape(queue);
    states := @extschema@.inbox__observed_states(shape, pg_catalog.format('%L::pg_catalog.timestamptz', now));
    conditions := conditions OPERATOR(pg_catalog.||) CASE state
        WHEN 'ready' THEN states.ready
        WHEN 'delayed' THEN states.delayed
        WHEN 'leased' THEN states.leased
        WHEN 'dead' THEN states.dead
        WHEN 'cancelled' THEN CASE WHEN shape.has_last_error
                                   THEN pg_catalog.format('(%s AND last_error = ''cancelled'')', states.dead) ELSE 'false' END
        ELSE 'true' END;
    IF priority IS NOT NULL THEN
        PERFORM @extschema@.inbox__filter_column(queue, 'priority');
        conditions := conditions OPERATOR(pg_catalog.||) pg_catalog.format('priority = %L::pg_catalog.int4', priority);
    END IF;
    IF group_key IS NOT NULL THEN
        PERFORM @extschema@.inbox__filter_column(queue, 'group_key');
        conditions := conditions OPERATOR(pg_catalog.||) pg_catalog.format('group_key = %L', group_key);
    END IF;
    IF key IS NOT NULL THEN
        PERFORM @extschema@.inbox__filter_column(queue, 'key');
        conditions := conditions OPERATOR(pg_catalog.||) pg_catalog.format('key = %L', key);
    END IF;
    RETURN pg_catalog.array_to_string(conditions, ' AND ');
END
$$;
COMMENT ON FUNCTION inbox__job_filter(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4, pg_catalog.text,
                                      pg_catalog.text, pg_catalog.timestamptz) IS
    'The SQL condition that keeps a queue''s jobs in a state with a priority, group and key.';

-- The SQL of one of `queue`'s columns, or `otherwise` where the table does not have it.
CREATE OR REPLACE FUNCTION inbox__column_or(queue pg_catalog.regclass, name pg_catalog.text,
                                            otherwise pg_catalog.text)
RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN CASE WHEN @extschema@.inbox__has_column(queue, name) THEN pg_catalog.quote_ident(name) ELSE otherwise END;
END
$$;
COMMENT ON FUNCTION inbox__column_or(pg_catalog.regclass, pg_catalog.text, pg_catalog.text) IS
    'A column of the queue, or a stand-in where it has none.';

-- Up to `max` jobs of `queue` under the filter, newest first, with ids below `before` (NULL: from
-- the newest): a page is found through the primary key, whatever the queue's size. (The body of
-- inbox_job_page, whose parameters are named as its columns, which PL/pgSQL does not allow.)
CREATE OR REPLACE FUNCTION inbox__job_page(queue pg_catalog.regclass, wanted_state pg_catalog.text,
                                           wanted_priority pg_catalog.int4, wanted_group pg_catalog.text,
                                           wanted_key pg_catalog.text, before pg_catalog.int8,
                                           max pg_catalog.int4)
RETURNS TABLE(id pg_catalog.int8, state pg_catalog.text, attempt pg_catalog.int4, priority pg_catalog.int4,
              group_key pg_catalog.text, key pg_catalog.text, due pg_catalog.timestamptz,
              enqueued_at pg_catalog.timestamptz, leased_at pg_catalog.timestamptz,
              dead_at pg_catalog.timestamptz, last_error pg_catalog.text)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    now constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    filter pg_catalog.text;
BEGIN
    filter := @extschema@.inbox__job_filter(queue, wanted_state, wanted_priority, wanted_group, wanted_key, now);
    IF @extschema@.inbox__required(max, 'max') OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    IF before IS NOT NULL THEN
        filter := pg_catalog.format('%s AND id < %L::pg_catalog.int8', filter, before);
    END IF;
    RETURN QUERY EXECUTE pg_catalog.format(
        'SELECT id::pg_catalog.int8, '
        '       CASE WHEN %2$s THEN ''dead'' WHEN %3$s THEN ''ready'' WHEN %4$s THEN ''leased'' ELSE ''delayed'' END, '
        '       attempt::pg_catalog.int4, %5$s, %6$s, %7$s, locked_until, %8$s, %9$s, %10$s, %11$s '
        '  FROM %1$s WHERE %12$s ORDER BY id DESC LIMIT $1',
        queue,
        @extschema@.inbox__job_filter(queue, 'dead', NULL, NULL, NULL, now),
        @extschema@.inbox__job_filter(queue, 'ready', NULL, NULL, NULL, now),
        @extschema@.inbox__job_filter(queue, 'leased', NULL, NULL, NULL, now),
        @extschema@.inbox__column_or(queue, 'priority', '0') OPERATOR(pg_catalog.||) '::pg_catalog.int4',
        @extschema@.inbox__column_or(queue, 'group_key', 'NULL') OPERATOR(pg_catalog.||) '::pg_catalog.text',
        @extschema@.inbox__column_or(queue, 'key', 'NULL') OPERATOR(pg_catalog.||) '::pg_catalog.text',
        @extschema@.inbox__column_or(queue, 'enqueued_at', 'NULL::pg_catalog.timestamptz'),
        @extschema@.inbox__column_or(queue, 'leased_at', 'NULL::pg_catalog.timestamptz'),
        @extschema@.inbox__column_or(queue, 'dead_at', 'NULL::pg_catalog.timestamptz'),
        @extschema@.inbox__column_or(queue, 'last_error', 'NULL') OPERATOR(pg_catalog.||) '::pg_catalog.text',
        filter)
      USING max::pg_catalog.int8;
END
$$;
COMMENT ON FUNCTION inbox__job_page(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4, pg_catalog.text,
                                    pg_catalog.text, pg_catalog.int8, pg_catalog.int4) IS
    'The body of inbox_job_page.';

CREATE OR REPLACE FUNCTION inbox_job_page(queue pg_catalog.regclass, state pg_catalog.text DEFAULT NULL,
                                          priority pg_catalog.int4 DEFAULT NULL,
                                          group_key pg_catalog.text DEFAULT NULL,
                                          key pg_catalog.text DEFAULT NULL,
                                          before pg_catalog.int8 DEFAULT NULL,
                                          max pg_catalog.int4 DEFAULT 50)
RETURNS TABLE(id pg_catalog.int8, state pg_catalog.text, attempt pg_catalog.int4, priority pg_catalog.int4,
              group_key pg_catalog.text, key pg_catalog.text, due pg_catalog.timestamptz,
              enqueued_at pg_catalog.timestamptz, leased_at pg_catalog.timestamptz,
              dead_at pg_catalog.timestamptz, last_error pg_catalog.text)
LANGUAGE sql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT * FROM @extschema@.inbox__job_page(queue, state, priority, group_key, key, before, max);
END;
COMMENT ON FUNCTION inbox_job_page(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4, pg_catalog.text,
                                   pg_catalog.text, pg_catalog.int8, pg_catalog.int4) IS
    'A page of a queue''s jobs under a filter, newest first, below an id.';

-- How many jobs of `queue` the filter keeps: exact (`exact` true) while there are at most
-- `exact_up_to`, which costs at most that many rows read; beyond it the planner's estimate,
-- which reads none, so that a count never scans a big table.
CREATE OR REPLACE FUNCTION inbox_job_count(queue pg_catalog.regclass, state pg_catalog.text DEFAULT NULL,
                                           priority pg_catalog.int4 DEFAULT NULL,
                                           group_key pg_catalog.text DEFAULT NULL,
                                           key pg_catalog.text DEFAULT NULL,
                                           exact_up_to pg_catalog.int8 DEFAULT 10000)
RETURNS TABLE(jobs pg_catalog.int8, exact pg_catalog.bool)
-- Volatile only because PostgreSQL runs EXPLAIN in no other function; it writes nothing.
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    filter pg_catalog.text;
    counted pg_catalog.int8;
    plan pg_catalog.json;
BEGIN
    filter := @extschema@.inbox__job_filter(queue, state, priority, group_key, key, pg_catalog.clock_timestamp());
    IF @extschema@.inbox__required(exact_up_to, 'exact_up_to') OPERATOR(pg_catalog.<) 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'exact_up_to must not be negative';
    END IF;
    EXECUTE pg_catalog.format('SELECT pg_catalog.count(*) FROM (SELECT FROM %s WHERE %s LIMIT $1) AS kept',
                              queue, filter)
       INTO counted USING exact_up_to OPERATOR(pg_catalog.+) 1;
    IF counted OPERATOR(pg_catalog.<=) exact_up_to THEN
        RETURN QUERY SELECT counted, true;
        RETURN;
    END IF;
    EXECUTE pg_catalog.format('EXPLAIN (FORMAT JSON) SELECT FROM %s WHERE %s', queue, filter) INTO plan;
    -- More than exact_up_to were counted: an estimate below that is known to be low.
    RETURN QUERY SELECT GREATEST(((plan OPERATOR(pg_catalog.->) 0 OPERATOR(pg_catalog.->) 'Plan'
                                   OPERATOR(pg_catalog.->>) 'Plan Rows')::pg_catalog.float8)::pg_catalog.int8,
                                 exact_up_to OPERATOR(pg_catalog.+) 1),
                        false;
END
$$;
COMMENT ON FUNCTION inbox_job_count(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4, pg_catalog.text,
                                    pg_catalog.text, pg_catalog.int8) IS
    'How many of a queue''s jobs a filter keeps: exact up to a bound, the planner''s estimate beyond.';

-- Job `id` of `queue` in full: its state and its row as JSON (every column the table has:
-- payload, attempt, due time or lease expiry, lease start, group, key, last error, progress),
-- No row when the job is gone (inbox_result tells how it ended).
CREATE OR REPLACE FUNCTION inbox_job_detail(queue pg_catalog.regclass, id pg_catalog.int8)
RETURNS TABLE(state pg_catalog.text, job pg_catalog.jsonb)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    now constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__required(id, 'id');
    RETURN QUERY EXECUTE pg_catalog.format(
        'SELECT CASE WHEN %2$s THEN ''dead'' WHEN %3$s THEN ''ready'' WHEN %4$s THEN ''leased'' ELSE ''delayed'' END, '
        '       pg_catalog.to_jsonb(q) '
        '  FROM %1$s AS q WHERE id = $1',
        queue,
        @extschema@.inbox__job_filter(queue, 'dead', NULL, NULL, NULL, now),
        @extschema@.inbox__job_filter(queue, 'ready', NULL, NULL, NULL, now),
        @extschema@.inbox__job_filter(queue, 'leased', NULL, NULL, NULL, now))
      USING id;
END
$$;
COMMENT ON FUNCTION inbox_job_detail(pg_catalog.regclass, pg_catalog.int8) IS
    'A job in full: its state and its row as JSON.';

-- The dead jobs of `queue` grouped by their last error, the biggest groups first (at most `max`
-- groups), each with its first and last death and its newest job.
CREATE OR REPLACE FUNCTION inbox_dead_letter_groups(queue pg_catalog.regclass, max pg_catalog.int4 DEFAULT 20)
RETURNS TABLE(last_error pg_catalog.text, jobs pg_catalog.int8, first_dead_at pg_catalog.timestamptz,
              last_dead_at pg_catalog.timestamptz, newest_id pg_catalog.int8)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    dead_at pg_catalog.text;
BEGIN
    IF @extschema@.inbox__required(max, 'max') OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    dead_at := @extschema@.inbox__column_or(queue, 'dead_at', 'NULL::pg_catalog.timestamptz');
    RETURN QUERY EXECUTE pg_catalog.format(
        'SELECT %2$s, pg_catalog.count(*), pg_catalog.min(%3$s), pg_catalog.max(%3$s), pg_catalog.max(id)::pg_catalog.int8 '
        '  FROM %1$s WHERE %4$s GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT $1',
        queue, @extschema@.inbox__column_or(queue, 'last_error', 'NULL') OPERATOR(pg_catalog.||) '::pg_catalog.text',
        dead_at, @extschema@.inbox__job_filter(queue, 'dead', NULL, NULL, NULL, pg_catalog.clock_timestamp()))
      USING max::pg_catalog.int8;
END
$$;
COMMENT ON FUNCTION inbox_dead_letter_groups(pg_catalog.regclass, pg_catalog.int4) IS
    'A queue''s dead jobs grouped by their last error, the biggest groups first.';

-- Puts back the dead jobs of `queue` whose last error is `last_error` (NULL: those without one),
-- at most `max` of them (NULL: all), each as inbox_requeue does; how many.
CREATE OR REPLACE FUNCTION inbox_requeue_dead_with_error(queue pg_catalog.regclass, last_error pg_catalog.text,
                                                         max pg_catalog.int4 DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    dead pg_catalog.int8;
    requeued pg_catalog.int8 := 0;
BEGIN
    IF max OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1 (NULL: all)';
    END IF;
    IF NOT @extschema@.inbox__has_column(@extschema@.inbox__required(queue, 'queue'), 'last_error') THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('queue %s has no column "last_error"', queue);
    END IF;
    FOR dead IN EXECUTE pg_catalog.format(
        'SELECT id FROM %s WHERE %s AND last_error IS NOT DISTINCT FROM $1 ORDER BY id LIMIT $2',
        queue, @extschema@.inbox__job_filter(queue, 'dead', NULL, NULL, NULL, pg_catalog.clock_timestamp()))
      USING last_error, max::pg_catalog.int8
    LOOP
        IF @extschema@.inbox_requeue(queue, dead) THEN
            requeued := requeued OPERATOR(pg_catalog.+) 1;
        END IF;
    END LOOP;
    RETURN requeued;
END
$$;
COMMENT ON FUNCTION inbox_requeue_dead_with_error(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4) IS
    'Puts back the queue''s dead jobs that died of one error.';

-- What the statistics collector counted of `queue`'s rows since its counters were last reset:
-- `enqueued` rows inserted and `settled` rows deleted (acked or discarded), its partitions
-- included. The dashboard's charts take a rate from two readings; the counters lag the commits
-- (a busy session passes its counts on about every second, an idle one within ten).
CREATE OR REPLACE FUNCTION inbox_queue_activity(queue pg_catalog.regclass)
RETURNS TABLE(enqueued pg_catalog.int8, settled pg_catalog.int8)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    RETURN QUERY
        SELECT COALESCE(pg_catalog.sum(s.n_tup_ins), 0)::pg_catalog.int8,
               COALESCE(pg_catalog.sum(s.n_tup_del), 0)::pg_catalog.int8
          FROM pg_catalog.pg_stat_all_tables s
         WHERE s.relid OPERATOR(pg_catalog.=) queue::pg_catalog.oid
            -- A partitioned queue's rows are counted in its partitions.
            OR s.relid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT t.relid FROM pg_catalog.pg_partition_tree(queue) t));
END
$$;
COMMENT ON FUNCTION inbox_queue_activity(pg_catalog.regclass) IS
    'The rows inserted into and deleted from a queue since its statistics were reset.';

-- The ordered groups of `queue` that have jobs waiting for their turn, the longest queues first
-- (at most `max` groups), each with the head that holds them: its id, state, attempt, due time
-- or lease end, and last error. A head that is leased, retrying or slow is what a group waits on;
-- a group whose head is missing (its waiting jobs are promoted when a head settles) shows none.
CREATE OR REPLACE FUNCTION inbox_blocked_groups(queue pg_catalog.regclass, max pg_catalog.int4 DEFAULT 20)
RETURNS TABLE(group_key pg_catalog.text, waiting pg_catalog.int8, head_id pg_catalog.int8,
              head_state pg_catalog.text, head_attempt pg_catalog.int4, head_due pg_catalog.timestamptz,
              head_last_error pg_catalog.text)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    now constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__filter_column(queue, 'group_key');
    PERFORM @extschema@.inbox__filter_column(queue, 'dead_at');
    IF @extschema@.inbox__required(max, 'max') OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    RETURN QUERY EXECUTE pg_catalog.format(
        'WITH waiting AS ( '
        '    SELECT group_key, pg_catalog.count(*) AS waiting FROM %1$s '
        '     WHERE group_key IS NOT NULL AND dead_at IS NULL AND locked_until = ''infinity'' '
        '     GROUP BY group_key ORDER BY 2 DESC, 1 LIMIT $1) '
        'SELECT w.group_key::pg_catalog.text, w.waiting, h.id::pg_catalog.int8, '
        '       CASE WHEN h.id IS NULL THEN NULL WHEN %2$s THEN ''ready'' WHEN %3$s THEN ''leased'' '
        '            ELSE ''delayed'' END, '
        '       h.attempt::pg_catalog.int4, h.locked_until, h.last_error '
        '  FROM waiting AS w '
        '  LEFT JOIN LATERAL (SELECT id, attempt, locked_until, %4$s AS last_error, %5$s AS leased_at FROM %1$s AS q '
        '                      WHERE q.group_key = w.group_key AND q.dead_at IS NULL '
        '                        AND q.locked_until < ''infinity'' ORDER BY q.id LIMIT 1) AS h ON true '
        ' ORDER BY w.waiting DESC, w.group_key',
        queue,
        -- The states' conditions name the head's columns unqualified: only h has them.
        @extschema@.inbox__job_filter(queue, 'ready', NULL, NULL, NULL, now),
        @extschema@.inbox__job_filter(queue, 'leased', NULL, NULL, NULL, now),
        @extschema@.inbox__column_or(queue, 'last_error', 'NULL') OPERATOR(pg_catalog.||) '::pg_catalog.text',
        @extschema@.inbox__column_or(queue, 'leased_at', 'NULL::pg_catalog.timestamptz'))
      USING max::pg_catalog.int8;
END
$$;
COMMENT ON FUNCTION inbox_blocked_groups(pg_catalog.regclass, pg_catalog.int4) IS
    'A queue''s ordered groups with jobs waiting, and the head each waits on.';

-- Every ledger the caller may read: a table (not a partition) with the ledger's columns
-- `event_key` (text) and `seen_at` (timestamptz), with the keys its statistics estimate (NULL
-- before its first ANALYZE) and its size on disk, indexes included; partitions are summed.
CREATE OR REPLACE FUNCTION inbox_ledgers()
RETURNS TABLE(ledger pg_catalog.regclass, keys_estimate pg_catalog.int8, bytes pg_catalog.int8)
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT c.oid::pg_catalog.regclass,
           (SELECT CASE WHEN pg_catalog.bool_or(p.reltuples OPERATOR(pg_catalog.>=) 0)
                        THEN pg_catalog.sum(GREATEST(p.reltuples, 0))::pg_catalog.int8 END
              FROM pg_catalog.pg_class p
             WHERE p.oid OPERATOR(pg_catalog.=) c.oid AND c.relkind OPERATOR(pg_catalog.=) 'r'
                OR p.oid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT t.relid FROM pg_catalog.pg_partition_tree(c.oid) AS t
                                                            WHERE t.isleaf))),
           CASE WHEN c.relkind OPERATOR(pg_catalog.=) 'r' THEN pg_catalog.pg_total_relation_size(c.oid)
                ELSE (SELECT COALESCE(pg_catalog.sum(pg_catalog.pg_total_relation_size(t.relid)), 0)::pg_catalog.int8
                        FROM pg_catalog.pg_partition_tree(c.oid) AS t) END
      FROM pg_catalog.pg_class c
      JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
     WHERE c.relkind OPERATOR(pg_catalog.=) ANY (ARRAY['r', 'p']::pg_catalog.char[]) AND NOT c.relispartition
       AND n.nspname OPERATOR(pg_catalog.<>) ALL (ARRAY['pg_catalog', 'information_schema']::pg_catalog.name[])
       AND n.nspname::pg_catalog.text NOT LIKE 'pg\_%'
       AND EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid AND a.attname OPERATOR(pg_catalog.=) 'event_key'
                      AND NOT a.attisdropped
                      AND a.atttypid OPERATOR(pg_catalog.=) ANY (ARRAY['text', 'varchar']::pg_catalog.regtype[]))
       AND EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid AND a.attname OPERATOR(pg_catalog.=) 'seen_at'
                      AND NOT a.attisdropped
                      AND a.atttypid OPERATOR(pg_catalog.=) 'timestamptz'::pg_catalog.regtype)
       AND pg_catalog.has_table_privilege(c.oid, 'SELECT')
     ORDER BY n.nspname, c.relname;
END;
COMMENT ON FUNCTION inbox_ledgers() IS
    'Every ledger the caller may read, with its estimated keys and its size.';

-- Requeues, discards or cancels (`action`) the jobs of `queue` under the filter, the oldest
-- `max` first, each by the function of that name, in the caller's transaction; how many it did.
-- Requeue and discard act on dead jobs only, cancel on the others: a job that moved on meanwhile
-- is skipped, as the function of one job would skip it.
CREATE OR REPLACE FUNCTION inbox_act_on_matching(queue pg_catalog.regclass, action pg_catalog.text,
                                                 state pg_catalog.text DEFAULT NULL,
                                                 priority pg_catalog.int4 DEFAULT NULL,
                                                 group_key pg_catalog.text DEFAULT NULL,
                                                 key pg_catalog.text DEFAULT NULL,
                                                 max pg_catalog.int4 DEFAULT 1000)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    now constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    filter pg_catalog.text;
    job pg_catalog.int8;
    done pg_catalog.int8 := 0;
BEGIN
    filter := @extschema@.inbox__job_filter(queue, state, priority, group_key, key, now);
    IF action IS NULL OR action NOT IN ('requeue', 'discard', 'cancel') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('unknown action "%s": expected requeue, discard or cancel', action);
    END IF;
    IF @extschema@.inbox__required(max, 'max') OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    filter := pg_catalog.format(CASE WHEN action = 'cancel' THEN '%s AND NOT (%s)' ELSE '%s AND (%s)' END,
                                filter, @extschema@.inbox__job_filter(queue, 'dead', NULL, NULL, NULL, now));
    FOR job IN EXECUTE pg_catalog.format('SELECT id FROM %s WHERE %s ORDER BY id LIMIT $1', queue, filter)
      USING max::pg_catalog.int8
    LOOP
        IF (CASE action WHEN 'requeue' THEN @extschema@.inbox_requeue(queue, job)
                        WHEN 'discard' THEN @extschema@.inbox_discard(queue, job)
                        ELSE @extschema@.inbox_cancel(queue, job) END) THEN
            done := done OPERATOR(pg_catalog.+) 1;
        END IF;
    END LOOP;
    RETURN done;
END
$$;
COMMENT ON FUNCTION inbox_act_on_matching(pg_catalog.regclass, pg_catalog.text, pg_catalog.text, pg_catalog.int4,
                                          pg_catalog.text, pg_catalog.text, pg_catalog.int4) IS
    'Requeues, discards or cancels the jobs a filter matches, at most max of them.';
