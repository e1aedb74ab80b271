//! The client and the worker through a real pgbouncer in transaction mode (the tests start it):
//! no named prepared statement, no session state left behind, wake-ups by LISTEN on a direct
//! connection or by polling.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker};
use inbox_client::{Database, JobState, PgDatabase, Queue, ResultWaiter, Statement};
use inbox_tests::{PgBouncer, TestDb};
use serde_json::json;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

/// `26000 invalid_sql_statement_name`: the named statement does not exist on this server
/// connection.
const NO_SUCH_STATEMENT: &str = "26000";

async fn connect(config: &tokio_postgres::Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// The value of setting `name` in the session of `client` (simple protocol: no statement).
async fn show(client: &Client, name: &str) -> String {
    let messages = client.simple_query(&format!("SHOW {name}")).await.unwrap();
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .expect("one row")
}

async fn create_queue_and_effects(pg: &PgDatabase, queue: &str) {
    pg.execute(&Queue::new(queue).create_statement())
        .await
        .unwrap();
    pg.execute(&Statement::new(
        "CREATE TABLE IF NOT EXISTS effects (queue text NOT NULL, n bigint NOT NULL)",
    ))
    .await
    .unwrap();
}

async fn enqueue(pg: &PgDatabase, queue: &str, count: i64) {
    pg.execute(
        &Statement::new(
            "SELECT count(*) FROM inbox_enqueue_batch($1::text::regclass, \
             ARRAY(SELECT to_jsonb(g) FROM generate_series(1, $2::bigint) g))",
        )
        .bind(queue)
        .bind(count),
    )
    .await
    .unwrap();
}

/// The effect rows per job of `queue`: `(jobs with an effect, rows)`.
async fn effects(db: &TestDb, queue: &str) -> (i64, i64) {
    let row = db
        .client()
        .await
        .query_one(
            "SELECT count(DISTINCT n), count(*) FROM effects WHERE queue = $1",
            &[&queue],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

fn effect(queue: &str, job: &Job<i64>) -> Statement {
    Statement::new("INSERT INTO effects (queue, n) VALUES ($1, $2)")
        .bind(queue)
        .bind(job.payload)
}

fn transactional_worker(pg: &PgDatabase, queue: &'static str) -> Worker<i64> {
    let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(&effect(queue, &job)).await?;
            Ok(Outcome::ack())
        })
    });
    Worker::transactional(pg.clone(), queue, handler)
}

fn plain_worker(pg: &PgDatabase, queue: &'static str) -> Worker<i64> {
    let effects = pg.clone();
    Worker::plain(pg.clone(), queue, move |job: Job<i64>| {
        let effects = effects.clone();
        async move {
            effects.execute(&effect(queue, &job)).await?;
            Ok(Outcome::ack())
        }
    })
}

/// The failure the unnamed mode removes: a statement prepared in one transaction is gone in the
/// next, which pgbouncer runs on another server connection (deterministic here: the other
/// server connection is the only one free).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_named_statement_is_lost_between_transactions_through_pgbouncer() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, 2);
    let config = bouncer.config();
    let (prepares, holder, other) = (
        connect(&config).await,
        connect(&config).await,
        connect(&config).await,
    );
    holder.batch_execute("BEGIN").await.unwrap(); // holds server A
    let statement = prepares.prepare("SELECT 1::int4").await.unwrap(); // on server B
    other.batch_execute("BEGIN").await.unwrap(); // holds server B
    holder.batch_execute("COMMIT").await.unwrap(); // frees A
    let error = prepares.query(&statement, &[]).await.unwrap_err();
    assert_eq!(
        error.code().map(|c| c.code()),
        Some(NO_SUCH_STATEMENT),
        "{error}"
    );
    other.batch_execute("COMMIT").await.unwrap();

    // The same dance with the client's unnamed statements: nothing to lose.
    let pg = bouncer.port_polling(2);
    let mut held = bouncer.pool(1).get().await.unwrap();
    let tx = held.transaction().await.unwrap();
    let rows = pg
        .query(&Statement::new("SELECT $1::int4 + 1 AS n").bind(1_i64))
        .await
        .unwrap();
    assert_eq!(rows.one().unwrap().get::<i64>("n").unwrap(), 2);
    tx.commit().await.unwrap();
    drop(held);
}

