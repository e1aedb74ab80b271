-- A producer's enqueue into the ring: an entry in the segment open now (ring_enqueue names the
-- segment's table).
SELECT ring_enqueue();
