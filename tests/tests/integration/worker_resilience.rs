//! The worker when the database takes things away: its LISTEN connection is killed, a handler
//! runs a statement past the statement timeout, a handler sits idle in its transaction past the
//! idle timeout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;

async fn setup(db: &TestDb) -> PgDatabase {
    let pg = PgDatabase::from_pool_and_config(db.pool(8), db.config());
    pg.execute(&Queue::new("jobs").create_statement())
        .await
        .unwrap();
    pg.execute(&Statement::new(
        "CREATE TABLE effects (n bigint, attempt int)",
    ))
    .await
    .unwrap();
    pg
}

/// The effect rows, as (job payload, attempt that wrote it).
async fn effects(pg: &PgDatabase) -> Vec<(i64, i32)> {
    let rows = pg
        .query(&Statement::new(
            "SELECT n, attempt FROM effects ORDER BY n, attempt",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| (row.get("n").unwrap(), row.get("attempt").unwrap()))
        .collect()
}

/// The backend pid of the worker's LISTEN connection, once it sleeps on the queue.
async fn listener_pid(db: &TestDb) -> Option<i32> {
    let client = db.client().await;
    client
        .query_opt("SELECT s FROM inbox_sleepers('jobs') AS s LIMIT 1", &[])
        .await
        .unwrap()
        .map(|row| row.get(0))
}

async fn wait_for_listener(db: &TestDb, other_than: Option<i32>) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(pid) = listener_pid(db)
            .await
            .filter(|pid| Some(*pid) != other_than)
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "the worker did not LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn recording_handler(started: Arc<AtomicUsize>) -> impl inbox_client::worker::TxHandler<i64> {
    transactional(move |job: Job<i64>, tx: &dyn Database| {
        let started = started.clone();
        Box::pin(async move {
            started.fetch_add(1, Ordering::SeqCst);
            tx.execute(
                &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            Ok(Outcome::ack())
        })
    })
}

/// A killed LISTEN connection is opened again, and enqueues wake the worker through the new one
/// (the poll interval is far longer than the wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_listen_connection_is_reestablished() {
    let db = TestDb::new().await;
    let pg = setup(&db).await;
    let started = Arc::new(AtomicUsize::new(0));
    let worker = Worker::transactional(pg.clone(), "jobs", recording_handler(started.clone()))
        .workers(2)
        .poll_interval(Duration::from_secs(60))
        .start();
    let first = wait_for_listener(&db, None).await;
    let admin = db.client().await;
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .unwrap();
    let second = wait_for_listener(&db, Some(first)).await;
    assert_ne!(first, second);
    // Let the reconnect's catch-up wake-up pass, so the next one can only come from NOTIFY.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let enqueued = Instant::now();
    Queue::new("jobs")
        .enqueue(&pg, &7_i64, None, None)
        .await
        .unwrap();
    while started.load(Ordering::SeqCst) == 0 {
        assert!(
            enqueued.elapsed() < Duration::from_secs(5),
            "the job was not picked up through the new LISTEN"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats = worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!(stats.acked, 1);
}

/// A handler statement that outlives the statement timeout fails, the delivery's writes roll
/// back, and the retry (which is quick) commits them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_past_the_timeout_fails_the_delivery_and_its_retry_commits_once() {
    let db = TestDb::new().await;
    let pg = setup(&db).await;
    Queue::new("jobs")
        .enqueue(&pg, &1_i64, None, None)
        .await
        .unwrap();
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            if job.attempt == 1 {
                tx.execute(&Statement::new("SELECT pg_sleep(5)")).await?;
            }
            Ok(Outcome::ack())
        })
    });
    let stats = Worker::transactional(pg.clone(), "jobs", handler)
        .statement_timeout(Duration::from_millis(300))
        .retry(RetryPolicy {
            base: Duration::from_millis(10),
            ..RetryPolicy::default()
        })
        .poll_interval(Duration::from_millis(50))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        (stats.acked, stats.failed, stats.retried),
        (1, 1, 1),
        "{stats:?}"
    );
    let effects = effects(&pg).await;
    assert_eq!(effects, vec![(1, 2)], "only the retry's write commits");
}

/// A handler that keeps its transaction idle past the idle-in-transaction timeout loses its
/// connection, and with it its writes; the job comes back when its lease ends and its next
/// delivery commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_idle_past_the_timeout_is_cut_and_the_job_runs_again() {
    let db = TestDb::new().await;
    let pg = setup(&db).await;
    Queue::new("jobs")
        .enqueue(&pg, &1_i64, None, None)
        .await
        .unwrap();
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            if job.attempt == 1 {
                // Waiting on something outside the database with the transaction open.
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            Ok(Outcome::ack())
        })
    });
    let stats = Worker::transactional(pg.clone(), "jobs", handler)
        .idle_in_transaction_timeout(Duration::from_millis(300))
        .lease(Duration::from_secs(1))
        .heartbeat(false)
        .poll_interval(Duration::from_millis(50))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.acked, 1, "{stats:?}");
    let effects = effects(&pg).await;
    assert_eq!(effects, vec![(1, 2)], "the cut transaction's write is gone");
}
