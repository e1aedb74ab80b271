#!/usr/bin/env bash
# The raw patterns of docs/design/queue-storage.md under a held snapshot, as an open loop:
# producers enqueue at a fixed rate (pgbench -R) while 4 connections lease and ack (each its own
# transaction), 60 s clean, 120 s with a holder, 60 s after; first today's SKIP LOCKED queue (a
# lease's UPDATE, an ack's DELETE), then the insert-only ring (entries, claims and closes in 8
# segments, reclaimed by TRUNCATE). Every 10 s: jobs completed a second, the backlog, the
# tables' size and dead tuples.
#
#   scripts/raw-storage.sh [RATE]    (jobs a second offered, default 3,000)
#
# RAW_CLEAN, RAW_HOLD and RAW_AFTER set the phases' seconds (60, 120, 60). RAW_HOLDER is what
# holds the horizon: `xid` (default: a session idle in a transaction that has an xid) or
# `readers` (four REPEATABLE READ transactions that scan the queue's tables in a loop).
#
# On a throwaway cluster of its own (autovacuum on, as a production server has it), started and
# removed here. Commits are not flushed (synchronous_commit = off): the figure is what the
# patterns cost the server, not the disk's flush rate.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source-path=SCRIPTDIR/..
source scripts/lib.sh

rate=${1:-3000}
clean=${RAW_CLEAN:-60} hold=${RAW_HOLD:-120} after=${RAW_AFTER:-60} holder=${RAW_HOLDER:-xid}
total=$((clean + hold + after))
dir="tests/raw-storage"
ensure_toolchain
INBOX_PG_FORCE_THROWAWAY=1 INBOX_PG_THROWAWAY_PORT=54500 ensure_postgres
psql -X -q -d postgres -c "ALTER SYSTEM SET synchronous_commit = off" -c "SELECT pg_reload_conf()" >/dev/null
psql -X -q -d postgres -c "CREATE DATABASE raw" >/dev/null
url="$INBOX_PG_URL/raw"
run() { psql -X -q -v ON_ERROR_STOP=1 -d "$url" "$@"; }
run -f "$dir/setup.sql"
work="$(mktemp -d)"
on_exit "rm -rf '$work'"
"$dir/ring-drain.sh" >"$work/ring-drain.sql"

# hold_horizon TABLES: holds the horizon for $hold seconds the way $holder says.
hold_horizon() {
  case "$holder" in
    xid) run -c "BEGIN; SELECT txid_current(); SELECT pg_sleep($hold); COMMIT;" >/dev/null ;;
    readers)
      # Each scans the queue's table once a second in one REPEATABLE READ transaction (its
      # snapshot, and its ACCESS SHARE locks, held to the end), as a report or an export would.
      local i
      for i in 1 2 3 4; do
        run -c "BEGIN ISOLATION LEVEL REPEATABLE READ;
                DO \$\$ BEGIN
                  WHILE clock_timestamp() < now() + interval '$hold seconds' LOOP
                    PERFORM count(*) FROM $1;
                    PERFORM pg_sleep(1);
                  END LOOP;
                END \$\$;
                COMMIT;" >/dev/null &
      done
      wait
      ;;
    *) fail "RAW_HOLDER is xid or readers, not $holder" ;;
  esac
}

# counts PATTERN: "completed produced MB dead" of the pattern's tables, from the statistics.
counts() {
  run -At -F ' ' -c "SELECT sum(n_tup_${2}) FILTER (WHERE relname ~ '$3'),
                            sum(n_tup_ins) FILTER (WHERE relname ~ '$4'),
                            round(sum(pg_total_relation_size(relid)) / 1048576.0, 1), sum(n_dead_tup)
                       FROM pg_stat_user_tables WHERE relname ~ '$1'"
}

# pattern NAME PRODUCE DRAIN TABLES COMPLETED-COUNTER COMPLETED-TABLES PRODUCED-TABLES READ [RECLAIM]
pattern() {
  local name=$1 produce=$2 drain=$3 tables=$4 done_counter=$5 done_tables=$6 made_tables=$7
  local read=$8 reclaim=${9:-0}
  banner "$name: $rate jobs/s offered; $holder holds the horizon from $clean s to $((clean + hold)) s"
  run -c "VACUUM ANALYZE" -c "CHECKPOINT"
  pgbench -n -M prepared -c 2 -j 1 -R "$rate" -T "$total" -f "$produce" "$url" >"$work/produce.log" 2>&1 &
  local producers=$!
  # Index probes only: a statement planned while the tables were empty would keep a plan that
  # reads every claim of a segment per lease (a scan, or a hash or merge anti-join) until
  # autovacuum's analyze replans it; the extension's statements are shaped for index probes.
  PGOPTIONS="-c enable_seqscan=off -c enable_hashjoin=off -c enable_mergejoin=off" pgbench -n -M prepared -D g=0 -D floor=0 -c 4 -j 2 \
    -T "$total" -f "$drain" "$url" >"$work/drain.log" 2>&1 &
  local consumers=$!
  (sleep "$clean" && hold_horizon "$read") &
  local held=$!
  # Windows by the clock: a reclaim pass takes its own time, so a count of sleeps would drift.
  local began=$SECONDS at last=0 last_at=$SECONDS next=$((SECONDS + 10)) now made size dead
  printf '%6s %10s %10s %10s %10s\n' "t" "done/s" "backlog" "MB" "dead"
  while ((SECONDS - began < total)); do
    if ((reclaim)); then
      for g in 0 1 2 3 4 5 6 7; do run -v g="$g" -f "$dir/reclaim.sql" 2>/dev/null | grep -v '^$' || true; done
    fi
    sleep 1
    if ((SECONDS >= next)); then
      at=$SECONDS
      read -r now made size dead <<<"$(counts "$tables" "$done_counter" "$done_tables" "$made_tables")"
      printf '%6s %10s %10s %10s %10s\n' "$((at - began))s" "$(((now - last) / (at - last_at)))" \
        "$((made - now))" "$size" "$dead"
      last=$now last_at=$at next=$((at + 10))
    fi
  done
  wait "$producers" "$consumers" "$held" || true
  grep -E "^(number of failed|latency average|tps)" "$work/produce.log" | sed 's/^/producers: /' || true
  grep -E "^(number of failed|latency average|latency stddev)" "$work/drain.log" | sed 's/^/consumers: /' || true
}

pattern "SKIP LOCKED (update, delete)" "$dir/skq-produce.sql" "$dir/skq-drain.sql" \
  '^skq$' del '^skq$' '^skq$' skq
pattern "insert-only ring (entries, claims, closes)" "$dir/ring-produce.sql" "$work/ring-drain.sql" \
  '^(ready|claims|closes)_' ins '^closes_' '^ready_' "ready" 1
