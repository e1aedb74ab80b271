-- Workflows: results, waiting, dependencies and batches (docs/guide.md, "Workflows";
-- docs/sql-api.md, "Workflows"), written once for both builds but for the release of dependants,
-- which runs in every parent's ack (inbox__release: extension/src/workflows.rs in the pgrx build,
-- sql/sql-only/55-workflows.sql in the SQL-only build).
--
-- None of it costs a queue's hot path anything. A queue takes part once one of its jobs is a
-- parent or a batch member, or it keeps results: inbox__watch then gives it triggers, which run
-- inside the transaction that settles its jobs, and whose arguments say what they serve:
--   inbox_jobs_succeeded  AFTER DELETE, once per statement with the rows it deleted: those that
--                         were not dead were acked;
--   inbox_job_died        AFTER UPDATE of a row whose dead_at becomes set: dead-lettered or
--                         cancelled (batches and results only).
-- So a dependant's release, a batch's callback and a kept result commit with the settlement
-- that made them, or not at all: no resolver process, no leader, nothing fires twice or is lost
-- in a crash.
--
-- A dependant waits as a job of an ordered group waits for its turn: locked_until = 'infinity'
-- with dead_at NULL, outside every take's index. inbox_blocked counts its parents still to
-- succeed (a dependant of one parent, due at once, needs no count); the last parent's ack makes
-- it due. A parent that dies keeps its dependants blocked for an operator: requeued, it releases
-- them when it succeeds; they can also be cancelled.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

DO $types$
BEGIN
    IF pg_catalog.to_regtype('inbox_job') IS NULL THEN
        -- A job of any queue: what depends_on lists.
        CREATE TYPE inbox_job AS (queue pg_catalog.regclass, id pg_catalog.int8);
    END IF;
END
$types$;
COMMENT ON TYPE inbox_job IS 'A job of a queue, as depends_on names its parents.';

-- Which jobs wait for which: one row per parent and dependant, deleted by the parent's success.
CREATE TABLE IF NOT EXISTS inbox_dependencies (
    parent_queue pg_catalog.regclass NOT NULL,
    parent_id pg_catalog.int8 NOT NULL,
    child_queue pg_catalog.regclass NOT NULL,
    child_id pg_catalog.int8 NOT NULL,
    PRIMARY KEY (parent_queue, parent_id, child_queue, child_id)
);
COMMENT ON TABLE inbox_dependencies IS
    'The parents each blocked job still waits for (inbox_enqueue_after).';

-- Each blocked job: how many parents have still to succeed, and when it runs once they have.
CREATE TABLE IF NOT EXISTS inbox_blocked (
    queue pg_catalog.regclass NOT NULL,
    id pg_catalog.int8 NOT NULL,
    parents_left pg_catalog.int4 NOT NULL CHECK (parents_left > 0),
    run_at pg_catalog.timestamptz NOT NULL,
    PRIMARY KEY (queue, id)
);
COMMENT ON TABLE inbox_blocked IS
    'Jobs that wait for their parents to succeed, with how many have still to (inbox_enqueue_after).';

-- Batches: a callback enqueued once every member has settled.
CREATE TABLE IF NOT EXISTS inbox_batches (
    id pg_catalog.int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    on_complete_queue pg_catalog.regclass,
    on_complete pg_catalog.jsonb,
    on_failure_queue pg_catalog.regclass,
    on_failure pg_catalog.jsonb,
    -- Members added; inbox_batch_members says how each settled.
    members pg_catalog.int4 NOT NULL DEFAULT 0,
    created_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Set by inbox_batch_seal: no member is added after it, and the batch may finish.
    sealed_at pg_catalog.timestamptz,
    -- When its last member settled (the callbacks were enqueued then); purged a day later.
    finished_at pg_catalog.timestamptz
);
CREATE INDEX IF NOT EXISTS inbox_batches_finished ON inbox_batches (finished_at)
    WHERE finished_at IS NOT NULL;
COMMENT ON TABLE inbox_batches IS
    'Batches of jobs and their callbacks (inbox_batch_open, inbox_batch_add, inbox_batch_seal).';

CREATE TABLE IF NOT EXISTS inbox_batch_members (
    queue pg_catalog.regclass NOT NULL,
    id pg_catalog.int8 NOT NULL,
    batch pg_catalog.int8 NOT NULL REFERENCES inbox_batches ON DELETE CASCADE,
    -- NULL until the member settles: 'succeeded' or 'died' (its first outcome, kept).
    outcome pg_catalog.text CHECK (outcome IN ('succeeded', 'died')),
    PRIMARY KEY (queue, id)
);
-- Each batch's members from the last enqueued: a settlement looks there first for a member that
-- is still to settle (inbox__members_settled).
CREATE INDEX IF NOT EXISTS inbox_batch_members_batch_id ON inbox_batch_members (batch, id);
COMMENT ON TABLE inbox_batch_members IS 'The jobs of each batch and how each settled.';
-- Each member's row is written once more, when it settles: half of every page is kept free for
-- that new version, which then stays on its page (a HOT update, no new index entries). Measured
-- in figure 16 (40,000 jobs): batches at 0.81 and 0.82 of plain jobs with it, 0.76 without.
ALTER TABLE inbox_batch_members SET (fillfactor = 50);
-- Installs that counted members on counter rows (inbox_batch_shards) lose them here.
DROP INDEX IF EXISTS inbox_batch_members_batch;
DROP TABLE IF EXISTS inbox_batch_shards;
ALTER TABLE inbox_batch_members DROP COLUMN IF EXISTS shard;

-- Results of succeeded jobs, kept until expires_at (inbox_keep_results, inbox_ack_with_result).
CREATE TABLE IF NOT EXISTS inbox_results (
    queue pg_catalog.regclass NOT NULL,
    id pg_catalog.int8 NOT NULL,
    -- How many deliveries it took.
    attempt pg_catalog.int4 NOT NULL,
    result pg_catalog.jsonb,
    finished_at pg_catalog.timestamptz NOT NULL,
    expires_at pg_catalog.timestamptz NOT NULL,
    PRIMARY KEY (queue, id)
);
CREATE INDEX IF NOT EXISTS inbox_results_expiry ON inbox_results (expires_at);
COMMENT ON TABLE inbox_results IS
    'Succeeded jobs with their results, kept for the queue''s retention (inbox_result).';

-- How long a queue keeps its succeeded jobs (inbox_keep_results); NULL keeps none.
ALTER TABLE inbox_queue_controls ADD COLUMN IF NOT EXISTS keep_results pg_catalog.interval;

-- Anyone who may settle a job may need to release its dependants, settle its batch and record its
-- result, in the settling transaction: the triggers run as the settling role.
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_dependencies, inbox_blocked, inbox_batches,
    inbox_batch_members, inbox_results TO PUBLIC;
DROP FUNCTION IF EXISTS inbox__batch_shards();

