-- The transactional outbox (docs/guide.md, "Publishing events"; docs/sql-api.md, "Outboxes"),
-- written once for both builds, except the publish: it runs in every producer's transaction, so
-- the pgrx build has it natively (outbox.rs) and the SQL-only build in sql/sql-only/35-publish.sql.
--
-- An outbox is a table of messages. `inbox_publish` inserts one inside the caller's transaction,
-- so it exists only if that transaction commits. A relay claims due messages with a lease and a
-- fencing token, publishes them to a broker and deletes them once the broker acknowledged them.
--
-- Order per key is commit order: a publish with a key first takes a transaction-level advisory
-- lock of (outbox, key), held until its transaction ends, and only then draws its id. So of two
-- transactions publishing one key, the second draws its id after the first committed (or rolled
-- back): within a key, ids increase in commit order, and the committed messages of a key are
-- always a prefix of its ids. A relay sends only the head of each key (no earlier unsent message
-- of the key, sending, waiting for a retry or not), so it never passes a message that may still
-- commit before an earlier one, and never needs a fence on the oldest open transaction: a long
-- transaction holds back only the keys it published to, not the whole outbox. Messages without a
-- key take no lock and are ordered by nothing.
--
-- A message behind its key's head is set aside by the claim that meets it (locked_until =
-- 'infinity', out of the claims' index), so a key with a long backlog costs each later claim
-- nothing; settling the head (sent, or dead) makes the key's next message due again ('-infinity').
-- Only a claim sets a message aside, while a message of its key before it stays locked by the
-- claim (FOR SHARE), so that a settlement of that message waits for the claim and then finds the
-- message set aside: none stays aside behind nothing.
--
-- The table is shaped like a queue (id, attempt, locked_until, payload), so that relays sleep and
-- wake through the queues' own functions (inbox_sleep, inbox_channel, inbox_notify); its
-- ordering_key column marks it as an outbox, which inbox_queues leaves out.
--
-- References to the extension's own objects are written @extschema@.name: PostgreSQL fills the
-- schema in when it creates the extension, and scripts/sql-only-build.sh drops the qualifier (the
-- SQL-only build pins its functions' search_path to its own schema).

-- Which relay holds each outbox, and what it sent. One row per outbox, made by its first claim.
CREATE TABLE IF NOT EXISTS inbox_relays (
    outbox pg_catalog.regclass PRIMARY KEY,
    relay pg_catalog.text NOT NULL,
    -- Drawn anew by every claim: the messages of a claim carry it, and only it settles them.
    token pg_catalog.int8 NOT NULL,
    leased_until pg_catalog.timestamptz NOT NULL,
    -- Since when this relay has held the lease without a break.
    since pg_catalog.timestamptz NOT NULL,
    sent pg_catalog.int8 NOT NULL DEFAULT 0,
    duplicates pg_catalog.int8 NOT NULL DEFAULT 0,
    failures pg_catalog.int8 NOT NULL DEFAULT 0
);
COMMENT ON TABLE inbox_relays IS
    'The relay lease of each outbox (inbox_relay_claim) and the counts of what it sent.';
GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_relays TO PUBLIC;
ALTER TABLE inbox_relays ENABLE ROW LEVEL SECURITY;
DO $policies$
DECLARE
    policy pg_catalog.text;
BEGIN
    FOREACH policy IN ARRAY ARRAY['inbox_relays_read', 'inbox_relays_relay',
                                  'inbox_relays_lease', 'inbox_relays_remove'] LOOP
        IF EXISTS (SELECT FROM pg_catalog.pg_policy
                    WHERE polrelid = 'inbox_relays'::pg_catalog.regclass AND polname = policy) THEN
            EXECUTE pg_catalog.format('DROP POLICY %I ON inbox_relays', policy);
        END IF;
    END LOOP;
END
$policies$;
-- A role sees the relay of the outboxes it may read, and may relay those it may delete from.
CREATE POLICY inbox_relays_read ON inbox_relays FOR SELECT
    USING (pg_catalog.has_table_privilege(outbox, 'SELECT')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = outbox::pg_catalog.oid));
CREATE POLICY inbox_relays_relay ON inbox_relays FOR INSERT
    WITH CHECK (pg_catalog.has_table_privilege(outbox, 'UPDATE, DELETE'));
CREATE POLICY inbox_relays_lease ON inbox_relays FOR UPDATE
    USING (pg_catalog.has_table_privilege(outbox, 'UPDATE, DELETE'));
