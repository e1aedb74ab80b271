//! Helpers that several modules of the integration tests share.

pub mod explain;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use inbox_client::worker::RetryPolicy;
use inbox_client::{Database, PgDatabase, Queue};
use inbox_tests::TestDb;

/// How long a step that must complete (a blocked call once it is released, a notification once
/// it is sent) may take before the test fails: generous, as the machine may be busy.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A port over `pool` connections with the queue `jobs` and a table `effects (job, attempt)`
/// in which handlers record the runs that commit; `tables` is further SQL the test needs.
pub async fn queue_with_effects(db: &TestDb, pool: usize, tables: &str) -> (PgDatabase, Queue) {
    let pg = PgDatabase::from_pool_and_config(db.pool(pool), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE effects (job bigint NOT NULL, attempt int NOT NULL); {tables}"
        ))
        .await
        .unwrap();
    (pg, queue)
}

/// The committed effects, as (job, attempt), in that order.
pub async fn effects(db: &TestDb) -> Vec<(i64, i32)> {
    db.client()
        .await
        .query(
            "SELECT job, attempt FROM effects ORDER BY job, attempt",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Counts one more run of job `id`; returns which run this is (1 on the first).
pub fn count_run(runs: &Mutex<HashMap<i64, u32>>, id: i64) -> u32 {
    let mut runs = runs.lock().unwrap();
    let run = runs.entry(id).or_insert(0);
    *run += 1;
    *run
}

/// Retries after 1–5 ms (capped at 20 ms), dead-lettering after `max_attempts` deliveries.
pub fn fast_retries(max_attempts: i32) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(2),
        cap: Duration::from_millis(20),
        max_attempts: Some(max_attempts),
        jitter: 0.5,
    }
}

/// Runs each statement and asserts that the server refused it with its SQLSTATE.
pub async fn assert_refused(client: &tokio_postgres::Client, cases: &[(&str, &str)]) {
    for &(sql, code) in cases {
        let error = client
            .batch_execute(sql)
            .await
            .expect_err(&format!("{sql} succeeded"));
        assert_eq!(
            error.code().map(|c| c.code()),
            Some(code),
            "{sql}: {error:?}"
        );
    }
}

pub async fn backend_pid(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits until backend `pid` is waiting for a heavyweight lock, as `observer` (a connection
/// outside any transaction, so that each query reads `pg_stat_activity` afresh) sees it.
pub async fn wait_until_waiting_on_lock(observer: &tokio_postgres::Client, pid: i32) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let row = observer
            .query_one(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap();
        let (kind, event): (Option<String>, Option<String>) = (row.get(0), row.get(1));
        if kind.as_deref() == Some("Lock") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never waited for a lock (last wait event: {kind:?} {event:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
