//! Case 9, a long snapshot: in a database of its own, a `REPEATABLE READ` transaction that has
//! read the queue stays open for 2 minutes (holding back vacuum's horizon), while a producer keeps
//! a backlog and a worker (4 slots locking groups of 10) churns through up to 100,000 jobs. Then
//! the snapshot ends and 20,000 more jobs run. What must hold: the queue keeps working in every
//! 20 s window of the hold, the lease scans use the queue's index (not sequential scans), every
//! job runs exactly once; reported: the throughput during and after, and the queue's size.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker, WorkerHandle};
use inbox_client::{Database, Statement};
use inbox_tests::TestDb;
use tokio_postgres::Client;

use crate::common::{self, enqueue_range, setup, worker_db, Ctx, Result, Row};

pub const NAME: &str = "REPEATABLE READ held 2 min";

async fn done(client: &Client) -> Result<i64> {
    Ok(client
        .query_one("SELECT count(*) FROM effects", &[])
        .await?
        .get(0))
}

async fn scans(client: &Client) -> Result<(i64, i64)> {
    let row = client
        .query_one(
            "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0) FROM pg_stat_user_tables \
             WHERE relid = 'jobs'::regclass",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// 4 slots locking groups of 10; each job inserts its effect in its delivery's transaction.
fn start_worker(db: &TestDb) -> WorkerHandle {
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            Ok(Outcome::ack())
        })
    });
    Worker::transactional(worker_db(db, 6), "jobs", handler)
        .workers(4)
        .claim(Claim::Lock)
        .group_size(10)
        .poll_interval(Duration::from_millis(50))
        .start()
}

async fn size(client: &Client) -> Result<String> {
    Ok(client
        .query_one("SELECT pg_size_pretty(pg_total_relation_size('jobs'))", &[])
        .await?
        .get(0))
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(9, NAME);
    let hold = Duration::from_secs(120);
    let churn: i64 = 100_000;
    let after: i64 = 20_000;
    let name = format!("inbox_faults_rr_{}", std::process::id());
    let url = ctx.own_database(&name).await?;
    let result = body(&mut row, &url, hold, churn, after).await;
    ctx.drop_database(&name).await;
    result?;
    Ok(row)
}

async fn body(row: &mut Row, url: &str, hold: Duration, churn: i64, after: i64) -> Result<()> {
    let db = TestDb::at(url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    enqueue_range(&admin, "jobs", 1, 5_000).await?;
    let mut worker = start_worker(&db);
    // The producer keeps a backlog of about 5,000 until it has enqueued `target` jobs.
    let enqueued = Arc::new(AtomicI64::new(5_000));
    let target = Arc::new(AtomicI64::new(churn));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let client = db.client().await;
        let (enqueued, target, stop) = (enqueued.clone(), target.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (have, want) = (
                    enqueued.load(Ordering::Relaxed),
                    target.load(Ordering::Relaxed),
                );
                let finished = done(&client).await.unwrap_or(have);
                if have < want && have - finished < 5_000 {
                    let next = (have + 1_000).min(want);
                    if enqueue_range(&client, "jobs", have + 1, next).await.is_ok() {
                        enqueued.store(next, Ordering::Relaxed);
                    }
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        })
    };
    let holder = db.client().await;
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM jobs")
        .await?;
    let (seq0, idx0) = scans(&admin).await?;
    let started = Instant::now();
    let first = done(&admin).await?;
    let mut windows = Vec::new();
    let mut last = first;
    while started.elapsed() < hold {
        tokio::time::sleep(Duration::from_secs(20).min(hold - started.elapsed())).await;
        let now = done(&admin).await?;
        windows.push(now - last);
        last = now;
    }
    let during = last - first;
    let size_during = size(&admin).await?;
    // A busy backend may keep its scan counts pending for a while; one that exits hands them
    // in, so the worker stops (closing its connections) before the counts are read.
    worker.shutdown(Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (seq1, idx1) = scans(&admin).await?;
    holder.batch_execute("COMMIT").await?;
    let held = started.elapsed();
    worker = start_worker(&db);
    row.faults = 1;
    // Whatever of the churn is left, then `after` more jobs, timed from the end of the churn.
    target.store(0, Ordering::Relaxed);
    // Lets an enqueue in flight finish before the count is read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let churned = enqueued.load(Ordering::Relaxed);
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(300)).await?;
    row.check(finished, || {
        "the churn did not drain after the snapshot ended".into()
    });
    let recovering = Instant::now();
    let base = done(&admin).await?;
    target.store(churned + after, Ordering::Relaxed);
    let finished = loop {
        if done(&admin).await? >= base + after {
            break true;
        }
        if recovering.elapsed() > Duration::from_secs(300) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let after_rate = after as f64 / recovering.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    producer.await?;
    worker.shutdown(Duration::from_secs(10)).await;
    row.check(finished, || {
        "the jobs after the snapshot did not drain".into()
    });
    let size_after = size(&admin).await?;
    let total = churned + after;
    row.jobs = total as u64;
    row.inputs = done(&admin).await? as u64;
    let tally = common::tally(&admin, "jobs", 1..=total, None).await?;
    row.add("", &tally);
    row.check(
        windows.iter().all(|&w| w > 0) || during >= churn - 5_000,
        || format!("a 20 s window of the hold did no work: {windows:?}"),
    );
    let (seq, idx) = (seq1 - seq0, idx1 - idx0);
    row.check(idx > 0 && seq * 100 <= idx, || {
        format!("during the hold the queue had {seq} sequential and {idx} index scans")
    });
    let during_rate = during as f64 / held.as_secs_f64();
    row.note(format!(
        "{during} jobs in {:.0} s under the snapshot ({during_rate:.0} jobs/s; per 20 s: {windows:?}), \
         {after_rate:.0} jobs/s after it ({:.2}x); queue {size_during} at the end of the hold, \
         {size_after} after; {idx} index scans and {seq} sequential scans of the queue during the hold",
        held.as_secs_f64(),
        after_rate / during_rate.max(1.0)
    ));
    drop(holder);
    drop(admin);
    drop(db);
    Ok(())
}
