-- The outbox's publish (outbox.rs has the pgrx build's): the rest of the outbox, and how the
-- key's lock keeps each key's messages in commit order, is in sql/shared/outbox.sql.

-- Records a message in the caller's transaction (see sql/shared/outbox.sql for the key's lock).
CREATE OR REPLACE FUNCTION inbox_publish_bytes(outbox pg_catalog.regclass, subject pg_catalog.text,
                                               payload pg_catalog.bytea, key pg_catalog.text DEFAULT NULL,
                                               headers pg_catalog.jsonb DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
DECLARE
    id pg_catalog.int8;
    table_oid pg_catalog.int8;
    statement_name pg_catalog.text;
BEGIN
    PERFORM inbox__required(outbox, 'outbox'),
            inbox__required(subject, 'subject'),
            inbox__required(payload, 'payload');
    IF subject = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'subject must not be empty';
    END IF;
    statement_name := 'inbox_publish_' || outbox::pg_catalog.oid::pg_catalog.text;
    IF headers IS NOT NULL AND (pg_catalog.jsonb_typeof(headers) <> 'object' OR EXISTS (
            SELECT FROM pg_catalog.jsonb_each(headers) AS h
             WHERE pg_catalog.jsonb_typeof(h.value) <> 'string'
               AND (pg_catalog.jsonb_typeof(h.value) <> 'array' OR EXISTS (
                    SELECT FROM pg_catalog.jsonb_array_elements(h.value) AS v
                     WHERE pg_catalog.jsonb_typeof(v) <> 'string')))) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'headers must be a JSON object of strings or arrays of strings';
    END IF;
    IF key IS NOT NULL THEN
        -- Held until the transaction ends: the next publisher of this key draws its id after
        -- this one committed. The second key is odd, apart from the even keys the wake-ups use.
        table_oid := outbox::pg_catalog.oid::pg_catalog.int8;
        PERFORM pg_catalog.pg_advisory_xact_lock(
            (table_oid - CASE WHEN table_oid > 2147483647 THEN 4294967296 ELSE 0 END)::pg_catalog.int4,
            pg_catalog.hashtext(key) | 1);
    END IF;
    -- The insert is planned once per session and outbox (a plain EXECUTE ... USING would plan it
    -- at every call, most of a publish's cost): a session's DEALLOCATE ALL or DISCARD ALL, or a
    -- pooler's next server connection, costs one PREPARE. A utility statement takes no
    -- parameters, so the values travel as literals.
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_prepared_statements p WHERE p.name = statement_name) THEN
        EXECUTE pg_catalog.format(
            'PREPARE %I (pg_catalog.text, pg_catalog.text, pg_catalog.bytea, pg_catalog.jsonb) AS '
            'INSERT INTO %s (subject, ordering_key, payload, headers) VALUES ($1, $2, $3, $4) RETURNING id',
            statement_name, outbox);
    END IF;
    EXECUTE pg_catalog.format('EXECUTE %I(%L, %L, %L, %L)', statement_name, subject, key, payload, headers)
       INTO id;
    PERFORM inbox_notify(outbox);
    RETURN id;
END
$$;

CREATE OR REPLACE FUNCTION inbox_publish(outbox pg_catalog.regclass, subject pg_catalog.text,
                                         payload pg_catalog.jsonb, key pg_catalog.text DEFAULT NULL,
                                         headers pg_catalog.jsonb DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path FROM CURRENT AS $$
BEGIN
    RETURN inbox_publish_bytes(
        outbox, subject,
        pg_catalog.convert_to(inbox__required(payload, 'payload')::pg_catalog.text, 'UTF8'),
        key, headers);
END
$$;

