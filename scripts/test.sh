#!/usr/bin/env bash
# The whole test suite: rustfmt, clippy, the extension's #[pg_test]s (cargo pgrx test), then the
# workspace's integration tests (the `inbox` CLI's included) and the Python and Node examples,
# against a fresh database with the extension installed and again against one with the SQL-only
# build (scripts/sql-only-test.sh checks that build first), the upgrade from the previous release,
# then the fault suite (scripts/faults.sh), the Citus tests (scripts/citus.sh, which builds
# Citus from the tarball INBOX_CITUS_SOURCE names where it is not installed; skipped, and said so
# under the closing table, where neither is there) and the dashboard in headless Chromium
# (installed from Debian with its driver).
#
#   ./scripts/test.sh [--quick]
#
# Stages that share neither a target directory nor a database run side by side, each with its
# output in target/test-logs/, printed when it ends (in full, under its name, when it fails). A
# table of each stage's seconds closes every run, a failed one too. --quick is the loop of
# development: fmt, clippy and the integration tests on the pgrx build only.
# Works from any directory; run as root (Postgres runs as user postgres).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

quick=0
case "${1:-}" in
  "") ;;
  --quick) quick=1 ;;
  *)
    echo "usage: $0 [--quick]" >&2
    exit 2
    ;;
esac

on_exit 'timing_table "$_exit_status"'
logs="$REPO_ROOT/target/test-logs"
mkdir -p "$logs"

stage "toolchain"
ensure_toolchain
((quick)) || ensure_example_runtimes

# Everything the README's scripts run is installed by them, part of Debian, or named in the README.
if ((!quick)); then
  stage "what the README's scripts need (scripts/check-readme-needs.py)"
  python3 scripts/check-readme-needs.py
fi

stage "cargo fmt --check"
cargo fmt --all -- --check

# clippy, then the #[pg_test]s: one after the other in target/debug, where they share the build
# scripts and proc macros of the dev profile (pgrx's bindings among them).
clippy_and_pg_tests() {
  part "cargo clippy"
  cargo clippy --workspace --all-targets -- -D warnings
  ((quick)) && return
  part "cargo pgrx test pg15 (the extension's #[pg_test]s)"
  local pgdata
  pgdata="$(mktemp -d /tmp/inbox-pgrx-test.XXXXXX)"
  on_exit "remove_pg_dir '$pgdata'" # also stops a cluster left by an interrupted run
  chown postgres:postgres "$pgdata"
  retire_installed_library # cargo pgrx test installs its own build of the library
  # Its cluster always listens on port 28815: one run at a time on a machine.
  (cd extension && flock /tmp/inbox-pgrx-test.lock \
    cargo pgrx test pg15 --runas postgres --pgdata "$pgdata")
}

# Everything of the ci profile in target/ci: the workspace's tests (the fault suite's binary with
# them), then the extension as cargo pgrx install builds it (cargo pgrx schema makes that build
# without installing, which cargo pgrx test does meanwhile), then the previous release for the
# upgrade test (in its own target directory, seeded from target/ci).
build_ci() {
  part "cargo test --no-run (ci profile)"
  cargo test "${CI_TESTS[@]}" --no-run
  part "the extension (ci profile, by cargo pgrx schema)"
  (cd extension && cargo pgrx schema pg15 --profile ci -o "$REPO_ROOT/target/ci/inbox-schema.sql")
  if ((!quick)); then
    part "the previous release (scripts/upgrade-test.sh --build)"
    ./scripts/upgrade-test.sh --build
  fi
}

stage "clippy and the #[pg_test]s beside the ci build"
fault_suite() {
  # A server of its own too: the cases hold snapshots and transactions open for seconds, and the
  # oldest snapshot of any database of a server is what inbox_vacuum_due waits on (the pgrx
  # build's tests check that it moves).
  part "a PostgreSQL of its own for the fault suite"
  INBOX_PG_FORCE_THROWAWAY=1 INBOX_PG_THROWAWAY_PORT=54429 ensure_postgres
  part "the fault suite"
  ./scripts/faults.sh --no-install
}

