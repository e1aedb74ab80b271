-- The release of dependants (extension/src/workflows.rs in the pgrx build, where it is native so
-- that its statement is planned once per queue and session); the rest of the workflows is shared
-- (sql/shared/workflows.sql).

-- Makes the released jobs `ids` of `queue` due, each at its run_at (NULL: now); a job cancelled
-- meanwhile stays dead, and one whose queue was dropped is gone with it.
CREATE OR REPLACE FUNCTION inbox__release(queue pg_catalog.regclass, ids pg_catalog.int8[],
                                          run_ats pg_catalog.timestamptz[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    released pg_catalog.int8;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) queue::pg_catalog.oid) THEN
        RETURN;
    END IF;
    EXECUTE pg_catalog.format(
        'UPDATE %s q SET locked_until = GREATEST(r.run_at, pg_catalog.clock_timestamp()) '
        '  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), '
        '                  pg_catalog.unnest($2::pg_catalog.timestamptz[])) AS r(id, run_at) '
        ' WHERE q.id OPERATOR(pg_catalog.=) r.id AND q.dead_at IS NULL '
        '   AND q.locked_until OPERATOR(pg_catalog.=) ''infinity''::pg_catalog.timestamptz', queue)
      USING ids, run_ats;
    GET DIAGNOSTICS released = ROW_COUNT;
    IF released OPERATOR(pg_catalog.>) 0 THEN
        PERFORM @extschema@.inbox_notify(queue);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__release(pg_catalog.regclass, pg_catalog.int8[], pg_catalog.timestamptz[]) IS
    'Makes released dependants due.';
