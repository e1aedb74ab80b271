-- Pausing and resuming queues and cancelling jobs (docs/sql-api.md, "Pausing a queue",
-- "Cancelling a job"), written once for both builds.
--
-- A pause is a row of inbox_queue_controls with paused_at set. Every lease and lock reads it
-- before it takes anything (the pgrx build through controls.rs, which keeps each session's copy
-- of the paused queues until a change of this table commits; the SQL-only build's inbox__take
-- from the table), so a pause holds from the moment its transaction commits: later leases and
-- locks hand out nothing, while deliveries already running finish and settle. inbox_sleep counts nothing due on a paused queue, so that idle workers sleep rather
-- than poll; a resume wakes them as an enqueue does (inbox_notify).
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

CREATE TABLE IF NOT EXISTS inbox_queue_controls (
    queue pg_catalog.regclass PRIMARY KEY,
    -- When the queue was paused; NULL while it runs.
    paused_at pg_catalog.timestamptz,
    -- Its limits (sql/shared/limits.sql): how many jobs may run at once, how many may start in
    -- any window of rate_period; NULL for none.
    concurrency pg_catalog.int4,
    rate_limit pg_catalog.int4,
    rate_period pg_catalog.interval,
    -- The limit per key: how many jobs of one key may run at once, the key being the payload's
    -- field per_key (NULL for none).
    key_concurrency pg_catalog.int4,
    per_key pg_catalog.text,
    -- Until when a job's key stays unique (inbox_set_unique): 'started' or 'finished'; NULL
    -- for 'acked', the default.
    unique_until pg_catalog.text
);
-- Installed by an earlier version: the columns added since.
ALTER TABLE inbox_queue_controls ADD COLUMN IF NOT EXISTS unique_until pg_catalog.text;
COMMENT ON TABLE inbox_queue_controls IS
    'Which queues are paused (inbox_pause, inbox_resume), their limits (inbox_set_concurrency, inbox_set_rate_limit) and until when their keys stay unique (inbox_set_unique).';
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_queue_controls TO PUBLIC;
ALTER TABLE inbox_queue_controls ENABLE ROW LEVEL SECURITY;
DO $policies$
DECLARE
    policy pg_catalog.text;
BEGIN
    FOREACH policy IN ARRAY ARRAY['inbox_queue_controls_read', 'inbox_queue_controls_add',
                                  'inbox_queue_controls_change', 'inbox_queue_controls_remove'] LOOP
        IF EXISTS (SELECT FROM pg_catalog.pg_policy
                    WHERE polrelid = 'inbox_queue_controls'::pg_catalog.regclass AND polname = policy) THEN
            EXECUTE pg_catalog.format('DROP POLICY %I ON inbox_queue_controls', policy);
        END IF;
    END LOOP;
END
$policies$;
-- Anyone who may lease from a queue sees whether it is paused (a lease must); a role that may
-- update it may pause and resume it.
CREATE POLICY inbox_queue_controls_read ON inbox_queue_controls FOR SELECT
    USING (pg_catalog.has_table_privilege(queue, 'SELECT')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));
CREATE POLICY inbox_queue_controls_add ON inbox_queue_controls FOR INSERT
    WITH CHECK (pg_catalog.has_table_privilege(queue, 'UPDATE'));
CREATE POLICY inbox_queue_controls_change ON inbox_queue_controls FOR UPDATE
    USING (pg_catalog.has_table_privilege(queue, 'UPDATE'));
CREATE POLICY inbox_queue_controls_remove ON inbox_queue_controls FOR DELETE
    USING (pg_catalog.has_table_privilege(queue, 'UPDATE')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));

-- The name of a session-level prepared statement of `statement` (its parameters of `types`),
-- prepared on first use: a statement built per call is planned once per session, as the pgrx
-- build's kept plans are per backend and table (a table's DDL makes PostgreSQL plan it again; a
-- change of its columns changes the statement, hence its name). Run it with
-- EXECUTE pg_catalog.format('EXECUTE %I(%L, ...)', name, ...), a regclass argument passed as its
-- oid, which reads back whatever the search_path. Whether it is prepared is read from
-- pg_prepared_statements on every call (about 10 us), so that a session's DEALLOCATE ALL or
-- DISCARD ALL (a pooler's reset), or a rolled-back first use, costs one PREPARE, never an error.
CREATE OR REPLACE FUNCTION inbox__prepared(statement pg_catalog.text, types pg_catalog.text)
RETURNS pg_catalog.text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    statement_name pg_catalog.text := 'inbox_' OPERATOR(pg_catalog.||)
        pg_catalog.md5(types OPERATOR(pg_catalog.||) ';' OPERATOR(pg_catalog.||) statement);
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_prepared_statements p
                    WHERE p.name OPERATOR(pg_catalog.=) statement_name) THEN
        EXECUTE pg_catalog.format('PREPARE %I (%s) AS %s', statement_name, types, statement);
    END IF;
    RETURN statement_name;
