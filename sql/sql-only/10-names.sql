-- Names and the statements a session keeps: what names.rs checks, with the same errors, and the
-- session's kept statements of the job path. Every file reads a table's columns through
-- inbox__queue_shape / inbox__ledger_shape only (sql/shared/shape.sql, both builds).
--
-- Every function pins its search_path (SET search_path FROM CURRENT, made the catalog first at
-- the end of the install), except the helpers that only the job path's functions call
-- (inbox__session_statement, inbox__take_jobs, inbox__enqueue, inbox__notify, the argument
-- checks, ...): they run on their caller's pinned path, since a SET clause costs each call a save
-- and restore of the setting, a few microseconds of a claim's forty.

-- inbox__required (22004 naming the argument) is shared with the pgrx build: sql/shared/outbox.sql,
-- and inbox__finite_time: sql/shared/shape.sql.

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