CREATE POLICY inbox_relays_remove ON inbox_relays FOR DELETE
    USING (pg_catalog.has_table_privilege(outbox, 'UPDATE, DELETE')
           OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = outbox::pg_catalog.oid));

-- Creates the outbox table `name` ([schema.]name, resolved as CREATE TABLE would), or returns an
-- existing table of the outbox's shape. Like the other create functions it keeps the caller's
-- search_path (so every name below is qualified) and the table belongs to the caller.
CREATE OR REPLACE FUNCTION inbox_create_outbox(name pg_catalog.text) RETURNS pg_catalog.regclass
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
DECLARE
    parts pg_catalog.text[];
    part pg_catalog.text;
    qualified pg_catalog.text;
    existing pg_catalog.regclass;
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'name must not be NULL';
    END IF;
    BEGIN
        parts := pg_catalog.parse_ident(name);
    EXCEPTION WHEN invalid_parameter_value THEN
        RAISE EXCEPTION USING ERRCODE = '42602', MESSAGE = pg_catalog.format('invalid name: %s', name);
    END;
    IF pg_catalog.cardinality(parts) OPERATOR(pg_catalog.>) 2 THEN
        RAISE EXCEPTION USING ERRCODE = '42602',
            MESSAGE = pg_catalog.format('invalid name: %s (at most schema.name)', name);
    END IF;
    FOREACH part IN ARRAY parts LOOP
        IF pg_catalog.octet_length(part) OPERATOR(pg_catalog.>) 63 THEN
            RAISE EXCEPTION USING ERRCODE = '42622',
                MESSAGE = pg_catalog.format('name too long: "%s" has more than 63 bytes', part);
        END IF;
    END LOOP;
    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(p), '.') INTO qualified
      FROM pg_catalog.unnest(parts) AS p;
    existing := pg_catalog.to_regclass(qualified);
    IF existing IS NULL THEN
        -- Every message is inserted once and deleted once: autovacuum visits often.
        EXECUTE pg_catalog.format(
            'CREATE TABLE %s ( '
            '    id pg_catalog.int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, '
            '    subject pg_catalog.text NOT NULL, '
            '    ordering_key pg_catalog.text, '
            '    payload pg_catalog.bytea NOT NULL, '
            '    headers pg_catalog.jsonb, '
            '    published_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(), '
            '    attempt pg_catalog.int4 NOT NULL DEFAULT 0, '
            '    locked_until pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(), '
            '    leased_at pg_catalog.timestamptz, '
            '    token pg_catalog.int8, '
            '    last_error pg_catalog.text, '
            '    dead_at pg_catalog.timestamptz '
            ') WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, '
            '        autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000, '
            '        autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05)', qualified);
        -- A claim walks the messages neither dead nor set aside in id order, and looks up each
        -- keyed one's predecessors in its key.
        EXECUTE pg_catalog.format(
            'CREATE INDEX ON %s (id) '
            'WHERE dead_at IS NULL AND locked_until OPERATOR(pg_catalog.<) ''infinity''::pg_catalog.timestamptz',
            qualified);
        EXECUTE pg_catalog.format(
            'CREATE INDEX ON %s (ordering_key, id) WHERE ordering_key IS NOT NULL AND dead_at IS NULL',
            qualified);
        EXECUTE pg_catalog.format('CREATE INDEX ON %s (dead_at, id) WHERE dead_at IS NOT NULL', qualified);
        existing := qualified::pg_catalog.regclass;
    END IF;
    -- An existing table must have every column of the outbox, of its type.
    DECLARE
        wanted record;
        actual pg_catalog.regtype;
    BEGIN
        FOR wanted IN VALUES ('id'::pg_catalog.text, 'pg_catalog.int8'::pg_catalog.regtype),
                             ('subject', 'pg_catalog.text'), ('ordering_key', 'pg_catalog.text'),
                             ('payload', 'pg_catalog.bytea'), ('headers', 'pg_catalog.jsonb'),
                             ('published_at', 'pg_catalog.timestamptz'), ('attempt', 'pg_catalog.int4'),
                             ('locked_until', 'pg_catalog.timestamptz'), ('leased_at', 'pg_catalog.timestamptz'),
                             ('token', 'pg_catalog.int8'), ('last_error', 'pg_catalog.text'),
                             ('dead_at', 'pg_catalog.timestamptz') LOOP
            SELECT a.atttypid::pg_catalog.regtype INTO actual FROM pg_catalog.pg_attribute a
             WHERE a.attrelid OPERATOR(pg_catalog.=) existing AND a.attname OPERATOR(pg_catalog.=) wanted.column1
               AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = '42703', MESSAGE = pg_catalog.format(
                    '%s is not an outbox: it has no column "%s"', existing, wanted.column1);
            ELSIF actual OPERATOR(pg_catalog.<>) wanted.column2 THEN
                RAISE EXCEPTION USING ERRCODE = '42804', MESSAGE = pg_catalog.format(
                    '%s is not an outbox: column "%s" is %s, not %s',
                    existing, wanted.column1, actual, wanted.column2);
            END IF;
        END LOOP;
    END;
    RETURN existing;
