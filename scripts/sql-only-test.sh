#!/usr/bin/env bash
# The SQL-only build's own checks (docs/sql-only.md), before the integration suite runs on it:
#   1. sql/inbox-sql-only.sql is what its sources give (scripts/sql-only-build.sh --check);
#   2. it installs with psql -f as a role that is not a superuser and owns the schema;
#   3. its API equals the pgrx build's: every function with the same arguments, defaults,
#      result, volatility, strictness, parallel safety, settings and comment;
#   4. the SQL tour (sql/tour.sql) runs on it as that role;
#   5. installing it again over a database in use (the upgrade in place) keeps the queues, leases,
#      ledgers and schedules and leaves the catalog equal to a fresh install;
#   6. installed by a superuser, it creates the event trigger, and a dropped queue's schedules
#      go with it.
# Leaves database inbox_sql_only (owned by role inbox_sql_only_owner) with the build installed
# for the integration suite.
#
# Usage: scripts/sql-only-test.sh DATABASE_URL_PREFIX   (a server URL without the database name)
# The pgrx build must be installed in that server (scripts/lib.sh's install_extension).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

server=$1
owner=inbox_sql_only_owner
work="$(mktemp -d /tmp/inbox-sql-only.XXXXXX)"
on_exit "rm -rf '$work'"
psql_on() { psql -X -w -q -v ON_ERROR_STOP=1 -d "$server/$1" "${@:2}"; }
# As the owner: the server URL with the user replaced.
owner_url() { echo "$server/$1" | sed -E "s#^(postgres(ql)?://)[^@/]*@#\1$owner@#"; }
psql_as_owner() { psql -X -w -q -v ON_ERROR_STOP=1 -d "$(owner_url "$1")" "${@:2}"; }
check() { # check DB DESCRIPTION SQL: the SQL must return true
  local got
  got="$(psql_on "$1" -Atc "$3")"
  if [[ "$got" != t ]]; then
    echo "FAILED: $2 (got '$got')" >&2
    exit 1
  fi
  echo "ok: $2"
}

banner "SQL-only: sql/inbox-sql-only.sql is current"
scripts/sql-only-build.sh --check
echo "ok"

banner "SQL-only: install as a role that is not a superuser"
psql_on postgres -c "SET client_min_messages = warning" \
  -c "DROP DATABASE IF EXISTS inbox_sql_only WITH (FORCE)" \
  -c "DROP DATABASE IF EXISTS inbox_sql_only_fresh WITH (FORCE)" \
  -c "DROP DATABASE IF EXISTS inbox_sql_only_pgrx WITH (FORCE)" \
  -c "DROP ROLE IF EXISTS $owner" \
  -c "CREATE ROLE $owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"
for db in inbox_sql_only inbox_sql_only_fresh; do
  # On PostgreSQL 15 the public schema belongs to the database's owner.
  psql_on postgres -c "CREATE DATABASE $db OWNER $owner"
  psql_as_owner "$db" -o /dev/null -f sql/inbox-sql-only.sql
done
psql_on postgres -c "CREATE DATABASE inbox_sql_only_pgrx"
psql_on inbox_sql_only_pgrx -c "CREATE EXTENSION inbox"
echo "ok: installed into inbox_sql_only and inbox_sql_only_fresh as $owner"

banner "SQL-only: the same API as the pgrx build"
# Each API function (the pgrx build's names; the SQL-only build's own helpers are inbox__*) with
# everything a caller can see of it. search_path and plan_cache_mode are left out of the settings
# compared: each build protects its statements and keeps their generic plans its own way (the
# SQL-only build pins the path, its helpers living in its schema, and sets the plan mode per
# function; the pgrx build's job-path functions set neither, see extension/src/statements.rs and
# plans.rs). So are the trigger functions, which only the pgrx build needs (its event trigger and
# its cache invalidation).
api_sql="
SELECT p.proname || '(' || pg_get_function_arguments(p.oid) || ') -> '
       || pg_get_function_result(p.oid)
       || ' | ' || concat_ws(' ', 'volatile=' || p.provolatile::text, 'parallel=' || p.proparallel::text,
                             'strict=' || p.proisstrict, 'definer=' || p.prosecdef,
                             'leakproof=' || p.proleakproof, 'rows=' || p.prorows)
       || ' | ' || coalesce((SELECT string_agg(c, ', ' ORDER BY c) FROM unnest(p.proconfig) c
                             WHERE c NOT LIKE 'search\\_path=%'
                               AND c NOT LIKE 'plan\\_cache\\_mode=%'), '')
       || ' | ' || coalesce(obj_description(p.oid, 'pg_proc'), '(no comment)')
  FROM pg_proc p
 WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'inbox\\_%'
   AND p.proname NOT LIKE 'inbox\\_\\_%'
   AND p.prorettype NOT IN ('event_trigger'::regtype, 'trigger'::regtype)
