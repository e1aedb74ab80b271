-- A producer's enqueue into the ring: an entry in the segment open now (routed by its value).
INSERT INTO ready (seg, entry, job, due, payload)
SELECT open_segment(), e, e, now(), '{}' FROM nextval('entries') AS e;
