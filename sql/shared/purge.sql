-- The ledger's purges (docs/sql-api.md, "Dedup ledger" and "Observability"): delete the keys
-- seen before a time in bounded batches, all of them or at most `max` per call (so that a caller
-- committing each call never holds one long transaction). Written once for both builds.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql).

-- Installed by an earlier version: the batch function the purges called.
DROP FUNCTION IF EXISTS inbox__purge_batch(text, timestamptz, bigint);

-- Deletes the keys of `ledger` seen before `older_than`, at most `max` (NULL: all), in batches of
-- 10,000: each batch's rows are found first, then deleted by ctid. Returns how many. The body of
-- both purges, which check their arguments first.
CREATE OR REPLACE FUNCTION inbox__purge(ledger regclass, older_than timestamptz, max bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $function$
DECLARE
    batch_size constant bigint := 10000;
    table_sql constant text := (@extschema@.inbox__ledger_shape(ledger)).table_sql;
    purged bigint := 0;
    batch bigint;
    deleted bigint;
BEGIN
    PERFORM @extschema@.inbox__citus_check_purge(ledger);
    LOOP
        batch := least(max - purged, batch_size);
        EXECUTE format('DELETE FROM %1$s WHERE ctid = ANY (ARRAY('
                       ' SELECT ctid FROM %1$s WHERE seen_at < $1 LIMIT $2))', table_sql)
          USING older_than, batch;
        GET DIAGNOSTICS deleted = ROW_COUNT;
        purged := purged + deleted;
        EXIT WHEN deleted < batch OR purged = max;
    END LOOP;
    RETURN purged;
END
$function$;

-- Deletes the keys seen before `older_than`; returns how many.
CREATE OR REPLACE FUNCTION inbox_purge(ledger regclass, older_than timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
BEGIN
    PERFORM @extschema@.inbox__required(ledger, 'ledger');
    PERFORM @extschema@.inbox__finite_time(older_than, 'older_than');
    RETURN @extschema@.inbox__purge(ledger, older_than, NULL);
END
$function$;

-- The same, at most `max` keys.
CREATE OR REPLACE FUNCTION inbox_purge(ledger regclass, older_than timestamptz, max bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $function$
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
    RETURN @extschema@.inbox__purge(ledger, older_than, max);
END
$function$;
