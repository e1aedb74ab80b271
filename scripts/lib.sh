#!/usr/bin/env bash
# Helpers sourced by the scripts in scripts/: install the toolchain, build and install the
# extension, find or start a PostgreSQL 15 to test against, and create fresh databases in it.
# Callers run under `set -euo pipefail`, as root (Postgres itself runs as user postgres).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# INBOX_PG_CONFIG picks another PostgreSQL 15 installation (a relocated copy of Debian's, say, so
# that several checkouts can install their own build of the extension side by side).
if [[ -n "${INBOX_PG_CONFIG:-}" ]]; then
  PG_CONFIG="$INBOX_PG_CONFIG"
  PG_BIN="$("$PG_CONFIG" --bindir)"
else
  PG_CONFIG=/usr/bin/pg_config
  PG_BIN=/usr/lib/postgresql/15/bin
fi
PGRX_VERSION=0.18.1

# Each banner shows the seconds since the script began, so a slow step shows in any log.
banner() { printf '\n\033[1m==== %s ==== [%ss]\033[0m\n' "$*" "$SECONDS"; }

# Stage timings for the table that timing_table prints: each row is "seconds<TAB>status<TAB>name".
_stage_rows=()
_stage_name=""
_stage_start=0

# stage NAME: a banner that also starts the timing of stage NAME and ends the previous one's.
stage() {
  _stage_close ok
  banner "$1"
  _stage_name=$1
  _stage_start=$SECONDS
}
_stage_close() {
  [[ -n "$_stage_name" ]] && _stage_rows+=("$((SECONDS - _stage_start))	$1	$_stage_name")
  _stage_name=""
}

