#!/usr/bin/env bash
# Runs the refunds example (client/examples/refunds.rs) against a fresh `inbox_demo` database,
# after building and installing the extension. Arguments are passed to the example.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

prepare_database inbox_demo
banner "refunds example on $DATABASE_URL"
cargo run --release -p inbox-client --features nats --example refunds -- "$@"
