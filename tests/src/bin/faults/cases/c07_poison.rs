//! Case 7, poison jobs: 2,000 healthy jobs and 5 whose handler always panics, `max_attempts` 4;
//! with leasing slots (one job each), locking slots (one job each) and locking groups of 10,
//! where a poison job shares its transaction with healthy ones. Each form runs as two workers
//! of two slots at once, each worker with its own memory (as two processes would be), so a job
//! that one of them lets go is taken by the other. What must hold: each poison job is
//! dead-lettered exactly once at attempt 4 with the panic as its error, after exactly 4
//! deliveries (no attempt runs twice, whichever worker takes it); every healthy job is acked
//! once, on its first delivery (a poison neighbour never sends it back: no head-of-line
//! blocking).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, Statement};
use inbox_tests::TestDb;

use crate::common::{self, enqueue_range, setup, worker_db, Ctx, Result, Row};

pub const NAME: &str = "poison job";

const MAX_ATTEMPTS: i32 = 4;
const POISON: i64 = 5;

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(7, NAME);
    for (claim, group) in [(Claim::Lease, 1), (Claim::Lock, 1), (Claim::Lock, 10)] {
        one(ctx, &mut row, claim, group).await?;
    }
    Ok(row)
}

async fn one(ctx: &Ctx, row: &mut Row, claim: Claim, group: usize) -> Result<()> {
    let label = format!("{claim:?}, group {group}");
    let healthy: i64 = 2_000;
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    // Poison jobs (negative payloads) first and spread among the healthy ones.
    let mut enqueued = 0;
    for batch in 0..POISON {
        admin
            .execute(
                "SELECT inbox_enqueue('jobs', to_jsonb($1::int8))",
                &[&(-1 - batch)],
            )
            .await?;
        let from = batch * healthy / POISON + 1;
        enqueued += enqueue_range(&admin, "jobs", from, (batch + 1) * healthy / POISON).await?;
    }
    row.jobs += enqueued + POISON as u64;
    let deliveries: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let seen = deliveries.clone();
    let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
        let seen = seen.clone();
        Box::pin(async move {
            *seen.lock().unwrap().entry(job.payload).or_default() += 1;
            if job.payload < 0 {
                panic!("injected poison {}", job.payload);
            }
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            Ok(Outcome::ack())
        })
    });
    // Two workers, as two processes: neither knows what the other's slots have seen.
    let worker = || {
        Worker::transactional(worker_db(&db, 4), "jobs", handler.clone())
            .workers(2)
            .claim(claim)
            .group_size(group)
            .poll_interval(Duration::from_millis(20))
            .retry(RetryPolicy {
                base: Duration::from_millis(20),
                cap: Duration::from_millis(100),
                max_attempts: Some(MAX_ATTEMPTS),
                jitter: 0.0,
            })
            .run_until_idle()
    };
    let (first, second) = tokio::join!(worker(), worker());
    let (first, second) = (first?, second?);
    let dead_letterings = first.dead + second.dead;
    let tally = common::tally(&admin, "jobs", 1..=healthy, None).await?;
    row.add(&label, &tally);
    row.faults += POISON as u64 * MAX_ATTEMPTS as u64;
    let retried: i64 = admin
        .query_one("SELECT count(*) FROM effects WHERE attempt > 1", &[])
        .await?
        .get(0);
    row.check(retried == 0, || {
        format!("{label}: {retried} healthy jobs were delivered more than once")
    });
    let dead = admin
        .query(
            "SELECT (payload #>> '{}')::int8, attempt, last_error FROM jobs \
             WHERE locked_until = 'infinity' ORDER BY 1",
            &[],
        )
        .await?;
    row.check(dead.len() == POISON as usize, || {
        format!("{label}: {} dead jobs, {POISON} expected", dead.len())
    });
    for job in &dead {
        let (n, attempt, error): (i64, i32, Option<String>) = (job.get(0), job.get(1), job.get(2));
        let delivered = deliveries.lock().unwrap().get(&n).copied().unwrap_or(0);
        row.check(
            n < 0
                && attempt == MAX_ATTEMPTS
                && delivered == MAX_ATTEMPTS as u32
                && error.as_deref().is_some_and(|e| e.contains("injected poison")),
            || {
                format!(
                    "{label}: dead job {n}: attempt {attempt}, {delivered} deliveries, error {error:?}"
                )
            },
        );
    }
    row.check(dead_letterings == POISON as u64, || {
        format!("{label}: the workers counted {dead_letterings} dead-letterings")
    });
    row.inputs += deliveries
        .lock()
        .unwrap()
        .values()
        .map(|&d| d as u64)
        .sum::<u64>();
    drop(admin);
    drop(db);
    Ok(())
}
