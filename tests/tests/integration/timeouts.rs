//! Handler timeouts over real connections: a handler that runs past `handler_timeout` is
//! abandoned where it waits (on the client, or on a statement in flight) and its delivery fails
//! as an attempt; in transactional mode its writes are rolled back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{assert_refused, effects, fast_retries, queue_with_effects};
use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, EnqueueOptions, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;

/// A transactional handler that writes, then waits on the client (attempt 1) or on a slow
/// statement (attempt 2): both deliveries time out and leave no write; attempt 3 commits. With
/// a lease and with a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_handler_past_its_timeout_fails_its_attempt_and_writes_nothing() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let (pg, queue) = queue_with_effects(&db, 4, "").await;
        let id = queue.enqueue(&pg, &0, None, None).await.unwrap().unwrap();

        let handler = transactional(|job: Job<i32>, tx: &dyn Database| {
            Box::pin(async move {
                tx.execute(
                    &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                        .bind(job.id)
                        .bind(job.attempt),
                )
                .await?;
                match job.attempt {
                    1 => tokio::time::sleep(Duration::from_secs(60)).await,
                    2 => {
                        tx.query(&Statement::new("SELECT pg_sleep(60)")).await?;
                    }
                    _ => {}
                }
                Ok(Outcome::Ack)
            })
        });
        let stats = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(1)
            .claim(claim)
            .handler_timeout(Duration::from_millis(300))
            // Bounds the abandoned pg_sleep, which the rollback waits for.
            .statement_timeout(Duration::from_secs(1))
            .retry(fast_retries(10))
            .run_until_idle()
            .await
            .unwrap();

        assert_eq!(effects(&db).await, vec![(id, 3)], "{claim:?}");
        assert_eq!(
            (stats.acked, stats.retried, stats.failed, stats.dead),
            (1, 2, 2, 0),
            "{claim:?}: {stats:?}"
        );
    }
}

/// A plain handler past its timeout is retried with the reason recorded, and acked on the next
/// attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_handler_past_its_timeout_is_retried() {
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(4), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    queue.enqueue(&pg, &0, None, None).await.unwrap().unwrap();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let attempts = attempts.clone();
        move |job: Job<i32>| {
            let attempts = attempts.clone();
            async move {
                attempts.lock().unwrap().push(job.attempt);
                if job.attempt == 1 {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                Ok(Outcome::Ack)
            }
        }
    };
    let worker = Worker::plain(pg.clone(), "jobs", handler)
        .handler_timeout(Duration::from_millis(300))
        .retry(RetryPolicy {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(1),
            ..fast_retries(10)
        })
        .start();
    // Between the two deliveries the job waits with the reason of its failed attempt.
    let client = db.client().await;
    let mut reason: Option<String> = None;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        reason = client
            .query_opt(
                "SELECT last_error FROM jobs WHERE last_error IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .map(|row| row.get(0));
        if reason.is_some() {
            break;
        }
    }
    assert!(
        reason.as_deref().is_some_and(|r| r.contains("timeout")),
        "{reason:?}"
    );
    for _ in 0..500 {
        if worker.stats().acked == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = worker.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*attempts.lock().unwrap(), vec![1, 2]);
    assert_eq!(
        (stats.acked, stats.retried, stats.failed),
        (1, 1, 1),
        "{stats:?}"
    );
}

/// A job enqueued with a timeout of its own is bounded by it in place of the worker's: job A
/// (300 ms of its own) times out on its first attempt and is acked on its second, while job B
/// (30 s of its own) runs 600 ms, past the worker's 200 ms, and is acked on its first. With a
/// lease and with a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_set_at_enqueue_bounds_the_job_in_place_of_the_workers() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let (pg, queue) = queue_with_effects(&db, 4, "").await;
        let short = EnqueueOptions::default().timeout(Duration::from_millis(300));
        let long = EnqueueOptions::default().timeout(Duration::from_secs(30));
        let a = queue.enqueue_with(&pg, &60_000, &short).await.unwrap();
        let b = queue.enqueue_with(&pg, &600, &long).await.unwrap();
        let (a, b) = (a.unwrap(), b.unwrap());
        let handler = transactional(|job: Job<u64>, tx: &dyn Database| {
            Box::pin(async move {
                tx.execute(
                    &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                        .bind(job.id)
                        .bind(job.attempt),
                )
                .await?;
                if job.attempt == 1 {
                    tokio::time::sleep(Duration::from_millis(job.payload)).await;
                }
                Ok(Outcome::Ack)
            })
        });
        let stats = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(1)
            .claim(claim)
            .handler_timeout(Duration::from_millis(200))
            .retry(fast_retries(10))
            .run_until_idle()
            .await
            .unwrap();

        assert_eq!(effects(&db).await, vec![(a, 2), (b, 1)], "{claim:?}");
        assert_eq!(
            (stats.acked, stats.retried, stats.failed),
            (2, 1, 1),
            "{claim:?}: {stats:?}"
        );
    }
}

/// In SQL: a lease and a lock hand over the job's timeout (NULL for none), a batch gives one to
/// each of its jobs, and bad timeouts are refused.
#[tokio::test]
async fn a_timeout_at_enqueue_is_handed_over_with_the_job_and_checked() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', '{}', timeout => '90 seconds'); \
             SELECT inbox_enqueue('jobs', '{}'); \
             SELECT inbox_enqueue_batch('jobs', ARRAY['{}', '{}']::jsonb[], timeout => '2 minutes'); \
             CREATE TABLE plain (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
                                 attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL)",
        )
        .await
        .unwrap();
    let leased: Vec<Option<f64>> = client
        .query(
            "SELECT extract(epoch FROM timeout)::float8 FROM inbox_lease('jobs', 2, '1 minute')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(leased, vec![Some(90.0), None]);
    client.batch_execute("BEGIN").await.unwrap();
    let locked: Vec<Option<f64>> = client
        .query(
            "SELECT extract(epoch FROM timeout)::float8 FROM inbox_lock('jobs', 2)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(locked, vec![Some(120.0), Some(120.0)]);
    assert_refused(
        &client,
        &[
            (
                "SELECT inbox_enqueue('plain', '{}', timeout => '1 second')",
                "42703",
            ),
            (
                "SELECT inbox_enqueue('jobs', '{}', timeout => '0 seconds')",
                "22023",
            ),
            (
                "SELECT inbox_enqueue('jobs', '{}', timeout => '-1 second')",
                "22023",
            ),
            (
                "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], timeout => '0 seconds')",
                "22023",
            ),
        ],
    )
    .await;
}
