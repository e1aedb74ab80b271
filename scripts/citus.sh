#!/usr/bin/env bash
# Citus for the tests (docs/scaling.md, "On Citus"): installs it where it is missing and starts a
# throwaway cluster of one coordinator and two worker nodes on this machine.
#
#   scripts/citus.sh install         Citus into this machine's PostgreSQL, unless it is there
#   scripts/citus.sh start DIR       a cluster under DIR (new); prints its coordinator's URL
#   scripts/citus.sh stop DIR        stops the cluster under DIR and removes DIR
#   scripts/citus.sh test            install, start, the Citus tests and the conformance tests
#                                    through the coordinator, stop (scripts/test.sh)
#   scripts/citus.sh bench [ARGS]    install, start, benchmark figure 17 (inbox-bench ARGS), stop
#
# A user with Citus from its own packages has citus.so already and skips the build. Otherwise
# it is built from the source tarball INBOX_CITUS_SOURCE (a release archive of Citus 13.x, which
# supports PostgreSQL 15), with the fixes in scripts/citus-patches that its version needs on this
# server applied first. The installed library is the cache: a second run, or a second clone,
# builds nothing. Without either, scripts/test.sh skips the Citus tests and says so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

# The database every node serves, with citus and inbox in it.
CITUS_DB=inbox_citus

