//! Case 11, cancellation: futures dropped at `BEGIN` (held back by the proxy), mid-way (during a
//! statement) and at `COMMIT` (slowed by a deferred trigger): the `Database` port's
//! `batch_atomic` on a pool of one connection, at those points and at random moments; and a
//! worker's delivery abandoned by a shutdown at the same three points. What must hold after each
//! drop: the pool's next user of the connection finds it idle, outside any transaction and
//! holding no locks; a batch committed whole or not at all; the abandoned job runs again and its
//! effect commits exactly once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use inbox_tests::TestDb;
use tokio_postgres::Client;

use crate::c04::server_address;
use crate::common::{self, config_via, pool_of, setup, Ctx, Result, Row};
use crate::proxy::Proxy;

pub const NAME: &str = "cancellation";

const SLOW: &str = "CREATE TABLE slow (n bigint); \
     CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS \
     $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$; \
     CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow \
     DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()";

/// What the pool's next user finds: `None` when the connection is idle, outside a transaction
/// and holds no locks, else what is wrong.
async fn next_user(admin: &Client, pool: &Pool) -> Result<Option<String>> {
    let client = pool.get().await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let row = admin
        .query_one(
            "SELECT a.state, a.backend_xid IS NOT NULL, \
                    (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid) \
             FROM pg_stat_activity a WHERE a.pid = $1",
            &[&pid],
        )
        .await?;
    let (state, xid, locks): (Option<String>, bool, i64) = (row.get(0), row.get(1), row.get(2));
    drop(client);
    Ok(
        (state.as_deref() != Some("idle") || xid || locks > 0).then(|| {
            format!("the next user's connection is {state:?}, xid assigned {xid}, {locks} locks")
        }),
    )
}

async fn pid_running_commit(admin: &Client, app: &str) -> Result<bool> {
    Ok(admin
        .query_opt(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
             AND state = 'active' AND query LIKE 'COMMIT%'",
            &[&app],
        )
        .await?
        .is_some())
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(11, NAME);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(SLOW).await?;
    let proxy = Proxy::start(server_address(&db)?).await?;
    let config = config_via(&db, proxy.port);
    port_drops(ctx, &mut row, &db, &admin, &proxy, &config).await?;
    worker_drops(&mut row, &db, &admin, &proxy, &config).await?;
    drop(proxy);
    drop(admin);
    drop(db);
    Ok(row)
}

/// `batch_atomic` futures dropped at BEGIN, mid-way, at COMMIT and at random moments.
async fn port_drops(
    ctx: &Ctx,
    row: &mut Row,
    db: &TestDb,
    admin: &Client,
    proxy: &Proxy,
    config: &tokio_postgres::Config,
) -> Result<()> {
    let pool = pool_of(config.clone(), 1);
    let pg = PgDatabase::from_pool(pool.clone());
    let random = ctx.profile.pick(40, 200);
    let mut rng = fastrand::Rng::with_seed(11);
    for i in 0..(3 + random) {
        let n = i as i64;
        let batch = vec![
            Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, 1)").bind(n),
            Statement::new("SELECT pg_sleep(0.05)"),
            Statement::new("INSERT INTO slow (n) VALUES ($1)").bind(n),
            Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, 2)").bind(n),
        ];
        let point = match i {
            0 => "BEGIN",
            1 => "mid-way",
            2 => "COMMIT",
            _ => "random",
        };
        if point == "BEGIN" {
            proxy.delay_begin(Duration::from_millis(300));
        }
        let future = pg.batch_atomic(&batch);
        let dropped = match point {
            "BEGIN" => tokio::time::timeout(Duration::from_millis(100), future)
                .await
                .is_err(),
            "mid-way" => tokio::time::timeout(Duration::from_millis(25), future)
                .await
                .is_err(),
            "COMMIT" => {
                let app = db.schema();
                tokio::select! {
                    _ = future => false,
                    _ = async {
                        while !pid_running_commit(admin, app).await.unwrap_or(false) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    } => true,
                }
            }
            _ => tokio::time::timeout(Duration::from_millis(rng.u64(0..600)), future)
                .await
                .is_err(),
        };
        proxy.delay_begin(Duration::ZERO);
        row.inputs += 1;
        row.faults += u64::from(dropped);
        if point != "random" {
            row.check(dropped, || format!("the batch was not dropped at {point}"));
        }
        if let Some(wrong) = next_user(admin, &pool).await? {
            row.failures
                .push(format!("batch dropped at {point} (#{i}): {wrong}"));
        }
        let written: i64 = admin
            .query_one("SELECT count(*) FROM effects WHERE n = $1", &[&n])
            .await?
            .get(0);
        row.check(written == 0 || written == 2, || {
            format!("batch dropped at {point} (#{i}) committed {written} of its 2 effects")
        });
    }
    admin.batch_execute("TRUNCATE effects, slow").await?;
    Ok(())
}

/// A worker's delivery abandoned by its shutdown at BEGIN, mid-handler and at COMMIT.
async fn worker_drops(
    row: &mut Row,
    db: &TestDb,
    admin: &Client,
    proxy: &Proxy,
    config: &tokio_postgres::Config,
) -> Result<()> {
    for (n, point) in [(1_i64, "BEGIN"), (2, "mid-handler"), (3, "COMMIT")] {
        admin
            .execute("SELECT inbox_enqueue('jobs', to_jsonb($1::int8))", &[&n])
            .await?;
        let pool = pool_of(config.clone(), 3);
        let pg = PgDatabase::from_pool_and_config(pool.clone(), config.clone());
        let started = Arc::new(AtomicBool::new(false));
        let flag = started.clone();
        let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
            let flag = flag.clone();
            Box::pin(async move {
                flag.store(true, Ordering::SeqCst);
                tx.execute(
                    &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                        .bind(job.payload)
                        .bind(job.attempt),
                )
                .await?;
                if job.attempt == 1 && job.payload == 2 {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
                if job.attempt == 1 && job.payload == 3 {
                    tx.execute(
                        &Statement::new("INSERT INTO slow (n) VALUES ($1)").bind(job.payload),
                    )
                    .await?;
                }
                Ok(Outcome::ack())
            })
        });
        if point == "BEGIN" {
            proxy.delay_begin(Duration::from_secs(1));
        }
        let worker = Worker::transactional(pg, "jobs", handler)
            .workers(1)
            .poll_interval(Duration::from_millis(20))
            .retry(RetryPolicy {
                base: Duration::from_millis(5),
                ..RetryPolicy::default()
            })
            .start();
        let reached = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let there = match point {
                    "BEGIN" => proxy.begins_delayed() > 0,
                    "mid-handler" => started.load(Ordering::SeqCst),
                    _ => pid_running_commit(admin, db.schema())
                        .await
                        .unwrap_or(false),
                };
                if there {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok();
        row.check(reached, || {
            format!("the worker's delivery never reached {point}")
        });
        worker.shutdown(Duration::from_millis(100)).await;
        proxy.delay_begin(Duration::ZERO);
        row.faults += 1;
        row.inputs += 1;
        if let Some(wrong) = next_user(admin, &pool).await? {
            row.failures
                .push(format!("delivery abandoned at {point}: {wrong}"));
        }
        // The abandoned job runs again (unless its commit took), and commits once.
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
        Worker::transactional(common::worker_db(db, 3), "jobs", handler)
            .workers(1)
            .poll_interval(Duration::from_millis(20))
            .run_until_idle()
            .await?;
        row.jobs += 1;
    }
    let tally = common::tally(admin, "jobs", 1..=3, None).await?;
    row.add("abandoned deliveries", &tally);
    Ok(())
}
