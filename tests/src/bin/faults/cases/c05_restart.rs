//! Case 5, the server crashes: on a throwaway cluster of the case's own, a running worker (4
//! leasing slots; its poll interval a minute, so that only NOTIFY wakes it once idle) works
//! through the queue while the server is stopped with `pg_ctl -m immediate` and started again,
//! several times. The worker is never restarted. What must hold: every ack the worker counted
//! before a crash survives it, every job ends acked exactly once, and after the last restart a
//! new job is picked up within seconds, woken through the worker's reconnected LISTEN.

use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, Statement};

use crate::cluster::Cluster;
use crate::common::{self, enqueue_range, setup, worker_db, Ctx, Result, Row};

pub const NAME: &str = "server crash and restart";

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(5, NAME);
    let jobs: i64 = ctx.profile.pick(3_000, 10_000);
    let restarts = ctx.profile.pick(2, 4);
    let cluster = Cluster::create(&ctx.pg_bin).await?;
    let db = cluster.faults_database().await?;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    drop(admin);
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(Outcome::ack())
        })
    });
    let worker = Worker::transactional(worker_db(&db, 6), "jobs", handler)
        .workers(4)
        .lease(Duration::from_secs(2))
        .poll_interval(Duration::from_secs(60))
        .retry(RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(50),
            max_attempts: Some(25),
            jitter: 0.0,
        })
        .start();
    let mut survived = true;
    for _ in 0..restarts {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cluster.stop("immediate").await?;
        let acked_before = worker.stats().acked;
        row.faults += 1;
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster.start().await?;
        let admin = db.client().await;
        let effects: i64 = admin
            .query_one("SELECT count(*) FROM effects", &[])
            .await?
            .get(0);
        if (effects as u64) < acked_before {
            survived = false;
            row.failures.push(format!(
                "the worker counted {acked_before} acks before the crash, {effects} effects survived it"
            ));
        }
    }
    let admin = db.client().await;
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(240)).await?;
    row.check(finished, || {
        "the queue did not drain after the restarts".into()
    });
    if !finished {
        // What the worker's connections are doing, for the report.
        let activity = admin
            .query(
                "SELECT coalesce(state, '?'), left(coalesce(query, ''), 50), count(*)::int8 \
                 FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid() \
                 GROUP BY 1, 2",
                &[&db.schema()],
            )
            .await?;
        let shown: Vec<String> = activity
            .iter()
            .map(|r| {
                format!(
                    "{} x {} {:?}",
                    r.get::<_, i64>(2),
                    r.get::<_, String>(0),
                    r.get::<_, String>(1)
                )
            })
            .collect();
        let stats = worker.stats();
        row.note(format!(
            "after the restarts: worker connections [{}]; worker counted {} acks, {} retries, {} failed",
            shown.join("; "),
            stats.acked,
            stats.retried,
            stats.failed
        ));
    }
    // Only NOTIFY can wake the idle worker within the minute: it must have LISTENed again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let probe = jobs + 1;
    let enqueued = Instant::now();
    admin
        .execute(
            "SELECT inbox_enqueue('jobs', to_jsonb($1::int8))",
            &[&probe],
        )
        .await?;
    let woke = common::wait_drained(&admin, "jobs", Duration::from_secs(10)).await?;
    let waited = enqueued.elapsed();
    row.check(woke, || {
        "a job enqueued after the restarts was not picked up within 10 s (LISTEN not reconnected)"
            .into()
    });
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    let tally = common::tally(&admin, "jobs", 1..=probe, None).await?;
    row.add("", &tally);
    row.inputs = stats.acked + stats.retried + stats.failed;
    row.note(format!(
        "{restarts} immediate stops under load; committed work survived: {survived}; \
         the job enqueued afterwards ran {:.2} s later; worker counted {} acks, {} retries",
        waited.as_secs_f64(),
        stats.acked,
        stats.retried
    ));
    drop(admin);
    drop(db);
    drop(cluster);
    Ok(row)
}
