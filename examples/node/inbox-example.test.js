// The Node example against a real database: effects exactly once, counted in the database.
// Each test works in a schema of its own in the database named by DATABASE_URL (where
// `CREATE EXTENSION inbox` was run), dropped afterwards. Run with `npm test`.

'use strict';

const assert = require('node:assert/strict');
const { randomBytes } = require('node:crypto');
const { test, beforeEach, afterEach } = require('node:test');
const { Client } = require('pg');

const ex = require('./inbox-example');

let schema;
let connection;

async function withClient(config, body) {
  const client = new Client(config);
  await client.connect();
  try {
    return await body(client);
  } finally {
    await client.end();
  }
}

async function scalar(sql, params = []) {
  return withClient(connection, async (client) => {
    const { rows } = await client.query(sql, params);
    return Number(Object.values(rows[0])[0]);
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

beforeEach(async () => {
  const connectionString = process.env.DATABASE_URL;
  assert.ok(connectionString, 'set DATABASE_URL');
  schema = `node_${randomBytes(6).toString('hex')}`;
  await withClient({ connectionString }, (client) => client.query(`CREATE SCHEMA ${schema}`));
  connection = { connectionString, options: `-c search_path=${schema},public` };
  // Qualified, so that tables of these names elsewhere on the search_path are never used.
  ex.names.queue = `${schema}.refund_jobs`;
  ex.names.ledger = `${schema}.webhook_inbox`;
  await withClient(connection, ex.setup);
});

afterEach(async () => {
  await withClient({ connectionString: process.env.DATABASE_URL }, (client) =>
    client.query(`DROP SCHEMA ${schema} CASCADE`),
  );
});

test('concurrent workers write every refund exactly once', async () => {
  await withClient(connection, async (client) => {
    const payloads = Array.from({ length: 300 }, (_, n) => ({ order: n, amount_cents: n }));
    assert.equal(await ex.enqueueRefunds(client, payloads), 300);
    for (let n = 1000; n < 1010; n++) await ex.enqueueRefund(client, n, 1, { fail_attempts: 1 });
    for (let n = 2000; n < 2003; n++) {
      await ex.enqueueRefund(client, n, 1, { fail_attempts: ex.MAX_ATTEMPTS });
    }
  });

  const tallies = await Promise.all([1, 2, 3, 4].map(() => ex.workUntilIdle(connection)));

  const sum = (key) => tallies.reduce((total, tally) => total + tally[key], 0);
  assert.equal(sum('acked'), 310);
  assert.equal(sum('retried'), 10 + 3 * ex.MAX_ATTEMPTS);
  assert.equal(await scalar('SELECT count(*) FROM refunds'), 310);
  assert.equal(await scalar('SELECT count(DISTINCT order_id) FROM refunds'), 310);
  // The failed attempts wrote a refund before throwing; their rollback took it back.
  assert.equal(await scalar('SELECT count(*) FROM refunds WHERE order_id >= 2000'), 0);
  await withClient(connection, async (client) => {
    const stats = await client.query(
      'SELECT ready, delayed, leased, dead FROM inbox_stats($1)',
      [ex.names.queue],
    );
    assert.deepEqual(stats.rows[0], { ready: '0', delayed: '0', leased: '0', dead: '3' });
    const dead = await client.query(`SELECT attempt, last_error FROM ${ex.names.queue} ORDER BY id`);
    assert.deepEqual(
      dead.rows.map((row) => row.attempt),
      [ex.MAX_ATTEMPTS, ex.MAX_ATTEMPTS, ex.MAX_ATTEMPTS],
    );
    for (const row of dead.rows) assert.match(row.last_error, /attempt 3/);
  });
});

test('a queued key is enqueued once', async () => {
  await withClient(connection, async (client) => {
    const first = await ex.enqueueRefund(client, 7, 70);
    const again = await ex.enqueueRefund(client, 7, 70);
    assert.notEqual(first, null);
    assert.equal(again, null);
  });
  assert.equal(await scalar(`SELECT count(*) FROM ${ex.names.queue}`), 1);
});

test('a delivery that lost its lease commits nothing', async () => {
  await withClient(connection, async (client) => {
    await ex.enqueueRefund(client, 42, 4200);
    const { rows } = await client.query(
      "SELECT id, token, attempt, payload FROM inbox_lease($1, 1, '200 milliseconds')",
      [ex.names.queue],
    );
    await sleep(500); // this delivery stalls past its lease; another worker takes the job
    const other = await ex.workUntilIdle(connection);
    assert.equal(other.acked, 1);
    const late = ex.newTally();
    await ex.deliver(client, ex.refund, rows[0], late);
    assert.deepEqual([late.acked, late.lost], [0, 1]);
  });
  assert.equal(await scalar('SELECT count(*) FROM refunds WHERE order_id = 42'), 1);
  assert.equal(await scalar(`SELECT count(*) FROM ${ex.names.queue}`), 0);
});

test('duplicate webhooks record each payment once', async () => {
  const events = Array.from({ length: 60 }, (_, n) => `evt_${n}`);
  const results = (
    await Promise.all(
      [1, 2, 3, 4].map(async () => {
        const firsts = [];
        for (const event of events) firsts.push(await ex.handleWebhook(connection, event, 42));
        return firsts;
      }),
    )
  ).flat();
  assert.equal(results.length, 4 * events.length);
  assert.equal(results.filter(Boolean).length, events.length);
  assert.equal(await scalar('SELECT count(*) FROM payments'), events.length);
  assert.equal(await scalar('SELECT count(DISTINCT event_id) FROM payments'), events.length);
  assert.equal(await scalar(`SELECT count(*) FROM ${ex.names.ledger}`), events.length);
});
