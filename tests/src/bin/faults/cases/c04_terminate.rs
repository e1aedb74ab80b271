//! Case 4, `pg_terminate_backend` before and during COMMIT, and commits whose result is lost.
//! Two workers share a queue (leasing one job at a time, and locking groups of 10) through a
//! proxy. A deferred constraint trigger on the effect table makes every COMMIT take a few
//! milliseconds, so that a killer that polls `pg_stat_activity` terminates worker backends both
//! while they are idle in their delivery's transaction (before COMMIT) and while they run COMMIT.
//! The proxy also cuts every 40th COMMIT's connection right after forwarding it: the commit takes,
//! its result never arrives. What must hold: every job ends acked (exactly one effect) or
//! dead-lettered, the pool recovers, no delivery ever starts in an aborted transaction (its first
//! statement would fail with 25P02), no connection is left in a transaction, and the workers
//! count no more acks than there were jobs (an ack whose result was lost is not counted twice).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, TxHandler, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use inbox_tests::TestDb;

use crate::common::{self, config_via, enqueue_range, pool_of, setup, Ctx, Result, Row};
use crate::proxy::Proxy;

pub const NAME: &str = "terminate around COMMIT";

pub const SLOW_COMMIT: &str = "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
     $$ BEGIN PERFORM pg_sleep(0.005); RETURN NULL; END $$; \
     CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON effects \
     DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()";

fn handler(leaked: Arc<AtomicU64>) -> impl TxHandler<i64> {
    transactional(move |job: Job<i64>, tx: &dyn Database| {
        let leaked = leaked.clone();
        Box::pin(async move {
            if let Err(error) = tx.execute(&Statement::new("SELECT 1")).await {
                if error.sqlstate() == Some("25P02") {
                    leaked.fetch_add(1, Ordering::Relaxed);
                }
                return Err(error.into());
            }
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            Ok(Outcome::ack())
        })
    })
}

