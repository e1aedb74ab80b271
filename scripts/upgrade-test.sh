#!/usr/bin/env bash
# The upgrade test: a database of the previous release, with queues, ledgers, jobs (ready,
# leased, dead) and keys in them, is upgraded with ALTER EXTENSION inbox UPDATE; the data must
# survive and keep working, and the catalog must equal a fresh install of the current version.
#
# The previous release's library is built from its commit (recorded below), and installed beside
# the current one: each release has its own library file (inbox-<version>.so), so a running
# database keeps working between installing the package and updating the extension.
#
# Usage: scripts/upgrade-test.sh DATABASE_URL_PREFIX   (a server URL without the database name)
#        scripts/upgrade-test.sh --build   (only builds the previous release, kept for next time)
# The current version must be installed already (scripts/lib.sh's install_extension); its schema
# is read from the ci profile's build, which scripts/test.sh installs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

PREVIOUS=0.1.0
PREVIOUS_COMMIT=a77cdcf86db1e835ffb7b41dbf29e4538c3063bb
server=$1
current="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
work="$(mktemp -d /tmp/inbox-upgrade.XXXXXX)"
on_exit "rm -rf '$work'"
psql_on() { psql -X -w -q -v ON_ERROR_STOP=1 -d "$server/$1" "${@:2}"; }

# The previous release's library, built from its commit in a target directory of its own (the
# crate's library has the same file name in every release), kept there with a stamp of the commit
# so that later runs reuse it.
previous_target="$REPO_ROOT/target/previous-release"
previous_lib="$previous_target/inbox-$PREVIOUS.so"
build_previous_release() {
  if [[ -f "$previous_lib" && "$(cat "$previous_target/stamp" 2>/dev/null)" == "$PREVIOUS_COMMIT" ]]; then
    echo "release $PREVIOUS: kept from an earlier run ($previous_lib)"
    return
  fi
  if ! git cat-file -e "$PREVIOUS_COMMIT^{commit}" 2>/dev/null; then
    echo "commit $PREVIOUS_COMMIT of release $PREVIOUS is not in this clone (fetch its history)" >&2
    exit 1
  fi
  rm -rf "$work/src"
  mkdir "$work/src"
  # git archive dates the files at the commit: newer dates make cargo rebuild what they belong to.
  git archive "$PREVIOUS_COMMIT" | tar -x -m -C "$work/src"
  # Seeded with the dependencies of the current ci build, which it shares (built the way cargo pgrx
  # builds, by cargo pgrx schema): only the extension crate is compiled.
  if [[ ! -d "$previous_target/ci" && -d "$REPO_ROOT/target/ci/deps" ]]; then
    mkdir -p "$previous_target/ci"
    cp -a "$REPO_ROOT/target/ci/deps" "$REPO_ROOT/target/ci/build" \
      "$REPO_ROOT/target/ci/.fingerprint" "$previous_target/ci/"
  fi
  (cd "$work/src/extension" && CARGO_TARGET_DIR="$previous_target" \
    cargo pgrx schema pg15 --profile ci -o "$work/previous.sql")
  cp "$previous_target/ci/libinbox.so" "$previous_lib"
  echo "$PREVIOUS_COMMIT" >"$previous_target/stamp"
}
if [[ "$server" == --build ]]; then
  build_previous_release
  exit
fi

banner "upgrade: the script in sql/ is current"
(cd extension && cargo pgrx schema pg15 --profile ci -o "$work/inbox--$current.sql" >/dev/null 2>&1)
python3 scripts/upgrade-script.py "sql/inbox--$PREVIOUS.sql" "$work/inbox--$current.sql" \
  >"$work/upgrade.sql"
if ! diff -u "sql/inbox--$PREVIOUS--$current.sql" "$work/upgrade.sql"; then
  echo "sql/inbox--$PREVIOUS--$current.sql is out of date: regenerate it with" >&2
  echo "  scripts/upgrade-script.py sql/inbox--$PREVIOUS.sql <(cargo pgrx schema) > sql/inbox--$PREVIOUS--$current.sql" >&2
  exit 1
fi

banner "upgrade: build release $PREVIOUS from $PREVIOUS_COMMIT"
build_previous_release
pkglibdir="$("$PG_CONFIG" --pkglibdir)"
sharedir="$("$PG_CONFIG" --sharedir)"
[[ -f "$pkglibdir/inbox.so" ]] && mv -f "$pkglibdir/inbox.so" "$pkglibdir/inbox.so.retired"
cp "$previous_lib" "$pkglibdir/inbox.so"
cp "sql/inbox--$PREVIOUS.sql" "sql/inbox--$PREVIOUS--$current.sql" "$sharedir/extension/"

banner "upgrade: a database of release $PREVIOUS"
for db in inbox_upgraded inbox_fresh; do
  psql -X -w -q -d "$server/postgres" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" \
    -c "CREATE DATABASE $db"
done
psql_on inbox_upgraded -o /dev/null <<SQL
CREATE EXTENSION inbox VERSION '$PREVIOUS';
SELECT inbox_create_queue('jobs');
SELECT inbox_create_ledger('seen');
CREATE TABLE blobs (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0,
                    locked_until timestamptz, payload bytea NOT NULL);
