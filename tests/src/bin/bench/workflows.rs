//! Figure 16: what workflows cost. The default transactional worker (`workers(8)`) burns down
//! the same jobs twice, on two fresh queues: once as plain jobs, once with every second job a
//! dependant of the one before it (its release runs in its parent's ack), and once as members of
//! batches of 100 (each ack counts its member, the last enqueues the callback); the rows are the
//! rates with and without, interleaved over the rounds (target at least 0.8). A third row is the
//! latency of waiting for a result: callers on 16 connections each enqueue a job and wait for it
//! (`ResultWaiter`) while other connections ack each job with a result, one commit each, and the
//! time from a commit's return to its waiter's return is taken (p99, target under 10 ms; p50
//! beside).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, JobState, Queue, ResultWaiter, Statement};
use serde_json::{json, Value};

use super::measure::{Row, Target};
use super::setup::{Ctx, Result};

/// The transactional worker's default, as a service writes it.
const WORKERS: usize = 8;
/// Members per batch.
const BATCH: i64 = 100;
/// Concurrent callers waiting for results.
const CALLERS: usize = 16;

const PLAIN: &str = "bench_flow_plain";
const COMPOSED: &str = "bench_flow_composed";
const CALLBACKS: &str = "bench_flow_callbacks";
const DONE: &str = "bench_flow_done";

/// Drops and creates the figure's queues (a queue that took part keeps its triggers).
async fn fresh_queues(admin: &tokio_postgres::Client) -> Result<()> {
    admin
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {PLAIN}, {COMPOSED}, {CALLBACKS}, {DONE}; \
             CREATE UNLOGGED TABLE {DONE} (n int8 NOT NULL); \
             SELECT inbox_create_queue('{PLAIN}'), inbox_create_queue('{COMPOSED}'), \
                    inbox_create_queue('{CALLBACKS}')"
        ))
        .await?;
    Ok(())
}

/// Burns `queue` down with the default worker, whose handler writes one row; jobs per second.
async fn burn_down(ctx: &Ctx, queue: &str, jobs: u64) -> Result<f64> {
    let handler = transactional(|job: Job<Value>, tx: &dyn Database| {
        Box::pin(async move {
            let n = job.payload["n"].as_i64().unwrap_or_default();
            tx.execute(&Statement::new(format!("INSERT INTO {DONE} VALUES ($1)")).bind(n))
                .await?;
            Ok(Outcome::ack())
        })
    });
    let started = Instant::now();
    let stats = Worker::transactional(ctx.database(WORKERS + 2)?, queue, handler)
        .workers(WORKERS)
        .run_until_idle()
        .await?;
    let elapsed = started.elapsed().as_secs_f64();
    if stats.acked != jobs {
        return Err(format!("{queue}: {} acked of {jobs}", stats.acked).into());
    }
    Ok(jobs as f64 / elapsed)
}

/// The two ways `jobs` jobs are composed.
#[derive(Clone, Copy)]
enum Composition {
    /// Pairs: job 2k depends on job 2k - 1.
    Dependencies,
    /// Batches of [`BATCH`] members with a callback each.
    Batches,
}

/// Fills the composed queue (outside the measurement) and the plain one with as many jobs.
async fn fill(admin: &tokio_postgres::Client, how: Composition, jobs: i64) -> Result<()> {
    fresh_queues(admin).await?;
    admin
        .execute(
            &format!(
                "INSERT INTO {PLAIN} (payload) SELECT jsonb_build_object('n', g) \
                   FROM generate_series(1, $1::int8) AS g"
            ),
            &[&jobs],
        )
        .await?;
    match how {
        Composition::Dependencies => {
            // Parents are jobs 1, 3, 5, ... (the fresh table's ids follow the inserts).
            admin
                .execute(
                    &format!(
                        "SELECT CASE WHEN g % 2 = 1 \
                                THEN inbox_enqueue('{COMPOSED}', jsonb_build_object('n', g)) \
                                ELSE inbox_enqueue_after('{COMPOSED}', jsonb_build_object('n', g), \
                                                         ARRAY[inbox_job('{COMPOSED}', g - 1)]) END \
                           FROM generate_series(1, $1::int8) AS g ORDER BY g"
                    ),
                    &[&jobs],
                )
                .await?;
        }
        Composition::Batches => {
            admin
                .execute(
                    &format!(
                        "WITH batches AS ( \
                           SELECT b, inbox_batch_open('{CALLBACKS}', '{{}}') AS id \
                             FROM generate_series(0, ($1::int8 - 1) / {BATCH}) AS b) \
                         SELECT inbox_batch_add(batches.id, '{COMPOSED}', jsonb_build_object('n', g)) \
                           FROM generate_series(1, $1::int8) AS g \
                           JOIN batches ON batches.b = (g - 1) / {BATCH} ORDER BY g"
                    ),
                    &[&jobs],
                )
                .await?;
            admin
                .batch_execute(&format!(
                    "SELECT inbox_batch_seal(m.batch) FROM \
                       (SELECT DISTINCT batch FROM inbox_batch_members \
                         WHERE queue = '{COMPOSED}'::regclass) AS m"
                ))
                .await?;
        }
    }
    Ok(())
}

