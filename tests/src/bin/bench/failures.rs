//! Figure 15: handler runs per settled job when handlers fail. The default transactional worker
//! (`workers(8)`, adaptive groups) burns down a queue whose handlers insert one row and then fail
//! the first attempt of a fixed share of the jobs (chosen by the job's payload, so the same
//! jobs in every run); each failed job is retried once. The least the work needs is one run per
//! job plus one per failure; the figure is the runs the handlers made against that least
//! (ratio at most 1.05 is the target: a failure is undone alone, without running its group's
//! other handlers again). Its rate in jobs/s is printed beside, for reference.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, Statement};
use serde_json::Value;

use super::measure::{Row, Target};
use super::setup::{fill, truncate, Ctx, Result, Side};

/// The shares of jobs whose first attempt fails, in percent.
const FAILURE_PERCENTS: [u64; 3] = [1, 15, 50];

/// The transactional worker's default, as a service writes it.
const WORKERS: usize = 8;

/// Whether job `n`'s first attempt fails at `percent`: a multiplicative hash of `n`, so that the
/// failures are spread over the queue rather than bunched at its head.
fn fails(n: u64, percent: u64) -> bool {
    n.wrapping_mul(2_654_435_761) % 100 < percent
}

pub async fn failures(ctx: &Ctx) -> Result<Vec<Row>> {
    let jobs: u64 = if ctx.opts.quick { 2_000 } else { 10_000 };
    let queue = Side::Inbox.queue();
    let done = Side::Inbox.done();
    let admin = ctx.connect().await?;
    let mut rows = Vec::new();
    for percent in FAILURE_PERCENTS {
        truncate(&admin, &[queue, done]).await?;
        fill(&admin, queue, jobs).await?;
        let failing = (1..=jobs).filter(|&n| fails(n, percent)).count() as u64;
        let runs = Arc::new(AtomicU64::new(0));
        let handler = {
            let runs = runs.clone();
            transactional(move |job: Job<Value>, tx: &dyn Database| {
                let runs = runs.clone();
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::Relaxed);
                    let n = job.payload["n"].as_u64().unwrap_or_default();
                    tx.execute(
                        &Statement::new(format!("INSERT INTO {done} VALUES ($1)")).bind(n as i64),
                    )
                    .await?;
                    if job.attempt == 1 && fails(n, percent) {
                        return Err("the first attempt of this job fails".into());
                    }
                    Ok(Outcome::ack())
                })
            })
        };
        let started = Instant::now();
        let stats = Worker::transactional(ctx.database(WORKERS + 2)?, queue, handler)
            .workers(WORKERS)
            .retry(RetryPolicy {
                base: Duration::from_millis(1),
                cap: Duration::from_millis(5),
                max_attempts: Some(5),
                jitter: 0.5,
            })
            .run_until_idle()
            .await?;
        let elapsed = started.elapsed().as_secs_f64();
        let committed: i64 = admin
            .query_one(&format!("SELECT count(*) FROM {done}"), &[])
            .await?
            .get(0);
        if stats.acked != jobs || committed != jobs as i64 {
            return Err(format!(
                "{percent}% failing: {} acked and {committed} effects for {jobs} jobs",
                stats.acked
            )
            .into());
        }
        let least = (jobs + failing) as f64;
        let made = runs.load(Ordering::Relaxed) as f64;
        rows.push(
            Row::new(
                15,
                format!("15. handler runs per needed run, {percent}% of first attempts fail"),
                Some(WORKERS),
                (Some(made), Some(least)),
                "runs",
                Target::InboxBelow(least * 1.05 + 0.5),
            )
            .note(format!(
                "{jobs} jobs, {failing} failing once; default worker, workers({WORKERS}); \
                 raw: the least (one run per job and per failure); {:.0} jobs/s",
                jobs as f64 / elapsed
            )),
        );
    }
    Ok(rows)
}
