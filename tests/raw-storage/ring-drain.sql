-- The ring's lease (an entry past the session's floor that no claim names, locked with SKIP
-- LOCKED, and a claim inserted; its primary key is what keeps a second lease out), then its ack
-- (a close, fenced by its primary key). :floor is the entry this session took last; a lease that
-- finds nothing past it starts again from 0 (the whole ring); pgbench -D floor=0 starts it.
WITH picked AS (
    SELECT r.seg, r.entry, r.job FROM ready r
     WHERE r.entry >= :floor AND r.due <= now()
       AND NOT EXISTS (SELECT FROM claims c WHERE c.seg = r.seg AND c.job = r.job AND c.token = 1)
     ORDER BY r.entry LIMIT 1 FOR UPDATE OF r SKIP LOCKED),
claimed AS (
    INSERT INTO claims (seg, job, token, entry, until)
    SELECT seg, job, 1, entry, now() + interval '30 seconds' FROM picked
        ON CONFLICT DO NOTHING RETURNING seg, job, entry)
SELECT coalesce(max(seg), -1) AS seg, coalesce(max(job), 0) AS job,
       coalesce(max(entry), 0) AS floor FROM claimed \gset
\if :job > 0
INSERT INTO closes (seg, job, token, outcome) VALUES (:seg, :job, 1, 'a') ON CONFLICT DO NOTHING;
\endif
