-- Wake-ups (wakeups.rs) and upkeep (upkeep.rs). An enqueue sends NOTIFY only when a session
-- sleeps on the queue. SQL has only the share and exclusive modes of the two-key advisory locks,
-- so the registry is two locks of the queue (first key the queue's oid as int4, as groups use;
-- the second keys are even, apart from the groups' odd ones and the queue's 0):
-- - the sleepers' lock (queue, 26978): each sleeper holds it shared, at session level;
-- - the gate (queue, 26980): every enqueue holds it shared until its transaction ends (tried,
--   never waited for); a session about to sleep takes it exclusively for a moment, which waits
--   for the enqueues in flight, registers, and lets it go before it looks at the queue.
-- An enqueue that cannot take the gate (a session is registering) notifies; one that can takes
-- the sleepers' lock exclusively for an instant: refused means a sleeper, so it notifies. So no
-- wake-up is lost, as in the pgrx build: a job either notifies a sleeper or is committed before
-- the sleeper looks at the queue.

CREATE OR REPLACE FUNCTION inbox__sleepers_key() RETURNS int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT RETURN 26978;

CREATE OR REPLACE FUNCTION inbox__gate_key() RETURNS int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT RETURN 26980;

-- Whether enqueues notify (the inbox.notify setting: unset is on; the spellings of a boolean).
CREATE OR REPLACE FUNCTION inbox__notify_enabled() RETURNS bool
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    setting text := lower(coalesce(current_setting('inbox.notify', true), ''));
    n int := length(setting);
BEGIN
    IF setting = '' THEN
        RETURN true;
    ELSIF setting IN ('on', '1') OR (n >= 1 AND (left('true', n) = setting OR left('yes', n) = setting)) THEN
        RETURN true;
    ELSIF setting = '0' OR (n >= 2 AND left('off', n) = setting)
          OR (n >= 1 AND (left('false', n) = setting OR left('no', n) = setting)) THEN
        RETURN false;
    END IF;
    RAISE EXCEPTION USING ERRCODE = '22023',
        MESSAGE = 'parameter "inbox.notify" requires a Boolean value';
END
$$;

-- Wakes the sessions asleep on the queue once the caller commits (wakeups.rs notify).
CREATE OR REPLACE FUNCTION inbox__notify(queue regclass) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
DECLARE
    k int4;
BEGIN
    IF NOT inbox__notify_enabled() THEN
        RETURN;
    END IF;
    -- inbox__lock_key, written out: a call of it costs more than the locks (once per enqueue).
    k := (queue::oid::int8 - CASE WHEN queue::oid::int8 > 2147483647 THEN 4294967296 ELSE 0 END)::int4;
    IF pg_try_advisory_xact_lock_shared(k, inbox__gate_key()) THEN
        IF pg_try_advisory_lock(k, inbox__sleepers_key()) THEN
            PERFORM pg_advisory_unlock(k, inbox__sleepers_key());
            RETURN;
        END IF;
    END IF;
    PERFORM pg_notify(inbox_channel(queue), '');
END
$$;

-- The public form of inbox__notify, for rows inserted by other means than the enqueues (the
-- outbox's publishes, an application's own INSERT): wakes the sleepers once the caller commits.
CREATE OR REPLACE FUNCTION inbox_notify(queue regclass) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM inbox__notify(inbox__required(queue, 'queue'));
END
$$;

-- Whether this session is registered as asleep on the queue.
CREATE OR REPLACE FUNCTION inbox__sleeping(queue regclass) RETURNS bool
LANGUAGE sql STABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
    SELECT EXISTS (
        SELECT FROM pg_locks
         WHERE locktype = 'advisory' AND pid = pg_backend_pid()
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND classid = queue::oid AND objid = inbox__sleepers_key() AND objsubid = 2
           AND mode = 'ShareLock' AND granted)
$$;

CREATE OR REPLACE FUNCTION inbox__release_sleeper(queue regclass) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    IF inbox__sleeping(queue) THEN
        RETURN pg_advisory_unlock_shared(inbox__lock_key(queue), inbox__sleepers_key());
    END IF;
    RETURN false;
END
$$;

