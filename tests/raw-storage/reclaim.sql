-- Reclaims segment :g if it is not the open one and every entry in it is closed. First checked
-- without a lock that the job path would wait for (a read takes ACCESS SHARE only); then, only
-- for a segment that passed, again under an ACCESS EXCLUSIVE lock taken with NOWAIT: a
-- transaction that holds the segment (a lease still in it, a reader) makes the reclaim try again
-- later, and no ACCESS EXCLUSIVE request ever queues in front of the job path. Under that lock no
-- lease, ack or insert can touch the segment between the check and the TRUNCATE.
SELECT :g <> open_segment()
       AND EXISTS (SELECT FROM ready_:g)
       AND NOT EXISTS (SELECT FROM ready_:g r WHERE NOT EXISTS (
                           SELECT FROM closes_:g c WHERE c.job = r.job AND c.token = 1)) AS finished \gset
\if :finished
BEGIN;
LOCK ready_:g, claims_:g, closes_:g IN ACCESS EXCLUSIVE MODE NOWAIT;
SELECT NOT EXISTS (SELECT FROM ready_:g r WHERE NOT EXISTS (
           SELECT FROM closes_:g c WHERE c.job = r.job AND c.token = 1)) AS done \gset
\if :done
TRUNCATE ready_:g, claims_:g, closes_:g;
\echo reclaimed segment :g
\endif
COMMIT;
\endif
