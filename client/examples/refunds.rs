//! The refunds service on Postgres: `./scripts/demo.sh` runs it against a fresh database.
//!
//! Support publishes refunds into `refund_jobs`, some twice. Each delivery writes the refund's
//! record and enqueues a receipt for the mailer on the delivery's transaction, and calls the
//! card processor, which times out on some first calls. The record, the receipt and the job's
//! settlement commit together, so whatever is retried or duplicated, each order ends with one
//! refund and one receipt; the processor, outside the database, is called at least once per
//! order and refunds once because the order is its idempotency key.
//!
//! Options: `--orders N` (default 3000), `--duplicates PERCENT` (10), `--timeouts PERCENT` (15),
//! `--workers N` (8).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker, WorkerStats};
use inbox_client::{Database, DbError, ErrorKind, PgDatabase, Queue, Statement, DATABASE_URL};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// A refund support asked for.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Refund {
    order: i64,
    amount_cents: i32,
}

/// What the mailer's queue receives.
#[derive(Serialize)]
struct Receipt {
    order: i64,
}

const SCHEMA: &str = "
DROP TABLE IF EXISTS refunds, refund_jobs, receipt_jobs;
CREATE TABLE refunds (order_id bigint PRIMARY KEY, amount_cents integer NOT NULL);
SELECT inbox_create_queue('refund_jobs');
SELECT inbox_create_queue('receipt_jobs');
";

/// The card processor: outside the database, so only its idempotency key makes a repeated call
/// harmless. It times out on the first call for a share of the orders.
#[derive(Default)]
struct CardProcessor {
    timeout_percent: u64,
    calls: Mutex<HashMap<i64, u32>>,
    refunded: Mutex<HashMap<i64, i32>>,
}

impl CardProcessor {
    async fn refund(&self, refund: &Refund) -> bool {
        tokio::time::sleep(Duration::from_micros(200)).await;
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let call = calls.entry(refund.order).or_default();
            *call += 1;
            *call
        };
        if call == 1 && (refund.order as u64 * 2_654_435_761) % 100 < self.timeout_percent {
            return false;
        }
        // The order is the idempotency key: a second successful call refunds nothing more.
        let mut refunded = self.refunded.lock().unwrap_or_else(|e| e.into_inner());
        refunded.entry(refund.order).or_insert(refund.amount_cents);
        true
    }
}