END
$$;
COMMENT ON FUNCTION inbox_create_outbox(pg_catalog.text) IS
    'Creates the outbox table (or returns an existing one of the outbox''s shape).';

-- Raises 22004 naming the argument unless `value` is given (both builds' functions check with it).
CREATE OR REPLACE FUNCTION inbox__required(value anyelement, argument pg_catalog.text) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = argument || ' must not be NULL';
    END IF;
    RETURN value;
END
$$;
COMMENT ON FUNCTION inbox__required(anyelement, pg_catalog.text) IS
    'The value, or 22004 naming the argument when it is NULL.';

-- Takes or renews the outbox's relay lease for `relay`, then claims up to `max` due messages: each
-- key's head (no earlier message of its key is unsent), and messages without a key, in id order.
-- Returns nothing while another relay holds the lease.
CREATE OR REPLACE FUNCTION inbox_relay_claim(outbox pg_catalog.regclass, relay pg_catalog.text,
                                             max pg_catalog.int4 DEFAULT 100,
                                             lease pg_catalog.interval DEFAULT '30 seconds')
RETURNS TABLE(id pg_catalog.int8, token pg_catalog.int8, attempt pg_catalog.int4, subject pg_catalog.text,
              key pg_catalog.text, payload pg_catalog.bytea, headers pg_catalog.jsonb,
              published_at pg_catalog.timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    at pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    claim_token pg_catalog.int8;
    claimed pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'),
            @extschema@.inbox__required(relay, 'relay'),
            @extschema@.inbox__required(max, 'max'),
            @extschema@.inbox__required(lease, 'lease');
    IF relay = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'relay must not be empty';
    ELSIF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('max must be at least 1, not %s', max);
    ELSIF lease <= '0'::pg_catalog.interval OR NOT pg_catalog.isfinite(lease) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('lease must be positive, not %s', lease);
    END IF;
    -- The lease row is locked until this transaction ends: of racing relays, one holds it.
    UPDATE @extschema@.inbox_relays r
       SET relay = inbox_relay_claim.relay, token = r.token + 1, leased_until = at + lease,
           since = CASE WHEN r.relay = inbox_relay_claim.relay AND r.leased_until > at THEN r.since ELSE at END
     WHERE r.outbox = inbox_relay_claim.outbox
       AND (r.relay = inbox_relay_claim.relay OR r.leased_until <= at)
    RETURNING r.token INTO claim_token;
    IF NOT FOUND THEN
        INSERT INTO @extschema@.inbox_relays AS r (outbox, relay, token, leased_until, since)
        VALUES (inbox_relay_claim.outbox, inbox_relay_claim.relay, 1, at + lease, at)
        ON CONFLICT (outbox) DO NOTHING
        RETURNING r.token INTO claim_token;
        IF NOT FOUND THEN
            RETURN;  -- another relay holds the lease
        END IF;
    END IF;
    -- Claims the heads among the first `max` × 4 due messages, in id order, stopping at `max`:
    -- where keys are many it looks at little more than the messages it takes.
    RETURN QUERY EXECUTE pg_catalog.format($claim$
        WITH picked AS (
            SELECT s.id
              FROM (SELECT m.id, m.ordering_key FROM %1$s m
                     WHERE m.dead_at IS NULL AND m.locked_until <= $2 AND m.locked_until < 'infinity'
                     ORDER BY m.id
                     LIMIT $4::pg_catalog.int8 * 4) AS s
             WHERE s.ordering_key IS NULL OR NOT EXISTS (
                   SELECT FROM %1$s e
                    WHERE e.ordering_key = s.ordering_key AND e.dead_at IS NULL AND e.id < s.id)
             LIMIT $4),
        locked AS (
            SELECT o.id FROM %1$s o
             WHERE o.id IN (SELECT id FROM picked) AND o.dead_at IS NULL AND o.locked_until <= $2
               FOR UPDATE SKIP LOCKED),
        claimed AS (
            UPDATE %1$s o SET attempt = o.attempt + 1, locked_until = $3, leased_at = $2, token = $1
              FROM locked WHERE o.id = locked.id
            RETURNING o.id, o.token, o.attempt, o.subject, o.ordering_key, o.payload, o.headers,
                      o.published_at)
        SELECT * FROM claimed ORDER BY id
        $claim$, outbox) USING claim_token, at, at + lease, max;
    GET DIAGNOSTICS claimed = ROW_COUNT;
    -- Fewer than half of `max`: the window is crowded by messages behind their keys' heads (a few
    -- keys with backlogs), or nearly empty. Those are set aside, so that the next claim looks past
    -- them; each while a message of its key before it is locked FOR SHARE until this commits, so
    -- that the settlement of that message (a delete or a dead-lettering) waits, then finds it set
    -- aside and makes it due again.
    IF claimed * 2 < max THEN
        EXECUTE pg_catalog.format($set_aside$
            UPDATE %1$s w SET locked_until = 'infinity'
              FROM (SELECT m.id FROM %1$s m
                     WHERE m.dead_at IS NULL AND m.locked_until <= $1 AND m.locked_until < 'infinity'
                     ORDER BY m.id
                     LIMIT $2::pg_catalog.int8 * 4) AS s
             WHERE w.id = s.id AND w.ordering_key IS NOT NULL AND w.locked_until > '-infinity'
               AND EXISTS (SELECT FROM %1$s e
                            WHERE e.ordering_key = w.ordering_key AND e.dead_at IS NULL AND e.id < w.id
                            ORDER BY e.id LIMIT 1 FOR SHARE OF e)
            $set_aside$, outbox) USING at, max;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox_relay_claim(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4, pg_catalog.interval) IS
    'Takes or renews the outbox''s relay lease and claims due messages, each key''s head only; nothing while another relay holds the lease.';

-- Who holds the outbox's relay lease (or held it last), and until when: a relay whose claim came
-- back empty learns whether it leads or stands by, without counting the outbox.
CREATE OR REPLACE FUNCTION inbox_relay_lease(outbox pg_catalog.regclass)
RETURNS TABLE(relay pg_catalog.text, token pg_catalog.int8, leased_until pg_catalog.timestamptz,
              since pg_catalog.timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox');
    RETURN QUERY SELECT r.relay, r.token, r.leased_until, r.since
                   FROM @extschema@.inbox_relays r WHERE r.outbox = inbox_relay_lease.outbox;
END
$$;
COMMENT ON FUNCTION inbox_relay_lease(pg_catalog.regclass) IS
    'The relay holding (or last holding) the outbox''s lease, its last token, and until when it holds it.';

-- Makes the oldest message of each of `keys` due at once ('-infinity') if a claim set it aside:
-- after a settlement took its key's head away. One index probe per key.
CREATE OR REPLACE FUNCTION inbox__outbox_promote(outbox pg_catalog.regclass, keys pg_catalog.text[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF keys IS NULL OR pg_catalog.cardinality(keys) = 0 THEN
        RETURN;
    END IF;
    EXECUTE pg_catalog.format($promote$
        UPDATE %1$s o SET locked_until = '-infinity'
          FROM (SELECT (SELECT e.id FROM %1$s e
                         WHERE e.ordering_key = k.key AND e.dead_at IS NULL
                         ORDER BY e.id LIMIT 1) AS id
                  FROM (SELECT DISTINCT pg_catalog.unnest($1) AS key) AS k) AS heads
         WHERE o.id = heads.id AND o.dead_at IS NULL AND o.locked_until = 'infinity'
        $promote$, outbox) USING keys;
END
$$;
COMMENT ON FUNCTION inbox__outbox_promote(pg_catalog.regclass, pg_catalog.text[]) IS
    'Makes the oldest message of each key due at once, after its key''s head was settled.';

-- Deletes the messages a relay published (the broker acknowledged them) while they are still
-- that claim's; returns how many it deleted.
CREATE OR REPLACE FUNCTION inbox_relay_sent(outbox pg_catalog.regclass, token pg_catalog.int8,
                                            ids pg_catalog.int8[], duplicates pg_catalog.int4 DEFAULT 0)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    deleted pg_catalog.int8;
    keys pg_catalog.text[];
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'),
            @extschema@.inbox__required(token, 'token'),
            @extschema@.inbox__required(ids, 'ids');
    IF coalesce(duplicates, -1) < 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'duplicates must be 0 or more';
    END IF;
    EXECUTE pg_catalog.format(
        'WITH deleted AS (DELETE FROM %s WHERE id = ANY ($1) AND token = $2 AND dead_at IS NULL '
        '                 RETURNING ordering_key) '
        'SELECT count(*), array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL) FROM deleted',
        outbox)
      INTO deleted, keys USING ids, token;
    PERFORM @extschema@.inbox__outbox_promote(outbox, keys);
    IF deleted > 0 THEN
        UPDATE @extschema@.inbox_relays r
           SET sent = r.sent + deleted, duplicates = r.duplicates + least(inbox_relay_sent.duplicates, deleted)
         WHERE r.outbox = inbox_relay_sent.outbox;
    END IF;
    RETURN deleted;
END
$$;
COMMENT ON FUNCTION inbox_relay_sent(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8[], pg_catalog.int4) IS
    'Deletes the published messages still held by the claim of `token`; returns how many.';

-- Records failed publishes of a claim: each message waits `delay` (by default 2^(attempt-1)
-- seconds, at most 5 minutes) before its next claim, or is dead-lettered once it has had
-- `max_attempts` attempts. Returns how many messages were still that claim's.
CREATE OR REPLACE FUNCTION inbox_relay_failed(outbox pg_catalog.regclass, token pg_catalog.int8,
                                              ids pg_catalog.int8[], errors pg_catalog.text[],
                                              max_attempts pg_catalog.int4 DEFAULT 10,
                                              delay pg_catalog.interval DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    recorded pg_catalog.int8;
    dead_keys pg_catalog.text[];
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'),
            @extschema@.inbox__required(token, 'token'),
            @extschema@.inbox__required(ids, 'ids'),
            @extschema@.inbox__required(errors, 'errors'),
            @extschema@.inbox__required(max_attempts, 'max_attempts');
    IF pg_catalog.cardinality(ids) <> pg_catalog.cardinality(errors) THEN
        RAISE EXCEPTION USING ERRCODE = '2202E', MESSAGE = pg_catalog.format(
            'ids and errors must have the same length (%s and %s)',
            pg_catalog.cardinality(ids), pg_catalog.cardinality(errors));
    ELSIF max_attempts < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = pg_catalog.format('max_attempts must be at least 1, not %s', max_attempts);
    ELSIF delay < '0'::pg_catalog.interval OR NOT pg_catalog.isfinite(delay) THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('delay must not be negative, not %s', delay);
    END IF;
    EXECUTE pg_catalog.format($failed$
        WITH failed AS (UPDATE %s o
           SET last_error = f.error, leased_at = NULL,
               dead_at = CASE WHEN o.attempt >= $3 THEN $5 END,
               locked_until = CASE WHEN o.attempt >= $3 THEN 'infinity'::pg_catalog.timestamptz
                                   ELSE $5 + coalesce($4, least(
                                       '1 second'::pg_catalog.interval
                                           * pg_catalog.power(2, least(greatest(o.attempt, 1), 20) - 1),
                                       '5 minutes'::pg_catalog.interval)) END
          FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($6)) AS f(id, error)
         WHERE o.id = f.id AND o.token = $2 AND o.dead_at IS NULL AND o.leased_at IS NOT NULL
        RETURNING o.ordering_key, o.dead_at IS NOT NULL AS died)
        SELECT count(*), array_agg(ordering_key) FILTER (WHERE died AND ordering_key IS NOT NULL)
          FROM failed
        $failed$, outbox)
      INTO recorded, dead_keys
      USING ids, token, max_attempts, delay, pg_catalog.clock_timestamp(), errors;
    -- A dead message no longer holds its key back.
    PERFORM @extschema@.inbox__outbox_promote(outbox, dead_keys);
    IF recorded > 0 THEN
        UPDATE @extschema@.inbox_relays r SET failures = r.failures + recorded
         WHERE r.outbox = inbox_relay_failed.outbox;
    END IF;
    RETURN recorded;
END
$$;
COMMENT ON FUNCTION inbox_relay_failed(pg_catalog.regclass, pg_catalog.int8, pg_catalog.int8[], pg_catalog.text[], pg_catalog.int4, pg_catalog.interval) IS
    'Records failed publishes: a retry after a backoff, or the dead letter after max_attempts; returns how many messages were still the claim''s.';

-- Gives up `relay`'s lease (at shutdown, once its publishes are settled): another relay may claim
-- at once, and the messages still claimed are due again. Whether the lease was this relay's.
CREATE OR REPLACE FUNCTION inbox_relay_release(outbox pg_catalog.regclass, relay pg_catalog.text)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    at pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'),
            @extschema@.inbox__required(relay, 'relay');
    UPDATE @extschema@.inbox_relays r SET leased_until = at
     WHERE r.outbox = inbox_relay_release.outbox AND r.relay = inbox_relay_release.relay
       AND r.leased_until > at;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    EXECUTE pg_catalog.format(
        'UPDATE %s SET locked_until = $1, leased_at = NULL '
        ' WHERE leased_at IS NOT NULL AND locked_until > $1 AND locked_until < ''infinity'' '
        '   AND dead_at IS NULL', outbox) USING at;
    RETURN true;
END
$$;
COMMENT ON FUNCTION inbox_relay_release(pg_catalog.regclass, pg_catalog.text) IS
    'Gives up the relay''s lease of the outbox; its claimed messages are due again.';

-- A message's state as the operator functions name it.
CREATE OR REPLACE FUNCTION inbox__outbox_state(dead_at pg_catalog.timestamptz, leased_at pg_catalog.timestamptz,
                                              locked_until pg_catalog.timestamptz, at pg_catalog.timestamptz)
RETURNS pg_catalog.text
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
RETURN CASE WHEN dead_at IS NOT NULL THEN 'dead'
            WHEN locked_until OPERATOR(pg_catalog.<=) at
              OR locked_until OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz THEN 'pending'
            WHEN leased_at IS NOT NULL THEN 'sending'
            ELSE 'retrying' END;
COMMENT ON FUNCTION inbox__outbox_state(pg_catalog.timestamptz, pg_catalog.timestamptz, pg_catalog.timestamptz, pg_catalog.timestamptz) IS
    'A message''s state at `at`: pending, sending, retrying or dead.';

-- The outbox's messages in id order: all of them, or those of one state.
-- inbox_outbox_messages's body: PL/pgSQL cannot name an argument and a result column both `state`.
CREATE OR REPLACE FUNCTION inbox__outbox_messages(outbox pg_catalog.regclass, wanted pg_catalog.text,
                                                  max pg_catalog.int4)
RETURNS TABLE(id pg_catalog.int8, state pg_catalog.text, subject pg_catalog.text, key pg_catalog.text,
              attempt pg_catalog.int4, published_at pg_catalog.timestamptz, due pg_catalog.timestamptz,
              last_error pg_catalog.text, payload pg_catalog.bytea, headers pg_catalog.jsonb)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'),
            @extschema@.inbox__required(max, 'max');
    IF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('max must be at least 1, not %s', max);
    ELSIF wanted NOT IN ('pending', 'sending', 'retrying', 'dead') THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format(
            'state must be pending, sending, retrying or dead, not %s', wanted);
    END IF;
    RETURN QUERY EXECUTE pg_catalog.format($list$
        SELECT * FROM (
            SELECT m.id, @extschema@.inbox__outbox_state(m.dead_at, m.leased_at, m.locked_until, $2) AS state,
                   m.subject, m.ordering_key, m.attempt, m.published_at,
                   CASE WHEN m.dead_at IS NULL AND m.locked_until < 'infinity'
                        THEN greatest(m.locked_until, m.published_at) END,
                   m.last_error, m.payload, m.headers
              FROM %s m
             WHERE $1 IS NULL OR ($1 = 'dead') = (m.dead_at IS NOT NULL)
             ORDER BY m.id) AS listed
         WHERE $1 IS NULL OR listed.state = $1
         LIMIT $3
        $list$, outbox) USING wanted, pg_catalog.clock_timestamp(), max;
END
$$;
-- A SQL function's body is checked when it is created, under its own search_path, where the
-- SQL-only build's unqualified name is not found yet (its pin comes at the end of the install).
SET LOCAL check_function_bodies = off;
CREATE OR REPLACE FUNCTION inbox_outbox_messages(outbox pg_catalog.regclass, state pg_catalog.text DEFAULT NULL,
                                                 max pg_catalog.int4 DEFAULT 100)
RETURNS TABLE(id pg_catalog.int8, state pg_catalog.text, subject pg_catalog.text, key pg_catalog.text,
              attempt pg_catalog.int4, published_at pg_catalog.timestamptz, due pg_catalog.timestamptz,
              last_error pg_catalog.text, payload pg_catalog.bytea, headers pg_catalog.jsonb)
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
AS $$ SELECT * FROM @extschema@.inbox__outbox_messages(outbox, state, max) $$;
SET LOCAL check_function_bodies = on;
COMMENT ON FUNCTION inbox_outbox_messages(pg_catalog.regclass, pg_catalog.text, pg_catalog.int4) IS
    'The outbox''s messages in id order (all, or those of one state), at most max.';

-- Sends dead message `id` again (its attempts counted from zero); whether it was dead.
CREATE OR REPLACE FUNCTION inbox_outbox_requeue(outbox pg_catalog.regclass, id pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    requeued pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'), @extschema@.inbox__required(id, 'id');
    EXECUTE pg_catalog.format(
        'UPDATE %s SET dead_at = NULL, locked_until = ''-infinity'', attempt = 0, leased_at = NULL, '
        '       token = NULL WHERE id = $1 AND dead_at IS NOT NULL', outbox) USING id;
    GET DIAGNOSTICS requeued = ROW_COUNT;
    IF requeued > 0 THEN
        PERFORM @extschema@.inbox_notify(outbox);
    END IF;
    RETURN requeued > 0;
END
$$;
COMMENT ON FUNCTION inbox_outbox_requeue(pg_catalog.regclass, pg_catalog.int8) IS
    'Sends a dead message again, its attempts counted from zero; whether it was dead.';

-- Sends the dead messages again, oldest first: all, or at most `max`; returns how many.
CREATE OR REPLACE FUNCTION inbox_outbox_requeue_dead(outbox pg_catalog.regclass, max pg_catalog.int4 DEFAULT NULL)
RETURNS pg_catalog.int8
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    requeued pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox');
    IF max < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = pg_catalog.format('max must be at least 1, not %s', max);
    END IF;
    EXECUTE pg_catalog.format(
        'UPDATE %1$s SET dead_at = NULL, locked_until = ''-infinity'', attempt = 0, leased_at = NULL, token = NULL '
        ' WHERE id IN (SELECT id FROM %1$s WHERE dead_at IS NOT NULL ORDER BY dead_at, id LIMIT $1 '
        '              FOR UPDATE SKIP LOCKED)', outbox) USING max;
    GET DIAGNOSTICS requeued = ROW_COUNT;
    IF requeued > 0 THEN
        PERFORM @extschema@.inbox_notify(outbox);
    END IF;
    RETURN requeued;
END
$$;
COMMENT ON FUNCTION inbox_outbox_requeue_dead(pg_catalog.regclass, pg_catalog.int4) IS
    'Sends the dead messages again, oldest first (all, or at most max); returns how many.';

-- Deletes dead message `id`; whether it was dead.
CREATE OR REPLACE FUNCTION inbox_outbox_discard(outbox pg_catalog.regclass, id pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    discarded pg_catalog.int8;
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox'), @extschema@.inbox__required(id, 'id');
    EXECUTE pg_catalog.format('DELETE FROM %s WHERE id = $1 AND dead_at IS NOT NULL', outbox) USING id;
    GET DIAGNOSTICS discarded = ROW_COUNT;
    RETURN discarded > 0;
END
$$;
COMMENT ON FUNCTION inbox_outbox_discard(pg_catalog.regclass, pg_catalog.int8) IS
    'Deletes a dead message; whether it was dead.';

-- The outbox's counts by state, its relay and what it sent, and the age of the oldest open
-- transaction that holds a key of it (which holds back that key's later publishers).
CREATE OR REPLACE FUNCTION inbox_outbox_stats(outbox pg_catalog.regclass)
RETURNS TABLE(pending pg_catalog.int8, sending pg_catalog.int8, retrying pg_catalog.int8, dead pg_catalog.int8,
              oldest_unsent_age pg_catalog.interval, sent pg_catalog.int8, duplicates pg_catalog.int8,
              failures pg_catalog.int8, relay pg_catalog.text, relay_lease_until pg_catalog.timestamptz,
              oldest_publisher_age pg_catalog.interval)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    at pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    PERFORM @extschema@.inbox__required(outbox, 'outbox');
    EXECUTE pg_catalog.format($counts$
        SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'sending'),
               count(*) FILTER (WHERE state = 'retrying'), count(*) FILTER (WHERE state = 'dead'),
               $1 - min(published_at) FILTER (WHERE state <> 'dead')
          FROM (SELECT @extschema@.inbox__outbox_state(dead_at, leased_at, locked_until, $1) AS state,
                       published_at FROM %s) AS m
        $counts$, outbox) USING at
      INTO pending, sending, retrying, dead, oldest_unsent_age;
    SELECT r.sent, r.duplicates, r.failures, r.relay, r.leased_until
      INTO sent, duplicates, failures, relay, relay_lease_until
      FROM @extschema@.inbox_relays r WHERE r.outbox = inbox_outbox_stats.outbox;
    sent := coalesce(sent, 0);
    duplicates := coalesce(duplicates, 0);
    failures := coalesce(failures, 0);
    -- The key locks of inbox_publish_bytes: (outbox, odd key) in the two-key form (objsubid 2).
    SELECT at - min(a.xact_start) INTO oldest_publisher_age
      FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
       AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
       AND l.classid = outbox::pg_catalog.oid AND (l.objid::pg_catalog.int8 & 1) = 1;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION inbox_outbox_stats(pg_catalog.regclass) IS
    'The outbox''s messages by state, the age of the oldest unsent one, its relay and counts, and the age of the oldest transaction holding one of its keys.';

-- Every outbox the caller may read (a table with the outbox's columns), with its stats. A table
-- locked exclusively at that moment (DROP, ALTER, ...) is left out rather than waited for.
CREATE OR REPLACE FUNCTION inbox_outboxes()
RETURNS TABLE(outbox pg_catalog.regclass, pending pg_catalog.int8, sending pg_catalog.int8, retrying pg_catalog.int8,
              dead pg_catalog.int8, oldest_unsent_age pg_catalog.interval, sent pg_catalog.int8,
              duplicates pg_catalog.int8, failures pg_catalog.int8, relay pg_catalog.text,
              relay_lease_until pg_catalog.timestamptz, oldest_publisher_age pg_catalog.interval)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    candidate record;
BEGIN
    FOR candidate IN
        SELECT c.oid, pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(c.relname) AS name
          FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
           AND n.nspname <> 'information_schema' AND n.nspname !~ '^pg_(catalog|toast)'
           AND NOT pg_catalog.pg_is_other_temp_schema(n.oid)
           AND pg_catalog.has_schema_privilege(n.oid, 'USAGE')
           AND pg_catalog.has_table_privilege(c.oid, 'SELECT')
           AND 6 = (SELECT count(*) FROM pg_catalog.pg_attribute a
                     WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                       AND (a.attname, a.atttypid) IN (
                           ('subject', 'pg_catalog.text'::pg_catalog.regtype),
                           ('ordering_key', 'pg_catalog.text'::pg_catalog.regtype),
                           ('payload', 'pg_catalog.bytea'::pg_catalog.regtype),
                           ('locked_until', 'pg_catalog.timestamptz'::pg_catalog.regtype),
                           ('leased_at', 'pg_catalog.timestamptz'::pg_catalog.regtype),
                           ('dead_at', 'pg_catalog.timestamptz'::pg_catalog.regtype)))
         ORDER BY n.nspname, c.relname
    LOOP
        BEGIN
            EXECUTE pg_catalog.format('LOCK TABLE ONLY %s IN ACCESS SHARE MODE NOWAIT', candidate.name);
        EXCEPTION WHEN lock_not_available OR undefined_table OR invalid_schema_name THEN
            CONTINUE;
        END;
        CONTINUE WHEN pg_catalog.to_regclass(candidate.name) IS DISTINCT FROM candidate.oid::pg_catalog.regclass;
        outbox := candidate.oid::pg_catalog.regclass;
        SELECT * INTO pending, sending, retrying, dead, oldest_unsent_age, sent, duplicates, failures,
                      relay, relay_lease_until, oldest_publisher_age
          FROM @extschema@.inbox_outbox_stats(outbox);
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION inbox_outboxes() IS
    'Every outbox the caller may read, with the counts of inbox_outbox_stats.';
