// The inbox extension from Node.js with node-postgres (`pg`), through its SQL API only.
//
// A producer enqueues refund jobs; workers lease them, write the refund in the same transaction
// as the job's ack (so a refund is written exactly once, however often the job runs), retry a
// failed job with its error, and leave it dead-lettered after MAX_ATTEMPTS; a webhook consumer
// claims each event in the dedup ledger in the same transaction as its effect.
//
//     DATABASE_URL=postgres://... node inbox-example.js   # sets up, runs, prints the outcome
//
// node-postgres sends every parameter untyped (as text), and PostgreSQL infers its type from
// the function called. The id and token given to `inbox_ack` are cast to bigint, which keeps the
// call on the one-job form whatever other forms of `inbox_ack` exist.
//
// What is exactly once: rows written in this database in the transaction that acks the job (or
// claims the event). A call to anything outside it (HTTP, e-mail, a card processor) is at least
// once: a retry after the call succeeded makes it again, so send it an idempotency key.

'use strict';

const { Client } = require('pg');

// The tables the example uses (the tests point them at a schema of their own).
const names = { queue: 'refund_jobs', ledger: 'webhook_inbox' };
const MAX_ATTEMPTS = 3;

/** Creates the queue, the ledger and the effect tables (each call is idempotent). */
async function setup(client) {
  await client.query('SELECT inbox_create_queue($1)', [names.queue]);
  await client.query('SELECT inbox_create_ledger($1)', [names.ledger]);
  await client.query(
    'CREATE TABLE IF NOT EXISTS refunds (order_id bigint NOT NULL, amount_cents int NOT NULL)',
  );
  await client.query(
    'CREATE TABLE IF NOT EXISTS payments (event_id text NOT NULL, amount_cents int NOT NULL)',
  );
}

// --- the producer ------------------------------------------------------------------------------

/** Enqueues one refund, deduplicated by order while it is queued; resolves to its id or null. */
async function enqueueRefund(client, order, amountCents, extra = {}) {
  const payload = JSON.stringify({ order, amount_cents: amountCents, ...extra });
  const { rows } = await client.query('SELECT inbox_enqueue($1, $2, key => $3) AS id', [
    names.queue,
    payload,
    `refund-${order}`,
  ]);
  return rows[0].id; // a bigint arrives as a string
}

/** Enqueues many refunds in one statement; resolves to how many. */
async function enqueueRefunds(client, payloads) {
  const { rowCount } = await client.query('SELECT inbox_enqueue_batch($1, $2)', [
    names.queue,
    payloads.map((payload) => JSON.stringify(payload)),
  ]);
  return rowCount;
}

// --- the worker --------------------------------------------------------------------------------

class Fenced extends Error {}

function newTally() {
  return { acked: 0, retried: 0, lost: 0, errors: [] };
}

/**
 * The handler: writes the refund through the delivery's transaction. A job may ask to fail
 * (`fail_attempts`): it writes its refund first and then throws, so the rollback of the failed
 * attempt is what keeps the refund from being written twice.
 */
async function refund(client, job, attempt) {
  await client.query('INSERT INTO refunds (order_id, amount_cents) VALUES ($1, $2)', [
    job.order,
    job.amount_cents,
  ]);
  if (attempt <= (job.fail_attempts || 0)) {
    throw new Error(`card processor timeout on attempt ${attempt}`);
  }
}

/** Runs one delivery: the handler's writes and the ack commit together, or not at all. */
async function deliver(client, handler, job, tally) {
  try {
    await client.query('BEGIN');
    await handler(client, job.payload, job.attempt);
    const { rows } = await client.query(
      'SELECT inbox_ack($1, $2::bigint, $3::bigint) AS acked',
      [names.queue, job.id, job.token],
    );
    if (!rows[0].acked) throw new Fenced();
    await client.query('COMMIT');
    tally.acked += 1;
  } catch (error) {
    await client.query('ROLLBACK');
    if (error instanceof Fenced) {
      tally.lost += 1; // the delivery that holds the job now will do it
      return;
    }
    tally.errors.push(error.message);
    // Retries at once; dead-letters once the job has had MAX_ATTEMPTS deliveries.
    await client.query("SELECT inbox_retry($1, $2, $3, '0 seconds', $4, $5)", [
      names.queue,
      job.id,
      job.token,
      error.message,
      MAX_ATTEMPTS,
    ]);
    tally.retried += 1;
  }
}