/// The server's address, from the test database's URL (a loopback TCP address).
pub fn server_address(db: &TestDb) -> Result<SocketAddr> {
    let config: tokio_postgres::Config = db.url().parse()?;
    let port = config.get_ports().first().copied().unwrap_or(5432);
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(4, NAME);
    let jobs: i64 = ctx.profile.pick(4_000, 20_000);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(SLOW_COMMIT).await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    let proxy = Proxy::start(server_address(&db)?).await?;
    proxy.cut_every_nth_commit(40);
    let config = config_via(&db, proxy.port);
    let pg = |size| PgDatabase::from_pool_and_config(pool_of(config.clone(), size), config.clone());
    let leaked = Arc::new(AtomicU64::new(0));
    let retry = RetryPolicy {
        base: Duration::from_millis(5),
        cap: Duration::from_millis(50),
        max_attempts: Some(25),
        jitter: 0.0,
    };
    let start = |claim: Claim, group: usize, workers: usize| {
        Worker::transactional(pg(workers + 2), "jobs", handler(leaked.clone()))
            .workers(workers)
            .claim(claim)
            .group_size(group)
            .lease(Duration::from_secs(2))
            .retry(retry.clone())
            .poll_interval(Duration::from_millis(50))
            .start()
    };
    let leasing = start(Claim::Lease, 1, 4);
    let locking = start(Claim::Lock, 10, 2);

    let stop = Arc::new(AtomicBool::new(false));
    let (before, during) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let killer = {
        let killer = db.client().await;
        let (stop, before, during) = (stop.clone(), before.clone(), during.clone());
        let app = db.schema().to_owned();
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(4);
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(rng.u64(30..150))).await;
                let victims = killer
                    .query(
                        "SELECT pid, query LIKE 'COMMIT%' AND state = 'active' FROM pg_stat_activity \
                         WHERE application_name = $1 AND pid <> pg_backend_pid() \
                         AND (state LIKE 'idle in transaction%' \
                              OR (state = 'active' AND query LIKE 'COMMIT%'))",
                        &[&app],
                    )
                    .await;
                let Ok(victims) = victims else { continue };
                // Prefer a backend running COMMIT: those windows are the short ones.
                let victim = victims
                    .iter()
                    .find(|v| v.get::<_, bool>(1))
                    .or_else(|| victims.get(rng.usize(0..victims.len().max(1))));
                let Some(victim) = victim else { continue };
                let (pid, committing): (i32, bool) = (victim.get(0), victim.get(1));
                if let Ok(done) = killer
                    .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                    .await
                {
                    if done.get::<_, bool>(0) {
                        let counter = if committing { &during } else { &before };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    // Faults for a while, then the queue must drain on its own.
    let window = Duration::from_secs(ctx.profile.pick(25, 90));
    let drained_under_faults = common::wait_drained(&admin, "jobs", window).await?;
    stop.store(true, Ordering::Relaxed);
    killer.await?;
    proxy.cut_every_nth_commit(0);
    let finished = drained_under_faults
        || common::wait_drained(&admin, "jobs", Duration::from_secs(120)).await?;
    if !finished {
        let stuck = admin
            .query(
                "SELECT attempt, locked_until > now(), leased_at IS NOT NULL, count(*) FROM jobs \
                 WHERE locked_until < 'infinity' GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 5",
                &[],
            )
            .await?;
        let shown: Vec<String> = stuck
            .iter()
            .map(|r| {
                format!(
                    "{} jobs at attempt {} (invisible {}, leased {})",
                    r.get::<_, i64>(3),
                    r.get::<_, i32>(0),
                    r.get::<_, bool>(1),
                    r.get::<_, bool>(2)
                )
            })
            .collect();
        row.note(format!("left in the queue: {}", shown.join("; ")));
        let activity = admin
            .query(
                "SELECT state, left(query, 60), count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid() GROUP BY 1, 2",
                &[&db.schema()],
            )
            .await?;
        let shown: Vec<String> = activity
            .iter()
            .map(|r| {
                format!(
                    "{} x {:?} {:?}",
                    r.get::<_, i64>(2),
                    r.get::<_, Option<String>>(0),
                    r.get::<_, Option<String>>(1)
                )
            })
            .collect();
        row.note(format!("worker connections: {}", shown.join("; ")));
    }
    let stats = [
        leasing.shutdown(Duration::from_secs(10)).await,
        locking.shutdown(Duration::from_secs(10)).await,
    ];
    row.check(finished, || "the queue did not drain".into());
    let tally = common::tally(&admin, "jobs", 1..=jobs, None).await?;
    row.add("", &tally);
    let acked: u64 = stats.iter().map(|s| s.acked).sum();
    row.inputs = stats
        .iter()
        .map(|s| s.acked + s.retried + s.dead + s.lost)
        .sum();
    row.check(acked <= jobs as u64, || {
        format!("the workers counted {acked} acks for {jobs} jobs")
    });
    let leaked = leaked.load(Ordering::Relaxed);
    row.check(leaked == 0, || {
        format!("{leaked} deliveries started in an aborted transaction (25P02)")
    });
    let open = common::in_transaction(&admin, db.schema()).await?;
    row.check(open == 0, || {
        format!("{open} connections left in a transaction")
    });
    let (before, during, cuts) = (
        before.load(Ordering::Relaxed),
        during.load(Ordering::Relaxed),
        proxy.cuts(),
    );
    row.faults = before + during + cuts;
    row.check(during > 0 && before > 0 && cuts > 0, || {
        format!("not every fault was injected: {before} before COMMIT, {during} during, {cuts} cut")
    });
    row.note(format!(
        "{before} backends terminated in their delivery's transaction, {during} during COMMIT, \
         {cuts} commits whose result was cut; the workers counted {acked} acks for {} acked jobs",
        tally.acked
    ));
    drop(proxy);
    drop(admin);
    drop(db);
    Ok(row)
}
