-- Citus (docs/scaling.md, "On Citus"): the placements of queues and ledgers that keep each of a
-- job's statements on one node, and a clear refusal of those that cannot.
--
-- A queue must be one shard: a table of a distributed schema (with the tables its handlers write,
-- so that a delivery commits on one node) or a single-shard table. A lease's
-- FOR UPDATE SKIP LOCKED cannot run across the shards of a hash-distributed table, and a
-- reference table would write every lease on every node. A ledger may also be hash-distributed
-- by event_key (a claim routes to the key's shard). Without Citus, nothing here runs a query.

-- How Citus places `tbl`: pg_dist_partition's partmethod ('h' hash, 'n' none) and repmodel
-- ('t' a reference table), both NULL where Citus is not installed or does not distribute it.
CREATE OR REPLACE FUNCTION inbox__citus_placement(tbl pg_catalog.regclass, OUT method pg_catalog.text,
                                                  OUT replication pg_catalog.text)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NULL THEN
        RETURN;
    END IF;
    -- Citus's catalogs exist only where it is installed: read them by name.
    EXECUTE 'SELECT p.partmethod::pg_catalog.text, p.repmodel::pg_catalog.text '
            '  FROM pg_catalog.pg_dist_partition p WHERE p.logicalrelid OPERATOR(pg_catalog.=) $1'
       INTO method, replication USING tbl;
END
$$;
COMMENT ON FUNCTION inbox__citus_placement(pg_catalog.regclass) IS
    'How Citus distributes a table (NULLs where it does not).';

-- Places `tbl`, a table a function just created, as Citus places a table of a distributed schema
-- created by a top-level CREATE TABLE (which is all Citus distributes by itself): one shard,
-- colocated with the other tables of its schema. That needs one of them already distributed to
-- colocate with; without one it leaves `tbl` alone (inbox__citus_check then says what to do). A
-- no-op without Citus, or outside a distributed schema.
CREATE OR REPLACE FUNCTION inbox__citus_join_tenant(tbl pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    neighbour pg_catalog.regclass;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_schema') IS NULL
       OR (@extschema@.inbox__citus_placement(tbl)).method IS NOT NULL THEN
        RETURN;
    END IF;
    -- Citus's catalogs exist only where it is installed: read them by name.
    EXECUTE 'SELECT p.logicalrelid FROM pg_catalog.pg_dist_schema s '
            '  JOIN pg_catalog.pg_class t ON t.relnamespace OPERATOR(pg_catalog.=) s.schemaid '
            '  JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) s.schemaid '
            '  JOIN pg_catalog.pg_dist_partition p ON p.logicalrelid OPERATOR(pg_catalog.=) c.oid '
            '                                     AND p.colocationid OPERATOR(pg_catalog.=) s.colocationid '
            ' WHERE t.oid OPERATOR(pg_catalog.=) $1 ORDER BY c.oid LIMIT 1'
       INTO neighbour USING tbl;
    IF neighbour IS NOT NULL THEN
        EXECUTE 'SELECT pg_catalog.create_distributed_table($1, NULL, colocate_with => $2)'
          USING tbl, neighbour::pg_catalog.text;
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__citus_join_tenant(pg_catalog.regclass) IS
    'Makes a table a function created in a Citus distributed schema one of that schema''s tables.';

-- Raises 0A000 unless `tbl`, a `kind` ('queue' or 'ledger'), is placed as above. Called where a
-- queue or a ledger is created, and by the pgrx build where it first reads a table's shape.
CREATE OR REPLACE FUNCTION inbox__citus_check(tbl pg_catalog.regclass, kind pg_catalog.text) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    method pg_catalog.text;
    replication pg_catalog.text;
    tenant_schema pg_catalog.text;
BEGIN
    SELECT p.method, p.replication INTO method, replication FROM @extschema@.inbox__citus_placement(tbl) p;
    IF method IS NULL AND pg_catalog.to_regclass('pg_catalog.pg_dist_schema') IS NOT NULL THEN
        EXECUTE 'SELECT s.schemaid::pg_catalog.regnamespace::pg_catalog.text '
                '  FROM pg_catalog.pg_dist_schema s JOIN pg_catalog.pg_class c '
                '    ON c.relnamespace OPERATOR(pg_catalog.=) s.schemaid '
                ' WHERE c.oid OPERATOR(pg_catalog.=) $1'
           INTO tenant_schema USING tbl;
    END IF;
    IF tenant_schema IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('%s %s is in the distributed schema %s but is not distributed', kind, tbl, tenant_schema),
            DETAIL = 'Citus distributes only a table created by a top-level CREATE TABLE, not one a function creates, '
                     'and the schema has no distributed table yet for the function to join; this one would stay on the '
                     'coordinator, and every delivery would be a transaction across nodes.',
            HINT = pg_catalog.format('Create one of the schema''s tables first (CREATE TABLE %s.effects ...) and then the %s, '
                                     'or create the %s in a schema that is not distributed yet and distribute that schema: '
                                     'SELECT citus_schema_distribute(''%s'').', tenant_schema, kind, kind, tenant_schema);
    END IF;
    IF method OPERATOR(pg_catalog.=) 'h' AND kind OPERATOR(pg_catalog.=) 'queue' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('queue %s is hash-distributed by Citus', tbl),
            DETAIL = 'A lease takes jobs with FOR UPDATE SKIP LOCKED, which Citus runs on one shard only.',
            HINT = 'Make the queue one shard: a table of a distributed schema, or create_distributed_table(queue, NULL).';
    END IF;
    IF method OPERATOR(pg_catalog.=) 'n' AND replication OPERATOR(pg_catalog.=) 't' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('%s %s is a Citus reference table', kind, tbl),
            DETAIL = pg_catalog.format('Every write to a reference table is a transaction on every node; a %s is written by every job.', kind),
            HINT = 'Make it one shard: a table of a distributed schema, or create_distributed_table(table, NULL).';
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__citus_check(pg_catalog.regclass, pg_catalog.text) IS
    'Raises 0A000 unless a queue or a ledger is placed by Citus so that each statement routes to one node.';

-- Raises 0A000 when `ledger` is hash-distributed by Citus: inbox_purge deletes by ctid, which
-- Citus cannot plan across shards (a ctid is unique only within its shard). Each shard is a
-- plain table on its node, where inbox_purge runs.
CREATE OR REPLACE FUNCTION inbox__citus_check_purge(ledger pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    method pg_catalog.text;
BEGIN
    SELECT p.method INTO method FROM @extschema@.inbox__citus_placement(ledger) p;
    IF method OPERATOR(pg_catalog.=) 'h' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('inbox_purge cannot run on %s, which is hash-distributed by Citus', ledger),
            DETAIL = 'It deletes by ctid, which Citus cannot plan across shards.',
            HINT = pg_catalog.format('Purge shard by shard: SELECT shardid, result FROM run_command_on_shards(''%s'', '
                                     '$q$SELECT inbox_purge(''%%s'', now() - interval ''30 days'', 10000)$q$).', ledger);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__citus_check_purge(pg_catalog.regclass) IS
    'Raises 0A000 when inbox_purge is called on a ledger that Citus hash-distributes.';

-- Raises 0A000 when Citus distributes `queue`: `what` (workflows, limits) writes the extension's
-- own tables in the transactions that settle the queue's jobs, and those tables are local to each
-- node, so a settlement would write two nodes, which Citus commits without two-phase commit when
-- one of them holds only local tables (not atomically).
CREATE OR REPLACE FUNCTION inbox__citus_check_local(queue pg_catalog.regclass, what pg_catalog.text) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF (@extschema@.inbox__citus_placement(queue)).method IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('%s cannot be used on %s, which Citus distributes', what, queue),
            DETAIL = pg_catalog.format('The %s write the extension''s own tables, which are local to each node, in the '
                                       'transaction that settles a job: Citus would not commit it atomically.', what);
    END IF;
END
$$;
COMMENT ON FUNCTION inbox__citus_check_local(pg_catalog.regclass, pg_catalog.text) IS
    'Raises 0A000 when a capability that writes the extension''s own tables is used on a queue Citus distributes.';
