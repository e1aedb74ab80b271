-- A tour of the SQL API, runnable with psql against a database where `CREATE EXTENSION inbox`
-- was run: psql -v ON_ERROR_STOP=1 -f sql/tour.sql. It works in a temporary schema and leaves
-- nothing behind. ./scripts/test.sh runs it; every expectation below must hold.
\set ON_ERROR_STOP 1
BEGIN;
CREATE SCHEMA tour;
SET LOCAL search_path = tour, public;
CREATE FUNCTION tour.expect(holds boolean, what text) RETURNS void LANGUAGE plpgsql AS
  $$ BEGIN IF holds IS NOT TRUE THEN RAISE EXCEPTION 'tour: expected %', what; END IF; END $$;

-- The dedup ledger: a claim is true once, and joins the caller's transaction.
SELECT inbox_create_ledger('payments_inbox');
CREATE TABLE payments (event_id text, amount int);
SELECT inbox_claim('payments_inbox', 'evt_1') AS first, inbox_claim('payments_inbox', 'evt_1') AS replay \gset
INSERT INTO payments SELECT 'evt_1', 42 WHERE :'first'::boolean;
INSERT INTO payments SELECT 'evt_1', 42 WHERE :'replay'::boolean;
SELECT expect((SELECT count(*) FROM payments) = 1, 'one payment');

-- A queue: enqueue (one, keyed, delayed, batch), lease, settle.
SELECT inbox_create_queue('emails');
SELECT inbox_enqueue('emails', '{"to": "a@example.com"}') AS a \gset
SELECT inbox_enqueue('emails', '{"to": "b@example.com"}', key => 'b-welcome') AS b \gset
SELECT inbox_enqueue('emails', '{"to": "b@example.com"}', key => 'b-welcome') IS NULL AS deduped \gset
SELECT count(*) AS batch FROM inbox_enqueue_batch('emails', ARRAY['{"to": "c"}', '{"to": "d"}']::jsonb[]) \gset
SELECT inbox_enqueue('emails', '{"to": "later"}', now() + interval '1 hour');
SELECT expect(:'deduped'::boolean AND :batch = 2, 'key dedup and batch');

SELECT id, token FROM inbox_lease('emails', 1, '30 seconds') \gset leased_
SELECT inbox_ack('emails', :leased_id, :leased_token) AS acked \gset
SELECT id, token FROM inbox_lease('emails', 1) \gset second_
SELECT inbox_retry('emails', :second_id, :second_token, '10 seconds', 'smtp timeout', 5) AS retried \gset
SELECT id, token FROM inbox_lock('emails', 1) \gset third_
SELECT inbox_dead('emails', :third_id, :third_token, 'bad address') AS dead \gset
SELECT expect(:'acked'::boolean AND :'retried'::boolean AND :'dead'::boolean, 'settlements apply');

SELECT * FROM inbox_stats('emails');
SELECT expect((ready, delayed, leased, dead) = (1, 2, 0, 1), 'one ready, two delayed, one dead')
  FROM inbox_stats('emails');
SELECT inbox_channel('emails') IS NOT NULL AS has_channel;
ROLLBACK;
