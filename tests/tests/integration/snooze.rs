//! Snoozing over real connections: a snoozed delivery runs again later and reports the same
//! attempt, `max_attempts` counts only the deliveries that were not snoozed, and the token of a
//! snoozed delivery is fenced once the job is delivered again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{assert_refused, effects, fast_retries, queue_with_effects};
use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker};
use inbox_client::{Database, Statement};
use inbox_tests::TestDb;

/// A transactional handler that writes, then snoozes its first three deliveries and acks the
/// fourth: with `max_attempts` 2 it is never dead-lettered, every delivery reports attempt 1,
/// and only the acked delivery's write commits. With a lease and with a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snoozed_delivery_runs_again_without_spending_an_attempt() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let (pg, queue) = queue_with_effects(&db, 4, "").await;
        let id = queue.enqueue(&pg, &0, None, None).await.unwrap().unwrap();
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let handler = {
            let attempts = attempts.clone();
            transactional(move |job: Job<i32>, tx: &dyn Database| {
                let attempts = attempts.clone();
                Box::pin(async move {
                    tx.execute(
                        &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                            .bind(job.id)
                            .bind(job.attempt),
                    )
                    .await?;
                    let deliveries = {
                        let mut attempts = attempts.lock().unwrap();
                        attempts.push(job.attempt);
                        attempts.len()
                    };
                    Ok(if deliveries <= 3 {
                        Outcome::snooze(Duration::from_millis(20))
                    } else {
                        Outcome::ack()
                    })
                })
            })
        };
        let stats = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(1)
            .claim(claim)
            .retry(fast_retries(2))
            .run_until_idle()
            .await
            .unwrap();

        assert_eq!(*attempts.lock().unwrap(), vec![1, 1, 1, 1], "{claim:?}");
        assert_eq!(effects(&db).await, vec![(id, 1)], "{claim:?}");
        assert_eq!(
            (stats.acked, stats.snoozed, stats.retried, stats.dead),
            (1, 3, 0, 0),
            "{claim:?}: {stats:?}"
        );
    }
}

/// In SQL: a snooze delays the job and ends its lease; the next lease reports the same attempt
/// under a new token, which fences the snoozed delivery's; `max_attempts` dead-letters on the
/// attempts that were not snoozed only. The same with a lock's token.
#[tokio::test]
async fn inbox_snooze_delays_the_job_and_keeps_its_attempt_under_a_new_token() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let lease = "SELECT id, attempt, token FROM inbox_lease('jobs', 1, '30 seconds')";
    let id: i64 = client
        .query_one("SELECT inbox_enqueue('jobs', '{}')", &[])
        .await
        .unwrap()
        .get(0);
    let row = client.query_one(lease, &[]).await.unwrap();
    let (attempt, token): (i32, i64) = (row.get(1), row.get(2));
    assert_eq!((row.get::<_, i64>(0), attempt, token), (id, 1, 1));

    let snoozed: bool = client
        .query_one(
            "SELECT inbox_snooze('jobs', $1, $2, '1 hour')",
            &[&id, &token],
        )
        .await
        .unwrap()
        .get(0);
    assert!(snoozed);
    let row = client
        .query_one(
            "SELECT locked_until > now() + interval '59 minutes', leased_at IS NULL, snoozes \
               FROM jobs WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, bool>(0),
            row.get::<_, bool>(1),
            row.get::<_, i32>(2)
        ),
        (true, true, 1)
    );
    assert!(
        client.query(lease, &[]).await.unwrap().is_empty(),
        "not due for an hour"
    );

    // Due again: the next lease reports attempt 1 under token 2, and token 1 is fenced.
    client
        .execute("UPDATE jobs SET locked_until = now() WHERE id = $1", &[&id])
        .await
        .unwrap();
    let row = client.query_one(lease, &[]).await.unwrap();
    assert_eq!((row.get::<_, i32>(1), row.get::<_, i64>(2)), (1, 2));
    let settle = |sql: &'static str, id: i64, token: i64| {
        let client = &client;
        async move {
            client
                .query_one(sql, &[&id, &token])
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(!settle("SELECT inbox_snooze('jobs', $1, $2)", id, 1).await);
    assert!(!settle("SELECT inbox_ack('jobs', $1, $2)", id, 1).await);

    // Attempt 1 (token 2) fails with max_attempts 2: retried, not dead; attempt 2 then dies.
    let retry = "SELECT inbox_retry('jobs', $1, $2, max_attempts => 2)";
    assert!(settle(retry, id, 2).await);
    let row = client.query_one(lease, &[]).await.unwrap();
    assert_eq!((row.get::<_, i32>(1), row.get::<_, i64>(2)), (2, 3));
    assert!(settle(retry, id, 3).await);
    let dead: bool = client
        .query_one("SELECT dead_at IS NOT NULL FROM jobs WHERE id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert!(dead, "attempt 2 of 2 dead-letters");

    // A lock's delivery snoozes too: its attempt is counted and given back in one settlement.
    let id: i64 = client
        .query_one("SELECT inbox_enqueue('jobs', '{}')", &[])
        .await
        .unwrap()
        .get(0);
    let lock = "SELECT attempt, token FROM inbox_lock('jobs', 1)";
    client.batch_execute("BEGIN").await.unwrap();
    let row = client.query_one(lock, &[]).await.unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, i64>(1)), (1, -1));
    assert!(settle("SELECT inbox_snooze('jobs', $1, $2)", id, -1).await);
    client.batch_execute("COMMIT").await.unwrap();
    client.batch_execute("BEGIN").await.unwrap();
    let row = client.query_one(lock, &[]).await.unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, i64>(1)), (1, -2));
    client.batch_execute("ROLLBACK").await.unwrap();
}

/// Bad input is refused with its SQLSTATE, and a table without `snoozes` says what to add.
#[tokio::test]
async fn inbox_snooze_refuses_bad_input() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             CREATE TABLE plain (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL)",
        )
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT inbox_snooze('plain', 1, 1)", "42703"),
            ("SELECT inbox_snooze(NULL, 1, 1)", "22004"),
            ("SELECT inbox_snooze('jobs', NULL, 1)", "22004"),
            ("SELECT inbox_snooze('jobs', 1, NULL)", "22004"),
            ("SELECT inbox_snooze('jobs', 1, 1, '-1 second')", "22023"),
        ],
    )
    .await;
    let error = client
        .batch_execute("SELECT inbox_snooze('plain', 1, 1)")
        .await
        .unwrap_err();
    let error = error.as_db_error().unwrap();
    assert!(
        error.hint().unwrap().contains("ADD COLUMN snoozes"),
        "{error:?}"
    );
}