-- How long a result is kept when the queue sets no retention (an ack with a result).
CREATE OR REPLACE FUNCTION inbox__default_result_retention() RETURNS pg_catalog.interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.interval '1 day';

-- The channel a queue's settlements are announced on (what wakes a ResultWaiter): a succeeded job
-- whose result is kept, or a job that died, with its id as the payload.
CREATE OR REPLACE FUNCTION inbox_result_channel(queue pg_catalog.regclass) RETURNS pg_catalog.text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    RETURN 'inbox_done_' OPERATOR(pg_catalog.||) queue::pg_catalog.oid::pg_catalog.text;
END
$$;
COMMENT ON FUNCTION inbox_result_channel(pg_catalog.regclass) IS
    'The channel on which the queue announces, at commit, each job that succeeded with a kept result or died (payload: its id).';

-- Whether `queue` has column `name`.
CREATE OR REPLACE FUNCTION inbox__has_column(queue pg_catalog.regclass, name pg_catalog.text)
RETURNS pg_catalog.bool
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN EXISTS (SELECT FROM pg_catalog.pg_attribute a
                WHERE a.attrelid OPERATOR(pg_catalog.=) queue::pg_catalog.oid
                  AND a.attname OPERATOR(pg_catalog.=) name
                  AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped);

-- Raises 42703 unless `queue` can take part in workflows: without dead_at it cannot tell a
-- waiting job from a dead one, without leased_at a lease from a lock.
CREATE OR REPLACE FUNCTION inbox__check_workflow_columns(queue pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    needed pg_catalog.text;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    FOREACH needed IN ARRAY ARRAY['dead_at', 'leased_at'] LOOP
        IF NOT @extschema@.inbox__has_column(queue, needed) THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = pg_catalog.format('queue %s has no column "%s" (workflows need it)', queue, needed),
                HINT = 'Queues made by inbox_create_queue have it.';
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox__check_workflow_columns(pg_catalog.regclass) IS
    'Raises 42703 unless the queue has the columns workflows need.';

-- The purposes `queue`'s triggers serve (their arguments): 'dependencies' (its jobs are
-- parents), 'batches' (batch members) and 'results' (it keeps results).
CREATE OR REPLACE FUNCTION inbox__watched_for(queue pg_catalog.regclass) RETURNS pg_catalog.text[]
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN COALESCE((
    SELECT pg_catalog.array_remove(pg_catalog.string_to_array(
               pg_catalog.encode(t.tgargs, 'escape'), '\000'), '')
      FROM pg_catalog.pg_trigger t
     WHERE t.tgrelid OPERATOR(pg_catalog.=) queue::pg_catalog.oid
       AND t.tgname OPERATOR(pg_catalog.=) 'inbox_jobs_succeeded'), '{}');

-- Makes `queue`'s triggers serve `purpose` too (see above), once. Creating them waits for the
-- transactions that write the queue, and needs the TRIGGER right on it (its owner has it).
CREATE OR REPLACE FUNCTION inbox__watch(queue pg_catalog.regclass, purpose pg_catalog.text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    purposes pg_catalog.text[];
    arguments pg_catalog.text;
BEGIN
    IF purpose OPERATOR(pg_catalog.=) ANY (@extschema@.inbox__watched_for(queue)) THEN
        RETURN;
    END IF;
    PERFORM @extschema@.inbox__check_workflow_columns(queue);
    PERFORM @extschema@.inbox__citus_check_local(queue, 'workflows');
    -- Another transaction may be adding a purpose: the lock orders them, and the purposes are
    -- read again under it.
    EXECUTE pg_catalog.format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', queue);
    purposes := @extschema@.inbox__watched_for(queue);
    IF purpose OPERATOR(pg_catalog.=) ANY (purposes) THEN
        RETURN;
    END IF;
    purposes := ARRAY(SELECT DISTINCT p FROM pg_catalog.unnest(purposes OPERATOR(pg_catalog.||) purpose) AS p ORDER BY p);
    arguments := (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(p), ', ') FROM pg_catalog.unnest(purposes) AS p);
    -- One call per statement, with the rows it deleted: an ack of a whole group costs one.
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE TRIGGER inbox_jobs_succeeded AFTER DELETE ON %s '
        '    REFERENCING OLD TABLE AS settled FOR EACH STATEMENT '
        '    EXECUTE FUNCTION @extschema@.inbox__jobs_succeeded(%s)', queue, arguments);
    -- Deaths are rare, and a row trigger's WHEN spares every other update (leases) the call.
    IF purposes OPERATOR(pg_catalog.&&) ARRAY['batches', 'results'] THEN
        EXECUTE pg_catalog.format(
            'CREATE OR REPLACE TRIGGER inbox_job_died AFTER UPDATE ON %s FOR EACH ROW '
            '    WHEN (OLD.dead_at IS NULL AND NEW.dead_at IS NOT NULL) '
            '    EXECUTE FUNCTION @extschema@.inbox__job_died(%s)', queue, arguments);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__watch(pg_catalog.regclass, pg_catalog.text) IS
    'Makes the queue''s triggers release dependants, settle batches or keep results when its jobs settle.';

-- The statement trigger of a watched queue's deletes: the rows of `settled` that were not dead
-- were acked, so their jobs succeeded.
CREATE OR REPLACE FUNCTION inbox__jobs_succeeded() RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    job_queue constant pg_catalog.regclass := TG_RELID::pg_catalog.regclass;
    released record;
    keep pg_catalog.interval;
