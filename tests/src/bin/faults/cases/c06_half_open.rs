//! Case 6, half-open connections: a worker (4 leasing slots, lease 2 s, statement and idle
//! timeouts 1 s) reaches the server through a proxy. Once it has done some of the jobs, the
//! proxy stops forwarding on every open connection without closing any (a network that drops
//! packets silently; pg-boss tests the same with its `halfOpenProxy`); new connections still get
//! through. What must hold: the worker's timeouts fire within their bounds, so the jobs held by
//! the frozen connections run again on other connections after their lease, the queue drains
//! within lease + timeouts + 15 s, shutdown returns within its deadline, and every job runs
//! exactly once.

use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use inbox_tests::TestDb;

use crate::c04::server_address;
use crate::common::{self, config_via, enqueue_range, pool_of, setup, worker_db, Ctx, Result, Row};
use crate::proxy::Proxy;

pub const NAME: &str = "half-open connection";

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(6, NAME);
    let jobs: i64 = 300;
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    let proxy = Proxy::start(server_address(&db)?).await?;
    let config = config_via(&db, proxy.port);
    let pg = PgDatabase::from_pool_and_config(pool_of(config.clone(), 6), config);
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(Outcome::ack())
        })
    });
    let (lease, timeout) = (Duration::from_secs(2), Duration::from_secs(1));
    let worker = Worker::transactional(pg, "jobs", handler)
        .workers(4)
        .lease(lease)
        .statement_timeout(timeout)
        .idle_in_transaction_timeout(timeout)
        .poll_interval(Duration::from_millis(100))
        .retry(RetryPolicy {
            base: Duration::from_millis(5),
            ..RetryPolicy::default()
        })
        .start();
    let done = || async {
        let count: i64 = admin
            .query_one("SELECT count(*) FROM effects", &[])
            .await?
            .get(0);
        Ok::<i64, crate::common::Error>(count)
    };
    while done().await? < 40 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let frozen = proxy.freeze_all();
    let frozen_at = Instant::now();
    let done_at_freeze = done().await?;
    row.faults = frozen as u64;
    let bound = lease + timeout * 2 + Duration::from_secs(15);
    let drained = common::wait_drained(&admin, "jobs", bound).await?;
    let done_after = done().await?;
    // What is left, and why: leased (and until when), delayed by a retry, or ready.
    let left: Vec<String> = admin
        .query(
            "SELECT format('job %s: attempt %s, locked for %s s more, leased %s, error %s', \
                    id, attempt, round(extract(epoch FROM locked_until - now())::numeric, 1), \
                    leased_at IS NOT NULL, coalesce(last_error, 'none')) \
               FROM jobs WHERE locked_until < 'infinity' ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    row.check(drained, || {
        format!(
            "{} s after freezing {frozen} connections the queue had not drained: {done_at_freeze} \
             jobs done at the freeze, {done_after} after; left: {}",
            bound.as_secs(),
            left.join("; ")
        )
    });
    let drain_time = frozen_at.elapsed();
    let deadline = Duration::from_secs(3);
    let stopping = Instant::now();
    let stopped = tokio::time::timeout(
        deadline + Duration::from_secs(10),
        worker.shutdown(deadline),
    )
    .await
    .is_ok();
    let stop_time = stopping.elapsed();
    row.check(
        stopped && stop_time <= deadline + Duration::from_secs(2),
        || {
            format!(
                "shutdown with a {} s deadline took {:.1} s{}",
                deadline.as_secs(),
                stop_time.as_secs_f64(),
                if stopped { "" } else { " and never returned" }
            )
        },
    );
    // Whatever is left runs on direct connections, so that the jobs can be checked.
    drop(proxy);
    if !drained {
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
        Worker::transactional(worker_db(&db, 4), "jobs", handler)
            .workers(2)
            .poll_interval(Duration::from_millis(100))
            .run_until_idle()
            .await?;
    }
    row.inputs = done().await? as u64;
    let tally = common::tally(&admin, "jobs", 1..=jobs, None).await?;
    row.add("", &tally);
    row.note(format!(
        "{frozen} connections frozen after {done_at_freeze} jobs; drained {} after {:.1} s; \
         shutdown took {:.1} s",
        if drained {
            ""
        } else {
            "only on direct connections"
        },
        drain_time.as_secs_f64(),
        stop_time.as_secs_f64()
    ));
    drop(admin);
    drop(db);
    Ok(row)
}