pub async fn workflows(ctx: &Ctx) -> Result<Vec<Row>> {
    let jobs: i64 = if ctx.opts.quick { 2_000 } else { 40_000 };
    let admin = ctx.connect().await?;
    let mut rows = Vec::new();
    for (how, name) in [
        (
            Composition::Dependencies,
            "16. workflows: every second job a dependant of the one before",
        ),
        (
            Composition::Batches,
            "16. workflows: every job a member of a batch of 100 with a callback",
        ),
    ] {
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for round in 0..ctx.opts.rounds {
            fill(&admin, how, jobs).await?;
            // Alternating which goes first.
            if round % 2 == 0 {
                with.push(burn_down(ctx, COMPOSED, jobs as u64).await?);
                without.push(burn_down(ctx, PLAIN, jobs as u64).await?);
            } else {
                without.push(burn_down(ctx, PLAIN, jobs as u64).await?);
                with.push(burn_down(ctx, COMPOSED, jobs as u64).await?);
            }
            if let Composition::Batches = how {
                let callbacks: i64 = admin
                    .query_one(&format!("SELECT count(*) FROM {CALLBACKS}"), &[])
                    .await?
                    .get(0);
                let batches = (jobs + BATCH - 1) / BATCH;
                if callbacks != batches {
                    return Err(format!("{callbacks} callbacks for {batches} batches").into());
                }
            }
        }
        rows.push(
            Row::new(
                16,
                name,
                Some(WORKERS),
                (Some(median(&mut with)), Some(median(&mut without))),
                "jobs/s",
                Target::RatioAtLeast(0.8),
            )
            .note(format!(
                "{jobs} jobs; default worker, workers({WORKERS}); raw: the same jobs \
                 without dependencies or batches, same worker"
            )),
        );
    }
    rows.push(wait_latency(ctx, if ctx.opts.quick { 2_000 } else { 10_000 }).await?);
    admin
        .batch_execute(&format!(
            "DROP TABLE {PLAIN}, {COMPOSED}, {CALLBACKS}, {DONE}"
        ))
        .await?;
    Ok(rows)
}

/// Settling tasks that ack each job with its payload as the result, one statement (and so one
/// commit) per job, noting when each commit returned.
const SETTLERS: usize = 4;

/// `calls` enqueue-and-wait calls from [`CALLERS`] connections while [`SETTLERS`] settle the
/// jobs: the p99 (and p50) of the time from a settlement's commit to its waiter's return.
async fn wait_latency(ctx: &Ctx, calls: usize) -> Result<Row> {
    let admin = ctx.connect().await?;
    fresh_queues(&admin).await?;
    let db = ctx.database(CALLERS + 2)?;
    let queue = Queue::new(PLAIN);
    queue
        .keep_results(&db, Some(Duration::from_secs(3600)))
        .await?;
    let committed: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut settlers = Vec::new();
    for _ in 0..SETTLERS {
        let client = ctx.connect().await?;
        let (committed, stop) = (committed.clone(), stop.clone());
        settlers.push(tokio::spawn(async move {
            let lease = client
                .prepare(&format!("SELECT id, token FROM inbox_lease('{PLAIN}', 16)"))
                .await?;
            let ack = client
                .prepare(&format!(
                    "SELECT inbox_ack_with_result('{PLAIN}', $1, $2, \
                            (SELECT payload FROM {PLAIN} WHERE id = $1))"
                ))
                .await?;
            while !stop.load(Ordering::Relaxed) {
                let taken = client.query(&lease, &[]).await?;
                if taken.is_empty() {
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                for job in taken {
                    let (id, token): (i64, i64) = (job.get(0), job.get(1));
                    client.query_one(&ack, &[&id, &token]).await?;
                    committed.lock().unwrap().insert(id, Instant::now());
                }
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    let waiter = Arc::new(ResultWaiter::new(&db));
    let started = Instant::now();
    let mut callers = Vec::new();
    for caller in 0..CALLERS {
        let (db, queue, waiter) = (db.clone(), queue.clone(), waiter.clone());
        let committed = committed.clone();
        let each = calls / CALLERS + usize::from(caller < calls % CALLERS);
        callers.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(each);
            for k in 0..each {
                let n = (caller * calls + k) as i64;
                let id = queue
                    .enqueue(&db, &n, None, None)
                    .await?
                    .ok_or("enqueued nothing")?;
                let done = waiter.wait(&queue, id, Duration::from_secs(30)).await?;
                let returned = Instant::now();
                if done.state != JobState::Succeeded || done.result != Some(json!(n)) {
                    return Err(format!("job {id} ({n}): {done:?}").into());
                }
                // The waiter may return before its settler has noted the commit's return.
                let at = loop {
                    if let Some(at) = committed.lock().unwrap().get(&id) {
                        break *at;
                    }
                    tokio::task::yield_now().await;
                };
                latencies.push(returned.saturating_duration_since(at).as_secs_f64() * 1e3);
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(latencies)
        }));
    }
    let mut latencies = Vec::with_capacity(calls);
    for caller in callers {
        latencies.extend(caller.await?.map_err(|e| e.to_string())?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for settler in settlers {
        settler.await??;
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Ok(Row::new(
        16,
        "16. workflows: waiting for a result, from its commit to the waiter's return (p99)",
        Some(CALLERS),
        (Some(at(0.99)), None),
        "ms",
        Target::InboxBelow(10.0),
    )
    .note(format!(
        "{calls} enqueue-and-wait calls from {CALLERS} connections (ResultWaiter, LISTEN); \
         {SETTLERS} connections ack each job with a result, one commit each; p50 {:.2} ms; \
         {:.0} calls/s",
        at(0.5),
        calls as f64 / elapsed
    )))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