BEGIN
    IF 'dependencies' OPERATOR(pg_catalog.=) ANY (TG_ARGV) THEN
        -- Each dependant waits for as many parents fewer; those left with none are released.
        -- They are locked in one order, so that acks sharing dependants never deadlock. Rows
        -- are found by their keys as arrays, so that every plan is an index scan whatever the
        -- tables' statistics say (joined to the transition table, a plan made for a table
        -- without statistics read every dependency of the queue for each job acked).
        FOR released IN
            WITH done AS (
                DELETE FROM @extschema@.inbox_dependencies d
                 WHERE d.parent_queue OPERATOR(pg_catalog.=) job_queue
                   AND d.parent_id OPERATOR(pg_catalog.=) ANY (ARRAY(
                           SELECT s.id FROM settled s WHERE s.dead_at IS NULL))
                RETURNING d.child_queue, d.child_id),
            counted AS (
                SELECT done.child_queue, done.child_id, pg_catalog.count(*)::pg_catalog.int4 AS n
                  FROM done GROUP BY done.child_queue, done.child_id),
            locked AS (
                SELECT b.queue, b.id, b.parents_left, c.n
                  FROM @extschema@.inbox_blocked b
                  JOIN counted c ON b.queue OPERATOR(pg_catalog.=) c.child_queue
                                AND b.id OPERATOR(pg_catalog.=) c.child_id
                 WHERE b.queue OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT k.child_queue FROM counted k))
                   AND b.id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT k.child_id FROM counted k))
                 ORDER BY b.queue::pg_catalog.oid, b.id FOR UPDATE OF b),
            waiting AS (
                UPDATE @extschema@.inbox_blocked b SET parents_left = b.parents_left OPERATOR(pg_catalog.-) l.n
                  FROM locked l
                 WHERE b.queue OPERATOR(pg_catalog.=) l.queue AND b.id OPERATOR(pg_catalog.=) l.id
                   AND l.parents_left OPERATOR(pg_catalog.>) l.n
                RETURNING b.id),
            freed AS (
                DELETE FROM @extschema@.inbox_blocked b USING locked l
                 WHERE b.queue OPERATOR(pg_catalog.=) l.queue AND b.id OPERATOR(pg_catalog.=) l.id
                   AND l.parents_left OPERATOR(pg_catalog.<=) l.n
                RETURNING b.queue, b.id, b.run_at),
            -- A dependant that waited for one parent, to run at once, has no count to keep.
            alone AS (
                SELECT c.child_queue AS queue, c.child_id AS id, NULL::pg_catalog.timestamptz AS run_at
                  FROM counted c
                 WHERE NOT EXISTS (SELECT FROM locked l
                                    WHERE l.queue OPERATOR(pg_catalog.=) c.child_queue
                                      AND l.id OPERATOR(pg_catalog.=) c.child_id))
            SELECT f.queue, pg_catalog.array_agg(f.id ORDER BY f.id) AS ids,
                   pg_catalog.array_agg(f.run_at ORDER BY f.id) AS run_ats
              FROM (SELECT * FROM freed UNION ALL SELECT * FROM alone) f GROUP BY f.queue
        LOOP
            PERFORM @extschema@.inbox__release(released.queue, released.ids, released.run_ats);
        END LOOP;
    END IF;
    IF 'batches' OPERATOR(pg_catalog.=) ANY (TG_ARGV) THEN
        PERFORM @extschema@.inbox__members_settled(
            job_queue, ARRAY(SELECT s.id FROM settled s WHERE s.dead_at IS NULL), true);
    END IF;
    IF 'results' OPERATOR(pg_catalog.=) ANY (TG_ARGV) THEN
        keep := (SELECT c.keep_results FROM @extschema@.inbox_queue_controls c
                  WHERE c.queue OPERATOR(pg_catalog.=) job_queue);
        IF keep IS NOT NULL THEN
            -- A lease counted its delivery when it took the job, a lock counts it now.
            INSERT INTO @extschema@.inbox_results AS r (queue, id, attempt, finished_at, expires_at)
            SELECT job_queue, s.id,
                   s.attempt OPERATOR(pg_catalog.+) CASE WHEN s.leased_at IS NULL THEN 1 ELSE 0 END,
                   pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) keep
              FROM settled s WHERE s.dead_at IS NULL
            ON CONFLICT ON CONSTRAINT inbox_results_pkey DO NOTHING;
            PERFORM pg_catalog.pg_notify(@extschema@.inbox_result_channel(job_queue), s.id::pg_catalog.text)
               FROM settled s WHERE s.dead_at IS NULL;
        END IF;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox__jobs_succeeded() IS
    'The trigger of a watched queue''s deletes: releases the dependants of the jobs acked, settles their batches and keeps their results.';

-- The row trigger of a watched queue's deaths: job OLD.id was dead-lettered or cancelled.
CREATE OR REPLACE FUNCTION inbox__job_died() RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF 'results' OPERATOR(pg_catalog.=) ANY (TG_ARGV) THEN
        PERFORM pg_catalog.pg_notify(@extschema@.inbox_result_channel(TG_RELID::pg_catalog.regclass),
                                     OLD.id::pg_catalog.text);
    END IF;
    IF 'batches' OPERATOR(pg_catalog.=) ANY (TG_ARGV) THEN
        PERFORM @extschema@.inbox__members_settled(TG_RELID::pg_catalog.regclass, ARRAY[OLD.id], false);
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION inbox__job_died() IS
    'The trigger of a watched queue''s deaths: counts a batch member as died and wakes the job''s waiters.';

-- Jobs `ids` of `queue` settled (succeeded or died): each member among them keeps its first
-- outcome, and a batch whose last member this was finishes.
--
-- No settlement waits for another's unless it may be the batch's last. After marking its own
-- members, it looks for a member still to settle that no other transaction is settling: one not
-- marked in the latest committed state and not locked (a member being marked is locked by its
-- settlement until that commits). It looks from the newest member, which a worker that leases
-- in order reaches last, and takes a share lock on what it finds, so that the member cannot
-- settle before this transaction ends: the member's own settlement then looks after this one
-- committed. Finding one, this settlement is not the last. Finding none, every member left is
-- being settled by a transaction in flight, or none is left: inbox__batch_check decides under the
-- batch's row lock, which orders those settlements so that the last to take it sees all the
-- others committed. At REPEATABLE READ a member or the batch changed since the snapshot fails
-- the look with 40001 (and the worker runs the delivery again) rather than be misread.
CREATE OR REPLACE FUNCTION inbox__members_settled(queue pg_catalog.regclass, ids pg_catalog.int8[],
                                                  members_succeeded pg_catalog.bool)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    settled pg_catalog.int8;
BEGIN
    FOR settled IN
        WITH marked AS (
            UPDATE @extschema@.inbox_batch_members m
               SET outcome = CASE WHEN members_succeeded THEN 'succeeded' ELSE 'died' END
             WHERE m.queue OPERATOR(pg_catalog.=) inbox__members_settled.queue
               AND m.id OPERATOR(pg_catalog.=) ANY (ids) AND m.outcome IS NULL
            RETURNING m.batch)
        SELECT DISTINCT marked.batch FROM marked ORDER BY marked.batch
    LOOP
        PERFORM FROM @extschema@.inbox_batch_members m
          WHERE m.batch OPERATOR(pg_catalog.=) settled AND m.outcome IS NULL
          ORDER BY m.batch DESC, m.id DESC LIMIT 1 FOR SHARE SKIP LOCKED;
        IF NOT FOUND THEN
            PERFORM @extschema@.inbox__batch_check(settled);
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox__members_settled(pg_catalog.regclass, pg_catalog.int8[], pg_catalog.bool) IS
    'Marks batch members'' outcomes and finishes each batch after its last.';

-- Finishes `batch` if it is sealed and none of its members is left to settle. Its row is
-- written first: its lock orders the checks (each reads the members after the others
-- committed), and at REPEATABLE READ a check that raced another fails with 40001 rather than
-- misread them. An unsealed batch is not locked: the seal, which waits for the members being
-- settled, checks it then (inbox_batch_seal).
CREATE OR REPLACE FUNCTION inbox__batch_check(batch pg_catalog.int8) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE @extschema@.inbox_batches b SET members = b.members
     WHERE b.id OPERATOR(pg_catalog.=) batch AND b.sealed_at IS NOT NULL AND b.finished_at IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT FROM @extschema@.inbox_batch_members m
                    WHERE m.batch OPERATOR(pg_catalog.=) inbox__batch_check.batch AND m.outcome IS NULL) THEN
        PERFORM @extschema@.inbox__batch_finished(batch);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__batch_check(pg_catalog.int8) IS
    'Finishes a sealed batch once every member has settled.';

