-- Reclaims segment :g if every entry in it is closed: under an ACCESS EXCLUSIVE lock that it
-- waits at most 20 ms for (a reader holding the segment makes it try again later), so that no
-- lease, ack or insert can touch the segment between the check and the TRUNCATE. One
-- transaction per segment: a lock on a segment it keeps would stop that segment's leases.
BEGIN;
SET LOCAL lock_timeout = '20ms';
LOCK ready_:g, claims_:g, closes_:g IN ACCESS EXCLUSIVE MODE;
SELECT EXISTS (SELECT FROM ready_:g)
       AND NOT EXISTS (SELECT FROM ready_:g r WHERE NOT EXISTS (
                           SELECT FROM closes_:g c WHERE c.job = r.job AND c.token = 1)) AS done \gset
\if :done
TRUNCATE ready_:g, claims_:g, closes_:g;
\echo reclaimed segment :g
\endif
COMMIT;
