-- Table shapes and names: what shape.rs and names.rs check, with the same errors. Every other
-- file reads a table's columns through inbox__queue_shape / inbox__ledger_shape only.
--
-- Every function pins its search_path (SET search_path FROM CURRENT, made the catalog first at
-- the end of the install), except the helpers that only the job path's functions call
-- (inbox__session_statement, inbox__take_jobs, inbox__enqueue, inbox__notify, the argument
-- checks, ...): they run on their caller's pinned path, since a SET clause costs each call a save
-- and restore of the setting, a few microseconds of a claim's forty.

DO $$
DECLARE
    field text;
BEGIN
    IF pg_catalog.to_regtype('inbox__queue_shape') IS NULL THEN
        CREATE TYPE inbox__queue_shape AS (
            table_sql text,
            payload text,
            nullable_locked_until bool,
            has_key bool,
            has_last_error bool,
            has_leased_at bool,
            has_priority bool,
            has_group_key bool,
            has_dead_at bool,
            has_run_at bool,
            groups bool,
            dead_predicate text,
            has_snoozes bool,
            has_timeout bool,
            has_errors bool
        );
    END IF;
    -- Installed by an earlier version: the fields added since.
    FOR field IN SELECT unnest(ARRAY['has_snoozes', 'has_timeout', 'has_errors']) LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute
                        WHERE attrelid = (SELECT typrelid FROM pg_catalog.pg_type
                                           WHERE oid = pg_catalog.to_regtype('inbox__queue_shape'))
                          AND attname = field AND NOT attisdropped) THEN
            EXECUTE pg_catalog.format('ALTER TYPE inbox__queue_shape ADD ATTRIBUTE %I bool', field);
        END IF;
    END LOOP;
    IF pg_catalog.to_regtype('inbox__ledger_shape') IS NULL THEN
        CREATE TYPE inbox__ledger_shape AS (table_sql text);
    END IF;
END
$$;

-- inbox__required (22004 naming the argument) is shared with the pgrx build: sql/shared/outbox.sql.

-- A required time that is finite (error.rs finite_time).
CREATE OR REPLACE FUNCTION inbox__finite_time(value timestamptz, argument text) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = argument || ' must not be NULL';
    END IF;
    IF NOT isfinite(value) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('%s must be a finite time, not %s',
            argument, CASE WHEN value > 'epoch'::timestamptz THEN 'infinity' ELSE '-infinity' END);
    END IF;
    RETURN value;
END
$$;

