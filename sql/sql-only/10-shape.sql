-- Table shapes and names: what shape.rs and names.rs check, with the same errors. Every other
-- file reads a table's columns through inbox__queue_shape / inbox__ledger_shape only.

DO $$
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
            dead_predicate text
        );
    END IF;
    IF pg_catalog.to_regtype('inbox__ledger_shape') IS NULL THEN
        CREATE TYPE inbox__ledger_shape AS (table_sql text);
    END IF;
END
$$;

-- Raises 22004 naming the argument.
CREATE OR REPLACE FUNCTION inbox__required(value anyelement, argument text) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = argument || ' must not be NULL';
    END IF;
    RETURN value;
END
$$;

-- A required time that is finite (error.rs finite_time).
CREATE OR REPLACE FUNCTION inbox__finite_time(value timestamptz, argument text) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path FROM CURRENT AS $$
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

-- The table's quoted name and its live columns (name, type, not null); 42P01 for an oid that is
-- no table any more, 42809 for a relation that is not an ordinary or partitioned table.
CREATE OR REPLACE FUNCTION inbox__table_columns(tab regclass, OUT table_sql text,
                                                OUT names text[], OUT types oid[], OUT not_nulls bool[])
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
DECLARE
    relkind text;
BEGIN
    SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname)
      INTO relkind, table_sql
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = tab;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42P01', MESSAGE = format('no table with oid %s', tab::oid);
    END IF;
    IF relkind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION USING ERRCODE = '42809', MESSAGE = format('%s is not a table', table_sql);
    END IF;
    SELECT coalesce(array_agg(a.attname::text), '{}'), coalesce(array_agg(a.atttypid), '{}'),
           coalesce(array_agg(a.attnotnull), '{}')
      INTO names, types, not_nulls
      FROM pg_attribute a
     WHERE a.attrelid = tab AND a.attnum > 0 AND NOT a.attisdropped;
END
$$;

-- Position of column `name` among `names`, checked to be one of `accepted`; 0 when absent and
-- optional. 42703 / 42804 as shape.rs.
CREATE OR REPLACE FUNCTION inbox__column(kind text, table_sql text, names text[], types oid[],
                                         name text, accepted oid[], required bool) RETURNS int
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
DECLARE
    at int := array_position(names, name);
BEGIN
    IF at IS NULL THEN
        IF required THEN
            RAISE EXCEPTION USING ERRCODE = '42703',
                MESSAGE = format('%s table %s has no column "%s"', kind, table_sql, name);
        END IF;
        RETURN 0;
    END IF;
    IF NOT types[at] = ANY (accepted) THEN
        RAISE EXCEPTION USING ERRCODE = '42804', MESSAGE = format(
            'column "%s" of %s table %s is of type %s, expected %s', name, kind, table_sql,
            format_type(types[at], NULL),
            array_to_string(ARRAY(SELECT format_type(t, NULL) FROM unnest(accepted) AS t), ' or '));
    END IF;
    RETURN at;
END
$$;

-- shape.rs QueueShape::load.
CREATE OR REPLACE FUNCTION inbox__queue_shape(queue regclass) RETURNS inbox__queue_shape
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT AS $$
DECLARE
    t record;
    shape inbox__queue_shape;
    integers constant oid[] := '{21,23,20}';   -- smallint, integer, bigint
    texts constant oid[] := '{25,1043}';        -- text, character varying
    timestamptz constant oid[] := '{1184}';
    locked_until int;
    payload int;
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'queue must not be NULL';
    END IF;
    t := inbox__table_columns(queue);
    PERFORM inbox__column('queue', t.table_sql, t.names, t.types, 'id', integers, true);
    PERFORM inbox__column('queue', t.table_sql, t.names, t.types, 'attempt', integers, true);
    locked_until := inbox__column('queue', t.table_sql, t.names, t.types, 'locked_until', timestamptz, true);
    payload := inbox__column('queue', t.table_sql, t.names, t.types, 'payload', '{3802,17}', true);
    shape.table_sql := t.table_sql;
    shape.payload := CASE WHEN t.types[payload] = 17 THEN 'bytea' ELSE 'jsonb' END;
    shape.nullable_locked_until := NOT t.not_nulls[locked_until];
    shape.has_key := inbox__column('queue', t.table_sql, t.names, t.types, 'key', texts, false) > 0;
    shape.has_last_error := inbox__column('queue', t.table_sql, t.names, t.types, 'last_error', texts, false) > 0;
    shape.has_leased_at := inbox__column('queue', t.table_sql, t.names, t.types, 'leased_at', timestamptz, false) > 0;
    shape.has_priority := inbox__column('queue', t.table_sql, t.names, t.types, 'priority', integers, false) > 0;
    shape.has_group_key := inbox__column('queue', t.table_sql, t.names, t.types, 'group_key', texts, false) > 0;
    shape.has_dead_at := inbox__column('queue', t.table_sql, t.names, t.types, 'dead_at', timestamptz, false) > 0;
    shape.has_run_at := inbox__column('queue', t.table_sql, t.names, t.types, 'run_at', timestamptz, false) > 0;
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
DECLARE
    t record;
BEGIN
    IF ledger IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ledger must not be NULL';
    END IF;
    t := inbox__table_columns(ledger);
    PERFORM inbox__column('ledger', t.table_sql, t.names, t.types, 'event_key', '{25,1043}', true);
    PERFORM inbox__column('ledger', t.table_sql, t.names, t.types, 'seen_at', '{1184}', true);
    RETURN ROW(t.table_sql)::inbox__ledger_shape;
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
    SELECT p.pronamespace::regnamespace::text FROM pg_proc p
     WHERE p.oid = 'inbox__install_schema()'::regprocedure
$$;
