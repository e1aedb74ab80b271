-- The dedup ledger (ledger.rs): inbox_claim records a key once, whatever the number of deliveries.

-- inbox_create_ledger and inbox_create_queue keep the caller's search_path, so that an unqualified
-- name lands where CREATE TABLE would put it (as the pgrx build); they therefore reach this
-- build's helpers through the install schema, written into their bodies here.
DO $install$
BEGIN
    EXECUTE format($create$
CREATE OR REPLACE FUNCTION inbox_create_ledger(name text) RETURNS regclass
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $body$
DECLARE
    ledger pg_catalog.text;
    existing pg_catalog.regclass;
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'name must not be NULL';
    END IF;
    ledger := %1$s.inbox__parse_qualified_name(name);
    existing := pg_catalog.to_regclass(ledger);
    IF existing IS NULL THEN
        EXECUTE pg_catalog.format('CREATE TABLE %%s (event_key pg_catalog.text PRIMARY KEY, '
                                  'seen_at pg_catalog.timestamptz NOT NULL)', ledger);
        EXECUTE pg_catalog.format('CREATE INDEX ON %%s USING brin (seen_at)', ledger);
        existing := ledger::pg_catalog.regclass;
        PERFORM %1$s.inbox__citus_join_tenant(existing);
    END IF;
    PERFORM %1$s.inbox__ledger_shape(existing);
    PERFORM %1$s.inbox__citus_check(existing, 'ledger');
    RETURN existing;
END
$body$
$create$, quote_ident(inbox__install_schema()));
END
$install$;

-- On the job path: the statement is the session's (inbox__session_statement) once a call built it.
CREATE OR REPLACE FUNCTION inbox_claim(ledger regclass, key text, seen_at timestamptz DEFAULT now())
RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    statement text;
    table_sql text;
    claimed bigint;
BEGIN
    IF ledger IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ledger must not be NULL';
    END IF;
    IF key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'key must not be NULL';
    END IF;
    IF seen_at IS NULL OR NOT isfinite(seen_at) THEN
        PERFORM inbox__finite_time(seen_at, 'seen_at');
    END IF;
    statement := inbox__session_statement(ledger, 'claim');
    IF statement IS NULL THEN
        table_sql := (inbox__ledger_shape(ledger)).table_sql;
        statement := inbox__keep_statement(ledger, 'claim', table_sql, inbox__prepared(format(
            'WITH claimed AS (INSERT INTO %s (event_key, seen_at) VALUES ($1, $2) '
            '                 ON CONFLICT (event_key) DO NOTHING RETURNING 1) '
            'SELECT count(*) FROM claimed', table_sql), 'text, timestamptz'));
    END IF;
    EXECUTE format('EXECUTE %I(%L, %L)', statement, key, seen_at) INTO claimed;
    RETURN claimed = 1;
END
$$;
DROP FUNCTION IF EXISTS inbox__claim(regclass, text, timestamptz);

CREATE OR REPLACE FUNCTION inbox_claim_or_fail(ledger regclass, key text, seen_at timestamptz DEFAULT now())
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT inbox_claim(ledger, key, seen_at) THEN
        RAISE EXCEPTION USING ERRCODE = '23505', MESSAGE = 'the key is already claimed in this ledger';
    END IF;
END
$$;

-- The statement runs in a volatile function, so that it reads the latest committed state with a
-- snapshot of its own, as the pgrx build's statements do.
CREATE OR REPLACE FUNCTION inbox__seen(ledger regclass, key text) RETURNS bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    seen bool;
BEGIN
    IF ledger IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'ledger must not be NULL';
    END IF;
    IF key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'key must not be NULL';
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT FROM %s WHERE event_key = $1)',
                   (inbox__ledger_shape(ledger)).table_sql)
      INTO seen USING key;
    RETURN coalesce(seen, false);
END
$$;

CREATE OR REPLACE FUNCTION inbox_seen(ledger regclass, key text) RETURNS bool
LANGUAGE plpgsql STABLE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    RETURN inbox__seen(ledger, key);
END
$$;

