#!/usr/bin/env bash
# Runs the inbox-bench benchmark (tests crate) against a fresh `inbox_bench` database, after
# building and installing the extension; figures 1 to 4 also run on the SQL-only build, in a
# fresh `inbox_bench_sql_only` database (SQL_ONLY_DATABASE_URL). Arguments are passed to
# inbox-bench.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

prepare_database inbox_bench
SQL_ONLY_DATABASE_URL="$(fresh_sql_only_database inbox_bench_sql_only)"
export SQL_ONLY_DATABASE_URL
banner "inbox-bench on $DATABASE_URL (and $SQL_ONLY_DATABASE_URL)"
# Figure 18 starts the dashboard: the `inbox` binary beside the benchmark's.
cargo build --release -p inbox-cli --bin inbox
cargo run --release -p inbox-tests --bin inbox-bench -- "$@"
