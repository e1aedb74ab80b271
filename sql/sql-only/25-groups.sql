-- Ordered groups (groups.rs): the jobs of one group_key run one at a time, in enqueue order.
-- Enqueues into a group and promotions of its head hold the same transaction-scoped advisory
-- locks as the pgrx build: (queue, 0) shared, then (queue, hashtext(group_key) | 1); more than 64
-- groups at once take (queue, 0) exclusively instead.

-- Takes the locks of `groups` until the transaction ends. Every enqueue into a group and every
-- promotion takes them first, so this is also where a transaction that is not READ COMMITTED is
-- refused: after the lock, the pgrx build reads the group through the latest committed snapshot,
-- which SQL cannot take, and a REPEATABLE READ snapshot older than the last change of the group
-- would strand a job behind a head that is gone or start a second head.
CREATE OR REPLACE FUNCTION inbox__group_lock(queue regclass, groups text[]) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    k int4 := inbox__lock_key(queue);
    distinct_groups text[] := ARRAY(SELECT DISTINCT g FROM unnest(groups) AS g WHERE g IS NOT NULL);
    n int := cardinality(distinct_groups);
    isolation text := current_setting('transaction_isolation');
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    IF isolation <> 'read committed' THEN
        RAISE EXCEPTION USING ERRCODE = 'feature_not_supported',
            MESSAGE = format('ordered groups need READ COMMITTED in the SQL-only build; this '
                             'transaction is %s', upper(isolation)),
            HINT = 'Enqueue into groups and settle their jobs in READ COMMITTED transactions, '
                   'or use the pgrx build (CREATE EXTENSION inbox).';
    END IF;
    IF n = 1 THEN
        PERFORM pg_advisory_xact_lock_shared(k, 0), pg_advisory_xact_lock(k, hashtext(distinct_groups[1]) | 1);
    ELSIF n > 64 THEN
        PERFORM pg_advisory_xact_lock(k, 0);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(k, 0);
        PERFORM pg_advisory_xact_lock(k, h)
           FROM (SELECT DISTINCT hashtext(g) | 1 AS h FROM unnest(distinct_groups) AS g ORDER BY 1) AS locks;
    END IF;
END
$$;

-- The condition that alias's row is its group's head: in the group, not dead, not waiting.
CREATE OR REPLACE FUNCTION inbox__head_predicate(shape inbox__queue_shape, alias text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN format('%1$s.dead_at IS NULL AND %2$s', alias,
              CASE WHEN shape.nullable_locked_until
                   THEN format('(%1$s.locked_until IS NULL OR %1$s.locked_until < ''infinity'')', alias)
                   ELSE format('%1$s.locked_until < ''infinity''', alias) END);

-- Whether the group has a head or waiting jobs, so that a new job waits. Each statement of a
-- volatile function reads the latest committed state (under READ COMMITTED), after the lock.
CREATE OR REPLACE FUNCTION inbox__group_busy(shape inbox__queue_shape, group_key text) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    busy bool;
BEGIN
    EXECUTE format('EXECUTE %I(%L)',
        inbox__prepared(format(
            'SELECT EXISTS (SELECT FROM %1$s AS a WHERE a.group_key = $1 AND %2$s) '
            '    OR EXISTS (SELECT FROM %1$s AS w WHERE w.group_key = $1 AND w.dead_at IS NULL '
            '                                       AND w.locked_until = ''infinity'')',
            shape.table_sql, inbox__head_predicate(shape, 'a')), 'text'),
        group_key)
      INTO busy;
    RETURN coalesce(busy, false);
END
$$;

-- Each group without a head gets its oldest waiting job as head, due at its run_at or now.
CREATE OR REPLACE FUNCTION inbox__promote(shape inbox__queue_shape, groups text[]) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    EXECUTE format('EXECUTE %I(%L, %L)',
        inbox__prepared(format(
            'WITH promoted AS (UPDATE %1$s AS q SET locked_until = %2$s '
            ' WHERE q.id = ANY (ARRAY( '
            '       SELECT (SELECT w.id FROM %1$s AS w '
            '                WHERE w.group_key = g.key AND w.dead_at IS NULL '
            '                  AND w.locked_until = ''infinity'' '
            '                ORDER BY w.id LIMIT 1) '
            '         FROM unnest($1::text[]) AS g(key) '
            '        WHERE NOT EXISTS (SELECT FROM %1$s AS a WHERE a.group_key = g.key AND %3$s))) '
            '   AND q.locked_until = ''infinity'' AND q.dead_at IS NULL RETURNING 1) '
            'SELECT count(*) FROM promoted',
            shape.table_sql, CASE WHEN shape.has_run_at THEN 'GREATEST(q.run_at, $2)' ELSE '$2' END,
            inbox__head_predicate(shape, 'a')), 'text[], timestamptz'),
        groups, clock_timestamp());
END
$$;

-- inbox__promote for one group, the form a settlement runs.
CREATE OR REPLACE FUNCTION inbox__promote_one(shape inbox__queue_shape, group_key text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    EXECUTE format('EXECUTE %I(%L, %L)',
        inbox__prepared(format(
            'WITH promoted AS (UPDATE %1$s AS q SET locked_until = %2$s '
            ' WHERE q.id = (SELECT w.id FROM %1$s AS w '
            '                WHERE w.group_key = $1 AND w.dead_at IS NULL '
            '                  AND w.locked_until = ''infinity'' '
            '                ORDER BY w.id LIMIT 1) '
            '   AND q.locked_until = ''infinity'' AND q.dead_at IS NULL '
            '   AND NOT EXISTS (SELECT FROM %1$s AS a WHERE a.group_key = $1 AND %3$s) RETURNING 1) '
            'SELECT count(*) FROM promoted',
            shape.table_sql, CASE WHEN shape.has_run_at THEN 'GREATEST(q.run_at, $2)' ELSE '$2' END,
            inbox__head_predicate(shape, 'a')), 'text, timestamptz'),
        group_key, clock_timestamp());
END
$$;

-- After a settlement or requeue changed the heads of `groups`: locks them and promotes the next
-- job of those left without a head.
CREATE OR REPLACE FUNCTION inbox__groups_settled(queue regclass, shape inbox__queue_shape, groups text[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    distinct_groups text[] := ARRAY(SELECT DISTINCT g FROM unnest(groups) AS g WHERE g IS NOT NULL ORDER BY 1);
BEGIN
    IF cardinality(distinct_groups) = 0 THEN
        RETURN;
    END IF;
    PERFORM inbox__group_lock(queue, distinct_groups);
    IF cardinality(distinct_groups) = 1 THEN
        PERFORM inbox__promote_one(shape, distinct_groups[1]);
    ELSE
        PERFORM inbox__promote(shape, distinct_groups);
    END IF;
END
$$;

-- The same, reading the queue's shape: what the dead letters' requeues call (both builds have it).
CREATE OR REPLACE FUNCTION inbox__groups_settled(queue regclass, groups text[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM inbox__groups_settled(queue, inbox__queue_shape(queue), groups);
END
$$;