-- Always double-quotes (names.rs quote_identifier).
CREATE OR REPLACE FUNCTION inbox__quote_identifier(identifier text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN '"' || replace(identifier, '"', '""') || '"';

-- names.rs quote_literal: doubles single quotes only.
CREATE OR REPLACE FUNCTION inbox__quote_literal(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN '''' || replace(value, '''', '''''') || '''';

-- Parses [schema.]name as names.rs does and returns it quoted; 42602 or 42622 otherwise.
CREATE OR REPLACE FUNCTION inbox__parse_qualified_name(name text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
DECLARE
    chars text[] := regexp_split_to_array(name, '');
    n int := coalesce(array_length(chars, 1), 0);
    i int := 1;
    c text;
    part text;
    parts text[] := '{}';
    reason text;
BEGIN
    <<parsing>>
    LOOP
        part := '';
        IF i <= n AND chars[i] = '"' THEN
            i := i + 1;
            LOOP
                IF i > n THEN
                    reason := 'unterminated quoted identifier';
                    EXIT parsing;
                END IF;
                c := chars[i];
                i := i + 1;
                IF c = '"' THEN
                    IF i <= n AND chars[i] = '"' THEN
                        part := part || '"';
                        i := i + 1;
                    ELSE
                        EXIT;
                    END IF;
                ELSE
                    part := part || c;
                END IF;
            END LOOP;
            IF part = '' THEN
                reason := 'zero-length quoted identifier';
                EXIT parsing;
            END IF;
        ELSE
            WHILE i <= n LOOP
                c := chars[i];
                EXIT WHEN NOT (c = '_' OR c ~ '^[[:alpha:]]$' OR lower(c) <> upper(c)
                               OR (part <> '' AND (c ~ '^[0-9$]$')));
                part := part || translate(c, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz');
                i := i + 1;
            END LOOP;
            IF part = '' THEN
                reason := 'expected an identifier';
                EXIT parsing;
            END IF;
        END IF;
        parts := parts || part;
        IF i > n THEN
            EXIT parsing;
        END IF;
        c := chars[i];
        i := i + 1;
        IF c = '.' AND cardinality(parts) < 2 THEN
            CONTINUE parsing;
        ELSIF c = '.' THEN
            reason := 'at most schema.name';
        ELSE
            reason := 'unexpected character (quote the name to use it)';
        END IF;
        EXIT parsing;
    END LOOP;
    IF reason IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '42602',
            MESSAGE = format('invalid table name %s: %s', inbox__quote_literal(name), reason);
    END IF;
    FOREACH part IN ARRAY parts LOOP
        IF octet_length(part) > 63 THEN
            RAISE EXCEPTION USING ERRCODE = '42622', MESSAGE = format(
                'identifier "%s" is %s bytes long; at most 63 are allowed', part, octet_length(part));
        END IF;
    END LOOP;
    RETURN array_to_string(ARRAY(SELECT inbox__quote_identifier(p) FROM unnest(parts) AS p), '.');
END
$$;

-- Reads the table's quoted name and the columns `names` (the first `required` of them required),
-- each checked to be of its kind: i an integer, x text, t timestamptz, p jsonb or bytea. Returns
-- the type of each column (NULL when absent) and whether it is NOT NULL. Raises as shape.rs:
-- 42P01 for an oid that is no table any more, 42809 for a relation that is not an ordinary or
-- partitioned table, 42703 for a missing column, 42804 for a mistyped one. One catalog query.
CREATE OR REPLACE FUNCTION inbox__checked_columns(tab regclass, kind text, names text[], kinds text,
                                                  required int, OUT table_sql text,
                                                  OUT types oid[], OUT not_nulls bool[])
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
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
CREATE OR REPLACE FUNCTION inbox__queue_shape(queue regclass) RETURNS inbox__queue_shape
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
DECLARE
    t record;
    shape inbox__queue_shape;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    t := inbox__checked_columns(queue, 'queue',
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
CREATE OR REPLACE FUNCTION inbox__ledger_shape(ledger regclass) RETURNS inbox__ledger_shape
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
BEGIN
    IF ledger IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ledger must not be NULL';
    END IF;
    RETURN ROW((inbox__checked_columns(ledger, 'ledger', '{event_key,seen_at}', 'xt', 2)).table_sql)::inbox__ledger_shape;
END
$$;

-- The condition that a row is a job waiting behind its group's head (QueueShape::waiting).
CREATE OR REPLACE FUNCTION inbox__waiting_predicate(shape inbox__queue_shape) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN CASE WHEN shape.groups THEN 'locked_until = ''infinity'' AND dead_at IS NULL' ELSE 'false' END;

-- The queue's oid as the int4 first key of the two-key advisory locks (groups.rs lock_key).
CREATE OR REPLACE FUNCTION inbox__lock_key(queue regclass) RETURNS int4
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT
RETURN (queue::oid::int8 - CASE WHEN queue::oid::int8 > 2147483647 THEN 4294967296 ELSE 0 END)::int4;

-- The schema this build is installed in (for the functions that keep the caller's search_path).
CREATE OR REPLACE FUNCTION inbox__install_schema() RETURNS text
LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT n.nspname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
     WHERE p.oid = 'inbox__install_schema()'::regprocedure
$$;

-- inbox__prepared (a statement planned once per session) is shared with the pgrx build:
-- sql/shared/controls.sql.

-- The statements a session keeps for the job path. A call on the job path would otherwise read
-- its table's shape from the catalog, build its statement's text and hash it, and look the name
-- up in pg_prepared_statements, every time: more than the statement itself costs. Instead each
-- session keeps, per table and operation, the name of the prepared statement and the table's
-- name in a setting of its own (`inbox_session.<op>_<table oid>`), and beside the statement a
-- probe, `SELECT * FROM <table> WHERE false`. Before a kept statement is used, the table's name
-- must still be the table's (after a rename it may be another table's, which a statement
-- prepared again would then reach), and the probe must run: PostgreSQL prepares it again (as the
-- statement) after any change of the table, and it then fails when a column was added, dropped,
-- renamed or retyped (its result type changes); it also fails when DEALLOCATE ALL removed the
-- session's statements (DISCARD ALL resets the setting too), and for a role that may not read
-- the table. Otherwise the caller builds the statement from the table's shape, as without a kept
-- statement. What neither sees is a column's NOT NULL being set or dropped: the session goes on
-- with the shape it read until it reconnects or calls DISCARD ALL (docs/sql-only.md).

-- The name of the session's statement `op` for `tab`, or NULL when the session has none that it
-- can trust (never kept, or its table or probe changed).
CREATE OR REPLACE FUNCTION inbox__session_statement(tab regclass, op text) RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
DECLARE
    -- The statement's name, a space, the table's name.
    kept text := current_setting('inbox_session.' || op || '_' || tab::oid, true);
    statement text := split_part(kept, ' ', 1);
BEGIN
    IF statement IS NULL OR statement = ''
       OR to_regclass(substr(kept, length(statement) + 2)) IS DISTINCT FROM tab THEN
        RETURN NULL;
    END IF;
    BEGIN
        EXECUTE 'EXECUTE ' || statement || '_probe';
    EXCEPTION WHEN OTHERS THEN
        RETURN NULL;
    END;
    RETURN statement;
END
$$;

-- Keeps `statement` (a name from inbox__prepared) as the session's statement `op` for `tab`
-- (named `table_sql`), with its probe prepared afresh; returns it.
CREATE OR REPLACE FUNCTION inbox__keep_statement(tab regclass, op text, table_sql text, statement text)
RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    probe text := statement || '_probe';
BEGIN
    IF EXISTS (SELECT FROM pg_prepared_statements p WHERE p.name = probe) THEN
        EXECUTE format('DEALLOCATE %I', probe);
    END IF;
    EXECUTE format('PREPARE %I AS SELECT * FROM %s WHERE false', probe, table_sql);
    PERFORM set_config('inbox_session.' || op || '_' || tab::oid, statement || ' ' || table_sql, false);
    RETURN statement;
END
$$;