struct Options {
    orders: i64,
    duplicate_percent: i64,
    timeout_percent: u64,
    workers: usize,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        orders: 3000,
        duplicate_percent: 10,
        timeout_percent: 15,
        workers: 8,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<i64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--orders" => options.orders = number(&value)?.max(1),
            "--duplicates" => options.duplicate_percent = number(&value)?.clamp(0, 100),
            "--timeouts" => options.timeout_percent = number(&value)?.clamp(0, 100) as u64,
            "--workers" => options.workers = number(&value)?.max(1) as usize,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(problem) => {
            eprintln!("NOT verified: {problem}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let options = options()?;
    let url = std::env::var(DATABASE_URL).map_err(|_| format!("set {DATABASE_URL}"))?;
    let db = PgDatabase::connect_with_size(&url, Some(options.workers + 4))
        .await
        .map_err(|e| e.to_string())?;
    let setup = db.pool().get().await.map_err(|e| e.to_string())?;
    setup
        .batch_execute(SCHEMA)
        .await
        .map_err(|e| e.to_string())?;
    drop(setup);

    // Support publishes the refunds; a share of the orders twice.
    let mut published: Vec<Refund> = (1..=options.orders)
        .map(|order| Refund {
            order,
            amount_cents: 500 + (order % 97) as i32 * 25,
        })
        .collect();
    let duplicates: Vec<Refund> = published
        .iter()
        .filter(|refund| refund.order % 100 < options.duplicate_percent)
        .cloned()
        .collect();
    published.extend(duplicates.iter().cloned());
    let refund_jobs = Queue::new("refund_jobs");
    for chunk in published.chunks(500) {
        refund_jobs
            .enqueue_batch(&db, chunk)
            .await
            .map_err(|e| e.to_string())?;
    }
    println!(
        "published {} refunds for {} orders ({} twice); the card processor times out on {}% of first calls",
        published.len(),
        options.orders,
        duplicates.len(),
        options.timeout_percent
    );

    let processor = Arc::new(CardProcessor {
        timeout_percent: options.timeout_percent,
        ..Default::default()
    });
    let dropped = Arc::new(AtomicU64::new(0));
    let handler = {
        let (processor, dropped) = (processor.clone(), dropped.clone());
        transactional(move |job: Job<Refund>, tx: &dyn Database| {
            let (processor, dropped) = (processor.clone(), dropped.clone());
            Box::pin(async move {
                let refund = job.payload;
                match record(tx, &refund).await {
                    Ok(()) => {}
                    Err(error) if error.kind() == ErrorKind::UniqueViolation => {
                        // A duplicate publication: this order is refunded already.
                        dropped.fetch_add(1, Ordering::Relaxed);
                        return Ok(Outcome::drop(format!(
                            "order {} already refunded",
                            refund.order
                        )));
                    }
                    Err(error) => return Err(error.into()),
                }
                if !processor.refund(&refund).await {
                    // The retry rolls the record and the receipt back first.
                    return Ok(Outcome::retry_after(Duration::from_millis(20)));
                }
                Ok(Outcome::ack())
            })
        })
    };
    let started = Instant::now();
    let worker = Worker::transactional(db.clone(), "refund_jobs", handler)
        .workers(options.workers)
        .retry(RetryPolicy {
            base: Duration::from_millis(20),
            ..RetryPolicy::default()
        })
        .poll_interval(Duration::from_millis(50))
        .start();

    let progress = ProgressBar::new(published.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs settled  {per_sec}  {msg}")
            .map_err(|e| e.to_string())?,
    );
    loop {
        let stats = worker.stats();
        progress.set_position(stats.acked + stats.dead);
        progress.set_message(format!("{} retried", stats.retried));
        let queue = refund_jobs.stats(&db).await.map_err(|e| e.to_string())?;
        if queue.ready + queue.delayed + queue.leased == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    progress.set_position(stats.acked + stats.dead);
    progress.finish();

    report(
        &stats,
        dropped.load(Ordering::Relaxed),
        published.len(),
        elapsed,
    );
    verify(&db, &options, &processor, duplicates.len() as i64).await
}

/// The refund's record and its receipt, written on the delivery's transaction.
async fn record(tx: &dyn Database, refund: &Refund) -> Result<(), DbError> {
    tx.execute(
        &Statement::new("INSERT INTO refunds (order_id, amount_cents) VALUES ($1, $2)")
            .bind(refund.order)
            .bind(refund.amount_cents),
    )
    .await?;
    Queue::new("receipt_jobs")
        .enqueue(
            tx,
            &Receipt {
                order: refund.order,
            },
            None,
            None,
        )
        .await?;
    Ok(())
}

fn report(stats: &WorkerStats, dropped: u64, published: usize, elapsed: Duration) {
    println!("processed:              {}", stats.acked);
    println!("retried:                {}", stats.retried);
    println!("dropped as duplicates:  {dropped}");
    println!(
        "dead-lettered (other):  {}",
        stats.dead.saturating_sub(dropped)
    );
    println!("handler failures:       {}", stats.failed);
    println!(
        "throughput:             {:.0} jobs/s ({published} jobs in {:.2} s)",
        published as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
}

/// Checks the database: one refund and one receipt per order, none twice, and every duplicate
/// dropped; the processor refunded each order once.
async fn verify(
    db: &PgDatabase,
    options: &Options,
    processor: &CardProcessor,
    duplicates: i64,
) -> Result<(), String> {
    let count = |sql: &'static str| async move {
        let rows = db
            .query(&Statement::new(sql))
            .await
            .map_err(|e| e.to_string())?;
        rows.one()
            .and_then(|row| row.get::<i64>("n"))
            .map_err(|e| e.to_string())
    };
    let orders = options.orders;
    let refunds = count("SELECT count(*) AS n FROM refunds").await?;
    let distinct_refunds = count("SELECT count(DISTINCT order_id) AS n FROM refunds").await?;
    let receipts = count("SELECT count(*) AS n FROM receipt_jobs").await?;
    let distinct_receipts =
        count("SELECT count(DISTINCT (payload->>'order')) AS n FROM receipt_jobs").await?;
    let dead =
        count("SELECT count(*) AS n FROM refund_jobs WHERE locked_until = 'infinity'").await?;
    let pending =
        count("SELECT count(*) AS n FROM refund_jobs WHERE locked_until <> 'infinity'").await?;
    let refunded = processor
        .refunded
        .lock()
        .map(|r| r.len() as i64)
        .unwrap_or(-1);
    let mut problems = Vec::new();
    if refunds != orders || distinct_refunds != orders {
        problems.push(format!(
            "{refunds} refund rows for {distinct_refunds} of {orders} orders"
        ));
    }
    if receipts != orders || distinct_receipts != orders {
        problems.push(format!(
            "{receipts} receipt jobs for {distinct_receipts} of {orders} orders"
        ));
    }
    if dead != duplicates {
        problems.push(format!(
            "{dead} refund jobs dead-lettered, {duplicates} duplicates published"
        ));
    }
    if pending != 0 {
        problems.push(format!("{pending} refund jobs still queued"));
    }
    if refunded != orders {
        problems.push(format!(
            "the processor refunded {refunded} of {orders} orders"
        ));
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    println!("verified: exactly once ({orders} orders, {refunds} refunds, {receipts} receipts)");
    Ok(())
}
