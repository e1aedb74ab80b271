#!/usr/bin/env bash
# Prints the ring's lease-and-ack loop for pgbench: one branch per segment, so that each
# statement names its segment's tables (prepared once per segment, as the extension prepares a
# statement per table) and locks nothing else.
#
# :g is the segment this session drains and :floor the entry it took last there. A lease takes
# the first entry past the floor that no claim names (SKIP LOCKED on the entry; the claim's
# primary key is what keeps a second lease out), and the ack inserts a close (its primary key
# the fence).
set -euo pipefail
for g in 0 1 2 3 4 5 6 7; do
  if ((g == 0)); then echo "\\if :g = 0"; else echo "\\elif :g = $g"; fi
  cat <<SQL
WITH picked AS (
    SELECT r.entry, r.job FROM ready_$g r
     WHERE r.entry > :floor AND r.due <= now()
       AND NOT EXISTS (SELECT FROM claims_$g c WHERE c.job = r.job AND c.token = 1)
     ORDER BY r.entry LIMIT 1 FOR UPDATE OF r SKIP LOCKED),
claimed AS (
    INSERT INTO claims_$g (job, token, entry, until)
    SELECT job, 1, entry, now() + interval '30 seconds' FROM picked
        ON CONFLICT DO NOTHING RETURNING job, entry)
SELECT coalesce(max(job), 0) AS job, coalesce(max(entry), 0) AS taken,
       open_segment() AS open FROM claimed \\gset
\\if :job > 0
INSERT INTO closes_$g (job, token, outcome) VALUES (:job, 1, 'a') ON CONFLICT DO NOTHING;
\\endif
SQL
done
# A lease that found nothing past the floor: an entry may have committed behind it (its number
# is drawn before its transaction commits). Before leaving a segment the session scans it once
# from its start; on the open segment it does so once in 50 empty leases (about once a second
# when idle) and otherwise waits a millisecond, as a worker waits for a wake-up.
cat <<'SQL'
\endif
\if :job > 0
\set floor :taken
\elif :g != :open
\if :floor > 0
\set floor 0
\else
\set g (:g + 1) % 8
\endif
\else
\set rescan random(1, 50)
\if :rescan = 1
\set floor 0
\else
\sleep 1 ms
\endif
\endif
SQL