END
$$;
COMMENT ON FUNCTION inbox__prepared(pg_catalog.text, pg_catalog.text) IS
    'The name of a statement prepared for the session, prepared on first use.';

-- Raises 22004 for NULL, 42703 unless `queue` has the columns every queue has (a lease's).
CREATE OR REPLACE FUNCTION inbox__check_queue(queue pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    missing pg_catalog.name;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    SELECT wanted INTO missing
      FROM pg_catalog.unnest(ARRAY['id', 'attempt', 'locked_until', 'payload']::pg_catalog.name[]) AS wanted
     WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                        WHERE a.attrelid = queue AND a.attname = wanted
                          AND a.attnum > 0 AND NOT a.attisdropped)
     LIMIT 1;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('%s is not a queue: it has no column "%s"', queue, missing);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__check_queue(pg_catalog.regclass) IS
    'Raises 22004 or 42703 unless the table has the columns of a queue.';

-- Deletes the rows of queues that are gone. The extension's event trigger deletes them in the
-- DROP; the SQL-only build installed without a superuser has none, and a row left behind could
-- pause a new table that reused the oid. Each pause and resume runs it.
CREATE OR REPLACE FUNCTION inbox__drop_orphan_controls() RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM @extschema@.inbox_queue_controls c
     WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class r
                        WHERE r.oid OPERATOR(pg_catalog.=) c.queue::pg_catalog.oid);
    DELETE FROM @extschema@.inbox_queue_slots s
     WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class r
                        WHERE r.oid OPERATOR(pg_catalog.=) s.queue::pg_catalog.oid);
END
$$;
COMMENT ON FUNCTION inbox__drop_orphan_controls() IS
    'Deletes the pause state of queues that were dropped.';

-- Pauses `queue` once the caller's transaction commits; whether it was running.
CREATE OR REPLACE FUNCTION inbox_pause(queue pg_catalog.regclass) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    paused pg_catalog.bool;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__drop_orphan_controls();
    INSERT INTO @extschema@.inbox_queue_controls AS c (queue, paused_at)
    VALUES (queue, pg_catalog.clock_timestamp())
        ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
        DO UPDATE SET paused_at = excluded.paused_at WHERE c.paused_at IS NULL
    RETURNING true INTO paused;
    RETURN paused IS NOT NULL;
END
$$;
COMMENT ON FUNCTION inbox_pause(pg_catalog.regclass) IS
    'Pauses the queue when the transaction commits: leases and locks hand out nothing until inbox_resume; whether it was running.';

-- Resumes `queue` once the caller's transaction commits, waking its sleeping workers; whether it
-- was paused.
CREATE OR REPLACE FUNCTION inbox_resume(queue pg_catalog.regclass) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    resumed pg_catalog.bool;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__drop_orphan_controls();
    UPDATE @extschema@.inbox_queue_controls AS c SET paused_at = NULL
     WHERE c.queue = inbox_resume.queue AND c.paused_at IS NOT NULL
    RETURNING true INTO resumed;
    IF resumed THEN
        PERFORM @extschema@.inbox_notify(queue);
    END IF;
    RETURN resumed IS NOT NULL;
END
$$;
COMMENT ON FUNCTION inbox_resume(pg_catalog.regclass) IS
    'Resumes a paused queue when the transaction commits and wakes its sleeping workers; whether it was paused.';

-- Since when `queue` is paused, as the latest committed state shows it (NULL while it runs).
CREATE OR REPLACE FUNCTION inbox_paused_since(queue pg_catalog.regclass) RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT c.paused_at FROM @extschema@.inbox_queue_controls c
             WHERE c.queue = inbox_paused_since.queue);