install_citus() {
  if citus_installed; then
    echo "Citus is installed: $("$PG_CONFIG" --pkglibdir)/citus.so"
    return
  fi
  local source=${INBOX_CITUS_SOURCE:-}
  if citus_unavailable >&2; then
    return 1
  fi
  local pkg missing=()
  # Citus's own libraries, GSSAPI's headers (the server's headers include them), make and patch.
  for pkg in libzstd-dev liblz4-dev libcurl4-openssl-dev libkrb5-dev make patch; do
    dpkg -s "$pkg" 2>/dev/null | grep -qx 'Status: install ok installed' || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    apt_install "${missing[@]}"
  fi
  local build patch
  build="$(mktemp -d /tmp/inbox-citus-build.XXXXXX)"
  tar -xzf "$source" -C "$build"
  local top=("$build"/*/)
  # scripts/citus-patches/<source folder>-pgX.Y.patch: a fix the release needs on PostgreSQL X.Y
  # and later minor releases of X (applied where the server is one of those).
  local server min
  server="$("$PG_CONFIG" --version | sed -n 's/^PostgreSQL \([0-9]*\.[0-9]*\).*/\1/p')"
  for patch in "$REPO_ROOT/scripts/citus-patches/$(basename "${top[0]}")"-pg*.patch; do
    [[ -f "$patch" ]] || continue
    min="${patch##*-pg}" min="${min%.patch}"
    [[ "${server%%.*}" == "${min%%.*}" ]] && ((${server#*.} >= ${min#*.})) || continue
    echo "applying $patch (PostgreSQL $server)"
    patch -d "${top[0]}" -p1 <"$patch"
  done
  echo "building Citus from $source (a few minutes)"
  (cd "${top[0]}" && PG_CONFIG="$PG_CONFIG" ./configure >"$build/configure.log" &&
    make -j"$(nproc)" >"$build/make.log" 2>&1 && make install >"$build/install.log") || {
    tail -n 40 "$build"/*.log >&2
    return 1
  }
  rm -rf "$build"
  echo "Citus installed: $("$PG_CONFIG" --pkglibdir)/citus.so"
}

_free_port() {
  local port=$1
  while _port_in_use "$port"; do port=$((port + 1)); done
  echo "$port"
}

# start_cluster DIR: initdb's and starts a coordinator and two workers under DIR (one port each,
# their numbers in DIR/ports), creates database inbox_citus on each with citus, adds the workers
# and creates inbox on the coordinator, which Citus propagates to the workers.
start_cluster() {
  local dir=$1 node port ports=() psql=(psql -X -w -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres)
  mkdir -p "$dir"
  chown postgres:postgres "$dir"
  port=${INBOX_CITUS_PORT:-54400}
  for node in coordinator worker1 worker2; do
    port="$(_free_port "$port")"
    ports+=("$port")
    as_postgres "$PG_BIN/initdb" -D "$dir/$node" -U postgres --auth=trust -E UTF8 \
      --locale=C.UTF-8 >/dev/null
    # Two-phase commit for deliveries that write on several nodes; logical decoding for the
    # rebalancer's shard moves; the coordinator recovers prepared transactions every second. The
    # tests crash nodes with pg_ctl (PostgreSQL's own crash recovery, not the disk's), so they
    # skip fsync; the benchmark keeps it (CITUS_FSYNC=on), as the server it is compared with.
    cat >>"$dir/$node/postgresql.conf" <<EOF
shared_preload_libraries = 'citus'
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
max_connections = 300
max_prepared_transactions = 200
wal_level = logical
max_wal_senders = 20
max_replication_slots = 20
citus.recover_2pc_interval = '1s'
fsync = ${CITUS_FSYNC:-off}
EOF
    if ! as_postgres "$PG_BIN/pg_ctl" -D "$dir/$node" -l "$dir/$node.log" -w start >/dev/null; then
      cat "$dir/$node.log" >&2
      return 1
    fi
    "${psql[@]}" -p "$port" -d postgres -c "CREATE DATABASE $CITUS_DB"
    "${psql[@]}" -p "$port" -d "$CITUS_DB" -c "SET client_min_messages = warning" \
      -c "CREATE EXTENSION citus"
    port=$((port + 1))
  done
  echo "${ports[*]}" >"$dir/ports"
  "${psql[@]}" -p "${ports[0]}" -d "$CITUS_DB" -o /dev/null \
    -c "SELECT citus_set_coordinator_host('127.0.0.1', ${ports[0]})" \
    -c "SELECT citus_add_node('127.0.0.1', ${ports[1]})" \
    -c "SELECT citus_add_node('127.0.0.1', ${ports[2]})" \
    -c "CREATE EXTENSION inbox"
  echo "postgres://postgres@127.0.0.1:${ports[0]}/$CITUS_DB"
}

# stop_cluster DIR: stops every node under DIR (a crashed one is simply not running) and removes DIR.
stop_cluster() {
  local dir=$1 node
  for node in coordinator worker1 worker2; do
    [[ -f "$dir/$node/postmaster.pid" ]] &&
      as_postgres "$PG_BIN/pg_ctl" -D "$dir/$node" -m immediate -w stop >/dev/null 2>&1 || true
  done
  rm -rf "$dir"
}

# The Citus tests (tests/tests/citus): the extension installed already (scripts/test.sh).
run_tests() {
  install_citus
  local dir
  dir="$(mktemp -d /tmp/inbox-citus.XXXXXX)"
  on_exit "stop_cluster '$dir'"
  banner "a Citus cluster under $dir"
  INBOX_CITUS_URL="$(start_cluster "$dir" | tail -n 1)"
  export INBOX_CITUS_URL INBOX_CITUS_DIR="$dir" INBOX_PG_BIN="$PG_BIN"
  echo "coordinator: $INBOX_CITUS_URL"
  banner "the Citus tests"
  cargo test "${CI_TESTS[@]}" --test citus -- --ignored --test-threads 1
  # The integration tests that hold on Citus, through the coordinator: each test's schema is a
  # tenant's, distributed from the start (tests/src/lib.rs), so its queues and ledgers are one
  # shard on a worker node. Why the other modules are not run there: docs/scaling.md.
  banner "the conformance tests through the coordinator"
  INBOX_TEST_DATABASE_URL="$INBOX_CITUS_URL" cargo test "${CI_TESTS[@]}" --test integration -- \
    sql_conformance:: cancel:: snooze:: pause:: timeouts:: worker_smoke:: client_inbox:: \
    groups::a_repeatable_read_enqueuer groups::a_serializable_enqueuer
}

# Figure 17 of inbox-bench: the single server (a fresh database, as scripts/bench.sh makes it)
# against the coordinator of a fresh cluster.
run_bench() {
  prepare_database inbox_bench_citus
  install_citus
  local dir
  dir="$(mktemp -d /tmp/inbox-citus.XXXXXX)"
  on_exit "stop_cluster '$dir'"
  banner "a Citus cluster under $dir"
  INBOX_CITUS_URL="$(CITUS_FSYNC=on start_cluster "$dir" | tail -n 1)"
  export INBOX_CITUS_URL
  banner "inbox-bench figure 17: $DATABASE_URL against $INBOX_CITUS_URL"
  cargo run --release -p inbox-tests --bin inbox-bench -- --figures 17 "$@"
}

case "${1:-}" in
  install) install_citus ;;
  bench)
    shift
    run_bench "$@"
    ;;
  start) start_cluster "${2:?start needs a directory}" ;;
  stop) stop_cluster "${2:?stop needs a directory}" ;;
  test) run_tests ;;
  *)
    echo "usage: $0 install | start DIR | stop DIR | test | bench [ARGS]" >&2
    exit 2
    ;;
esac