/** Leases jobs until the queue has none ready, running each in its own transaction. */
async function workUntilIdle(connection, { handler = refund, lease = '30 seconds', batch = 10 } = {}) {
  const client = new Client(connection);
  await client.connect();
  const tally = newTally();
  try {
    for (;;) {
      // The lease commits on its own: the attempt stays counted even if this process dies,
      // so a job that crashes its worker ends up dead-lettered.
      const { rows } = await client.query(
        'SELECT id, token, attempt, payload FROM inbox_lease($1, $2, $3)',
        [names.queue, batch, lease],
      );
      if (rows.length === 0) return tally;
      for (const job of rows) await deliver(client, handler, job, tally);
    }
  } finally {
    await client.end();
  }
}

// --- the dedup ledger --------------------------------------------------------------------------

/**
 * Records a payment once per event, however often the event is delivered. The claim and the
 * effect are one transaction: a replay (or a concurrent duplicate) finds the key claimed and
 * writes nothing; a crash before the commit leaves neither.
 */
async function handleWebhook(connection, eventId, amountCents) {
  const client = new Client(connection);
  await client.connect();
  try {
    await client.query('BEGIN');
    const { rows } = await client.query('SELECT inbox_claim($1, $2) AS first', [names.ledger, eventId]);
    if (rows[0].first) {
      await client.query('INSERT INTO payments (event_id, amount_cents) VALUES ($1, $2)', [
        eventId,
        amountCents,
      ]);
    }
    await client.query('COMMIT');
    return rows[0].first;
  } catch (error) {
    await client.query('ROLLBACK');
    throw error;
  } finally {
    await client.end();
  }
}

async function main() {
  const connectionString = process.env.DATABASE_URL;
  if (!connectionString) {
    console.error('set DATABASE_URL');
    return 2;
  }
  const connection = { connectionString };
  const client = new Client(connection);
  await client.connect();
  try {
    await setup(client);
    await enqueueRefunds(
      client,
      Array.from({ length: 100 }, (_, n) => ({ order: n + 1, amount_cents: 100 + n })),
    );
    await enqueueRefund(client, 1000, 5, { fail_attempts: 1 });
    await enqueueRefund(client, 1001, 5, { fail_attempts: MAX_ATTEMPTS });
    const tallies = await Promise.all([1, 2, 3, 4].map(() => workUntilIdle(connection)));
    for (const event of ['evt_1', 'evt_2', 'evt_1', 'evt_2', 'evt_1']) {
      await handleWebhook(connection, event, 42);
    }
    const count = async (sql, params = []) => Number((await client.query(sql, params)).rows[0].n);
    const refunds = await count('SELECT count(*) AS n FROM refunds');
    const dead = await count('SELECT dead AS n FROM inbox_stats($1)', [names.queue]);
    const payments = await count('SELECT count(*) AS n FROM payments');
    console.log(`refunds written: ${refunds}, dead-lettered jobs: ${dead}, payments recorded: ${payments}`);
    const sum = (key) => tallies.reduce((total, tally) => total + tally[key], 0);
    console.log(`acked ${sum('acked')}, retried ${sum('retried')}`);
    return 0;
  } finally {
    await client.end();
  }
}

module.exports = {
  names,
  MAX_ATTEMPTS,
  setup,
  enqueueRefund,
  enqueueRefunds,
  refund,
  deliver,
  newTally,
  workUntilIdle,
  handleWebhook,
};

if (require.main === module) {
  main().then(
    (code) => process.exit(code),
    (error) => {
      console.error(error);
      process.exit(1);
    },
  );
}
