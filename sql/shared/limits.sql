-- Concurrency and rate limits (docs/sql-api.md, "Limits"), written once for both builds: the
-- leases and locks of a queue that has a limit run inbox__take_limited, or in the pgrx build, for
-- a queue without a limit per key, the statements of inbox__limit_statements around its own take
-- (controls.rs; it and the SQL-only build's inbox__take tell from inbox_queue_controls which
-- queues have limits), so that a queue without limits pays nothing for them.
--
-- A limit is a set of slots, rows of inbox_queue_slots, and a take gives each job it hands out
-- one slot of every limit of its queue. It picks free slots with FOR UPDATE SKIP LOCKED in its
-- own transaction, so takes of one queue never wait on each other and never hand out more than
-- the slots allow; with no ticker and no leader:
-- - a concurrency slot names the job it was last given (job, token). It is busy while that job
--   still holds its lease (the attempt is the token, leased_at is set and locked_until is ahead
--   of the clock), and free once the job is settled (acked, retried, dead, cancelled) or its
--   lease has expired; inbox_extend refuses a lease that has expired, so a slot once free stays
--   free. A slot taken by inbox_lock names a token no row carries: it is busy exactly as long as
--   its row lock, which the locking transaction holds until it ends.
-- - a rate slot holds when it was last given. It is free once `per` has passed since then, so no
--   window of length `per` holds more than `n` starts (a start is a lease or lock, on the
--   server's clock). A lock that rolls back gives its start back.
-- - a key's concurrency slot is a concurrency slot of one key (the value of the payload's field
--   per_key), made when a take first needs it; free ones may be deleted at any time (see
--   inbox__take_limited). A take serves the keys that have due jobs and a free slot least
--   recently served first, one job per key in turn, so no key waits behind another's backlog.
-- Setting a limit gives the jobs already leased slots of it, and lowering one keeps the busy
-- slots above the new limit (they retire once free): while any of them is busy, nothing starts
-- (of that key), so the new limit holds from the change on.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

CREATE TABLE IF NOT EXISTS inbox_queue_slots (
    queue pg_catalog.regclass NOT NULL,
    -- 'c' a concurrency slot, 'r' a rate slot, 'k' a key's concurrency slot.
    kind "char" NOT NULL CHECK (kind OPERATOR(pg_catalog.=) ANY (ARRAY['c', 'r', 'k']::"char"[])),
    -- The limit's key: '' for the whole queue; the key's value for 'k'.
    key pg_catalog.text NOT NULL DEFAULT '',
    slot pg_catalog.int4 NOT NULL,
    -- The job a concurrency slot was last given, and the token it was given with.
    job pg_catalog.int8,
    token pg_catalog.int8,
    -- When the slot was last given.
    started_at pg_catalog.timestamptz,
    PRIMARY KEY (queue, kind, key, slot)
);
COMMENT ON TABLE inbox_queue_slots IS
    'The slots of the queues'' concurrency and rate limits (inbox_set_concurrency, inbox_set_rate_limit).';
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_queue_slots TO PUBLIC;
ALTER TABLE inbox_queue_slots ENABLE ROW LEVEL SECURITY;
DO $policies$
DECLARE
    policy pg_catalog.text;
BEGIN
    FOREACH policy IN ARRAY ARRAY['inbox_queue_slots_read', 'inbox_queue_slots_add',
                                  'inbox_queue_slots_change', 'inbox_queue_slots_remove'] LOOP
        IF EXISTS (SELECT FROM pg_catalog.pg_policy
                    WHERE polrelid = 'inbox_queue_slots'::pg_catalog.regclass AND polname = policy) THEN
            EXECUTE pg_catalog.format('DROP POLICY %I ON inbox_queue_slots', policy);
        END IF;
    END LOOP;
END
$policies$;
-- As the controls: anyone who may read the queue sees its slots; a role that may update the
-- queue (as every lease does) takes them, and sets the limits.
CREATE POLICY inbox_queue_slots_read ON inbox_queue_slots FOR SELECT
    USING (pg_catalog.has_table_privilege(queue, 'SELECT')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));
CREATE POLICY inbox_queue_slots_add ON inbox_queue_slots FOR INSERT
    WITH CHECK (pg_catalog.has_table_privilege(queue, 'UPDATE'));
CREATE POLICY inbox_queue_slots_change ON inbox_queue_slots FOR UPDATE
    USING (pg_catalog.has_table_privilege(queue, 'UPDATE'));
CREATE POLICY inbox_queue_slots_remove ON inbox_queue_slots FOR DELETE
    USING (pg_catalog.has_table_privilege(queue, 'UPDATE')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));

-- The condition under which concurrency slot `s` of the queue `q` is busy, $3 the clock: its
-- job still holds the lease it was given with.
CREATE OR REPLACE FUNCTION inbox__slot_busy(queue pg_catalog.regclass, s pg_catalog.text)
RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.format(
    'EXISTS (SELECT FROM %1$s q WHERE q.id OPERATOR(pg_catalog.=) %2$s.job '
    '   AND q.attempt OPERATOR(pg_catalog.=) %2$s.token AND q.leased_at IS NOT NULL '
    '   AND q.locked_until OPERATOR(pg_catalog.>) $3 '
    '   AND q.locked_until OPERATOR(pg_catalog.<) ''infinity''::pg_catalog.timestamptz)',
    queue, s);

-- Raises 22004 for NULL, 42703 unless `queue` is a queue that records its leases (leased_at),
-- which a concurrency slot reads.
CREATE OR REPLACE FUNCTION inbox__check_limited_queue(queue pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__citus_check_local(queue, 'limits');
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = queue AND a.attname = 'leased_at'
                      AND a.atttypid = 'pg_catalog.timestamptz'::pg_catalog.regtype
                      AND a.attnum > 0 AND NOT a.attisdropped) THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('%s cannot have limits: it has no column "leased_at"', queue),
            HINT = 'Add it: ALTER TABLE ... ADD COLUMN leased_at timestamptz.';
    END IF;
END
$$;