CREATE OR REPLACE FUNCTION inbox_sleep(queue regclass) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    shape inbox__queue_shape;
    k int4;
    due bool;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    -- Unlike the pgrx build, inside a transaction block this is not refused (25001): SQL cannot
    -- tell a transaction block from the implicit transaction of the statement.
    -- Raises 42P01/42703/42804 unless `queue` is a queue table, before anything is registered.
    shape := inbox__queue_shape(queue);
    k := inbox__lock_key(queue);
    -- Waits for the enqueues in flight (lock_timeout bounds it: 55P03, nothing registered).
    PERFORM pg_advisory_lock(k, inbox__gate_key());
    BEGIN
        IF NOT inbox__sleeping(queue) THEN
            PERFORM pg_advisory_lock_shared(k, inbox__sleepers_key());
        END IF;
        PERFORM pg_advisory_unlock(k, inbox__gate_key());
        -- A statement of its own: a snapshot taken after the registration.
        EXECUTE format('SELECT EXISTS (SELECT FROM %s WHERE %s)', shape.table_sql,
                       CASE WHEN shape.nullable_locked_until THEN 'locked_until IS NULL OR locked_until <= $1'
                            ELSE 'locked_until <= $1' END)
          INTO due USING clock_timestamp();
        -- Nothing is due on a paused queue (its resume wakes the sleepers), nor on one whose
        -- limits are full (a slot that frees is taken by the worker that freed it; one freed by
        -- an expired lease is found by the sleepers' next poll).
        due := due AND NOT EXISTS (SELECT FROM inbox_queue_controls c
                                    WHERE c.queue = inbox_sleep.queue AND c.paused_at IS NOT NULL)
                   AND inbox__limits_allow(queue);
    EXCEPTION WHEN query_canceled OR others THEN
        -- Session locks survive the rollback of this block (a cancel included): give them up.
        IF inbox__release_sleeper(queue) THEN NULL; END IF;
        PERFORM pg_advisory_unlock(k, inbox__gate_key())
           FROM pg_locks
          WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND classid = queue::oid
            AND objid = inbox__gate_key() AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted;
        RAISE;
    END;
    IF due THEN
        PERFORM inbox__release_sleeper(queue);
    END IF;
    RETURN NOT due;
END
$$;

CREATE OR REPLACE FUNCTION inbox_stop_sleeping(queue regclass) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    RETURN inbox__release_sleeper(queue);
END
$$;

CREATE OR REPLACE FUNCTION inbox_sleepers(queue regclass) RETURNS SETOF int
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    RETURN QUERY
        SELECT l.pid FROM pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
           AND l.classid = queue::oid AND l.objid = inbox__sleepers_key() AND l.objsubid = 2
           AND l.mode = 'ShareLock' AND l.granted
         ORDER BY l.pid;
END
$$;

-- The oldest transaction whose deletions a vacuum of this database's tables must keep, as far
-- as the statistics views show it (upkeep.rs asks the server directly).
CREATE OR REPLACE FUNCTION inbox__removal_horizon() RETURNS text
LANGUAGE sql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
    SELECT coalesce(
        (SELECT h.x::text FROM (
             SELECT a.backend_xmin AS x FROM pg_stat_activity a
              WHERE a.backend_xmin IS NOT NULL
                AND (a.datname = current_database() OR a.backend_type = 'walsender')
             UNION ALL
             SELECT a.backend_xid FROM pg_stat_activity a
              WHERE a.backend_xid IS NOT NULL AND a.datname = current_database()
             UNION ALL
             SELECT s.xmin FROM pg_replication_slots s WHERE s.xmin IS NOT NULL
             UNION ALL
             SELECT p.transaction FROM pg_prepared_xacts p WHERE p.database = current_database()
         ) AS h ORDER BY age(h.x) DESC LIMIT 1),
        pg_snapshot_xmin(pg_current_snapshot())::text)
$$;

CREATE OR REPLACE FUNCTION inbox_vacuum_due(queue regclass) RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    facts record;
    horizon text;
    remembered text;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    -- A queue or an outbox: any table.
    PERFORM inbox__checked_columns(queue, 'table', '{}', '', 0);
    SELECT pg_stat_get_dead_tuples(c.oid) AS dead, pg_stat_get_live_tuples(c.oid) AS live,
           EXISTS (SELECT FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid) AS running,
           pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE') AS permitted,
           format('%I.%I', n.nspname, c.relname) AS name
      INTO facts
      FROM pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
      JOIN pg_database d ON d.datname = current_database()
     WHERE c.oid = queue;
    -- 1,000 dead rows and a tenth of the live ones.
    IF NOT (facts.dead >= 1000 AND facts.dead::float8 >= 0.1 * facts.live::float8)
       OR facts.running OR NOT facts.permitted THEN
        RETURN NULL;
    END IF;
    -- Not again while the oldest snapshot stands still: a vacuum could remove nothing more.
    horizon := inbox__removal_horizon();
    remembered := current_setting('inbox_sql_only.vacuumed_' || queue::oid::text, true);
    PERFORM set_config('inbox_sql_only.vacuumed_' || queue::oid::text, horizon, false);
    IF remembered IS NOT DISTINCT FROM horizon THEN
        RETURN NULL;
    END IF;
    RETURN facts.name;
END
$$;
