#!/usr/bin/env bash
# Runs the inbox-bench benchmark (tests crate) against a fresh `inbox_bench` database, after
# building and installing the extension. Arguments are passed to inbox-bench.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

prepare_database inbox_bench
banner "inbox-bench on $DATABASE_URL"
cargo run --release -p inbox-tests --bin inbox-bench -- "$@"
