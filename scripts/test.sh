#!/usr/bin/env bash
# The whole test suite: rustfmt, clippy, the extension's #[pg_test]s (cargo pgrx test), then the
# workspace's integration tests (the `inbox` CLI's included) and the Python and Node examples,
# against a fresh database with the extension installed and again against one with the SQL-only
# build (scripts/sql-only-test.sh checks that build first), the upgrade from the previous release,
# then the fault suite (scripts/faults.sh).
# Works from any directory; run as root (Postgres runs as user postgres).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

start=$SECONDS
on_exit 'echo "total time: $((SECONDS - start))s"'

banner "toolchain"
ensure_toolchain

banner "cargo fmt --check"
cargo fmt --all -- --check

banner "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

banner "cargo pgrx test pg15 (the extension's #[pg_test]s)"
pgrx_pgdata="$(mktemp -d /tmp/inbox-pgrx-test.XXXXXX)"
on_exit "remove_pg_dir '$pgrx_pgdata'"  # also stops a cluster left by an interrupted run
chown postgres:postgres "$pgrx_pgdata"
retire_installed_library  # cargo pgrx test installs its own build of the library
# Its cluster always listens on port 28815: one run at a time on a machine.
(cd extension && flock /tmp/inbox-pgrx-test.lock \
  cargo pgrx test pg15 --runas postgres --pgdata "$pgrx_pgdata")

banner "install the extension"
install_extension

banner "PostgreSQL for the integration tests"
ensure_postgres
url="$(fresh_database inbox_test)"

banner "the SQL tour (sql/tour.sql)"
psql "$url" -X -q -v ON_ERROR_STOP=1 -f sql/tour.sql >/dev/null

banner "cargo test (integration tests against $url)"
INBOX_TEST_DATABASE_URL="$url" cargo test --workspace --exclude inbox --profile ci

banner "the Python and Node examples (examples/run.sh against $url)"
ensure_example_runtimes
DATABASE_URL="$url" examples/run.sh

banner "the SQL-only build (scripts/sql-only-test.sh)"
./scripts/sql-only-test.sh "$INBOX_PG_URL"
sql_only_url="$INBOX_PG_URL/inbox_sql_only"

banner "cargo test on the SQL-only build (the same integration tests against $sql_only_url)"
INBOX_TEST_DATABASE_URL="$sql_only_url" cargo test --workspace --exclude inbox --profile ci

banner "the Python and Node examples on the SQL-only build"
DATABASE_URL="$sql_only_url" examples/run.sh

banner "the upgrade from the previous release (scripts/upgrade-test.sh)"
./scripts/upgrade-test.sh "$INBOX_PG_URL"

banner "the fault suite (scripts/faults.sh, docs/reliability.md)"
./scripts/faults.sh --no-install

banner "all tests passed"