/// Transactional workers (leases and locks) and a plain one, 8 slots sharing 2 server
/// connections through pgbouncer: every job is delivered and its effect committed exactly once,
/// and no server connection keeps a worker's timeout afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_through_pgbouncer_with_more_clients_than_servers_deliver_every_job_once() {
    const JOBS: i64 = 400;
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, 2);
    let pg = bouncer.port_polling(10);
    for (queue, worker) in [
        ("lease_jobs", transactional_worker(&pg, "lease_jobs")),
        (
            "lock_jobs",
            transactional_worker(&pg, "lock_jobs").claim(Claim::Lock),
        ),
        ("plain_jobs", plain_worker(&pg, "plain_jobs")),
    ] {
        create_queue_and_effects(&pg, queue).await;
        enqueue(&pg, queue, JOBS).await;
        let stats = tokio::time::timeout(
            Duration::from_secs(120),
            worker
                .workers(8)
                .poll_interval(Duration::from_millis(20))
                .run_until_idle(),
        )
        .await
        .unwrap_or_else(|_| panic!("{queue}: not drained in 120 s"))
        .unwrap();
        assert_eq!(stats.acked as i64, JOBS, "{queue}: {stats:?}");
        assert_eq!(
            (stats.retried, stats.dead, stats.failed, stats.lost),
            (0, 0, 0, 0),
            "{queue}: {stats:?}"
        );
        assert_eq!(effects(&db, queue).await, (JOBS, JOBS), "{queue}");
    }

    // Both server connections (held at once by two transactions) have the server's defaults.
    let direct = db.client().await;
    let (one, two) = (
        connect(&bouncer.config()).await,
        connect(&bouncer.config()).await,
    );
    one.batch_execute("BEGIN").await.unwrap();
    two.batch_execute("BEGIN").await.unwrap();
    for setting in [
        "statement_timeout",
        "idle_in_transaction_session_timeout",
        "lock_timeout",
    ] {
        let default = show(&direct, setting).await;
        assert_eq!(show(&one, setting).await, default, "{setting}");
        assert_eq!(show(&two, setting).await, default, "{setting}");
    }
    one.batch_execute("COMMIT").await.unwrap();
    two.batch_execute("COMMIT").await.unwrap();
}

