-- The table of schedules (inbox_schedule), shared by the extension and the SQL-only build. Each
-- role sees and changes the schedules of the queues it may use (see the policies). Written to be
-- run again over an existing install: it keeps the rows and brings the policies up to date.
CREATE TABLE IF NOT EXISTS inbox_periodic_jobs (
    queue pg_catalog.regclass NOT NULL,
    name pg_catalog.text NOT NULL CHECK (name <> ''),
    cron pg_catalog.text NOT NULL,
    time_zone pg_catalog.text NOT NULL,
    payload pg_catalog.jsonb NOT NULL,
    next_tick pg_catalog.timestamptz NOT NULL,
    PRIMARY KEY (queue, name)
);
COMMENT ON TABLE inbox_periodic_jobs IS
    'The schedules of inbox_schedule; their ticks become jobs in inbox_lease and inbox_lock.';
CREATE INDEX IF NOT EXISTS inbox_periodic_jobs_due ON inbox_periodic_jobs (queue, next_tick);
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_periodic_jobs TO PUBLIC;
ALTER TABLE inbox_periodic_jobs ENABLE ROW LEVEL SECURITY;
-- A dropped queue's schedules are visible to and removable by anyone: the privilege checks cannot
-- see a table that is gone, and such schedules say nothing and fire nothing.
DO $policies$
DECLARE
    policy pg_catalog.text;
BEGIN
    FOREACH policy IN ARRAY ARRAY['inbox_periodic_jobs_read', 'inbox_periodic_jobs_define',
                                  'inbox_periodic_jobs_fire', 'inbox_periodic_jobs_remove'] LOOP
        IF EXISTS (SELECT FROM pg_catalog.pg_policy
                    WHERE polrelid = 'inbox_periodic_jobs'::pg_catalog.regclass
                      AND polname = policy) THEN
            EXECUTE pg_catalog.format('DROP POLICY %I ON inbox_periodic_jobs', policy);
        END IF;
    END LOOP;
END
$policies$;
CREATE POLICY inbox_periodic_jobs_read ON inbox_periodic_jobs FOR SELECT
    USING (pg_catalog.has_table_privilege(queue, 'SELECT, INSERT')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));
CREATE POLICY inbox_periodic_jobs_define ON inbox_periodic_jobs FOR INSERT
    WITH CHECK (pg_catalog.has_table_privilege(queue, 'INSERT'));
CREATE POLICY inbox_periodic_jobs_fire ON inbox_periodic_jobs FOR UPDATE
    USING (pg_catalog.has_table_privilege(queue, 'INSERT'));
CREATE POLICY inbox_periodic_jobs_remove ON inbox_periodic_jobs FOR DELETE
    USING (pg_catalog.has_table_privilege(queue, 'INSERT')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = queue::pg_catalog.oid));
