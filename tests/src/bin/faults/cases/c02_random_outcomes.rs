//! Case 2, random outcomes: 50,000 jobs, 8 workers on one queue (4 leasing one job at a time, 4
//! locking groups of 10). Each handler first bumps the job's counter (an effect row, in its
//! transaction), then, drawn at random per delivery: acks (55 %), retries (15 %), returns an
//! error (14 %), panics (15 %), or runs a statement past the 200 ms statement timeout (1 %). From
//! the fourth delivery on it always acks. Every acked job's counter must be exactly 1.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, TxHandler, Worker};
use inbox_client::{Database, Statement};
use inbox_tests::TestDb;

use crate::common::{self, enqueue_range, setup, worker_db, Ctx, Result, Row};

pub const NAME: &str = "random outcomes";

#[derive(Default)]
struct Injected {
    retries: AtomicU64,
    errors: AtomicU64,
    panics: AtomicU64,
    timeouts: AtomicU64,
    deliveries: AtomicU64,
}

fn handler(injected: Arc<Injected>) -> impl TxHandler<i64> {
    transactional(move |job: Job<i64>, tx: &dyn Database| {
        let injected = injected.clone();
        Box::pin(async move {
            injected.deliveries.fetch_add(1, Ordering::Relaxed);
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            let roll = fastrand::Rng::with_seed((job.payload as u64) << 8 | job.attempt as u64)
                .u32(0..100);
            if job.attempt >= 4 || roll < 55 {
                return Ok(Outcome::ack());
            }
            match roll {
                55..70 => {
                    injected.retries.fetch_add(1, Ordering::Relaxed);
                    Ok(Outcome::retry_after(Duration::ZERO))
                }
                70..84 => {
                    injected.errors.fetch_add(1, Ordering::Relaxed);
                    Err("injected error".into())
                }
                84..99 => {
                    injected.panics.fetch_add(1, Ordering::Relaxed);
                    panic!("injected panic in job {}", job.payload)
                }
                _ => {
                    injected.timeouts.fetch_add(1, Ordering::Relaxed);
                    tx.execute(&Statement::new("SELECT pg_sleep(5)")).await?;
                    Ok(Outcome::ack())
                }
            }
        })
    })
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(2, NAME);
    let jobs: i64 = ctx.profile.pick(20_000, 50_000);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    let injected = Arc::new(Injected::default());
    let retry = RetryPolicy {
        base: Duration::from_millis(1),
        cap: Duration::from_millis(10),
        max_attempts: Some(25),
        jitter: 0.0,
    };
    let start = |claim: Claim, group: usize| {
        Worker::transactional(worker_db(&db, 6), "jobs", handler(injected.clone()))
            .workers(4)
            .claim(claim)
            .group_size(group)
            .statement_timeout(Duration::from_millis(200))
            .retry(retry.clone())
            .poll_interval(Duration::from_millis(50))
            .start()
    };
    let leasing = start(Claim::Lease, 1);
    let locking = start(Claim::Lock, 10);
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(800)).await?;
    let stats = [
        leasing.shutdown(Duration::from_secs(10)).await,
        locking.shutdown(Duration::from_secs(10)).await,
    ];
    row.check(finished, || "the queue did not drain".into());
    let tally = common::tally(&admin, "jobs", 1..=jobs, None).await?;
    row.add("", &tally);
    row.check(tally.acked == jobs as u64, || {
        format!("{} of {jobs} jobs acked ({} dead)", tally.acked, tally.dead)
    });
    let acked: u64 = stats.iter().map(|s| s.acked).sum();
    row.check(acked == jobs as u64, || {
        format!("the workers counted {acked} acks for {jobs} jobs")
    });
    let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    row.faults = get(&injected.retries)
        + get(&injected.errors)
        + get(&injected.panics)
        + get(&injected.timeouts);
    row.inputs = get(&injected.deliveries);
    row.note(format!(
        "{} deliveries: {} retries, {} errors, {} panics, {} statement timeouts injected",
        get(&injected.deliveries),
        get(&injected.retries),
        get(&injected.errors),
        get(&injected.panics),
        get(&injected.timeouts)
    ));
    drop(admin);
    drop(db);
    Ok(row)
}