# timing_table STATUS: ends the current stage (failed unless STATUS is 0) and prints every
# stage's seconds and the total. Meant for on_exit, so that a failed run shows it too.
timing_table() {
  local row secs status name why
  if (($1)); then _stage_close FAILED; else _stage_close ok; fi
  printf '\n%7s  %-6s  %s\n' seconds status stage
  for row in "${_stage_rows[@]}"; do
    IFS=$'\t' read -r secs status name <<<"$row"
    printf '%7s  %-6s  %s\n' "$secs" "$status" "$name"
  done
  printf '%7s  %-6s  %s\n' "$SECONDS" "" "total"
  for row in "${_skipped_rows[@]}"; do
    name=${row%%$'\t'*} why=${row#*$'\t'}
    printf '%7s  %-6s  %s\n' - SKIPPED "$name"
    printf '                 %s\n' "${why//$'\n'/$'\n'                 }"
  done
}

# skip_stage NAME WHY: stage NAME does not run here, for reason WHY (what is missing and how to
# get it). Said now, and again under the timing table, so that a passing run cannot hide it.
_skipped_rows=()
skip_stage() {
  printf '\n\033[1m==== SKIPPED: %s ====\033[0m\n%s\n' "$1" "$2"
  _skipped_rows+=("$1	$2")
}

# Stages run side by side: parallel NAME LOG CMD... starts CMD in the background with its output
# in LOG; wait_parallel waits for all of them, prints each log in the order they were started and
# fails, naming the stages that did, if any did. Each command runs under set -e of its own.
_parallel_names=()
_parallel_logs=()
_parallel_pids=()
parallel() {
  local name=$1 log=$2
  shift 2
  echo "started in the background: $name (log: $log)"
  ((${#_parallel_pids[@]})) || on_exit _kill_parallel
  rm -f "$log.status"
  # Its own process group (set -m), so that an interrupted run can stop all of it.
  set -m
  {
    # The caller's cleanups stay the caller's: the stage registers its own.
    _on_exit_cmds=()
    trap - EXIT
    set +e
    t0=$SECONDS
    _parallel_log=$log
    rm -f "$log.parts"
    (
      set -e
      "$@"
    ) >"$log" 2>&1
    echo "$? $((SECONDS - t0)) $SECONDS" >"$log.status"
  } &
  set +m
  _parallel_names+=("$name")
  _parallel_logs+=("$log")
  _parallel_pids+=("$!")
}
# part NAME: inside a parallel stage, a banner that also starts the timing of part NAME of it (the
# table shows each part's seconds under the stage).
part() {
  banner "$1"
  [[ -z "${_parallel_log:-}" ]] || printf '%s\t%s\n' "$SECONDS" "$1" >>"$_parallel_log.parts"
}
_kill_parallel() {
  local pid
  for pid in "${_parallel_pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
  for pid in "${_parallel_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
wait_parallel() {
  local i status secs end failed=() rows=() parts=() j from name result
  for i in "${!_parallel_pids[@]}"; do
    wait "${_parallel_pids[i]}" || true
    read -r status secs end <"${_parallel_logs[i]}.status" 2>/dev/null || status=1 secs=? end=$SECONDS
    banner "${_parallel_names[i]}: output (${secs}s, exit status $status)"
    cat "${_parallel_logs[i]}"
    result=ok
    if ((status)); then
      failed+=("${_parallel_names[i]}")
      result=FAILED
    fi
    rows+=("$secs	$result	  ${_parallel_names[i]}")
    parts=()
    [[ -f "${_parallel_logs[i]}.parts" ]] && mapfile -t parts <"${_parallel_logs[i]}.parts"
    for j in "${!parts[@]}"; do
      IFS=$'\t' read -r from name <<<"${parts[j]}"
      if ((j + 1 < ${#parts[@]})); then
        rows+=("$((${parts[j + 1]%%$'\t'*} - from))	ok	    $name")
      else
        # The last part ends with the stage, and failed if the stage did.
        rows+=("$((end - from))	$result	    $name")
      fi
    done
  done
  # The stage that started them, then each of them, indented.
  if ((${#failed[@]})); then _stage_close FAILED; else _stage_close ok; fi
  _stage_rows+=("${rows[@]}")
  _parallel_names=() _parallel_logs=() _parallel_pids=()
  if ((${#failed[@]})); then
    printf '\nFAILED: %s (output above)\n' "${failed[@]}" >&2
    return 1
  fi
}

# Cleanup commands run in reverse order when the script exits, also on failure or Ctrl-C.
_on_exit_cmds=()
_run_on_exit() {
  _exit_status=$?  # the script's, for cleanup commands that report it (timing_table)
  local i
  for ((i = ${#_on_exit_cmds[@]} - 1; i >= 0; i--)); do eval "${_on_exit_cmds[i]}" || true; done
}
on_exit() {
  _on_exit_cmds+=("$1")
  trap _run_on_exit EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
}

as_postgres() { (cd / && sudo -u postgres -- "$@"); }

# apt_install [OPTION...] PACKAGE...: installs Debian packages, one caller at a time. The suites
# of scripts/test.sh run side by side and several install what they need (faketime, Chromium):
# apt and dpkg refuse a second process outright, so each waits here for the one before it, and
# for another process holding dpkg's lock (up to 10 minutes).
apt_install() {
  (
    flock 9
    apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "$@"
  ) 9>/tmp/inbox-apt.lock
}

ensure_toolchain() {
  local pkg missing=()
  # pgbouncer: the connection pooler tests start one in transaction mode (they fail without it).
  # jq: scripts/lib.sh's workspace_tests reads the test targets from cargo metadata.
  # nats-server: the outbox tests and fault case start one with JetStream (they fail without it).
  for pkg in postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo pgbouncer jq nats-server; do
    dpkg -s "$pkg" 2>/dev/null | grep -qx 'Status: install ok installed' || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    apt_install "${missing[@]}"
  fi
  if ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION\$"; then
    # A build tool whose own speed no step waits on: optimised lightly, it builds about a fifth
    # sooner (5 min 39 s against 6 min 57 s in a first demo here, its longest step).
    CARGO_PROFILE_RELEASE_OPT_LEVEL=1 cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
  fi
  if ! grep -qs '^pg15 *=' "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
    cargo pgrx init --pg15 "$PG_CONFIG"
  fi
}

# install_extension [PROFILE]: builds the extension from the current sources (cargo rebuilds what
# changed) with cargo profile PROFILE (default release) and installs it into Debian's
# PostgreSQL 15. The tests install the ci profile's build: the release profile's fat LTO takes
# minutes and buys the tests nothing.
install_extension() {
  local profile=${1:-release}
  retire_installed_library
  (cd "$REPO_ROOT/extension" && cargo pgrx install --profile "$profile" --pg-config "$PG_CONFIG")
  # The install scripts of earlier releases (cargo pgrx installs only the upgrade scripts), so that
  # a database can be created at an earlier version where its library is installed too.
  local script
  for script in "$REPO_ROOT"/sql/inbox--*.sql; do
    [[ "$(basename "$script")" == inbox--*--*.sql ]] && continue
    install -m 644 "$script" "$("$PG_CONFIG" --sharedir)/extension/"
  done
}

# retire_installed_library: moves the installed library of the version being built
# (inbox-<version>.so) aside before a new one is written, so that backends of a running server
# which have the old one loaded keep their (unchanged) copy: overwriting a loaded library in place
# crashes them. Libraries of other versions stay, for databases that have not been updated yet.
retire_installed_library() {
  local lib version
  version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/Cargo.toml" | head -1)"
  lib="$("$PG_CONFIG" --pkglibdir)/inbox-$version.so"
  if [[ -f "$lib" ]]; then
    mv -f "$lib" "$lib.retired"
  fi
}

# citus_installed: Citus's library and its extension's control file are both in this PostgreSQL
# (an install that was interrupted may have copied the one without the other).
citus_installed() {
  [[ -f "$("$PG_CONFIG" --pkglibdir)/citus.so" && -f "$("$PG_CONFIG" --sharedir)/extension/citus.control" ]]
}

# citus_unavailable: prints why the Citus tests cannot run here and how to make them run, and
# succeeds, when Citus is not installed and INBOX_CITUS_SOURCE names no tarball to build it from;
# fails (prints nothing) when they can run. Debian does not package Citus.
citus_unavailable() {
  citus_installed && return 1
  local source=${INBOX_CITUS_SOURCE:-}
  [[ -n "$source" && -f "$source" ]] && return 1
  if [[ -n "$source" ]]; then
    echo "Citus is not installed and INBOX_CITUS_SOURCE names no file ('$source')."
  else
    echo "Citus is not installed (Debian does not package it) and INBOX_CITUS_SOURCE is not set."
  fi
  echo "To run them: install Citus 13 for PostgreSQL 15 (citus.so in $("$PG_CONFIG" --pkglibdir)),"
  echo "or set INBOX_CITUS_SOURCE to a Citus 13.x source tarball, which scripts/citus.sh builds"
  echo "and installs (about 6 minutes), e.g. the release archive"
  echo "https://github.com/citusdata/citus/archive/refs/tags/v13.2.2.tar.gz."
}

_port_in_use() { (: <"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# remove_pg_dir DIR: stops every cluster whose data directory is DIR/*, then deletes DIR.
remove_pg_dir() {
  local pidfile
  for pidfile in "$1"/*/postmaster.pid; do
    [[ -f "$pidfile" ]] || continue
    as_postgres "$PG_BIN/pg_ctl" -D "$(dirname "$pidfile")" -m fast -w stop >/dev/null || true
  done
  rm -rf "$1"
}

# Uses the server on 127.0.0.1:5432 if it answers with trust auth (unless
# INBOX_PG_FORCE_THROWAWAY=1); otherwise starts a throwaway cluster that is stopped and
# removed when the script exits. Exports PGHOST, PGPORT, PGUSER and INBOX_PG_URL.
ensure_postgres() {
  export PGHOST=127.0.0.1 PGUSER=postgres PGPORT=5432
  if [[ "${INBOX_PG_FORCE_THROWAWAY:-0}" != 1 ]] &&
    pg_isready -q -h 127.0.0.1 -p 5432 &&
    psql -X -w -d postgres -Atqc 'SELECT 1' </dev/null >/dev/null 2>&1; then
    echo "using the PostgreSQL on 127.0.0.1:5432"
  else
    # INBOX_PG_THROWAWAY_PORT: where the search for a free port starts (stages started side by
    # side start theirs apart, so that two searches cannot pick the same port).
    PGPORT=${INBOX_PG_THROWAWAY_PORT:-54329}
    while _port_in_use "$PGPORT"; do PGPORT=$((PGPORT + 1)); done
    INBOX_PG_DIR="$(mktemp -d /tmp/inbox-pg.XXXXXX)"
    on_exit "remove_pg_dir '$INBOX_PG_DIR'"
    chown postgres:postgres "$INBOX_PG_DIR"
    as_postgres "$PG_BIN/initdb" -D "$INBOX_PG_DIR/data" -U postgres --auth=trust \
      -E UTF8 --locale=C.UTF-8 >/dev/null
    if ! as_postgres "$PG_BIN/pg_ctl" -D "$INBOX_PG_DIR/data" -l "$INBOX_PG_DIR/log" -w \
      -o "-p $PGPORT -k $INBOX_PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=200" \
      start >/dev/null; then
      cat "$INBOX_PG_DIR/log" >&2
      return 1
    fi
    echo "started a throwaway PostgreSQL on 127.0.0.1:$PGPORT in $INBOX_PG_DIR"
  fi
  export INBOX_PG_URL="postgres://postgres@127.0.0.1:$PGPORT"
}

# fresh_database NAME: (re)creates database NAME with the extension installed; prints its URL.
fresh_database() {
  local db=$1 psql=(psql -X -w -q -v ON_ERROR_STOP=1 -c 'SET client_min_messages = warning')
  "${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" \
    -c "CREATE DATABASE \"$db\"" >&2
  "${psql[@]}" -d "$db" -c 'CREATE EXTENSION inbox' >&2
  echo "$INBOX_PG_URL/$db"
}

# fresh_sql_only_database NAME: (re)creates database NAME with the SQL-only build
# (sql/inbox-sql-only.sql) installed in its public schema; prints its URL.
fresh_sql_only_database() {
  local db=$1 psql=(psql -X -w -q -v ON_ERROR_STOP=1 -c 'SET client_min_messages = warning')
  "${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" \
    -c "CREATE DATABASE \"$db\"" >&2
  "${psql[@]}" -d "$db" -o /dev/null -f "$REPO_ROOT/sql/inbox-sql-only.sql" >&2
  echo "$INBOX_PG_URL/$db"
}

# prepare_database NAME: what the demo and the benchmark need before they run: the toolchain,
# the extension built from the current sources and installed, a Postgres, and a fresh database
# NAME with the extension, whose URL it leaves in $DATABASE_URL. (Not in a subshell: the
# throwaway cluster, if one is started, lives as long as the calling script.)
prepare_database() {
  banner "toolchain"
  ensure_toolchain
  banner "install the extension"
  install_extension
  banner "PostgreSQL"
  ensure_postgres
  DATABASE_URL="$(fresh_database "$1")"
  export DATABASE_URL
}

# ensure_example_runtimes: what examples/run.sh needs, from Debian where missing: python3 with
# venv (the Python example's virtualenv) and node with npm (the Node example).
ensure_example_runtimes() {
  local missing=()
  command -v python3 >/dev/null || missing+=(python3)
  python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
  command -v node >/dev/null || missing+=(nodejs)
  command -v npm >/dev/null || missing+=(npm)
  if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    apt_install "${missing[@]}"
  fi
}

# ensure_browser: Chromium and its WebDriver server from Debian, for the dashboard's browser tests
# (cli/tests/ui/browser.rs).
ensure_browser() {
  local pkg missing=()
  for pkg in chromium chromium-driver; do
    dpkg -s "$pkg" 2>/dev/null | grep -qx 'Status: install ok installed' || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    apt_install --no-install-recommends "${missing[@]}"
  fi
}

# The cargo arguments of every build and run of the workspace's tests (all but the extension's):
# one package selection, so that every invocation resolves the same features and reuses one build
# in target/ci (`-p inbox-tests` alone, say, resolves others and rebuilds most dependencies).
CI_TESTS=(--workspace --exclude inbox --profile ci)

# workspace_tests URL [--no-doc]: the workspace's unit, integration and doc tests against the
# database at URL (built already by `cargo test "${CI_TESTS[@]}" --no-run`). A test binary made
# of modules (tests/tests/<name>/main.rs) runs one module at a time, as when each module was a
# binary of its own: the locks that keep a module's load tests apart from its timing-sensitive
# ones do not reach other modules. --no-doc skips the doc tests, which use no database.
workspace_tests() {
  local url=$1 doc=1 targets row target src list module names
  [[ "${2:-}" == --no-doc ]] && doc=0
  export INBOX_TEST_DATABASE_URL=$url
  cargo test "${CI_TESTS[@]}" --lib --bins
  targets="$(cargo metadata --no-deps --format-version 1 |
    jq -r '.packages[] | select(.name != "inbox") | .targets[]
             | select(.kind == ["test"]) | [.name, .src_path] | @tsv')"
  mapfile -t targets <<<"$targets"
  for row in "${targets[@]}"; do
    IFS=$'\t' read -r target src <<<"$row"
    # The Citus tests need a cluster: scripts/citus.sh starts one and runs them.
    [[ "$target" == citus ]] && continue
    if [[ "$src" != */main.rs ]]; then
      cargo test "${CI_TESTS[@]}" --test "$target"
      continue
    fi
    list="$(cargo test "${CI_TESTS[@]}" --test "$target" -- --list --format terse)"
    list="$(sed -n 's/: test$//p' <<<"$list")"
    # Each module's tests, then those outside any module (named without "::").
    for module in $(sed -n 's/::.*//p' <<<"$list" | sort -u) ""; do
      if [[ -n "$module" ]]; then
        mapfile -t names < <(grep "^$module::" <<<"$list")
      else
        mapfile -t names < <(grep -v "::" <<<"$list" || true)
      fi
      ((${#names[@]})) || continue
      banner "$target: ${module:-(no module)}: ${#names[@]} tests"
      cargo test "${CI_TESTS[@]}" --test "$target" -- --exact "${names[@]}"
    done
  done
  if ((doc)); then
    cargo test "${CI_TESTS[@]}" --doc
  fi
}
