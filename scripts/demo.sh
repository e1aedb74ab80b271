#!/usr/bin/env bash
# Runs the refunds example (client/examples/refunds.rs) against a fresh `inbox_demo` database,
# after building and installing the extension. Arguments are passed to the example.
#
# Both are built with the `ci` profile (optimised, without the release profile's whole-program
# optimisation, which costs minutes and buys a demo nothing; scripts/bench.sh keeps `release`).
# The example, which needs neither cargo-pgrx nor the server's headers, builds while the toolchain
# installs; a table of each step's seconds closes the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

on_exit 'timing_table "$_exit_status"'
logs="$REPO_ROOT/target/demo-logs"
mkdir -p "$logs"

toolchain_and_extension() {
  part "toolchain (Debian packages, cargo-pgrx $PGRX_VERSION)"
  ensure_toolchain
  part "the extension (ci profile, cargo pgrx install)"
  install_extension ci
}

stage "build, side by side"
parallel "the toolchain, then the extension" "$logs/extension.log" toolchain_and_extension
parallel "the refunds example (ci profile)" "$logs/example.log" \
  cargo build --profile ci -p inbox-client --features nats --example refunds
wait_parallel

stage "PostgreSQL"
ensure_postgres
DATABASE_URL="$(fresh_database inbox_demo)"
export DATABASE_URL

stage "refunds example on $DATABASE_URL"
"$REPO_ROOT/target/ci/examples/refunds" "$@"
