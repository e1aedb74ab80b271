#!/usr/bin/env bash
# The raw patterns of docs/design/queue-storage.md under a held snapshot: today's SKIP LOCKED
# queue (a lease's UPDATE, an ack's DELETE) against the insert-only ring (entries, claims and
# closes in segments reclaimed by TRUNCATE), each as a pgbench loop of 4 connections draining a
# preloaded queue: 60 s clean, 120 s with a session idle in a transaction that holds an xid,
# 60 s after. Prints each 10 s's rate and, beside it, the tables' size and dead tuples.
#
#   scripts/raw-storage.sh [JOBS]    (JOBS preloaded per pattern, default 3,000,000)
#
# RAW_CLEAN, RAW_HOLD and RAW_AFTER set the phases' seconds (60, 120, 60).
#
# On a throwaway cluster of its own (autovacuum on, as a production server has it), started and
# removed here. Commits are not flushed (synchronous_commit = off): the figure is what the
# patterns cost the server, not the disk's flush rate.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

jobs=${1:-3000000}
clean=${RAW_CLEAN:-60} hold=${RAW_HOLD:-120} after=${RAW_AFTER:-60}
dir="tests/raw-storage"
ensure_toolchain
INBOX_PG_FORCE_THROWAWAY=1 INBOX_PG_THROWAWAY_PORT=54500 ensure_postgres
psql -X -q -d postgres -c "ALTER SYSTEM SET synchronous_commit = off" -c "SELECT pg_reload_conf()" >/dev/null
psql -X -q -d postgres -c "CREATE DATABASE raw" >/dev/null
url="$INBOX_PG_URL/raw"
run() { psql -X -q -v ON_ERROR_STOP=1 -d "$url" "$@"; }
run -f "$dir/setup.sql"

sizes() {
  run -At -c "SELECT pg_size_pretty(sum(pg_total_relation_size(relid))) || ' / ' ||
                     sum(n_dead_tup)::text || ' dead'
                FROM pg_stat_user_tables WHERE relname ~ '^($1)'"
}

# pattern NAME SCRIPT TABLES PRELOAD-SQL [RECLAIM]
pattern() {
  local name=$1 script=$2 tables=$3 preload=$4 reclaim=${5:-0}
  banner "$name: preload $jobs jobs"
  run -c "$preload"
  run -c "VACUUM ANALYZE" -c "CHECKPOINT"
  local out
  out="$(mktemp)"
  # Index scans only: a statement prepared while the claims were few would keep a plan that
  # reads all of them (a server of this design would analyze each segment as it opens one).
  PGOPTIONS="-c enable_seqscan=off" pgbench -n -M prepared -D floor=0 -c 4 -j 2 -T $((clean + hold + after)) -P 10 -f "$dir/$script" "$url" >"$out" 2>&1 &
  local bench=$!
  (
    sleep "$clean"
    run -c "BEGIN; SELECT txid_current(); SELECT pg_sleep($hold); COMMIT;" >/dev/null
  ) &
  local holder=$!
  local t=0
  while kill -0 "$bench" 2>/dev/null; do
    if ((reclaim)); then
      for g in 0 1 2 3 4 5 6 7; do run -v g="$g" -f "$dir/reclaim.sql" 2>&1 | grep -v '^$' || true; done
    fi
    sleep 2
    t=$((t + 2))
    if ((t % 10 == 0)); then echo "t=${t}s $name tables: $(sizes "$tables")"; fi
  done
  wait "$holder" || true
  wait "$bench" || true
  banner "$name: pgbench (the xid is held from $clean s to $((clean + hold)) s)"
  grep -vE "^(pgbench|transaction type|scaling|query mode|number of|maximum number|duration|initial connection)" "$out"
  rm -f "$out"
}

pattern "SKIP LOCKED (update, delete)" skq-drain.sql skq \
  "INSERT INTO skq (payload) SELECT '{}' FROM generate_series(1, $jobs)"
pattern "insert-only ring (entries, claims, closes)" ring-drain.sql "ready|claims|closes" \
  "INSERT INTO ready (seg, entry, job, due, payload)
   SELECT (e - 1) * 8 / $jobs, e, e, now(), '{}'
     FROM (SELECT nextval('entries') AS e FROM generate_series(1, $jobs)) AS s" 1