-- The SQL of a limit per key on `queue`, keyed by the payload's field `per_key`:
-- - key: a job's key ('' for a payload without the field);
-- - due: that a job is due at $2 (and neither dead nor waiting for its group's turn);
-- - rank: the queue's order among one key's jobs;
-- - index: the index that finds the keys that have due jobs, and each key's in that order.
CREATE OR REPLACE FUNCTION inbox__key_sql(queue pg_catalog.regclass, per_key pg_catalog.text,
                                          OUT key pg_catalog.text, OUT due pg_catalog.text,
                                          OUT rank pg_catalog.text, OUT index pg_catalog.text)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    finite constant pg_catalog.text := 'locked_until OPERATOR(pg_catalog.<) ''infinity''::pg_catalog.timestamptz';
    nullable pg_catalog.bool;
BEGIN
    key := pg_catalog.format('COALESCE(payload OPERATOR(pg_catalog.->>) %L::pg_catalog.text, '''')', per_key);
    SELECT NOT a.attnotnull INTO nullable FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = queue AND a.attname = 'locked_until' AND a.attnum > 0 AND NOT a.attisdropped;
    rank := CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_attribute a
                               WHERE a.attrelid = queue AND a.attname = 'priority'
                                 AND a.attnum > 0 AND NOT a.attisdropped)
                 THEN '(OPERATOR(pg_catalog.-) priority::pg_catalog.int8), ' ELSE '' END
            || 'locked_until, id';
    index := pg_catalog.format('CREATE INDEX %I ON %s ((%s), %s)',
                               'inbox_key_' || queue::pg_catalog.oid, queue, key, rank);
    IF nullable THEN
        due := pg_catalog.format('(locked_until IS NULL OR (locked_until OPERATOR(pg_catalog.<=) $2 AND %s))', finite);
    ELSE
        due := pg_catalog.format('locked_until OPERATOR(pg_catalog.<=) $2 AND %s', finite);
        index := index || ' WHERE ' || finite;
    END IF;
END
$$;

-- Sets how many jobs of `queue` may run at once, across all its workers (NULL: no limit), from
-- the commit of the caller's transaction on; with `per_key`, how many of one key, the key being
-- the payload's field of that name (one field per queue: another replaces it). Waits for the
-- transactions that hold its slots (inbox_lock) to end; a limit per key makes an index on the
-- queue (which needs its owner, and waits for its writers) and drops it when it goes.
DROP FUNCTION IF EXISTS inbox_set_concurrency(pg_catalog.regclass, pg_catalog.int4);
CREATE OR REPLACE FUNCTION inbox_set_concurrency(queue pg_catalog.regclass, n pg_catalog.int4,
                                                 per_key pg_catalog.text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    slot_kind constant "char" := CASE WHEN per_key IS NULL THEN 'c' ELSE 'k' END;
    field pg_catalog.text;
    index pg_catalog.text;
BEGIN
    PERFORM @extschema@.inbox__check_limited_queue(queue);
    IF n < 1 OR n > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('the concurrency limit must be from 1 to 10000, not %s', n),
            HINT = 'NULL removes the limit.';
    END IF;
    IF per_key = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'per_key must name a field of the payload';
    ELSIF per_key IS NOT NULL AND NOT EXISTS (
            SELECT FROM pg_catalog.pg_attribute a
             WHERE a.attrelid = queue AND a.attname = 'payload'
               AND a.atttypid = 'pg_catalog.jsonb'::pg_catalog.regtype
               AND a.attnum > 0 AND NOT a.attisdropped) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = pg_catalog.format('%s cannot be limited per key: its payloads are not jsonb', queue);
    END IF;
    PERFORM @extschema@.inbox__drop_orphan_controls();
    -- From here on the slots' state is their committed one.
    PERFORM FROM @extschema@.inbox_queue_slots s
      WHERE s.queue OPERATOR(pg_catalog.=) inbox_set_concurrency.queue AND s.kind = slot_kind
        FOR UPDATE;
    IF per_key IS NULL THEN
        INSERT INTO @extschema@.inbox_queue_controls AS c (queue, concurrency) VALUES (queue, n)
            ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
            DO UPDATE SET concurrency = excluded.concurrency;
        INSERT INTO @extschema@.inbox_queue_slots (queue, kind, slot)
        SELECT queue, 'c', g FROM pg_catalog.generate_series(1, coalesce(n, 0)) AS g
            ON CONFLICT DO NOTHING;
    ELSE
        SELECT c.per_key INTO field FROM @extschema@.inbox_queue_controls c
         WHERE c.queue OPERATOR(pg_catalog.=) inbox_set_concurrency.queue FOR UPDATE;
        IF field IS DISTINCT FROM per_key OR n IS NULL THEN
            -- Jobs that run under a limit of another field are not counted under this one.
            DELETE FROM @extschema@.inbox_queue_slots s
             WHERE s.queue OPERATOR(pg_catalog.=) inbox_set_concurrency.queue AND s.kind = 'k';
            SELECT pg_catalog.format('%I.%I', nsp.nspname, i.relname) INTO index
              FROM pg_catalog.pg_index x
              JOIN pg_catalog.pg_class i ON i.oid OPERATOR(pg_catalog.=) x.indexrelid
              JOIN pg_catalog.pg_namespace nsp ON nsp.oid OPERATOR(pg_catalog.=) i.relnamespace
             WHERE x.indrelid OPERATOR(pg_catalog.=) queue::pg_catalog.oid
               AND i.relname OPERATOR(pg_catalog.=) ('inbox_key_' OPERATOR(pg_catalog.||) queue::pg_catalog.oid);
            IF index IS NOT NULL THEN
                EXECUTE 'DROP INDEX ' OPERATOR(pg_catalog.||) index;
            END IF;
            IF n IS NOT NULL THEN
                EXECUTE (@extschema@.inbox__key_sql(queue, per_key)).index;
            END IF;
        END IF;
        INSERT INTO @extschema@.inbox_queue_controls AS c (queue, key_concurrency, per_key)
        VALUES (queue, n, CASE WHEN n IS NOT NULL THEN per_key END)
            ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
            DO UPDATE SET key_concurrency = excluded.key_concurrency, per_key = excluded.per_key;
    END IF;
    -- The jobs running now (their leases) count from the start: each that no busy slot names yet
    -- is given its key's lowest slot that is not busy, up to the limit and past it (those slots
    -- retire once free, as below), so that a limit set under load is not exceeded by the jobs
    -- started before it. A slot that a take made and gave meanwhile stays its own.
    IF n IS NOT NULL THEN
        EXECUTE pg_catalog.format(
            'WITH running AS ( '
            '  SELECT q.id, q.attempt, %2$s AS key, '
            '         pg_catalog.row_number() OVER (PARTITION BY %2$s ORDER BY q.id) AS nth '
            '    FROM %1$s q '
            '   WHERE q.leased_at IS NOT NULL AND q.locked_until OPERATOR(pg_catalog.>) $3 '
            '     AND q.locked_until OPERATOR(pg_catalog.<) ''infinity''::pg_catalog.timestamptz '
            '     AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots s '
            '                      WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind OPERATOR(pg_catalog.=) $4 '
            '                        AND s.job OPERATOR(pg_catalog.=) q.id '
            '                        AND s.token OPERATOR(pg_catalog.=) q.attempt)), '
            'numbers AS ( '
            '  SELECT r.key, g AS slot, pg_catalog.row_number() OVER (PARTITION BY r.key ORDER BY g) AS nth '
            '    FROM (SELECT running.key, pg_catalog.count(*)::pg_catalog.int4 AS jobs '
            '            FROM running GROUP BY running.key) AS r, '
            '         pg_catalog.generate_series(1, r.jobs OPERATOR(pg_catalog.+) coalesce( '
            '             (SELECT pg_catalog.max(s.slot) FROM @extschema@.inbox_queue_slots s '
            '               WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind OPERATOR(pg_catalog.=) $4 '
            '                 AND s.key OPERATOR(pg_catalog.=) r.key), 0)) AS g '
            '   WHERE NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots s '
            '                      WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind OPERATOR(pg_catalog.=) $4 '
            '                        AND s.key OPERATOR(pg_catalog.=) r.key AND s.slot OPERATOR(pg_catalog.=) g '
            '                        AND %3$s)) '
            'INSERT INTO @extschema@.inbox_queue_slots AS t (queue, kind, key, slot, job, token, started_at) '
            'SELECT $1, $4, running.key, numbers.slot, running.id, running.attempt, $3 '
            '  FROM running JOIN numbers ON numbers.key OPERATOR(pg_catalog.=) running.key '
            '                           AND numbers.nth OPERATOR(pg_catalog.=) running.nth '
            '    ON CONFLICT ON CONSTRAINT inbox_queue_slots_pkey DO UPDATE '
            '   SET job = excluded.job, token = excluded.token, started_at = excluded.started_at '
            ' WHERE NOT %4$s',
            queue,
            CASE WHEN per_key IS NULL THEN '''''::pg_catalog.text'
                 ELSE (@extschema@.inbox__key_sql(queue, per_key)).key END,
            @extschema@.inbox__slot_busy(queue, 's'),
            @extschema@.inbox__slot_busy(queue, 't'))
          USING queue, n, pg_catalog.clock_timestamp(), slot_kind;
    END IF;
    -- The free slots above the limit go; the busy ones retire (see the head of this file).
    EXECUTE pg_catalog.format(
        'DELETE FROM @extschema@.inbox_queue_slots s WHERE s.queue OPERATOR(pg_catalog.=) $1 '
        '   AND s.kind = $4 AND s.slot OPERATOR(pg_catalog.>) $2 AND ($2 OPERATOR(pg_catalog.=) 0 OR NOT %s)',
        @extschema@.inbox__slot_busy(queue, 's'))
      USING queue, coalesce(n, 0), pg_catalog.clock_timestamp(), slot_kind;
    -- Workers asleep on a full queue look again.
    PERFORM @extschema@.inbox_notify(queue);
END
$$;
COMMENT ON FUNCTION inbox_set_concurrency(pg_catalog.regclass, pg_catalog.int4, pg_catalog.text) IS
    'Sets how many jobs of the queue may run at once across all workers, or with per_key how many of one key (NULL: no limit).';

-- Sets how many jobs of `queue` may start in any window of length `per` (NULL n: no limit).
CREATE OR REPLACE FUNCTION inbox_set_rate_limit(queue pg_catalog.regclass, n pg_catalog.int4,
                                                per pg_catalog.interval DEFAULT '1 second')
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_limited_queue(queue);
    IF n < 1 OR n > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('the rate limit must be from 1 to 10000 starts, not %s', n),
            HINT = 'NULL removes the limit.';
    END IF;
    IF n IS NOT NULL AND (per IS NULL OR per OPERATOR(pg_catalog.<=) '0'::pg_catalog.interval
                          OR NOT pg_catalog.isfinite(per)
                          OR per OPERATOR(pg_catalog.>) '1 day'::pg_catalog.interval) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('per must be positive and at most 1 day, not %s', coalesce(per::pg_catalog.text, 'NULL'));
    END IF;
    PERFORM @extschema@.inbox__drop_orphan_controls();
    PERFORM FROM @extschema@.inbox_queue_slots s
      WHERE s.queue OPERATOR(pg_catalog.=) inbox_set_rate_limit.queue AND s.kind = 'r'
        FOR UPDATE;
    INSERT INTO @extschema@.inbox_queue_controls AS c (queue, rate_limit, rate_period)
    VALUES (queue, n, CASE WHEN n IS NOT NULL THEN per END)
        ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
        DO UPDATE SET rate_limit = excluded.rate_limit, rate_period = excluded.rate_period;
    INSERT INTO @extschema@.inbox_queue_slots (queue, kind, slot)
    SELECT queue, 'r', g FROM pg_catalog.generate_series(1, coalesce(n, 0)) AS g
        ON CONFLICT DO NOTHING;
    -- Slots above the limit that started within the new window retire; the others go.
    DELETE FROM @extschema@.inbox_queue_slots s
     WHERE s.queue OPERATOR(pg_catalog.=) inbox_set_rate_limit.queue AND s.kind = 'r'
       AND s.slot OPERATOR(pg_catalog.>) coalesce(n, 0)
       AND (n IS NULL OR s.started_at IS NULL
            OR s.started_at OPERATOR(pg_catalog.<=) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) per));
    PERFORM @extschema@.inbox_notify(queue);