-- Enqueues a callback of `batch`, unless its queue was dropped (then a warning says so): the
-- settlement of the batch's last member must not fail for it.
CREATE OR REPLACE FUNCTION inbox__enqueue_callback(batch pg_catalog.int8, queue pg_catalog.regclass,
                                                   payload pg_catalog.jsonb)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) queue::pg_catalog.oid) THEN
        RAISE WARNING USING MESSAGE = pg_catalog.format(
            'inbox: the callback queue of batch %s was dropped; callback not enqueued: %s', batch, payload);
        RETURN;
    END IF;
    PERFORM @extschema@.inbox_enqueue(queue, payload);
END
$$;
COMMENT ON FUNCTION inbox__enqueue_callback(pg_catalog.int8, pg_catalog.regclass, pg_catalog.jsonb) IS
    'Enqueues a batch callback unless its queue was dropped.';

-- Enqueues a finished batch's callbacks with its counts under the payload's "batch" key:
-- on_complete always, on_failure too when a member died.
CREATE OR REPLACE FUNCTION inbox__batch_finished(batch pg_catalog.int8) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    b record;
    settled record;
    counts pg_catalog.jsonb;
BEGIN
    UPDATE @extschema@.inbox_batches AS f SET finished_at = pg_catalog.clock_timestamp()
     WHERE f.id OPERATOR(pg_catalog.=) batch AND f.finished_at IS NULL
    RETURNING f.* INTO b;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT s.succeeded, s.died INTO settled FROM @extschema@.inbox_batch(batch) s;
    counts := pg_catalog.jsonb_build_object('batch', pg_catalog.jsonb_build_object(
        'id', b.id, 'members', b.members, 'succeeded', settled.succeeded, 'died', settled.died));
    IF b.on_complete_queue IS NOT NULL THEN
        PERFORM @extschema@.inbox__enqueue_callback(batch, b.on_complete_queue, b.on_complete OPERATOR(pg_catalog.||) counts);
    END IF;
    IF b.on_failure_queue IS NOT NULL AND settled.died OPERATOR(pg_catalog.>) 0 THEN
        PERFORM @extschema@.inbox__enqueue_callback(batch, b.on_failure_queue, b.on_failure OPERATOR(pg_catalog.||) counts);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__batch_finished(pg_catalog.int8) IS
    'Marks a batch finished and enqueues its callbacks, once.';

-- Raises 22023 unless a callback can be enqueued: a queue that stores jsonb and an object payload.
CREATE OR REPLACE FUNCTION inbox__check_callback(queue pg_catalog.regclass, payload pg_catalog.jsonb,
                                                 argument pg_catalog.text)
RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF (queue IS NULL) OPERATOR(pg_catalog.<>) (payload IS NULL) THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = pg_catalog.format('%s and %s_queue must be given together', argument, argument);
    END IF;
    IF queue IS NULL THEN
        RETURN;
    END IF;
    PERFORM @extschema@.inbox__check_queue(queue);
    IF pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('%s must be a JSON object (its "batch" key receives the counts)', argument);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid OPERATOR(pg_catalog.=) queue::pg_catalog.oid
                      AND a.attname OPERATOR(pg_catalog.=) 'payload'
                      AND a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.jsonb'::pg_catalog.regtype) THEN
        RAISE EXCEPTION USING ERRCODE = '42804',
            MESSAGE = pg_catalog.format('queue %s stores no jsonb payloads, which %s needs', queue, argument);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__check_callback(pg_catalog.regclass, pg_catalog.jsonb, pg_catalog.text) IS
    'Raises unless a batch callback can be enqueued into the queue.';

-- When job `id` of `queue` was enqueued (NULL when it is gone or the queue does not say).
CREATE OR REPLACE FUNCTION inbox__enqueued_at(queue pg_catalog.regclass, id pg_catalog.int8)
RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    enqueued pg_catalog.timestamptz;
BEGIN
    IF queue IS NULL OR id IS NULL OR NOT @extschema@.inbox__has_column(queue, 'enqueued_at') THEN
        RETURN NULL;
    END IF;
    EXECUTE pg_catalog.format('SELECT enqueued_at FROM %s WHERE id OPERATOR(pg_catalog.=) $1', queue)
      INTO enqueued USING id;
    RETURN enqueued;
END
$$;
COMMENT ON FUNCTION inbox__enqueued_at(pg_catalog.regclass, pg_catalog.int8) IS
    'When a job was enqueued, or NULL.';

