-- Today's lease and ack, each its own transaction (the worker's two commits).
UPDATE skq SET attempt = attempt + 1, locked_until = now() + interval '30 seconds'
 WHERE id = (SELECT id FROM skq WHERE locked_until <= now() ORDER BY locked_until, id
              LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, attempt \gset
DELETE FROM skq WHERE id = :id AND attempt = :attempt;