if ((quick)); then
  parallel "cargo clippy" "$logs/clippy.log" clippy_and_pg_tests
else
  parallel "cargo clippy, cargo pgrx test pg15 (the extension's #[pg_test]s)" \
    "$logs/clippy-pg-tests.log" clippy_and_pg_tests
fi
parallel "the ci build (tests, extension, previous release)" "$logs/build.log" build_ci
# The Citus tests, where Citus is installed or can be built from INBOX_CITUS_SOURCE (scripts/citus.sh).
citus=0
if ((!quick)); then
  if citus_why="$(citus_unavailable)"; then
    skip_stage "the Citus tests (scripts/citus.sh test)" "$citus_why"
  else
    citus=1
    parallel "Citus (scripts/citus.sh install)" "$logs/citus-install.log" ./scripts/citus.sh install
  fi
fi
wait_parallel

stage "install the extension (ci profile)"
install_extension ci

stage "PostgreSQL for the tests"
ensure_postgres
url="$(fresh_database inbox_test)"

stage "the SQL tour (sql/tour.sql)"
psql "$url" -X -q -v ON_ERROR_STOP=1 -f sql/tour.sql >/dev/null

# The examples of both builds take turns: they install their drivers into one virtualenv and one
# node_modules.
examples() { DATABASE_URL="$1" flock "$logs/examples.lock" examples/run.sh; }

on_pgrx_build() {
  part "cargo test (integration tests against $url)"
  workspace_tests "$url"
  part "the Python and Node examples (examples/run.sh against $url)"
  examples "$url"
}

on_sql_only_build() {
  # A server of its own (stopped when this stage ends): beside the pgrx build's tests and the fault
  # suite, the two builds' tests would need more connections than a default server's 100.
  part "a PostgreSQL of its own for the SQL-only build"
  INBOX_PG_FORCE_THROWAWAY=1 ensure_postgres
  local sql_only_url="$INBOX_PG_URL/inbox_sql_only"
  part "the SQL-only build (scripts/sql-only-test.sh)"
  ./scripts/sql-only-test.sh "$INBOX_PG_URL"
  part "cargo test on the SQL-only build (the same integration tests against $sql_only_url)"
  # The doc tests use no database: the pgrx build's run has them.
  workspace_tests "$sql_only_url" --no-doc
  part "the Python and Node examples on the SQL-only build"
  examples "$sql_only_url"
}

# The dashboard in a real browser (cli/tests/ui/browser.rs, ignored by a plain cargo test).
dashboard_in_a_browser() {
  part "Chromium and chromedriver"
  ensure_browser
  part "the dashboard in Chromium (cargo test --test ui -- --ignored)"
  INBOX_TEST_DATABASE_URL="$url" cargo test "${CI_TESTS[@]}" --test ui -- --ignored browser::
}

if ((quick)); then
  stage "cargo test (integration tests against $url)"
  workspace_tests "$url"
else
  stage "the tests on both builds, the upgrade and the fault suite, side by side"
  parallel "the tests on the pgrx build" "$logs/pgrx-build.log" on_pgrx_build
  parallel "the tests on the SQL-only build" "$logs/sql-only-build.log" on_sql_only_build
  parallel "the upgrade from the previous release (scripts/upgrade-test.sh)" "$logs/upgrade.log" \
    ./scripts/upgrade-test.sh "$INBOX_PG_URL"
  parallel "the fault suite (scripts/faults.sh, docs/reliability.md)" "$logs/faults.log" \
    fault_suite
  if ((citus)); then
    parallel "the Citus tests on a cluster of three nodes (scripts/citus.sh test)" "$logs/citus.log" \
      ./scripts/citus.sh test
  fi
  parallel "the dashboard in a browser (cli/tests/ui/browser.rs)" "$logs/browser.log" \
    dashboard_in_a_browser
  wait_parallel
fi

banner "all tests passed"
