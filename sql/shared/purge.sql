-- The ledger's purges (docs/sql-api.md, "Dedup ledger" and "Observability"): delete the keys
-- seen before a time in bounded batches, all of them or at most `max` per call (so that a caller
-- committing each call never holds one long transaction). Written once for both builds.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- One bounded batch of a purge: the rows are found first, then deleted by ctid. Returns how many.
CREATE OR REPLACE FUNCTION inbox__purge_batch(table_sql text, older_than timestamptz, batch bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    deleted bigint;
BEGIN
    EXECUTE format('DELETE FROM %1$s WHERE ctid = ANY (ARRAY('
                   ' SELECT ctid FROM %1$s WHERE seen_at < $1 LIMIT $2))', table_sql)
      USING older_than, batch;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$function$;

-- Deletes the keys seen before `older_than`; returns how many.
CREATE OR REPLACE FUNCTION inbox_purge(ledger regclass, older_than timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    batch_size constant bigint := 10000;
    purged bigint := 0;
    table_sql text;
    deleted bigint;
BEGIN
    PERFORM @extschema@.inbox__required(ledger, 'ledger');
    PERFORM @extschema@.inbox__finite_time(older_than, 'older_than');
    table_sql := (@extschema@.inbox__ledger_shape(ledger)).table_sql;
    PERFORM @extschema@.inbox__citus_check_purge(ledger);
    LOOP
        deleted := @extschema@.inbox__purge_batch(table_sql, older_than, batch_size);
        purged := purged + deleted;
        EXIT WHEN deleted < batch_size;
    END LOOP;
    RETURN purged;
END
$function$;

-- The same, at most `max` keys.
CREATE OR REPLACE FUNCTION inbox_purge(ledger regclass, older_than timestamptz, max bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    batch_size constant bigint := 10000;
    purged bigint := 0;
    table_sql text;
    batch bigint;
    deleted bigint;
BEGIN
    PERFORM @extschema@.inbox__required(ledger, 'ledger');
    IF NOT isfinite(@extschema@.inbox__required(older_than, 'older_than')) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'older_than must be a finite timestamp';
    END IF;
    IF @extschema@.inbox__required(max, 'max') < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'max must be at least 1';
    END IF;
    table_sql := (@extschema@.inbox__ledger_shape(ledger)).table_sql;
    PERFORM @extschema@.inbox__citus_check_purge(ledger);
    WHILE purged < max LOOP
        batch := least(max - purged, batch_size);
        deleted := @extschema@.inbox__purge_batch(table_sql, older_than, batch);
        purged := purged + deleted;
        EXIT WHEN deleted < batch;
    END LOOP;
    RETURN purged;
END
$function$;