-- Makes `queue` ready to take part in workflows ahead of time, as its owner would in a migration:
-- its jobs may then be parents and batch members without the first such enqueue creating its
-- triggers (which locks the queue against its workers' writes for a moment, and needs the
-- TRIGGER right).
CREATE OR REPLACE FUNCTION inbox_enable_workflows(queue pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__watch(queue, 'dependencies');
    PERFORM @extschema@.inbox__watch(queue, 'batches');
END
$$;
COMMENT ON FUNCTION inbox_enable_workflows(pg_catalog.regclass) IS
    'Gives the queue the triggers that let its jobs be parents and batch members, ahead of the first.';

-- Locks parent `id` of `queue` against its settlement until the caller commits, and tells whether
-- it is still to succeed. A parent no longer in its queue succeeded (an ack deletes the job); an
-- id the queue never drew raises 23503. The lock is an update of the row, so that a settlement
-- that raced it, even in a REPEATABLE READ transaction, waits and then sees the dependant.
CREATE OR REPLACE FUNCTION inbox__hold_parent(queue pg_catalog.regclass, id pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held pg_catalog.int8;
    sequence pg_catalog.text;
    drawn pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'a parent''s queue');
    PERFORM @extschema@.inbox__required(id, 'a parent''s id');
    PERFORM @extschema@.inbox__watch(queue, 'dependencies');
    EXECUTE pg_catalog.format('UPDATE %s SET attempt = attempt WHERE id OPERATOR(pg_catalog.=) $1', queue)
      USING id;
    GET DIAGNOSTICS held = ROW_COUNT;
    IF held OPERATOR(pg_catalog.>) 0 THEN
        RETURN true;
    END IF;
    sequence := pg_catalog.pg_get_serial_sequence(queue::pg_catalog.text, 'id');
    IF sequence IS NOT NULL THEN
        EXECUTE pg_catalog.format('SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM %s', sequence)
          INTO drawn;
    END IF;
    IF drawn IS NULL OR id OPERATOR(pg_catalog.>) drawn THEN
        RAISE EXCEPTION USING ERRCODE = '23503',
            MESSAGE = pg_catalog.format('job %s of %s does not exist', id, queue);
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION inbox__hold_parent(pg_catalog.regclass, pg_catalog.int8) IS
    'Locks a parent job until commit; whether it is still to succeed.';

-- Enqueues a job into `queue` that runs only after every job of depends_on has succeeded, as a
-- member of `batch` when given (once: see inbox__enqueue_composed).
CREATE OR REPLACE FUNCTION inbox__enqueue_composed_once(queue pg_catalog.regclass, payload pg_catalog.jsonb,
                                                   depends_on @extschema@.inbox_job[],
                                                   batch pg_catalog.int8, run_at pg_catalog.timestamptz,
                                                   key pg_catalog.text, priority pg_catalog.int4,
                                                   timeout pg_catalog.interval)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    parent record;
    -- The parents still to succeed (a record array cannot be declared here: the SQL-only build
    -- resolves its type on the catalog's search_path).
    pending_queues pg_catalog.regclass[] := '{}';
    pending_ids pg_catalog.int8[] := '{}';
    job pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    IF pg_catalog.array_ndims(depends_on) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = 'depends_on must be a one-dimensional array';
    END IF;
    IF pg_catalog.cardinality(depends_on) OPERATOR(pg_catalog.>) 0 THEN
        PERFORM @extschema@.inbox__check_workflow_columns(queue);
    END IF;
    IF batch IS NOT NULL THEN
        PERFORM @extschema@.inbox__watch(queue, 'batches');
    END IF;
    -- Parents are locked in one order, so that enqueues sharing parents never deadlock: oldest
    -- first, so that a parent is locked before any parent that depends on it (a lock-mode
    -- delivery holding the older one releases the younger in its ack).
    FOR parent IN
        SELECT DISTINCT @extschema@.inbox__enqueued_at(p.queue, p.id) AS enqueued_at,
                        p.queue::pg_catalog.oid AS oid, p.queue, p.id
          FROM pg_catalog.unnest(depends_on) AS p
         ORDER BY 1, 2, p.id
    LOOP
        IF @extschema@.inbox__hold_parent(parent.queue, parent.id) THEN
            pending_queues := pending_queues OPERATOR(pg_catalog.||) parent.queue;
            pending_ids := pending_ids OPERATOR(pg_catalog.||) parent.id;
        END IF;
    END LOOP;
    job := @extschema@.inbox_enqueue(queue, payload, run_at => run_at, key => key, priority => priority,
                                     timeout => timeout);
    IF job IS NULL THEN
        -- Its key is queued already: nothing is added.
        RETURN NULL;
    END IF;
    IF pg_catalog.cardinality(pending_ids) OPERATOR(pg_catalog.>) 0 THEN
        -- Set aside until its last parent succeeds. The job is new in this transaction, so no
        -- one has seen it due.
        EXECUTE pg_catalog.format(
            'UPDATE %s SET locked_until = ''infinity''::pg_catalog.timestamptz WHERE id OPERATOR(pg_catalog.=) $1',
            queue) USING job;
        IF pg_catalog.cardinality(pending_ids) OPERATOR(pg_catalog.>) 1
           OR run_at OPERATOR(pg_catalog.>) pg_catalog.now() THEN
            INSERT INTO @extschema@.inbox_blocked (queue, id, parents_left, run_at)
            VALUES (queue, job, pg_catalog.cardinality(pending_ids), run_at);
        END IF;
        INSERT INTO @extschema@.inbox_dependencies (parent_queue, parent_id, child_queue, child_id)
        SELECT p.parent_queue, p.parent_id, inbox__enqueue_composed_once.queue, job
          FROM ROWS FROM (pg_catalog.unnest(pending_queues), pg_catalog.unnest(pending_ids)) AS p(parent_queue, parent_id);
    END IF;
    IF batch IS NOT NULL THEN
        -- Locked after the parents: a worker settling a member locks the batch last too.
        PERFORM @extschema@.inbox__open_batch(batch);
        UPDATE @extschema@.inbox_batches b SET members = b.members OPERATOR(pg_catalog.+) 1
         WHERE b.id OPERATOR(pg_catalog.=) inbox__enqueue_composed_once.batch;
        INSERT INTO @extschema@.inbox_batch_members (queue, id, batch) VALUES (queue, job, batch);
    END IF;
    RETURN job;
END
$$;
COMMENT ON FUNCTION inbox__enqueue_composed_once(pg_catalog.regclass, pg_catalog.jsonb, inbox_job[], pg_catalog.int8,
                                                 pg_catalog.timestamptz, pg_catalog.text, pg_catalog.int4,
                                                 pg_catalog.interval) IS
    'Enqueues a job after its parents, as a member of a batch when given.';

-- Whether an enqueue into `queue` after depends_on (as a member of `batch` when given) would be
-- the first composition of one of these queues, which creates its triggers (inbox__watch).
CREATE OR REPLACE FUNCTION inbox__composition_watches(queue pg_catalog.regclass,
                                                      depends_on @extschema@.inbox_job[],
                                                      batch pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN (batch IS NOT NULL
        AND NOT ('batches' OPERATOR(pg_catalog.=) ANY (@extschema@.inbox__watched_for(queue))))
    OR EXISTS (SELECT FROM pg_catalog.unnest(depends_on) AS p
                WHERE NOT ('dependencies' OPERATOR(pg_catalog.=) ANY (@extschema@.inbox__watched_for(p.queue))));
COMMENT ON FUNCTION inbox__composition_watches(pg_catalog.regclass, inbox_job[], pg_catalog.int8) IS
    'Whether the enqueue would create a queue''s workflow triggers.';

-- The body of inbox_enqueue_after and inbox_batch_add. The first composition of a queue creates
-- its triggers, which holds the queue against its writers until commit; the enqueue may then wait
-- for a parent or a batch counter that such a writer holds (a lock-mode delivery of the parent,
-- an ack releasing a dependant into the queue). PostgreSQL breaks that cycle by cancelling one
-- side: when it is this enqueue, the subtransaction gives its locks back, the writer finishes, and
-- the enqueue runs again. Later enqueues create nothing and pay for no subtransaction.
CREATE OR REPLACE FUNCTION inbox__enqueue_composed(queue pg_catalog.regclass, payload pg_catalog.jsonb,
                                                   depends_on @extschema@.inbox_job[],
                                                   batch pg_catalog.int8, run_at pg_catalog.timestamptz,
                                                   key pg_catalog.text, priority pg_catalog.int4,
                                                   timeout pg_catalog.interval)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT @extschema@.inbox__composition_watches(queue, depends_on, batch) THEN
        RETURN @extschema@.inbox__enqueue_composed_once(queue, payload, depends_on, batch, run_at, key,
                                                        priority, timeout);
    END IF;
    FOR attempt IN 1..5 LOOP
        BEGIN
            RETURN @extschema@.inbox__enqueue_composed_once(queue, payload, depends_on, batch, run_at, key,
                                                            priority, timeout);
        EXCEPTION WHEN deadlock_detected THEN
            IF attempt OPERATOR(pg_catalog.=) 5 THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox__enqueue_composed(pg_catalog.regclass, pg_catalog.jsonb, inbox_job[], pg_catalog.int8,
                                            pg_catalog.timestamptz, pg_catalog.text, pg_catalog.int4,
                                            pg_catalog.interval) IS
    'The body of inbox_enqueue_after and inbox_batch_add.';

-- Enqueues a job that runs only after every job of depends_on has succeeded (docs/sql-api.md,
-- inbox_enqueue_after). Parents may be in any queue of the database; they exist before their
-- dependant, so no cycle can form. Returns the job's id, or NULL when its key is queued already.
CREATE OR REPLACE FUNCTION inbox_enqueue_after(queue pg_catalog.regclass, payload pg_catalog.jsonb,
                                               depends_on @extschema@.inbox_job[],
                                               run_at pg_catalog.timestamptz DEFAULT pg_catalog.now(),
                                               key pg_catalog.text DEFAULT NULL,
                                               priority pg_catalog.int4 DEFAULT 0,
                                               timeout pg_catalog.interval DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(depends_on, 'depends_on');
    RETURN @extschema@.inbox__enqueue_composed(queue, payload, depends_on, NULL, run_at, key, priority, timeout);
END
$$;
COMMENT ON FUNCTION inbox_enqueue_after(pg_catalog.regclass, pg_catalog.jsonb, inbox_job[],
                                        pg_catalog.timestamptz, pg_catalog.text, pg_catalog.int4,
                                        pg_catalog.interval) IS
    'Enqueues a job that runs only after all its parents (jobs of any queue) have succeeded.';

-- A job of a queue, for depends_on: inbox_job('orders', 42).
CREATE OR REPLACE FUNCTION inbox_job(queue pg_catalog.regclass, id pg_catalog.int8) RETURNS @extschema@.inbox_job
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN ROW(queue, id)::@extschema@.inbox_job;
COMMENT ON FUNCTION inbox_job(pg_catalog.regclass, pg_catalog.int8) IS 'A job of a queue, for depends_on.';

-- Opens a batch: its callbacks are enqueued, once, when it is sealed and every member has
-- settled. Returns its id.
CREATE OR REPLACE FUNCTION inbox_batch_open(on_complete_queue pg_catalog.regclass DEFAULT NULL,
                                            on_complete pg_catalog.jsonb DEFAULT NULL,
                                            on_failure_queue pg_catalog.regclass DEFAULT NULL,
                                            on_failure pg_catalog.jsonb DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    batch pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__check_callback(on_complete_queue, on_complete, 'on_complete');
    PERFORM @extschema@.inbox__check_callback(on_failure_queue, on_failure, 'on_failure');
    INSERT INTO @extschema@.inbox_batches (on_complete_queue, on_complete, on_failure_queue, on_failure)
    VALUES (on_complete_queue, on_complete, on_failure_queue, on_failure)
    RETURNING id INTO batch;
    RETURN batch;
END
$$;
COMMENT ON FUNCTION inbox_batch_open(pg_catalog.regclass, pg_catalog.jsonb, pg_catalog.regclass, pg_catalog.jsonb) IS
    'Opens a batch whose callbacks are enqueued once every member has settled after inbox_batch_seal.';

-- The open batch `batch`, locked until the caller commits; 02000 when there is none, 55000 when
-- it is sealed.
CREATE OR REPLACE FUNCTION inbox__open_batch(batch pg_catalog.int8) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    sealed pg_catalog.timestamptz;
BEGIN
    PERFORM @extschema@.inbox__required(batch, 'batch');
    SELECT b.sealed_at INTO sealed FROM @extschema@.inbox_batches b
     WHERE b.id OPERATOR(pg_catalog.=) batch FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '02000', MESSAGE = pg_catalog.format('no batch %s', batch);
    END IF;
    IF sealed IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = pg_catalog.format('batch %s is sealed: no member can be added', batch);
    END IF;
END
$$;

-- Enqueues a member of open batch `batch` (after depends_on, when given); its id, or NULL when its
-- key is queued already (it is then no member).
CREATE OR REPLACE FUNCTION inbox_batch_add(batch pg_catalog.int8, queue pg_catalog.regclass,
                                           payload pg_catalog.jsonb,
                                           depends_on @extschema@.inbox_job[] DEFAULT NULL,
                                           run_at pg_catalog.timestamptz DEFAULT pg_catalog.now(),
                                           key pg_catalog.text DEFAULT NULL,
                                           priority pg_catalog.int4 DEFAULT 0,
                                           timeout pg_catalog.interval DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Checked now, and again under the batch's lock (inbox__enqueue_composed).
    IF NOT EXISTS (SELECT FROM @extschema@.inbox_batches b
                    WHERE b.id OPERATOR(pg_catalog.=) @extschema@.inbox__required(batch, 'batch')) THEN
        RAISE EXCEPTION USING ERRCODE = '02000', MESSAGE = pg_catalog.format('no batch %s', batch);
    END IF;
    RETURN @extschema@.inbox__enqueue_composed(queue, payload, depends_on, batch, run_at, key, priority, timeout);
END
$$;
COMMENT ON FUNCTION inbox_batch_add(pg_catalog.int8, pg_catalog.regclass, pg_catalog.jsonb, inbox_job[],
                                    pg_catalog.timestamptz, pg_catalog.text, pg_catalog.int4, pg_catalog.interval) IS
    'Enqueues a member of an open batch.';

-- Seals `batch`: no member is added after it; when every member has settled already, its
-- callbacks are enqueued in this transaction. Whether it was open.
CREATE OR REPLACE FUNCTION inbox_batch_seal(batch pg_catalog.int8) RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(batch, 'batch');
    UPDATE @extschema@.inbox_batches b SET sealed_at = pg_catalog.clock_timestamp()
     WHERE b.id OPERATOR(pg_catalog.=) batch AND b.sealed_at IS NULL;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM @extschema@.inbox_batches b WHERE b.id OPERATOR(pg_catalog.=) batch) THEN
            RAISE EXCEPTION USING ERRCODE = '02000', MESSAGE = pg_catalog.format('no batch %s', batch);
        END IF;
        RETURN false;
    END IF;
    -- Its members may all have settled already. Those not marked are locked first, so that a
    -- settlement not yet committed is waited for and then seen (its own check skips the batch,
    -- whose seal it cannot see yet).
    PERFORM FROM @extschema@.inbox_batch_members m
     WHERE m.batch OPERATOR(pg_catalog.=) inbox_batch_seal.batch AND m.outcome IS NULL FOR SHARE;
    PERFORM @extschema@.inbox__batch_check(batch);
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox_batch_seal(pg_catalog.int8) IS
    'Seals a batch: no member is added after it, and its callbacks are enqueued once every member has settled.';

-- A batch's counts as the latest committed state shows them; no row when there is no such batch.
CREATE OR REPLACE FUNCTION inbox_batch(batch pg_catalog.int8)
RETURNS TABLE(members pg_catalog.int4, succeeded pg_catalog.int4, died pg_catalog.int4,
              created_at pg_catalog.timestamptz, sealed_at pg_catalog.timestamptz,
              finished_at pg_catalog.timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY
        SELECT b.members, t.succeeded::pg_catalog.int4, t.died::pg_catalog.int4,
               b.created_at, b.sealed_at, b.finished_at
          FROM @extschema@.inbox_batches b,
               LATERAL (SELECT pg_catalog.count(*) FILTER (WHERE m.outcome OPERATOR(pg_catalog.=) 'succeeded') AS succeeded,
                               pg_catalog.count(*) FILTER (WHERE m.outcome OPERATOR(pg_catalog.=) 'died') AS died
                          FROM @extschema@.inbox_batch_members m
                         WHERE m.batch OPERATOR(pg_catalog.=) b.id) t
         WHERE b.id OPERATOR(pg_catalog.=) batch;
END
$$;
COMMENT ON FUNCTION inbox_batch(pg_catalog.int8) IS 'A batch''s member counts and when it was sealed and finished.';

-- A batch's members, how each settled and its kept result, by queue and id.
CREATE OR REPLACE FUNCTION inbox_batch_members(batch pg_catalog.int8)
RETURNS TABLE(queue pg_catalog.regclass, id pg_catalog.int8, outcome pg_catalog.text, result pg_catalog.jsonb)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN QUERY
        SELECT m.queue, m.id, m.outcome, r.result
          FROM @extschema@.inbox_batch_members m
          LEFT JOIN @extschema@.inbox_results r
            ON r.queue OPERATOR(pg_catalog.=) m.queue AND r.id OPERATOR(pg_catalog.=) m.id
         WHERE m.batch OPERATOR(pg_catalog.=) inbox_batch_members.batch
         ORDER BY m.queue::pg_catalog.oid, m.id;
END
$$;
COMMENT ON FUNCTION inbox_batch_members(pg_catalog.int8) IS
    'A batch''s members with how each settled and its kept result.';

-- Keeps the succeeded jobs of `queue` with their results for `keep` (NULL keeps none, the default).
CREATE OR REPLACE FUNCTION inbox_keep_results(queue pg_catalog.regclass, keep pg_catalog.interval)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    IF keep OPERATOR(pg_catalog.<=) pg_catalog.interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'keep must be positive (NULL keeps no results)';
    END IF;
    IF keep IS NOT NULL THEN
        PERFORM @extschema@.inbox__watch(queue, 'results');
    END IF;
    PERFORM @extschema@.inbox__drop_orphan_controls();
    INSERT INTO @extschema@.inbox_queue_controls AS c (queue, keep_results) VALUES (queue, keep)
        ON CONFLICT ON CONSTRAINT inbox_queue_controls_pkey DO UPDATE SET keep_results = excluded.keep_results;
END
$$;
COMMENT ON FUNCTION inbox_keep_results(pg_catalog.regclass, pg_catalog.interval) IS
    'Keeps the queue''s succeeded jobs and their results for the given time (NULL: none).';

-- Records `result` for the delivery `token` holds of job `id`, to be kept when the job is acked
-- in the same transaction (for the queue's retention, or a day when it sets none); whether the
-- token holds the job. A worker whose handler writes in the delivery's transaction records the
-- result there, before the ack that ends it: both commit, or neither.
CREATE OR REPLACE FUNCTION inbox_set_result(queue pg_catalog.regclass, id pg_catalog.int8,
                                            token pg_catalog.int8, result pg_catalog.jsonb)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    PERFORM @extschema@.inbox__required(token, 'token');
    EXECUTE pg_catalog.format(
        'SELECT count(*) FROM %s WHERE id OPERATOR(pg_catalog.=) $1 '
        '   AND attempt OPERATOR(pg_catalog.=) CASE WHEN $2 OPERATOR(pg_catalog.<) 0 '
        '       THEN OPERATOR(pg_catalog.-) $2 OPERATOR(pg_catalog.-) 1 ELSE $2 END '
        '   AND locked_until IS DISTINCT FROM ''infinity''::pg_catalog.timestamptz', queue)
      INTO held USING id, token;
    IF held OPERATOR(pg_catalog.=) 0 THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.inbox__keep_result(queue, id, token, result);
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox_set_result(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8, pg_catalog.jsonb) IS
    'Records a delivery''s result, kept when the job is acked in the same transaction.';

-- Keeps `result` for job `id`, whose delivery `token` succeeded, and announces it.
CREATE OR REPLACE FUNCTION inbox__keep_result(queue pg_catalog.regclass, id pg_catalog.int8,
                                              token pg_catalog.int8, result pg_catalog.jsonb)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    keep pg_catalog.interval;
BEGIN
    keep := COALESCE((SELECT c.keep_results FROM @extschema@.inbox_queue_controls c
                       WHERE c.queue OPERATOR(pg_catalog.=) inbox__keep_result.queue),
                     @extschema@.inbox__default_result_retention());
    -- A lease's token is its attempt; a lock's is -attempt - 1, before the lock's delivery counted.
    INSERT INTO @extschema@.inbox_results AS r (queue, id, attempt, result, finished_at, expires_at)
    VALUES (queue, id, pg_catalog.abs(token)::pg_catalog.int4, result, pg_catalog.clock_timestamp(),
            pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) keep)
    ON CONFLICT ON CONSTRAINT inbox_results_pkey
    DO UPDATE SET attempt = excluded.attempt, result = excluded.result,
                  finished_at = excluded.finished_at, expires_at = excluded.expires_at;
    PERFORM pg_catalog.pg_notify(@extschema@.inbox_result_channel(queue), id::pg_catalog.text);
END
$$;
COMMENT ON FUNCTION inbox__keep_result(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8, pg_catalog.jsonb) IS
    'Keeps a succeeded delivery''s result and announces it on the queue''s result channel.';

-- Acks job `id` as inbox_ack does and keeps `result` with it; whether the token still held the
-- job.
CREATE OR REPLACE FUNCTION inbox_ack_with_result(queue pg_catalog.regclass, id pg_catalog.int8,
                                                 token pg_catalog.int8, result pg_catalog.jsonb)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT @extschema@.inbox_ack(queue, id, token) THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.inbox__keep_result(queue, id, token, result);
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox_ack_with_result(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8, pg_catalog.jsonb) IS
    'Acks a job and keeps its result (inbox_result) for the queue''s retention, or a day.';

-- Where job `id` of `queue` stands, as the latest committed state shows it: 'succeeded' (its
-- result kept), 'ready', 'scheduled', 'running' (leased), 'waiting' (behind its group's head),
-- 'blocked' (by its parents), 'dead' or 'cancelled'; no row when the job is not there (acked
-- without a kept result, discarded, purged, or never enqueued). Cheap to poll: two key lookups.
CREATE OR REPLACE FUNCTION inbox_result(queue pg_catalog.regclass, id pg_catalog.int8)
RETURNS TABLE(state pg_catalog.text, attempt pg_catalog.int4, result pg_catalog.jsonb,
              last_error pg_catalog.text, finished_at pg_catalog.timestamptz,
              progress pg_catalog.jsonb)
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    job pg_catalog.jsonb;
    locked_until pg_catalog.timestamptz;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    -- The row as jsonb, so that a queue without some optional column still answers.
    EXECUTE pg_catalog.format('SELECT pg_catalog.to_jsonb(q) OPERATOR(pg_catalog.-) ''payload'' '
                              '  FROM %s q WHERE q.id OPERATOR(pg_catalog.=) $1', queue)
      INTO job USING id;
    IF job IS NULL THEN
        -- Looked up after the queue, so that an ack committing in between is seen here.
        RETURN QUERY SELECT 'succeeded'::pg_catalog.text, r.attempt, r.result, NULL::pg_catalog.text, r.finished_at,
                            NULL::pg_catalog.jsonb
                       FROM @extschema@.inbox_results r
                      WHERE r.queue OPERATOR(pg_catalog.=) inbox_result.queue
                        AND r.id OPERATOR(pg_catalog.=) inbox_result.id;
        RETURN;
    END IF;
    locked_until := (job OPERATOR(pg_catalog.->>) 'locked_until')::pg_catalog.timestamptz;
    state := CASE
        WHEN job OPERATOR(pg_catalog.->>) 'dead_at' IS NOT NULL
            THEN CASE WHEN job OPERATOR(pg_catalog.->>) 'last_error' OPERATOR(pg_catalog.=) 'cancelled'
                      THEN 'cancelled' ELSE 'dead' END
        WHEN locked_until OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz
            THEN CASE WHEN NOT (job OPERATOR(pg_catalog.?) 'dead_at') THEN 'dead'
                      -- Set aside outside a group: a dependant (they have no group).
                      WHEN job OPERATOR(pg_catalog.->>) 'group_key' IS NULL THEN 'blocked'
                      ELSE 'waiting' END
        WHEN locked_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
            THEN CASE WHEN job OPERATOR(pg_catalog.->>) 'leased_at' IS NOT NULL THEN 'running' ELSE 'scheduled' END
        ELSE 'ready' END;
    attempt := (job OPERATOR(pg_catalog.->>) 'attempt')::pg_catalog.int4;
    result := NULL;
    last_error := job OPERATOR(pg_catalog.->>) 'last_error';
    finished_at := (job OPERATOR(pg_catalog.->>) 'dead_at')::pg_catalog.timestamptz;
    progress := NULLIF(job OPERATOR(pg_catalog.->) 'progress', 'null'::pg_catalog.jsonb);
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION inbox_result(pg_catalog.regclass, pg_catalog.int8) IS
    'Where a job stands: its state, attempt, kept result or last error; no row when it is gone.';

-- Deletes up to `max` expired results, batches finished over a day ago, and durable steps' records
-- of jobs that are gone (sql/shared/steps.sql); how many rows it deleted. Bounded, so that a
-- worker's upkeep can call it often.
CREATE OR REPLACE FUNCTION inbox_purge_results(max pg_catalog.int4 DEFAULT 1000) RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    results pg_catalog.int8;
    batches pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(max, 'max');
    IF max OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max must be at least 1';
    END IF;
    DELETE FROM @extschema@.inbox_results r
     WHERE r.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(
        SELECT e.ctid FROM @extschema@.inbox_results e
         WHERE e.expires_at OPERATOR(pg_catalog.<) pg_catalog.clock_timestamp()
         ORDER BY e.expires_at LIMIT max FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS results = ROW_COUNT;
    DELETE FROM @extschema@.inbox_batches b
     WHERE b.id OPERATOR(pg_catalog.=) ANY (ARRAY(
        SELECT f.id FROM @extschema@.inbox_batches f
         WHERE f.finished_at OPERATOR(pg_catalog.<)
               (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) pg_catalog.interval '1 day')
         ORDER BY f.finished_at LIMIT max FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS batches = ROW_COUNT;
    RETURN results OPERATOR(pg_catalog.+) batches OPERATOR(pg_catalog.+) @extschema@.inbox__purge_steps(max);
END
$$;
COMMENT ON FUNCTION inbox_purge_results(pg_catalog.int4) IS
    'Deletes up to max expired results, day-old finished batches and the step records of jobs that are gone; how many.';

-- The most progress a delivery may record, in bytes of its JSON text: progress is a small note
-- (a count, a percentage, a step), written again by every heartbeat that carries a change.
CREATE OR REPLACE FUNCTION inbox__progress_max_bytes() RETURNS pg_catalog.int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN 8192;

-- Records `progress` for the leased delivery `token` of job `id`, in the job's column progress,
-- while its lease holds (a later delivery's token fences it); whether it did. A lock's delivery
-- cannot: its row is locked until its transaction ends, which no one else would see before.
CREATE OR REPLACE FUNCTION inbox_set_progress(queue pg_catalog.regclass, id pg_catalog.int8,
                                              token pg_catalog.int8, progress pg_catalog.jsonb)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    applied pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__check_queue(queue);
    PERFORM @extschema@.inbox__required(id, 'id');
    PERFORM @extschema@.inbox__required(token, 'token');
    IF NOT @extschema@.inbox__has_column(queue, 'progress') THEN
        RAISE EXCEPTION USING ERRCODE = '42703',
            MESSAGE = pg_catalog.format('queue %s has no column "progress" to record progress in', queue),
            HINT = pg_catalog.format('ALTER TABLE %s ADD COLUMN progress jsonb', queue);
    END IF;
    IF token OPERATOR(pg_catalog.<) 0 THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = 'progress is recorded for leased deliveries only (a lock''s row is seen by no one until its transaction ends)';
    END IF;
    IF pg_catalog.octet_length(progress::pg_catalog.text) OPERATOR(pg_catalog.>) @extschema@.inbox__progress_max_bytes() THEN
        RAISE EXCEPTION USING ERRCODE = '54000',
            MESSAGE = pg_catalog.format('progress must be at most %s bytes of JSON', @extschema@.inbox__progress_max_bytes());
    END IF;
    EXECUTE pg_catalog.format(
        'UPDATE %s SET progress = $3 WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2 '
        '   AND locked_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() '
        '   AND locked_until OPERATOR(pg_catalog.<) ''infinity''::pg_catalog.timestamptz%s',
        queue, CASE WHEN @extschema@.inbox__has_column(queue, 'leased_at') THEN ' AND leased_at IS NOT NULL' ELSE '' END)
      USING id, token, progress;
    GET DIAGNOSTICS applied = ROW_COUNT;
    RETURN applied OPERATOR(pg_catalog.=) 1;
END
$$;
COMMENT ON FUNCTION inbox_set_progress(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8, pg_catalog.jsonb) IS
    'Records a leased delivery''s progress (a small jsonb) on its job, while the lease holds.';
