//! Figure 19: what a durable step costs. The first row is the transactional worker whose
//! handler runs one step per job (a closure that returns at once, its result recorded with
//! `inbox_record_step` in a commit of its own) before inserting its row, against the same worker
//! and handler without the step: the price of a step on the job path. The second row is the
//! record alone: connections calling `inbox_record_step` one commit each, against the same row
//! inserted by a plain `INSERT .. ON CONFLICT DO NOTHING` into a table of the same shape, one
//! commit each: what the function adds to the insert.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_client::worker::{AsyncTxHandler, HandlerResult, Job, Outcome, Tx, Worker};
use inbox_client::JobType;
use serde::{Deserialize, Serialize};

use super::measure::{compare, window, Row, Target};
use super::setup::*;

/// The raw side of the record's row: `inbox_steps`'s shape, without the function around it.
const RAW_STEPS: &str = "bench_steps_raw";

#[derive(Serialize, Deserialize)]
struct Numbered {
    n: i64,
}

impl JobType for Numbered {
    const QUEUE: &'static str = Q_INBOX;
}

/// Inserts the job's row, after one durable step when `step`.
struct Handler {
    step: bool,
    acked: Arc<AtomicU64>,
}

impl AsyncTxHandler<Numbered> for Handler {
    async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
        let n = job.payload.n;
        if self.step {
            let _: i64 = job
                .step("call", || async { Ok::<_, std::io::Error>(n) })
                .await?;
        }
        tx.client()
            .await?
            .execute("INSERT INTO bench_done_inbox (n) VALUES ($1)", &[&n])
            .await?;
        self.acked.fetch_add(1, Ordering::Relaxed);
        Ok(Outcome::ack())
    }
}

async fn worker(ctx: &Ctx, connections: usize, step: bool) -> Result<f64> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[Q_INBOX, DONE_INBOX]).await?;
    admin.batch_execute("TRUNCATE inbox_steps").await?;
    admin
        .execute(
            &format!(
                "SELECT count(*) FROM inbox_enqueue_batch('{Q_INBOX}'::regclass, \
                 ARRAY(SELECT {PAYLOAD_N} FROM generate_series(1, $1::int8) g))"
            ),
            &[&(2 * ctx.opts.depth(connections, 1) as i64)],
        )
        .await?;
    let acked = Arc::new(AtomicU64::new(0));
    let handler = Handler {
        step,
        acked: acked.clone(),
    };
    // One connection per slot, the heartbeat's, and some for the steps' records.
    let handle = Worker::transactional_for(ctx.database(2 * connections + 2)?, handler)
        .workers(connections)
        .start();
    let rate = window(ctx, || acked.load(Ordering::Relaxed)).await?;
    handle.shutdown(Duration::from_millis(300)).await;
    Ok(rate)
}

/// `connections` connections recording steps (or inserting their rows) one commit each, each a
/// job's step of its own; records per second.
async fn records(ctx: &Ctx, connections: usize, through_function: bool) -> Result<f64> {
    let admin = ctx.connect().await?;
    admin
        .batch_execute(&format!("TRUNCATE inbox_steps; TRUNCATE {RAW_STEPS}"))
        .await?;
    let sql = if through_function {
        format!("SELECT recorded FROM inbox_record_step('{Q_INBOX}', $1, 1, 'call', '1')")
    } else {
        format!(
            "INSERT INTO {RAW_STEPS} (queue, job, name, result, attempt, recorded_at) \
             VALUES ('{Q_INBOX}'::regclass, $1, 'call', '1', 1, clock_timestamp()) \
             ON CONFLICT DO NOTHING RETURNING result"
        )
    };
    let next = Arc::new(AtomicI64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let (client, sql) = (ctx.connect().await?, sql.clone());
        let (next, done, stop) = (next.clone(), done.clone(), stop.clone());
        tasks.spawn(async move {
            let statement = client.prepare(&sql).await?;
            while !stop.is_cancelled() {
                let job = next.fetch_add(1, Ordering::Relaxed);
                client.query(&statement, &[&job]).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, tokio_postgres::Error>(())
        });
    }
    let rate = window(ctx, || done.load(Ordering::Relaxed)).await;
    stop.cancel();
    while let Some(finished) = tasks.join_next().await {
        finished??;
    }
    rate
}

/// Figure 19: a durable step's price on the job path, and its record against a plain insert.
pub async fn steps(ctx: &Ctx) -> Result<Vec<Row>> {
    let admin = ctx.connect().await?;
    admin
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {RAW_STEPS}; \
             CREATE TABLE {RAW_STEPS} (LIKE inbox_steps INCLUDING ALL)"
        ))
        .await?;
    let mut rows = Vec::new();
    for &n in &ctx.opts.connections {
        let (with_step, without) = compare(
            ctx.opts.rounds,
            || worker(ctx, n, true),
            || worker(ctx, n, false),
        )
        .await?;
        let row = Row::new(
            19,
            "19. worker tx, one durable step per job",
            Some(n),
            (Some(with_step), Some(without)),
            "jobs/s",
            Target::None,
        )
        .note("the raw column is the same worker and handler without the step");
        super::report::print_row(&row);
        rows.push(row);
        let (recorded, inserted) = compare(
            ctx.opts.rounds,
            || records(ctx, n, true),
            || records(ctx, n, false),
        )
        .await?;
        let row = Row::new(
            19,
            "19. a step's record (inbox_record_step, a commit each)",
            Some(n),
            (Some(recorded), Some(inserted)),
            "records/s",
            Target::None,
        )
        .note("the raw column inserts the same row into a table of the same shape, a commit each");
        super::report::print_row(&row);
        rows.push(row);
    }
    admin
        .batch_execute(&format!("DROP TABLE {RAW_STEPS}; TRUNCATE inbox_steps"))
        .await?;
    Ok(rows)
}