UNION ALL
SELECT 'table ' || c.relname || ': ' || string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                   || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                   || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), ''),
                   ', ' ORDER BY a.attnum)
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
 WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'inbox\\_%'
   AND c.relname NOT LIKE 'inbox\\_\\_%' AND c.relkind = 'r'
 GROUP BY c.relname
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid)
  FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
 WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'inbox\\_%'
   AND c.relname NOT LIKE 'inbox\\_\\_%'
UNION ALL
SELECT 'policy ' || tablename || ' ' || policyname || ' ' || cmd || ' ' || roles::text
       || ' using ' || coalesce(qual, '-') || ' check ' || coalesce(with_check, '-')
  FROM pg_policies WHERE schemaname = 'public' AND tablename LIKE 'inbox\\_%'
ORDER BY 1"
psql_on inbox_sql_only_pgrx -Atc "$api_sql" >"$work/pgrx.txt"
psql_on inbox_sql_only_fresh -Atc "$api_sql" >"$work/sql-only.txt"
if ! diff -u "$work/pgrx.txt" "$work/sql-only.txt"; then
  echo "FAILED: the SQL-only build's API differs from the pgrx build's (- pgrx, + SQL-only)" >&2
  exit 1
fi
echo "ok: $(wc -l <"$work/pgrx.txt") functions, tables, indexes and policies equal"

banner "SQL-only: the SQL tour, as $owner"
psql_as_owner inbox_sql_only -o /dev/null -f sql/tour.sql
echo "ok"

banner "SQL-only: installing again over a database in use keeps its data"
psql_as_owner inbox_sql_only -o /dev/null <<'SQL'
SELECT inbox_create_queue('jobs');
SELECT inbox_create_ledger('seen');
SELECT inbox_enqueue('jobs', '{"n": 1}'::jsonb, now(), 'one');
SELECT inbox_enqueue('jobs', '{"n": 2}'::jsonb, now() + interval '1 hour', 'two');
SELECT count(*) FROM inbox_enqueue_batch('jobs', ARRAY['{"n": 3}', '{"n": 4}', '{"n": 5}']::jsonb[]);
SELECT inbox_claim('seen', 'event-1'), inbox_claim('seen', 'event-2');
SELECT inbox_schedule('jobs', 'nightly', '0 3 * * *', '{"report": true}', 'Europe/Paris');
CREATE TABLE held AS SELECT id, token FROM inbox_lease('jobs', 1, '1 hour');
SELECT inbox_dead('jobs', id, token, 'poison') FROM inbox_lease('jobs', 1, '1 hour');
SQL
psql_as_owner inbox_sql_only -o /dev/null -f sql/inbox-sql-only.sql
check inbox_sql_only "ready, delayed, leased and dead jobs are all there" \
  "SELECT (ready, delayed, leased, dead) = (2, 1, 1, 1) FROM inbox_stats('jobs')"
check inbox_sql_only "the lease taken before still settles" \
  "SELECT inbox_ack('jobs', id, token) FROM held"
check inbox_sql_only "a queued key still dedups" \
  "SELECT inbox_enqueue('jobs', '{}', key => 'two') IS NULL"
check inbox_sql_only "the ledger remembers its keys" \
  "SELECT NOT inbox_claim('seen', 'event-1') AND inbox_claim('seen', 'event-3')"
check inbox_sql_only "the schedule is kept" \
  "SELECT count(*) = 1 FROM inbox_schedules('jobs') WHERE name = 'nightly'"
psql_on inbox_sql_only -c "DROP TABLE held"
psql_on inbox_sql_only -Atc "$api_sql" >"$work/reinstalled.txt"
if ! diff -u "$work/sql-only.txt" "$work/reinstalled.txt"; then
  echo "FAILED: after installing again the catalog differs from a fresh install" >&2
  exit 1
fi
echo "ok: the catalog equals a fresh install"
psql_on inbox_sql_only -o /dev/null -c "SELECT inbox_purge('seen', now() + interval '1 day')" \
  -c "DROP TABLE jobs, seen" -c "DELETE FROM inbox_periodic_jobs"

banner "SQL-only: installed by a superuser, a dropped queue takes its schedules with it"
# A schema owner cannot create the event trigger (checked above: the catalogs are equal without
# it); a superuser's install does, and then DROP TABLE deletes the queue's schedules at once.
superuser_db="$(INBOX_PG_URL=$server fresh_sql_only_database inbox_sql_only_superuser)"
superuser_db=${superuser_db##*/}
check "$superuser_db" "the event trigger exists" \
  "SELECT count(*) = 1 FROM pg_event_trigger WHERE evtname = 'inbox_drop_schedules_of_dropped_tables'"
psql_on "$superuser_db" -o /dev/null -c "SELECT inbox_create_queue('doomed')" \
  -c "SELECT inbox_schedule('doomed', 'hourly', '0 * * * *', '{}')" -c "DROP TABLE doomed"
check "$superuser_db" "the dropped queue's schedule went with it" \
  "SELECT count(*) = 0 FROM inbox_periodic_jobs"

for db in inbox_sql_only_fresh inbox_sql_only_pgrx "$superuser_db"; do
  psql_on postgres -c "DROP DATABASE $db WITH (FORCE)"
done
banner "SQL-only build: passed"