/// How many sessions of this test's schema are listening, seen on a direct connection: those
/// whose last statement was a LISTEN, or which sleep on a queue (`inbox_sleep`, whose lock has
/// `objsubid` 26978 in the pgrx build, and is `pg_advisory_lock_shared(queue, 26978)`, `objid`
/// 26978 and `objsubid` 2, in the SQL-only build; see `docs/sql-api.md`, `docs/sql-only.md`).
async fn listeners(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_activity a \
             WHERE application_name = current_setting('application_name') \
               AND pid <> pg_backend_pid() \
               AND (query LIKE 'LISTEN%' \
                    OR EXISTS (SELECT FROM pg_locks l WHERE l.pid = a.pid \
                                AND l.locktype = 'advisory' \
                                AND (l.objsubid = 26978 \
                                     OR (l.objid = 26978 AND l.objsubid = 2))))",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Through pgbouncer, a worker given a direct connection LISTENs on it and wakes at once on an
/// enqueue (its poll interval is a minute); one given none never LISTENs (not through the pooler
/// either) and finds the job by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_pgbouncer_a_worker_listens_directly_or_polls() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, 2);

    let listening = bouncer.port_listening_directly(&db, 4);
    create_queue_and_effects(&listening, "woken").await;
    let handle = transactional_worker(&listening, "woken")
        .workers(2)
        .poll_interval(Duration::from_secs(60))
        .start();
    let deadline = Instant::now() + Duration::from_secs(10);
    while listeners(&db).await == 0 {
        assert!(Instant::now() < deadline, "the worker did not LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first idle poll has passed; the next is a minute away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    enqueue(&listening, "woken", 1).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while handle.stats().acked < 1 {
        assert!(Instant::now() < deadline, "no wake-up through LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.shutdown(Duration::from_secs(5)).await;
    assert_eq!(effects(&db, "woken").await, (1, 1));

    let polling = bouncer.port_polling(4);
    create_queue_and_effects(&polling, "polled").await;
    let handle = transactional_worker(&polling, "polled")
        .workers(2)
        .poll_interval(Duration::from_millis(100))
        .start();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(listeners(&db).await, 0, "a polling worker LISTENs");
    enqueue(&polling, "polled", 1).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while handle.stats().acked < 1 {
        assert!(
            Instant::now() < deadline,
            "the job was not found by polling"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(listeners(&db).await, 0, "a polling worker LISTENs");
    handle.shutdown(Duration::from_secs(5)).await;
    assert_eq!(effects(&db, "polled").await, (1, 1));
}

/// Kept results through pgbouncer, where no LISTEN is possible: a transactional worker (through
/// the pooler) acks each job with a result derived from its payload, and 16 callers each enqueue
/// jobs and wait for them by polling, each getting its own result; a waiter built with
/// [`ResultWaiter::new`] on a port without direct connection settings polls too, and never
/// LISTENs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_pgbouncer_callers_poll_for_their_own_results() {
    const CALLERS: i64 = 16;
    const EACH: i64 = 20;
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db, 4);
    let pg = bouncer.port_polling(24);
    assert!(pg.listen_config().is_none());
    let queue = Queue::new("results");
    pg.execute(&queue.create_statement()).await.unwrap();
    queue
        .keep_results(&pg, Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    let worker = Worker::transactional(
        pg.clone(),
        "results",
        transactional(|job: Job<i64>, _tx: &dyn Database| {
            Box::pin(async move {
                Ok(Outcome::ack_with(
                    json!({"n": job.payload, "square": job.payload * job.payload}),
                ))
            })
        }),
    )
    .workers(4)
    .poll_interval(Duration::from_millis(20))
    .start();

    let waiter = Arc::new(ResultWaiter::polling(&pg, Duration::from_millis(20)));
    let mut callers = Vec::new();
    for caller in 0..CALLERS {
        let (pg, queue, waiter) = (pg.clone(), queue.clone(), waiter.clone());
        callers.push(tokio::spawn(async move {
            for k in 0..EACH {
                let n = caller * 1000 + k;
                let id = queue.enqueue(&pg, &n, None, None).await.unwrap().unwrap();
                let done = waiter
                    .wait(&queue, id, Duration::from_secs(30))
                    .await
                    .unwrap();
                assert_eq!(done.state, JobState::Succeeded, "job {id}: {done:?}");
                assert_eq!(
                    done.result,
                    Some(json!({"n": n, "square": n * n})),
                    "job {id}"
                );
                assert_eq!(done.attempt, Some(1), "job {id}");
            }
        }));
    }
    for caller in callers {
        caller.await.unwrap();
    }

    // No direct connection settings: `new` polls (LISTEN through the pooler would not work).
    let waiter = ResultWaiter::new(&pg);
    let id = queue.enqueue(&pg, &7, None, None).await.unwrap().unwrap();
    let done = waiter
        .wait(&queue, id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done.state, JobState::Succeeded, "job {id}: {done:?}");
    assert_eq!(done.result, Some(json!({"n": 7, "square": 49})));
    assert_eq!(listeners(&db).await, 0, "a polling waiter LISTENs");

    let stats = worker.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.acked as i64, CALLERS * EACH + 1, "{stats:?}");
    assert_eq!(
        (stats.retried, stats.dead, stats.failed, stats.lost),
        (0, 0, 0, 0),
        "{stats:?}"
    );
}
