-- A table's shape read from the catalog, written once for both builds: the operator functions
-- (dead letters, inbox_queues, inbox_metrics, inbox_jobs, purges) and every call of the SQL-only
-- build read a queue's or ledger's columns through inbox__queue_shape / inbox__ledger_shape. The
-- pgrx build's job path reads the same shape natively (extension/src/shape.rs), with the same
-- errors: 42P01 for an oid that is no table any more, 42809 for a relation that is not a table,
-- 42703 for a missing column, 42804 for a mistyped one.
--
-- References to the extension's own objects are written @extschema@.name (see outbox.sql). The
-- SQL-only build creates this file before the other shared files: their signatures use its types.

DO $types$
DECLARE
    field pg_catalog.text;
BEGIN
    IF pg_catalog.to_regtype('@extschema@.inbox__queue_shape') IS NULL THEN
        CREATE TYPE @extschema@.inbox__queue_shape AS (
            table_sql pg_catalog.text,
            payload pg_catalog.text,
            nullable_locked_until pg_catalog.bool,
            has_key pg_catalog.bool,
            has_last_error pg_catalog.bool,
            has_leased_at pg_catalog.bool,
            has_priority pg_catalog.bool,
            has_group_key pg_catalog.bool,
            has_dead_at pg_catalog.bool,
            has_run_at pg_catalog.bool,
            groups pg_catalog.bool,
            dead_predicate pg_catalog.text,
            has_snoozes pg_catalog.bool,
            has_timeout pg_catalog.bool,
            has_errors pg_catalog.bool
        );
    END IF;
    -- Installed by an earlier version of the SQL-only build: the fields added since.
    FOR field IN SELECT pg_catalog.unnest(ARRAY['has_snoozes', 'has_timeout', 'has_errors']) LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute
                        WHERE attrelid = (SELECT typrelid FROM pg_catalog.pg_type
                                           WHERE oid = pg_catalog.to_regtype('@extschema@.inbox__queue_shape'))
                          AND attname = field AND NOT attisdropped) THEN
            EXECUTE pg_catalog.format('ALTER TYPE @extschema@.inbox__queue_shape ADD ATTRIBUTE %I pg_catalog.bool', field);
        END IF;
    END LOOP;
    IF pg_catalog.to_regtype('@extschema@.inbox__ledger_shape') IS NULL THEN
        CREATE TYPE @extschema@.inbox__ledger_shape AS (table_sql pg_catalog.text);
    END IF;
END
$types$;

-- A required time that is finite (error.rs finite_time). The SQL-only build's job path calls it
-- only for a time that is NULL or infinite, to raise.
CREATE OR REPLACE FUNCTION inbox__finite_time(value pg_catalog.timestamptz, argument pg_catalog.text)
RETURNS pg_catalog.timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = argument || ' must not be NULL';
    END IF;
    IF NOT pg_catalog.isfinite(value) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('%s must be a finite time, not %s',
            argument, CASE WHEN value > 'epoch'::pg_catalog.timestamptz THEN 'infinity' ELSE '-infinity' END);
    END IF;
    RETURN value;
END
$$;

-- Reads the table's quoted name and the columns `names` (the first `required` of them required),
-- each checked to be of its kind: i an integer, x text, t timestamptz, v interval, j jsonb, p
-- jsonb or bytea. Returns the type of each column (NULL when absent) and whether it is NOT NULL.
-- One catalog query.
CREATE OR REPLACE FUNCTION inbox__checked_columns(tab pg_catalog.regclass, kind pg_catalog.text,
                                                  names pg_catalog.text[], kinds pg_catalog.text,
                                                  required pg_catalog.int4, OUT table_sql pg_catalog.text,
                                                  OUT types pg_catalog.oid[], OUT not_nulls pg_catalog.bool[])
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    relkind text;
    found_names text[];
    found_types oid[];
    found_not_nulls bool[];
    accepted oid[];
    at int;
