-- Concurrency and rate limits (docs/sql-api.md, "Limits"), written once for both builds: the
-- leases and locks of a queue that has a limit run inbox__take_limited (the pgrx build's
-- controls.rs and the SQL-only build's inbox__take tell from inbox_queue_controls which queues
-- have one), so that a queue without limits pays nothing for them.
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
-- Lowering a limit keeps the busy slots above the new one (they retire once free): while any of
-- them is busy, nothing starts, so the new limit holds from the change on.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

CREATE TABLE IF NOT EXISTS inbox_queue_slots (
    queue pg_catalog.regclass NOT NULL,
    -- 'c' a concurrency slot, 'r' a rate slot.
    kind "char" NOT NULL CHECK (kind OPERATOR(pg_catalog.=) ANY (ARRAY['c', 'r']::"char"[])),
    -- The limit's key: '' for the whole queue.
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

-- Sets how many jobs of `queue` may run at once, across all its workers (NULL: no limit), from
-- the commit of the caller's transaction on. Waits for the transactions that hold its slots
-- (inbox_lock) to end.
CREATE OR REPLACE FUNCTION inbox_set_concurrency(queue pg_catalog.regclass, n pg_catalog.int4)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_limited_queue(queue);
    IF n < 1 OR n > 10000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('the concurrency limit must be from 1 to 10000, not %s', n),
            HINT = 'NULL removes the limit.';
    END IF;
    PERFORM @extschema@.inbox__drop_orphan_controls();
    -- From here on the slots' state is their committed one.
    PERFORM FROM @extschema@.inbox_queue_slots s
      WHERE s.queue OPERATOR(pg_catalog.=) inbox_set_concurrency.queue AND s.kind = 'c'
        FOR UPDATE;
    INSERT INTO @extschema@.inbox_queue_controls AS c (queue, concurrency) VALUES (queue, n)
        ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
        DO UPDATE SET concurrency = excluded.concurrency;
    INSERT INTO @extschema@.inbox_queue_slots (queue, kind, slot)
    SELECT queue, 'c', g FROM pg_catalog.generate_series(1, coalesce(n, 0)) AS g
        ON CONFLICT DO NOTHING;
    -- The free slots above the limit go; the busy ones retire (see the head of this file).
    EXECUTE pg_catalog.format(
        'DELETE FROM @extschema@.inbox_queue_slots s WHERE s.queue OPERATOR(pg_catalog.=) $1 '
        '   AND s.kind = ''c'' AND s.slot OPERATOR(pg_catalog.>) $2 AND ($2 OPERATOR(pg_catalog.=) 0 OR NOT %s)',
        @extschema@.inbox__slot_busy(queue, 's'))
      USING queue, coalesce(n, 0), pg_catalog.clock_timestamp();
    -- Workers asleep on a full queue look again.
    PERFORM @extschema@.inbox_notify(queue);
END
$$;
COMMENT ON FUNCTION inbox_set_concurrency(pg_catalog.regclass, pg_catalog.int4) IS
    'Sets how many jobs of the queue may run at once across all workers (NULL: no limit).';

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
CREATE OR REPLACE FUNCTION inbox_limits(queue pg_catalog.regclass)
RETURNS TABLE(concurrency pg_catalog.int4, running pg_catalog.int8, rate_limit pg_catalog.int4,
              rate_period pg_catalog.interval, recent_starts pg_catalog.int8)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    at constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    SELECT c.concurrency, c.rate_limit, c.rate_period INTO concurrency, rate_limit, rate_period
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
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION inbox_limits(pg_catalog.regclass) IS
    'The queue''s concurrency and rate limits, the jobs running under the first and the starts within the window of the second.';

-- Takes up to `max` free slots of the queue's concurrency limit, locked until the caller's
-- transaction ends: none while a retiring slot is busy. $1 queue, $2 limit, $3 clock, $4 max.
CREATE OR REPLACE FUNCTION inbox__free_slots(queue pg_catalog.regclass) RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.format(
    'SELECT pg_catalog.array_agg(f.slot) FROM ( '
    '  SELECT s.slot FROM @extschema@.inbox_queue_slots s '
    '   WHERE s.queue OPERATOR(pg_catalog.=) $1 AND s.kind = ''c'' AND s.key = '''' '
    '     AND s.slot OPERATOR(pg_catalog.<=) $2 AND NOT %1$s '
    '     AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r '
    '                      WHERE r.queue OPERATOR(pg_catalog.=) $1 AND r.kind = ''c'' AND r.key = '''' '
    '                        AND r.slot OPERATOR(pg_catalog.>) $2 AND %2$s) '
    '   ORDER BY s.started_at NULLS FIRST, s.slot LIMIT $4 FOR UPDATE OF s SKIP LOCKED) AS f',
    @extschema@.inbox__slot_busy(queue, 's'), @extschema@.inbox__slot_busy(queue, 'r'));

-- The lease (`lease` set) or lock (NULL) of a queue that has limits: as many due jobs as it
-- can give a slot of every limit, at most `max`.
CREATE OR REPLACE FUNCTION inbox__take_limited(queue pg_catalog.regclass, max pg_catalog.int4,
                                               lease pg_catalog.interval)
RETURNS TABLE(id pg_catalog.int8, attempt pg_catalog.int4, token pg_catalog.int8,
              payload pg_catalog.jsonb, payload_bytes pg_catalog.bytea)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    at constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    limits record;
    running pg_catalog.int4[];
    starts pg_catalog.int4[];
    n pg_catalog.int4 := max;
    jobs pg_catalog.int8[] := '{}';
    tokens pg_catalog.int8[] := '{}';
    stamp pg_catalog.timestamptz;
BEGIN
    SELECT c.concurrency, c.rate_limit, c.rate_period INTO limits
      FROM @extschema@.inbox_queue_controls c WHERE c.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue;
    IF limits.concurrency IS NOT NULL THEN
        EXECUTE @extschema@.inbox__free_slots(queue) INTO running USING queue, limits.concurrency, at, n;
        n := LEAST(n, coalesce(pg_catalog.cardinality(running), 0));
    END IF;
    IF limits.rate_limit IS NOT NULL AND n OPERATOR(pg_catalog.>) 0 THEN
        SELECT pg_catalog.array_agg(f.slot) INTO starts FROM (
            SELECT s.slot FROM @extschema@.inbox_queue_slots s
             WHERE s.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue AND s.kind = 'r' AND s.key = ''
               AND s.slot OPERATOR(pg_catalog.<=) limits.rate_limit
               AND (s.started_at IS NULL
                    OR s.started_at OPERATOR(pg_catalog.<=) (at OPERATOR(pg_catalog.-) limits.rate_period))
               AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r
                                WHERE r.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue
                                  AND r.kind = 'r' AND r.key = ''
                                  AND r.slot OPERATOR(pg_catalog.>) limits.rate_limit
                                  AND r.started_at OPERATOR(pg_catalog.>) (at OPERATOR(pg_catalog.-) limits.rate_period))
             ORDER BY s.started_at NULLS FIRST, s.slot LIMIT n FOR UPDATE OF s SKIP LOCKED) AS f;
        n := LEAST(n, coalesce(pg_catalog.cardinality(starts), 0));
    END IF;
    IF n OPERATOR(pg_catalog.<) 1 THEN
        RETURN;
    END IF;
    FOR id, attempt, token, payload, payload_bytes IN
        SELECT t.id, t.attempt, t.token, t.payload, t.payload_bytes
          FROM @extschema@.inbox__take_unlimited(queue, n, lease) AS t
    LOOP
        jobs := jobs OPERATOR(pg_catalog.||) id;
        tokens := tokens OPERATOR(pg_catalog.||) token;
        RETURN NEXT;
    END LOOP;
    IF pg_catalog.cardinality(jobs) OPERATOR(pg_catalog.=) 0 THEN
        RETURN;
    END IF;
    -- Stamped after the jobs' leased_at: the next start of a rate slot is `per` after this one's.
    stamp := pg_catalog.clock_timestamp();
    IF running IS NOT NULL THEN
        UPDATE @extschema@.inbox_queue_slots s SET job = given.job, token = given.token, started_at = stamp
          FROM ROWS FROM (pg_catalog.unnest(running[1:pg_catalog.cardinality(jobs)]),
                          pg_catalog.unnest(jobs), pg_catalog.unnest(tokens)) AS given(slot, job, token)
         WHERE s.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue AND s.kind = 'c' AND s.key = ''
           AND s.slot OPERATOR(pg_catalog.=) given.slot;
    END IF;
    IF starts IS NOT NULL THEN
        UPDATE @extschema@.inbox_queue_slots s SET started_at = stamp
         WHERE s.queue OPERATOR(pg_catalog.=) inbox__take_limited.queue AND s.kind = 'r' AND s.key = ''
           AND s.slot OPERATOR(pg_catalog.=) ANY (starts[1:pg_catalog.cardinality(jobs)]);
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
    SELECT c.concurrency, c.rate_limit, c.rate_period INTO limits
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
    IF limits.rate_limit IS NOT NULL THEN
        RETURN EXISTS (SELECT FROM @extschema@.inbox_queue_slots s
                        WHERE s.queue OPERATOR(pg_catalog.=) inbox__limits_allow.queue AND s.kind = 'r'
                          AND s.key = '' AND s.slot OPERATOR(pg_catalog.<=) limits.rate_limit
                          AND (s.started_at IS NULL
                               OR s.started_at OPERATOR(pg_catalog.<=) (at OPERATOR(pg_catalog.-) limits.rate_period)))
           AND NOT EXISTS (SELECT FROM @extschema@.inbox_queue_slots r
                            WHERE r.queue OPERATOR(pg_catalog.=) inbox__limits_allow.queue AND r.kind = 'r'
                              AND r.key = '' AND r.slot OPERATOR(pg_catalog.>) limits.rate_limit
                              AND r.started_at OPERATOR(pg_catalog.>) (at OPERATOR(pg_catalog.-) limits.rate_period));
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox__limits_allow(pg_catalog.regclass) IS
    'Whether the queue''s limits would let a job start now.';
