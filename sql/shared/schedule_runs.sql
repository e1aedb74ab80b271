-- When each schedule last fired, and running a schedule now, off its timetable: written once for
-- both builds, after the table of schedules (periodic_jobs.sql). Run again over an existing
-- install, it adds the column once and keeps the rows.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- The tick a schedule last fired (the time on its timetable, not when a lease fired it); NULL
-- until its first. inbox_lease and inbox_lock set it with next_tick.
ALTER TABLE inbox_periodic_jobs ADD COLUMN IF NOT EXISTS last_tick pg_catalog.timestamptz;
COMMENT ON COLUMN inbox_periodic_jobs.last_tick IS
    'The tick the schedule last fired; NULL until its first.';

-- Enqueues the job of schedule `name` of `queue` now, as inbox_enqueue does, outside its
-- timetable: the schedule's ticks go on as before. Its key names the schedule and the moment
-- ('schedule:<name>:run:<UTC time>'), so a run never collides with a tick. A run needs the
-- rights that fire the schedule, INSERT on the queue (42501); 42704 when there is no such
-- schedule.
CREATE OR REPLACE FUNCTION inbox_run_schedule(queue pg_catalog.regclass, name pg_catalog.text)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    now constant pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    payload pg_catalog.jsonb;
BEGIN
    PERFORM @extschema@.inbox__required(queue, 'queue');
    PERFORM @extschema@.inbox__required(name, 'name');
    IF NOT pg_catalog.has_table_privilege(queue, 'INSERT') THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = pg_catalog.format('permission denied to run the schedules of queue %s', queue);
    END IF;
    SELECT s.payload INTO payload FROM @extschema@.inbox_periodic_jobs s
     WHERE s.queue OPERATOR(pg_catalog.=) inbox_run_schedule.queue
       AND s.name OPERATOR(pg_catalog.=) inbox_run_schedule.name
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42704',
            MESSAGE = pg_catalog.format('queue %s has no schedule "%s"', queue, name);
    END IF;
    RETURN @extschema@.inbox_enqueue(queue, payload, now,
        pg_catalog.format('schedule:%s:run:%s', name,
            pg_catalog.to_char(now AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')));
END
$$;
COMMENT ON FUNCTION inbox_run_schedule(pg_catalog.regclass, pg_catalog.text) IS
    'Enqueues a schedule''s job now, outside its timetable; returns its id.';
