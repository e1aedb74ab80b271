-- Today's lease and ack, each its own transaction (the worker's two commits). A lease that
-- finds nothing sleeps a millisecond, as a worker would wait for a wake-up.
WITH leased AS (
    UPDATE skq SET attempt = attempt + 1, locked_until = now() + interval '30 seconds'
     WHERE id = (SELECT id FROM skq WHERE locked_until <= now() ORDER BY locked_until, id
                  LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id, attempt)
SELECT coalesce(max(id), 0) AS id, coalesce(max(attempt), 0) AS attempt FROM leased \gset
\if :id > 0
DELETE FROM skq WHERE id = :id AND attempt = :attempt;
\else
\sleep 1 ms
\endif