SELECT inbox_enqueue('jobs', '{"n": 1}'::jsonb, now(), 'one');
SELECT inbox_enqueue('jobs', '{"n": 2}'::jsonb, now() + interval '1 hour', 'two');
SELECT count(*) FROM inbox_enqueue_batch('jobs', ARRAY['{"n": 3}', '{"n": 4}', '{"n": 5}']::jsonb[]);
SELECT inbox_enqueue('blobs', '\x01'::bytea, now(), NULL);
SELECT inbox_claim('seen', 'event-1'), inbox_claim('seen', 'event-2');
-- One job leased (its token kept for after the upgrade), one dead.
CREATE TABLE held AS SELECT id, token FROM inbox_lease('jobs', 1, '1 hour');
SELECT inbox_dead('jobs', id, token, 'poison') FROM inbox_lease('jobs', 1, '1 hour');
SQL

banner "upgrade: ALTER EXTENSION inbox UPDATE to $current"
psql_on inbox_upgraded -c "ALTER EXTENSION inbox UPDATE"
psql_on inbox_fresh -c "CREATE EXTENSION inbox"

banner "upgrade: the data survived and works"
check() { # check DB DESCRIPTION SQL: the SQL must return true
  local got
  got="$(psql_on "$1" -Atc "$3")"
  if [[ "$got" != t ]]; then
    echo "FAILED: $2 (got '$got')" >&2
    exit 1
  fi
  echo "ok: $2"
}
check inbox_upgraded "the version is $current" \
  "SELECT extversion = '$current' FROM pg_extension WHERE extname = 'inbox'"
check inbox_upgraded "ready, delayed, leased and dead jobs are all there" \
  "SELECT (ready, delayed, leased, dead) = (2, 1, 1, 1) FROM inbox_stats('jobs')"
check inbox_upgraded "the lease taken before the upgrade still settles" \
  "SELECT inbox_ack('jobs', id, token) FROM held"
check inbox_upgraded "a queued key still dedups" \
  "SELECT inbox_enqueue('jobs', '{}', key => 'two') IS NULL"
check inbox_upgraded "untyped enqueues work on an old queue" \
  "SELECT inbox_enqueue('jobs', '{\"n\": 6}') IS NOT NULL"
check inbox_upgraded "a user's bytea table works" \
  "SELECT inbox_enqueue_bytes('blobs', '\\x02') IS NOT NULL"
check inbox_upgraded "leases, retries and acks work on the old queue" \
  "WITH l AS (SELECT * FROM inbox_lease('jobs', 10)) \
   SELECT bool_and(inbox_ack('jobs', id, token)) AND count(*) = 3 FROM l"
check inbox_upgraded "the ledger remembers its keys" \
  "SELECT NOT inbox_claim('seen', 'event-1') AND inbox_claim('seen', 'event-3')"
check inbox_upgraded "the dead job is still dead, with its reason" \
  "SELECT dead = 1 FROM inbox_stats('jobs')"

banner "upgrade: the catalog equals a fresh install"
# Every object of the extension, and for functions everything that defines them.
catalog_sql="
SELECT pg_describe_object(d.classid, d.objid, d.objsubid) || coalesce(' | ' || (
         SELECT concat_ws(' | ', pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
                          p.provolatile, p.proparallel, p.proisstrict, p.prosecdef, p.proleakproof,
                          p.procost, p.prorows, p.proconfig::text, p.probin, p.prosrc,
                          obj_description(p.oid, 'pg_proc'))
           FROM pg_proc p WHERE d.classid = 'pg_proc'::regclass AND p.oid = d.objid), '')
       || coalesce(' | ' || (
         SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                           || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                           || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), ''),
                           ', ' ORDER BY a.attnum)
           FROM pg_attribute a LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
          WHERE d.classid = 'pg_class'::regclass AND a.attrelid = d.objid AND a.attnum > 0
            AND NOT a.attisdropped), '')
  FROM pg_depend d
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'inbox')
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid)
  FROM pg_index i JOIN pg_depend d ON d.objid = i.indrelid AND d.classid = 'pg_class'::regclass
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'inbox')
UNION ALL
SELECT 'dumped ' || coalesce(extconfig::regclass[]::text, '{}') FROM pg_extension WHERE extname = 'inbox'
ORDER BY 1"
psql_on inbox_upgraded -Atc "$catalog_sql" >"$work/upgraded.txt"
psql_on inbox_fresh -Atc "$catalog_sql" >"$work/fresh.txt"
if ! diff -u "$work/fresh.txt" "$work/upgraded.txt"; then
  echo "FAILED: the upgraded catalog differs from a fresh install (- fresh, + upgraded)" >&2
  exit 1
fi
echo "ok: $(wc -l <"$work/fresh.txt") catalog entries equal"

for db in inbox_upgraded inbox_fresh; do
  psql -X -w -q -d "$server/postgres" -c "DROP DATABASE $db WITH (FORCE)"
done
banner "upgrade from $PREVIOUS to $current: passed"