BEGIN
    SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname),
           array_agg(a.attname::text), array_agg(a.atttypid), array_agg(a.attnotnull)
      INTO relkind, table_sql, found_names, found_types, found_not_nulls
      FROM pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
      LEFT JOIN pg_attribute a
             ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY (names)
     WHERE c.oid = tab
     GROUP BY 1, 2;
    IF relkind IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '42P01', MESSAGE = format('no table with oid %s', tab::oid);
    END IF;
    IF relkind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION USING ERRCODE = '42809', MESSAGE = format('%s is not a table', table_sql);
    END IF;
    types := '{}';
    not_nulls := '{}';
    FOR i IN 1 .. cardinality(names) LOOP
        at := array_position(found_names, names[i]);
        IF at IS NULL THEN
            IF i <= required THEN
                RAISE EXCEPTION USING ERRCODE = '42703',
                    MESSAGE = format('%s table %s has no column "%s"', kind, table_sql, names[i]);
            END IF;
            types := types || NULL::oid;
            not_nulls := not_nulls || false;
            CONTINUE;
        END IF;
        accepted := CASE substr(kinds, i, 1)
                        WHEN 'i' THEN '{21,23,20}'::oid[]   -- smallint, integer, bigint
                        WHEN 'x' THEN '{25,1043}'::oid[]    -- text, character varying
                        WHEN 't' THEN '{1184}'::oid[]       -- timestamp with time zone
                        WHEN 'v' THEN '{1186}'::oid[]       -- interval
                        WHEN 'j' THEN '{3802}'::oid[]       -- jsonb
                        ELSE '{3802,17}'::oid[] END;        -- jsonb, bytea
        IF NOT found_types[at] = ANY (accepted) THEN
            RAISE EXCEPTION USING ERRCODE = '42804', MESSAGE = format(
                'column "%s" of %s table %s is of type %s, expected %s', names[i], kind, table_sql,
                format_type(found_types[at], NULL),
                array_to_string(ARRAY(SELECT format_type(t, NULL) FROM unnest(accepted) AS t), ' or '));
        END IF;
        types := types || found_types[at];
        not_nulls := not_nulls || found_not_nulls[at];
    END LOOP;
END
$$;

-- shape.rs QueueShape::load.
CREATE OR REPLACE FUNCTION inbox__queue_shape(queue pg_catalog.regclass) RETURNS @extschema@.inbox__queue_shape
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t record;
    shape @extschema@.inbox__queue_shape;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    t := @extschema@.inbox__checked_columns(queue, 'queue',
        '{id,attempt,locked_until,payload,key,last_error,leased_at,priority,group_key,dead_at,run_at,snoozes,timeout,errors}',
        'iitpxxtixttivj', 4);
    shape.table_sql := t.table_sql;
    shape.payload := CASE WHEN t.types[4] = 17 THEN 'bytea' ELSE 'jsonb' END;
    shape.nullable_locked_until := NOT t.not_nulls[3];
    shape.has_key := t.types[5] IS NOT NULL;
    shape.has_last_error := t.types[6] IS NOT NULL;
    shape.has_leased_at := t.types[7] IS NOT NULL;
    shape.has_priority := t.types[8] IS NOT NULL;
    shape.has_group_key := t.types[9] IS NOT NULL;
    shape.has_dead_at := t.types[10] IS NOT NULL;
    shape.has_run_at := t.types[11] IS NOT NULL;
    shape.has_snoozes := t.types[12] IS NOT NULL;
    shape.has_timeout := t.types[13] IS NOT NULL;
    shape.has_errors := t.types[14] IS NOT NULL;
    shape.groups := shape.has_group_key AND shape.has_dead_at;
    -- Only where a job can also wait in its group does dead_at tell the two apart.
    shape.dead_predicate := CASE WHEN shape.groups
        THEN 'locked_until = ''infinity'' AND dead_at IS NOT NULL'
        ELSE 'locked_until = ''infinity''' END;
    RETURN shape;
END
$$;

-- shape.rs LedgerShape::load.
CREATE OR REPLACE FUNCTION inbox__ledger_shape(ledger pg_catalog.regclass) RETURNS @extschema@.inbox__ledger_shape
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF ledger IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ledger must not be NULL';
    END IF;
    RETURN ROW((@extschema@.inbox__checked_columns(ledger, 'ledger', '{event_key,seen_at}', 'xt', 2)).table_sql)::@extschema@.inbox__ledger_shape;
END
$$;