END
$$;
COMMENT ON FUNCTION inbox_paused_since(pg_catalog.regclass) IS
    'Since when the queue is paused, or NULL while it runs.';

-- Cancels job `id` of `queue`, waiting or running: it becomes a dead job whose last error says
-- 'cancelled' (listed, requeued and discarded as dead jobs are), so that every settlement of a
-- running delivery is fenced from then on (its ack, retry and its heartbeat's extension return
-- false) and a job of an ordered group lets the next one run. The row is locked first: a job
-- held by an inbox_lock transaction is cancelled when that transaction ends, unless it acked
-- it. Whether it cancelled the job: false when it is gone or dead already.
CREATE OR REPLACE FUNCTION inbox_cancel(queue pg_catalog.regclass, id pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    job record;
    applied pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    EXECUTE pg_catalog.format('SELECT attempt, locked_until FROM %s WHERE id = $1 FOR UPDATE', queue)
       INTO job USING id;
    GET DIAGNOSTICS applied = ROW_COUNT;  -- EXECUTE sets no FOUND
    IF applied = 0 THEN
        RETURN false;
    ELSIF job.locked_until IS DISTINCT FROM 'infinity'::pg_catalog.timestamptz THEN
        -- Ready, delayed or leased: dead-lettered as its holder would, with the token its
        -- attempt is (the row is locked, so no one else settles it meanwhile).
        RETURN @extschema@.inbox_dead(queue, id, job.attempt, 'cancelled');
    ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                       WHERE a.attrelid = queue AND a.attname = 'dead_at'
                         AND a.attnum > 0 AND NOT a.attisdropped) THEN
        -- Without dead_at, 'infinity' means dead.
        RETURN false;
    END IF;
    -- Waiting behind its group's head (or dead already, which dead_at tells). The time is a
    -- parameter: Citus routes no UPDATE that calls a volatile function.
    EXECUTE pg_catalog.format(
        'UPDATE %s SET dead_at = $2%s WHERE id = $1 AND dead_at IS NULL',
        queue,
        CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_attribute a
                           WHERE a.attrelid = queue AND a.attname = 'last_error'
                             AND a.attnum > 0 AND NOT a.attisdropped)
             THEN ', last_error = ''cancelled''' ELSE '' END)
      USING id, pg_catalog.clock_timestamp();
    GET DIAGNOSTICS applied = ROW_COUNT;
    RETURN applied = 1;
END
$$;
COMMENT ON FUNCTION inbox_cancel(pg_catalog.regclass, pg_catalog.int8) IS
    'Cancels a waiting or running job: it becomes dead with last_error ''cancelled'', and its running delivery is fenced.';

-- Runs job `id` again after `delay` without spending an attempt (docs/sql-api.md,
-- inbox_snooze). It is settled as a retry is, fenced by `token`: the lease or lock ends, the job keeps
-- its place as its group's head, its last error stays, and it never dead-letters. Then the
-- column snoozes counts it: a lease reports the attempt less the snoozes, while the token stays
-- the count of deliveries, which only grows, so that a stale holder stays fenced. The row is
-- locked by the retry until this transaction ends, so no lease sees one update without the other.
CREATE OR REPLACE FUNCTION inbox_snooze(queue pg_catalog.regclass, id pg_catalog.int8,
                                        token pg_catalog.int8,
                                        delay pg_catalog.interval DEFAULT '0 seconds')
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = queue AND a.attname = 'snoozes' AND a.attnum > 0
                      AND NOT a.attisdropped
                      AND a.atttypid IN ('int2'::pg_catalog.regtype, 'int4'::pg_catalog.regtype,
                                         'int8'::pg_catalog.regtype)) THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('%s cannot snooze jobs: it has no integer column "snoozes"', queue),
            HINT = 'Add it: ALTER TABLE ... ADD COLUMN snoozes integer NOT NULL DEFAULT 0.';
    END IF;
    IF NOT @extschema@.inbox_retry(queue, id, token, delay) THEN
        RETURN false;
    END IF;
    EXECUTE pg_catalog.format(
        'UPDATE %s SET snoozes = COALESCE(snoozes, 0) OPERATOR(pg_catalog.+) 1 WHERE id = $1', queue)
      USING id;
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox_snooze(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8, pg_catalog.interval) IS
    'Settles a delivery to run again after delay without spending an attempt (fenced by its token).';