END
$$;
COMMENT ON FUNCTION inbox_set_rate_limit(pg_catalog.regclass, pg_catalog.int4, pg_catalog.interval) IS
    'Sets how many jobs of the queue may start in any window of length per (NULL n: no limit).';

-- The limits of `queue` and how much of them is in use now.
DROP FUNCTION IF EXISTS inbox_limits(pg_catalog.regclass);
CREATE OR REPLACE FUNCTION inbox_limits(queue pg_catalog.regclass)
RETURNS TABLE(concurrency pg_catalog.int4, running pg_catalog.int8, rate_limit pg_catalog.int4,
              rate_period pg_catalog.interval, recent_starts pg_catalog.int8,
              key_concurrency pg_catalog.int4, per_key pg_catalog.text,
              keys_running pg_catalog.int8, most_running_per_key pg_catalog.int8)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    at constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    SELECT c.concurrency, c.rate_limit, c.rate_period, c.key_concurrency, c.per_key
      INTO concurrency, rate_limit, rate_period, key_concurrency, per_key
      FROM @extschema@.inbox_queue_controls c WHERE c.queue OPERATOR(pg_catalog.=) inbox_limits.queue;
    IF concurrency IS NOT NULL THEN
        -- Leases only: a slot held by an inbox_lock transaction shows as free until it ends.
        EXECUTE pg_catalog.format(
            'SELECT pg_catalog.count(*) FROM @extschema@.inbox_queue_slots s '
            ' WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''c'' AND s.key = '''' AND %s',
            @extschema@.inbox__slot_busy(queue, 's'))
          INTO running USING queue, concurrency, at;
    END IF;
    IF rate_limit IS NOT NULL THEN
        SELECT pg_catalog.count(*) INTO recent_starts FROM @extschema@.inbox_queue_slots s
         WHERE s.queue OPERATOR(pg_catalog.=) inbox_limits.queue AND s.kind = 'r' AND s.key = ''
           AND s.started_at OPERATOR(pg_catalog.>) (at OPERATOR(pg_catalog.-) rate_period);
    END IF;
    IF key_concurrency IS NOT NULL THEN
        -- As above, leases only.
        EXECUTE pg_catalog.format(
            'SELECT pg_catalog.count(*), coalesce(pg_catalog.max(per.n), 0) FROM ( '
            '  SELECT pg_catalog.count(*) AS n FROM @extschema@.inbox_queue_slots s '
            '   WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''k'' AND %s GROUP BY s.key) AS per',
            @extschema@.inbox__slot_busy(queue, 's'))
          INTO keys_running, most_running_per_key USING queue, key_concurrency, at;
    END IF;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION inbox_limits(pg_catalog.regclass) IS
    'The queue''s limits, the jobs running under its concurrency limits and the starts within the window of its rate limit.';

-- The condition under which slot `s`, just locked by FOR UPDATE, is the version of it that the
-- locking statement's snapshot shows. When a take that gave the slot commits after that
-- snapshot was taken, the lock lands on the slot's new version and the statement judges it again
-- (READ COMMITTED's recheck), but by the old snapshot, in which the new holder's lease is not
-- visible: a slot that has just become busy would look free. Such a slot is passed over (the
-- new version, found by its address, is not in the snapshot); the next take, with a newer
-- snapshot, judges it rightly. (OFFSET 0 keeps the look a fetch by address.)
CREATE OR REPLACE FUNCTION inbox__slot_unchanged(s pg_catalog.text) RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.format(
    'EXISTS (SELECT FROM @extschema@.inbox_queue_slots v WHERE v.ctid OPERATOR(pg_catalog.=) %1$s.ctid OFFSET 0)',
    s);

DROP FUNCTION IF EXISTS inbox__free_slots(pg_catalog.regclass);
DROP FUNCTION IF EXISTS inbox__still_free(pg_catalog.regclass, "char", pg_catalog.text[],
                                          pg_catalog.int4[], pg_catalog.timestamptz);

-- The statements of a take from a queue whose limits are its own (a concurrency limit, a rate
-- limit), run by inbox__take_limited and, in the pgrx build, by the take itself (controls.rs):
-- - free_slots locks up to $2 free slots of the concurrency limit ($1 queue, $3 the clock) and
--   returns their rows' addresses (tid[]); none while a retiring slot is busy. In the index's
--   order from a slot of the session's own, wrapping round, so that the scan stops at the first
--   free ones: the busy slots it passes are at most the jobs running.
-- - free_starts does the same for the rate limit (the slots last given at least `per` ago),
--   from the slot whose turn it is by the clock.
-- - give_slots gives the slots locked (by address: the lock keeps a row where it is) to the jobs
--   taken: $1 the queue, $2 the slots, $3 the jobs and $4 their tokens (int8[], NULL for a rate
--   slot, which records its start only), stamped after the jobs' leases: the next start of a rate
--   slot is `per` after this one's.
-- Each statement reads the limits from inbox_queue_controls, once.
CREATE OR REPLACE FUNCTION inbox__limit_statements(queue pg_catalog.regclass,
                                                   OUT free_slots pg_catalog.text,
                                                   OUT free_starts pg_catalog.text,
                                                   OUT give_slots pg_catalog.text)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    own constant pg_catalog.text :=
        's.queue OPERATOR(pg_catalog.=) $1 AND s.kind OPERATOR(pg_catalog.=) %1$L::"char" '
        'AND s.key OPERATOR(pg_catalog.=) '''' ';
    retiring constant pg_catalog.text :=
        'NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r '
        '             WHERE r.queue OPERATOR(pg_catalog.=) $1 AND r.kind OPERATOR(pg_catalog.=) %1$L::"char" '
        '               AND r.key OPERATOR(pg_catalog.=) '''' AND r.slot OPERATOR(pg_catalog.>) %2$s AND %3$s) ';
    -- From slot %5$s up to the limit, then from the first: where the free slots likely are.
    lock constant pg_catalog.text :=
        'WITH limits AS MATERIALIZED ( '
        '  SELECT c.concurrency, c.rate_limit, c.rate_period FROM @extschema@.inbox_queue_controls c '
        '   WHERE c.queue OPERATOR(pg_catalog.=) $1) '
        'SELECT pg_catalog.array_agg(f.ctid) FROM ( '
        '  SELECT * FROM (SELECT s.ctid FROM @extschema@.inbox_queue_slots s '
        '                  WHERE %1$s AND s.slot OPERATOR(pg_catalog.>=) %5$s '
        '                    AND s.slot OPERATOR(pg_catalog.<=) %2$s AND %3$s AND %4$s '
        '                  ORDER BY s.slot LIMIT $2 FOR UPDATE OF s SKIP LOCKED) AS later '
        '  UNION ALL '
        '  SELECT * FROM (SELECT s.ctid FROM @extschema@.inbox_queue_slots s '
        '                  WHERE %1$s AND s.slot OPERATOR(pg_catalog.<) %5$s AND %3$s AND %4$s '
        '                  ORDER BY s.slot LIMIT $2 FOR UPDATE OF s SKIP LOCKED) AS earlier '
        '  LIMIT $2) AS f';
    -- The queue's limits, read once per statement (from `limits`, above).
    concurrency constant pg_catalog.text := '(SELECT l.concurrency FROM limits l)';
    rate constant pg_catalog.text := '(SELECT l.rate_limit FROM limits l)';
    period constant pg_catalog.text := '(SELECT l.rate_period FROM limits l)';
    since constant pg_catalog.text := '($3 OPERATOR(pg_catalog.-) ' OPERATOR(pg_catalog.||) period OPERATOR(pg_catalog.||) ')';
BEGIN
    free_slots := pg_catalog.format(lock,
        pg_catalog.format(own, 'c'), concurrency,
        'NOT ' OPERATOR(pg_catalog.||) @extschema@.inbox__slot_busy(queue, 's')
            OPERATOR(pg_catalog.||) ' AND ' OPERATOR(pg_catalog.||) @extschema@.inbox__slot_unchanged('s'),
        pg_catalog.format(retiring, 'c', concurrency, @extschema@.inbox__slot_busy(queue, 'r')),
        -- Each session its own first slot: concurrent takes do not all queue up at slot 1, and a
        -- session that settled a job finds the slot it gave back first.
        pg_catalog.format('(pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.%%) %s OPERATOR(pg_catalog.+) 1)',
                          concurrency));
    free_starts := pg_catalog.format(lock,
        pg_catalog.format(own, 'r'), rate,
        pg_catalog.format('(s.started_at IS NULL OR s.started_at OPERATOR(pg_catalog.<=) %s)', since),
        pg_catalog.format(retiring, 'r', rate,
                          pg_catalog.format('r.started_at OPERATOR(pg_catalog.>) %s', since)),
        -- The slot whose turn it would be if the starts came evenly, `per` / `n` apart: the
        -- slots after it were given longest ago, and the scan need not pass the window's starts.
        -- (In numeric up to the remainder: the turns since 1970 of 10,000 starts a microsecond
        -- would overflow a bigint.)
        pg_catalog.format(
            '((pg_catalog.floor(EXTRACT(epoch FROM $3) OPERATOR(pg_catalog.*) %1$s '
            '                   OPERATOR(pg_catalog./) EXTRACT(epoch FROM %2$s)) '
            '  OPERATOR(pg_catalog.%%) %1$s)::pg_catalog.int8 OPERATOR(pg_catalog.+) 1)',
            rate, period));
    give_slots :=
        'UPDATE @extschema@.inbox_queue_slots s '
        '   SET job = ($3)[pg_catalog.array_position($2, s.ctid)], '
        '       token = ($4)[pg_catalog.array_position($2, s.ctid)], '
        '       started_at = pg_catalog.clock_timestamp() '
        ' WHERE s.ctid OPERATOR(pg_catalog.=) ANY ($2) AND s.queue OPERATOR(pg_catalog.=) $1';
END
$$;

-- The turns of the keys of a queue limited per key: (key, turn, place) for each job a key may
-- start now, at most $5, the keys that have due jobs and fewer than $4 busy slots taking
-- turns, least recently served first ($1 queue, $2 and $3 the clock). The keys are found by a
-- loose scan of the key index (inbox__key_sql), one probe per key that has due jobs.
CREATE OR REPLACE FUNCTION inbox__key_turns(queue pg_catalog.regclass, per_key pg_catalog.text)
RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    sql record := @extschema@.inbox__key_sql(queue, per_key);
BEGIN
    RETURN pg_catalog.format(
        'WITH RECURSIVE keys(key) AS ( '
        '    (SELECT %1$s FROM %2$s WHERE %3$s ORDER BY 1 LIMIT 1) '
        '    UNION ALL '
        '    SELECT (SELECT %1$s FROM %2$s WHERE %1$s OPERATOR(pg_catalog.>) keys.key AND %3$s ORDER BY 1 LIMIT 1) '
        '      FROM keys WHERE keys.key IS NOT NULL), '
        'state AS ( '
        '    SELECT keys.key, used.last, used.busy FROM keys, LATERAL ( '
        '        SELECT pg_catalog.max(s.started_at) AS last, pg_catalog.count(*) FILTER (WHERE %4$s) AS busy '
        '          FROM @extschema@.inbox_queue_slots s '
        '         WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''k'' AND s.key OPERATOR(pg_catalog.=) keys.key) AS used '
        '     WHERE keys.key IS NOT NULL AND used.busy OPERATOR(pg_catalog.<) $4) '
        'SELECT state.key, turn, pg_catalog.row_number() OVER (ORDER BY turn, state.last NULLS FIRST, state.key) AS place '
        '  FROM state, pg_catalog.generate_series(1, LEAST($4 OPERATOR(pg_catalog.-) state.busy, $5)::pg_catalog.int4) AS turn '
        ' ORDER BY place LIMIT $5',
        sql.key, queue, sql.due, @extschema@.inbox__slot_busy(queue, 's'));
END
$$;

-- The lease (`lease` set) or lock (NULL) of a queue that has limits: as many due jobs as it
-- can give a slot of every limit, at most `max`. The pgrx build takes from a queue without a
-- limit per key itself, with the same statements (inbox__limit_statements).
DROP FUNCTION IF EXISTS inbox__take_limited(pg_catalog.regclass, pg_catalog.int4, pg_catalog.interval);
CREATE OR REPLACE FUNCTION inbox__take_limited(queue pg_catalog.regclass, max pg_catalog.int4,
                                               lease pg_catalog.interval)
RETURNS TABLE(id pg_catalog.int8, attempt pg_catalog.int4, token pg_catalog.int8,
              payload pg_catalog.jsonb, payload_bytes pg_catalog.bytea, timeout pg_catalog.interval)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp
-- Its statements keep to their generic plans, planned once per session:
-- each finds its rows by key, and the custom plans the plan cache kept choosing were planned
-- again at every take (a fifth of a take's time, measured).
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    at constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    limits record;
    statements record;
    -- The slots locked for the take (their rows' addresses).
    running pg_catalog.tid[];
    starts pg_catalog.tid[];
    n pg_catalog.int4 := max;
    jobs pg_catalog.int8[] := '{}';
    tokens pg_catalog.int8[] := '{}';
    given_jobs pg_catalog.int4;
    stamp pg_catalog.timestamptz;
    -- A limit per key: the keys' turns, the slots locked for them, the jobs chosen for those.
    sql record;
    turn_keys pg_catalog.text[];
    turn_wants pg_catalog.int4[];
    turn_key pg_catalog.text;
    turn_want pg_catalog.int4;
    key_slots pg_catalog.int4[];
    picked pg_catalog.int4[];
    want pg_catalog.int4;
    given record;
    slot_keys pg_catalog.text[] := '{}';
    slot_numbers pg_catalog.int4[] := '{}';
    keys pg_catalog.text[];
    wants pg_catalog.int4[];
    chosen pg_catalog.int8[];
    chosen_keys pg_catalog.text[];
    idle_keys pg_catalog.text[];
    idle_slots pg_catalog.int4[];
BEGIN
    SELECT c.concurrency, c.rate_limit, c.rate_period, c.key_concurrency, c.per_key INTO limits
      FROM @extschema@.inbox_queue_controls c WHERE c.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue;
    IF limits.concurrency IS NOT NULL OR limits.rate_limit IS NOT NULL THEN
        statements := @extschema@.inbox__limit_statements(queue);
    END IF;
    IF limits.concurrency IS NOT NULL THEN
        EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L)',
                @extschema@.inbox__prepared(statements.free_slots,
                    'pg_catalog.regclass, pg_catalog.int4, pg_catalog.timestamptz'),
                queue::pg_catalog.oid, n, at)
          INTO running;
        running := coalesce(running, '{}');
        n := LEAST(n, pg_catalog.cardinality(running));
    END IF;
    IF limits.rate_limit IS NOT NULL AND n OPERATOR(pg_catalog.>) 0 THEN
        EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L)',
                @extschema@.inbox__prepared(statements.free_starts,
                    'pg_catalog.regclass, pg_catalog.int4, pg_catalog.timestamptz'),
                queue::pg_catalog.oid, n, at)
          INTO starts;
        starts := coalesce(starts, '{}');
        n := LEAST(n, pg_catalog.cardinality(starts));
    END IF;
    IF limits.key_concurrency IS NOT NULL AND n OPERATOR(pg_catalog.>) 0 THEN
        sql := @extschema@.inbox__key_sql(queue, limits.per_key);
        -- The keys in turn, more turns than the take may start: another take may have locked
        -- the slots of the first ones (they all see the same order), and this one goes on to
        -- the next keys rather than come back empty.
        -- A key wants its turns among the first n places, and one if it has none there.
        EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L, %L, %L, %L)',
                @extschema@.inbox__prepared(
                    'SELECT pg_catalog.array_agg(t.key ORDER BY t.first), pg_catalog.array_agg(t.want ORDER BY t.first) '
                    '  FROM (SELECT t.key, pg_catalog.min(t.place) AS first, '
                    '               GREATEST(1, pg_catalog.count(*) FILTER (WHERE t.place OPERATOR(pg_catalog.<=) $6))::pg_catalog.int4 AS want '
                    '          FROM (' OPERATOR(pg_catalog.||) @extschema@.inbox__key_turns(queue, limits.per_key)
                           OPERATOR(pg_catalog.||) ') AS t GROUP BY t.key) AS t',
                    'pg_catalog.regclass, pg_catalog.timestamptz, pg_catalog.timestamptz, pg_catalog.int4, '
                    'pg_catalog.int4, pg_catalog.int4'),
                queue::pg_catalog.oid, at, at, limits.key_concurrency, n OPERATOR(pg_catalog.*) 4, n)
          INTO turn_keys, turn_wants;
        FOR i IN 1..coalesce(pg_catalog.cardinality(turn_keys), 0) LOOP
            turn_key := turn_keys[i];
            turn_want := turn_wants[i];
            EXIT WHEN pg_catalog.cardinality(slot_numbers) OPERATOR(pg_catalog.>=) n;
            EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L, %L, %L)',
                    @extschema@.inbox__prepared(pg_catalog.format(
                        'SELECT pg_catalog.array_agg(f.slot) FROM ( '
                        '  SELECT s.slot FROM @extschema@.inbox_queue_slots s '
                        '   WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''k'' AND s.key OPERATOR(pg_catalog.=) $2 '
                        '     AND s.slot OPERATOR(pg_catalog.<=) $4 AND NOT %s AND %s '
                        '   ORDER BY s.slot LIMIT $5 FOR UPDATE OF s SKIP LOCKED) AS f',
                        @extschema@.inbox__slot_busy(queue, 's'), @extschema@.inbox__slot_unchanged('s')),
                        'pg_catalog.regclass, pg_catalog.text, pg_catalog.timestamptz, pg_catalog.int4, '
                        'pg_catalog.int4'),
                    queue::pg_catalog.oid, turn_key, at, limits.key_concurrency,
                    LEAST(turn_want, n OPERATOR(pg_catalog.-) pg_catalog.cardinality(slot_numbers)))
              INTO key_slots;
            key_slots := coalesce(key_slots, '{}');
            want := LEAST(turn_want, n OPERATOR(pg_catalog.-) pg_catalog.cardinality(slot_numbers))
                    OPERATOR(pg_catalog.-) pg_catalog.cardinality(key_slots);
            -- A key gets its slots as it needs them: the numbers it lacks, free and this take's
            -- own until it commits. Two takes that make the same slot would wait on each other
            -- (an inbox_lock's until its transaction ends): the one that cannot have the key's
            -- advisory lock makes none this time.
            IF want OPERATOR(pg_catalog.>) 0 AND pg_catalog.pg_try_advisory_xact_lock(
                   (queue::pg_catalog.oid::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32)
                   OPERATOR(pg_catalog.|) (pg_catalog.hashtext(turn_key)::pg_catalog.int8
                                           OPERATOR(pg_catalog.&) 4294967295)) THEN
                WITH made AS (
                    INSERT INTO @extschema@.inbox_queue_slots (queue, kind, key, slot)
                    SELECT inbox__take_limited.queue, 'k', turn_key, g
                      FROM pg_catalog.generate_series(1, limits.key_concurrency) AS g
                     WHERE NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots e
                                        WHERE e.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue
                                          AND e.kind = 'k' AND e.key OPERATOR(pg_catalog.=) turn_key
                                          AND e.slot OPERATOR(pg_catalog.=) g)
                     LIMIT want
                        ON CONFLICT DO NOTHING
                    RETURNING slot)
                SELECT key_slots OPERATOR(pg_catalog.||) ARRAY(SELECT made.slot FROM made) INTO key_slots;
            END IF;
            IF pg_catalog.cardinality(key_slots) OPERATOR(pg_catalog.>) 0 THEN
                slot_keys := slot_keys OPERATOR(pg_catalog.||)
                             pg_catalog.array_fill(turn_key, ARRAY[pg_catalog.cardinality(key_slots)]);
                slot_numbers := slot_numbers OPERATOR(pg_catalog.||) key_slots;
            END IF;
        END LOOP;
        SELECT pg_catalog.array_agg(s.key), pg_catalog.array_agg(s.want) INTO keys, wants
          FROM (SELECT u.key, pg_catalog.count(*)::pg_catalog.int4 AS want
                  FROM pg_catalog.unnest(slot_keys) AS u(key) GROUP BY u.key) AS s;
        IF keys IS NOT NULL THEN
            -- Each key's first due jobs, as many as it has slots.
            EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L)',
                    @extschema@.inbox__prepared(pg_catalog.format(
                        'SELECT pg_catalog.array_agg(c.id), pg_catalog.array_agg(w.key) '
                        '  FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($3)) AS w(key, want), '
                        '       LATERAL (SELECT id FROM %s WHERE %s OPERATOR(pg_catalog.=) w.key AND %s '
                        '                 ORDER BY %s LIMIT w.want FOR UPDATE SKIP LOCKED) AS c',
                        queue, sql.key, sql.due, sql.rank),
                        'pg_catalog.text[], pg_catalog.timestamptz, pg_catalog.int4[]'),
                    keys, at, wants)
              INTO chosen, chosen_keys;
        END IF;
        n := LEAST(n, coalesce(pg_catalog.cardinality(chosen), 0));
        -- Now and then the free slots last given more than 10 minutes ago go, so that keys seen
        -- once leave no rows behind; a free slot is made again when its key next needs it, and
        -- its key then counts as never served, which it nearly is: the keys' turns (when each
        -- was last served) are kept for the last 10 minutes. Not the keys this take serves: the
        -- slots it made for them are free until it gives them below. Leases only: a lock would
        -- hold the deleted rows, which takes that make them wait on, for the whole of its
        -- transaction.
        IF lease IS NOT NULL AND pg_catalog.random() OPERATOR(pg_catalog.<) 0.02 THEN
            EXECUTE pg_catalog.format(
                'SELECT pg_catalog.array_agg(f.key), pg_catalog.array_agg(f.slot) FROM ( '
                '  SELECT s.key, s.slot FROM @extschema@.inbox_queue_slots s '
                '   WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''k'' '
                '     AND (s.started_at IS NULL OR s.started_at OPERATOR(pg_catalog.<) $2) AND NOT %s AND %s '
                '     AND NOT (s.key OPERATOR(pg_catalog.=) ANY ($4)) '
                '     FOR UPDATE OF s SKIP LOCKED) AS f',
                @extschema@.inbox__slot_busy(queue, 's'), @extschema@.inbox__slot_unchanged('s'))
              INTO idle_keys, idle_slots
              USING queue, at OPERATOR(pg_catalog.-) '10 minutes'::pg_catalog.interval, at, slot_keys;
            DELETE FROM @extschema@.inbox_queue_slots d
             USING ROWS FROM (pg_catalog.unnest(idle_keys), pg_catalog.unnest(idle_slots)) AS f(key, slot)
             WHERE d.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue AND d.kind = 'k'
               AND d.key OPERATOR(pg_catalog.=) f.key AND d.slot OPERATOR(pg_catalog.=) f.slot;
        END IF;
    END IF;
    IF n OPERATOR(pg_catalog.<) 1 THEN
        RETURN;
    END IF;
    FOR id, attempt, token, payload, payload_bytes, timeout IN
        SELECT t.id, t.attempt, t.token, t.payload, t.payload_bytes, t.timeout
          FROM @extschema@.inbox__take_unlimited(queue, n, lease, chosen) AS t
    LOOP
        jobs := jobs OPERATOR(pg_catalog.||) id;
        tokens := tokens OPERATOR(pg_catalog.||) token;
        RETURN NEXT;
    END LOOP;
    IF pg_catalog.cardinality(jobs) OPERATOR(pg_catalog.=) 0 THEN
        RETURN;
    END IF;
    given_jobs := pg_catalog.cardinality(jobs);
    IF running IS NOT NULL OR starts IS NOT NULL THEN
        -- The rate slots' jobs are NULL: past the end of the arrays.
        EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L, %L)',
                @extschema@.inbox__prepared(statements.give_slots,
                    'pg_catalog.regclass, pg_catalog.tid[], pg_catalog.int8[], pg_catalog.int8[]'),
                queue::pg_catalog.oid,
                coalesce(running[1:given_jobs], '{}') OPERATOR(pg_catalog.||) coalesce(starts[1:given_jobs], '{}'),
                CASE WHEN running IS NOT NULL THEN jobs END, CASE WHEN running IS NOT NULL THEN tokens END);
    END IF;
    -- The keys' slots are stamped after the jobs' leased_at too.
    stamp := pg_catalog.clock_timestamp();
    IF chosen IS NOT NULL THEN
        -- Each job taken gets one of the slots locked for its key.
        FOR given IN
            SELECT j.key, j.job, j.token, l.slot
              FROM (SELECT c.key, t.job, t.token,
                           pg_catalog.row_number() OVER (PARTITION BY c.key ORDER BY t.job) AS nth
                      FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(tokens)) AS t(job, token)
                      JOIN ROWS FROM (pg_catalog.unnest(chosen), pg_catalog.unnest(chosen_keys)) AS c(job, key)
                        ON c.job OPERATOR(pg_catalog.=) t.job) AS j
              JOIN (SELECT l.key, l.slot,
                           pg_catalog.row_number() OVER (PARTITION BY l.key ORDER BY l.slot) AS nth
                      FROM ROWS FROM (pg_catalog.unnest(slot_keys), pg_catalog.unnest(slot_numbers)) AS l(key, slot)) AS l
                ON l.key OPERATOR(pg_catalog.=) j.key AND l.nth OPERATOR(pg_catalog.=) j.nth
        LOOP
            UPDATE @extschema@.inbox_queue_slots s SET job = given.job, token = given.token, started_at = stamp
             WHERE s.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue AND s.kind = 'k'
               AND s.key OPERATOR(pg_catalog.=) given.key AND s.slot OPERATOR(pg_catalog.=) given.slot;
        END LOOP;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__take_limited(pg_catalog.regclass, pg_catalog.int4, pg_catalog.interval) IS
    'The lease or lock of a queue with limits: as many due jobs as it can give a slot of every limit.';

-- Whether a take of `queue` could start a job now as far as its limits go (inbox_sleep's
-- question: a worker sleeps rather than polls a queue whose limits are full). Reads without
-- locking: a slot another take has just locked may look free, and that worker looks once more.
CREATE OR REPLACE FUNCTION inbox__limits_allow(queue pg_catalog.regclass) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    at constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    limits record;
    free pg_catalog.bool;
BEGIN
    SELECT c.concurrency, c.rate_limit, c.rate_period, c.key_concurrency, c.per_key INTO limits
      FROM @extschema@.inbox_queue_controls c WHERE c.queue OPERATOR(pg_catalog.=) inbox__limits_allow.queue;
    IF limits.concurrency IS NOT NULL THEN
        EXECUTE pg_catalog.format(
            'SELECT EXISTS (SELECT FROM @extschema@.inbox_queue_slots s '
            '                WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''c'' AND s.key = '''' '
            '                  AND s.slot OPERATOR(pg_catalog.<=) $2 AND NOT %1$s) '
            '   AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r '
            '                    WHERE r.queue OPERATOR(pg_catalog.=) $1 AND r.kind = ''c'' AND r.key = '''' '
            '                      AND r.slot OPERATOR(pg_catalog.>) $2 AND %2$s)',
            @extschema@.inbox__slot_busy(queue, 's'), @extschema@.inbox__slot_busy(queue, 'r'))
          INTO free USING queue, limits.concurrency, at;
        IF NOT free THEN
            RETURN false;
        END IF;
    END IF;
    IF limits.rate_limit IS NOT NULL AND NOT (
           EXISTS (SELECT FROM @extschema@.inbox_queue_slots s
                    WHERE s.queue OPERATOR(pg_catalog.=) inbox__limits_allow.queue AND s.kind = 'r'
                      AND s.key = '' AND s.slot OPERATOR(pg_catalog.<=) limits.rate_limit
                      AND (s.started_at IS NULL
                           OR s.started_at OPERATOR(pg_catalog.<=) (at OPERATOR(pg_catalog.-) limits.rate_period)))
           AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r
                            WHERE r.queue OPERATOR(pg_catalog.=) inbox__limits_allow.queue AND r.kind = 'r'
                              AND r.key = '' AND r.slot OPERATOR(pg_catalog.>) limits.rate_limit
                              AND r.started_at OPERATOR(pg_catalog.>) (at OPERATOR(pg_catalog.-) limits.rate_period))) THEN
        RETURN false;
    END IF;
    IF limits.key_concurrency IS NOT NULL THEN
        -- Some key has a due job and a free slot.
        EXECUTE 'SELECT EXISTS (' OPERATOR(pg_catalog.||) @extschema@.inbox__key_turns(queue, limits.per_key)
                OPERATOR(pg_catalog.||) ')'
          INTO free USING queue, at, at, limits.key_concurrency, 1;
        RETURN free;
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox__limits_allow(pg_catalog.regclass) IS
    'Whether the queue''s limits would let a job start now.';