-- Unique keys (docs/sql-api.md, "Unique keys"). A queue's key is unique through its unique index
-- on (key), whose predicate says in which states a job holds its key:
--   acked     while the job exists: waiting, running, retrying or dead (the default);
--   finished  until it is acked or dead-lettered: a dead job frees its key;
--   started   until its first delivery is counted (attempt 0), and not once it is dead.
-- The index is the only arbiter, so concurrent enqueues of one key insert it once (ON CONFLICT
-- waits for an uncommitted insert of the key, or for the lease that takes it out of the index).
-- Enqueues name the same predicate in their ON CONFLICT clause (inbox__key_predicate), so that
-- the partial index is inferred; it is spelled with pg_catalog's operators, whatever the path.
CREATE OR REPLACE FUNCTION inbox__key_predicate(queue pg_catalog.regclass) RETURNS pg_catalog.text
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT CASE (SELECT c.unique_until FROM @extschema@.inbox_queue_controls c WHERE c.queue = $1)
               WHEN 'finished' THEN 'key IS NOT NULL AND dead_at IS NULL'
               WHEN 'started' THEN
                   'key IS NOT NULL AND dead_at IS NULL AND attempt OPERATOR(pg_catalog.=) 0'
               ELSE 'key IS NOT NULL' END;
END;

-- Sets until when the keys of `queue` stay unique ('acked', 'finished' or 'started'): replaces
-- the queue's unique index on (key) by one whose predicate says it, in this transaction (as the
-- queue's owner; it waits for the queue's writers). Jobs already queued that the new index
-- would refuse make it fail with 23505, changing nothing.
CREATE OR REPLACE FUNCTION inbox_set_unique(queue pg_catalog.regclass, until pg_catalog.text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    old pg_catalog.regclass;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(until, 'until');
    IF until NOT IN ('acked', 'finished', 'started') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('until must be ''acked'', ''finished'' or ''started'', not %L', until);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = queue AND a.attname = 'key' AND a.attnum > 0 AND NOT a.attisdropped) THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('%s has no column "key"', queue),
            HINT = 'Add it: ALTER TABLE ... ADD COLUMN key text.';
    END IF;
    IF until <> 'acked' AND NOT EXISTS (
        SELECT FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = queue AND a.attname = 'dead_at' AND a.attnum > 0 AND NOT a.attisdropped) THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('%s cannot free keys until %s: it has no column "dead_at"', queue, until),
            HINT = 'Add it: ALTER TABLE ... ADD COLUMN dead_at timestamptz.';
    END IF;
    -- The unique indexes on (key) alone, whatever their predicate, give way to the new one.
    FOR old IN
        SELECT i.indexrelid::pg_catalog.regclass FROM pg_catalog.pg_index i
          JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attname = 'key'
         WHERE i.indrelid = queue AND i.indisunique AND i.indnatts = 1
           AND i.indkey[0] = a.attnum AND i.indexprs IS NULL
    LOOP
        EXECUTE pg_catalog.format('DROP INDEX %s', old);
    END LOOP;
    INSERT INTO @extschema@.inbox_queue_controls AS c (queue, unique_until)
    VALUES (queue, NULLIF(until, 'acked'))
    ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey
    DO UPDATE SET unique_until = excluded.unique_until;
    EXECUTE pg_catalog.format('CREATE UNIQUE INDEX ON %s (key) WHERE %s',
                              queue, @extschema@.inbox__key_predicate(queue));
END
$$;
COMMENT ON FUNCTION inbox_set_unique(pg_catalog.regclass, pg_catalog.text) IS
    'Sets until when a job''s key stays unique: acked (default), finished (acked or dead) or started (first delivery).';

-- Until when the keys of `queue` stay unique: 'acked', 'finished' or 'started'.
CREATE OR REPLACE FUNCTION inbox_unique_until(queue pg_catalog.regclass) RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    RETURN COALESCE((SELECT c.unique_until FROM @extschema@.inbox_queue_controls c
                      WHERE c.queue = inbox_unique_until.queue), 'acked');
END
$$;
COMMENT ON FUNCTION inbox_unique_until(pg_catalog.regclass) IS
    'Until when a job''s key stays unique: acked, finished or started.';
