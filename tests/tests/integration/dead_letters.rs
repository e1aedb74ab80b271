//! Dead-letter operations over real connections, through the client's `Queue`: every path that
//! dead-letters records `dead_at`; requeue, requeue of all (or the oldest), discard and listing;
//! bad input refused with its SQLSTATE and nothing changed; concurrent requeues never requeue a
//! job twice.

use std::time::Duration;

use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{Database, EnqueueOptions, ErrorKind, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

async fn setup(db: &TestDb) -> (PgDatabase, Queue, Client) {
    let pg = PgDatabase::from_pool_and_config(db.pool(6), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    (pg, queue, db.client().await)
}

async fn lease_ids(client: &Client) -> Vec<i64> {
    client
        .query("SELECT id FROM inbox_lease('jobs', 100)", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn every_dead_letter_path_records_when_and_why() {
    let db = TestDb::new().await;
    let (pg, queue, client) = setup(&db).await;
    for n in 0..3 {
        queue.enqueue(&pg, &n, None, None).await.unwrap();
    }
    assert_eq!(lease_ids(&client).await, [1, 2, 3]);
    client
        .batch_execute(
            "SELECT inbox_retry('jobs', 1, 1, '0', 'too many', 1); \
             SELECT inbox_dead('jobs', 2, 1, 'poison')",
        )
        .await
        .unwrap();
    // And the worker's own dead-lettering (its retry policy), through a lock claim.
    client
        .batch_execute("SELECT inbox_retry('jobs', 3, 1, '0', 'first')")
        .await
        .unwrap();
    let handler = transactional(|_job: Job<i64>, _tx: &dyn Database| {
        Box::pin(async { Ok(Outcome::retry()) })
    });
    let stats = Worker::transactional(pg.clone(), "jobs", handler)
        .retry(RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(1),
            max_attempts: Some(2),
            jitter: 0.0,
        })
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.dead, 1);
    let dead = queue.dead_jobs(&pg, 100).await.unwrap();
    let ids: Vec<i64> = dead.iter().map(|job| job.id).collect();
    assert_eq!(ids, [1, 2, 3], "oldest first");
    assert_eq!(dead[0].last_error.as_deref(), Some("too many"));
    assert_eq!(dead[1].last_error.as_deref(), Some("poison"));
    assert_eq!(dead[2].attempt, 2);
    assert!(dead.iter().all(|job| job.dead_at.is_some()));
    assert!(dead.windows(2).all(|w| w[0].dead_at <= w[1].dead_at));
    assert_eq!(dead[0].payload, Some(serde_json::json!(0)));
    assert_eq!(dead[0].payload_bytes, None);
    assert_eq!(queue.stats(&pg).await.unwrap().dead, 3);
    assert_eq!(queue.dead_jobs(&pg, 2).await.unwrap().len(), 2);
}

#[tokio::test]
async fn requeue_discard_and_requeue_dead() {
    let db = TestDb::new().await;
    let (pg, queue, client) = setup(&db).await;
    for n in 0..5 {
        queue.enqueue(&pg, &n, None, None).await.unwrap();
    }
    assert_eq!(lease_ids(&client).await.len(), 5);
    for id in 1..=5 {
        client
            .execute("SELECT inbox_dead('jobs', $1, 1, 'x')", &[&(id as i64)])
            .await
            .unwrap();
    }
    // Not dead (or not there): false, nothing changed.
    queue.enqueue(&pg, &99, None, None).await.unwrap();
    assert!(!queue.requeue(&pg, 6).await.unwrap());
    assert!(!queue.discard(&pg, 6).await.unwrap());
    assert!(!queue.requeue(&pg, 1000).await.unwrap());
    assert!(queue.discard(&pg, 5).await.unwrap());
    assert!(!queue.discard(&pg, 5).await.unwrap());
    assert!(queue.requeue(&pg, 1).await.unwrap());
    assert!(!queue.requeue(&pg, 1).await.unwrap(), "no longer dead");
    let row = client
        .query_one(
            "SELECT attempt, last_error, dead_at IS NULL, locked_until <= now() FROM jobs WHERE id = 1",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 0, "attempts counted from zero");
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some("x"),
        "last_error kept"
    );
    assert!(row.get::<_, bool>(2) && row.get::<_, bool>(3), "due now");
    assert_eq!(queue.requeue_dead(&pg, Some(2)).await.unwrap(), 2);
    let left: Vec<i64> = queue
        .dead_jobs(&pg, 100)
        .await
        .unwrap()
        .iter()
        .map(|job| job.id)
        .collect();
    assert_eq!(left, [4], "the two oldest were requeued");
    assert_eq!(queue.requeue_dead(&pg, None).await.unwrap(), 1);
    assert_eq!(queue.requeue_dead(&pg, None).await.unwrap(), 0);
    let mut ready = lease_ids(&client).await;
    ready.sort();
    assert_eq!(ready, [1, 2, 3, 4, 6]);
}

#[tokio::test]
async fn bad_input_is_refused_and_changes_nothing() {
    let db = TestDb::new().await;
    let (pg, queue, client) = setup(&db).await;
    queue.enqueue(&pg, &1, None, None).await.unwrap();
    lease_ids(&client).await;
    client
        .batch_execute("SELECT inbox_dead('jobs', 1, 1, 'x')")
        .await
        .unwrap();
    for (sql, code) in [
        (
            "SELECT inbox_requeue('jobs', NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT inbox_requeue(NULL, 1)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT inbox_discard('jobs', NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT * FROM inbox_dead_jobs('jobs', NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT inbox_requeue_dead('jobs', 0)",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "SELECT inbox_requeue_dead('jobs', -1)",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "SELECT * FROM inbox_dead_jobs('jobs', 0)",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "SELECT inbox_requeue('nosuch', 1)",
            SqlState::UNDEFINED_TABLE,
        ),
    ] {
        let error = client.batch_execute(sql).await.expect_err(sql);
        assert_eq!(error.code(), Some(&code), "{sql}: {error:?}");
    }
    let error = queue.requeue_dead(&pg, Some(0)).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput, "{error:?}");
    let dead = queue.dead_jobs(&pg, 10).await.unwrap();
    assert_eq!(dead.len(), 1, "still dead");
    assert_eq!(
        queue.dead_jobs(&pg, i32::MAX).await.unwrap().len(),
        1,
        "a huge max is fine"
    );
}

/// Four connections requeue all dead jobs at once: each job is requeued by exactly one of them.
#[tokio::test]
async fn concurrent_requeues_requeue_each_job_once() {
    let db = TestDb::new().await;
    let (pg, _queue, client) = setup(&db).await;
    client
        .batch_execute(
            "SELECT count(*) FROM inbox_enqueue_batch('jobs', ARRAY(SELECT to_jsonb(g) FROM generate_series(1, 2000) g)); \
             SELECT count(*) FROM inbox_lease('jobs', 2000); \
             SELECT count(*) FROM jobs WHERE inbox_dead('jobs', id, 1, 'x')",
        )
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let pg = pg.clone();
        tasks.push(tokio::spawn(async move {
            let mut total = 0;
            loop {
                let n = Queue::new("jobs")
                    .requeue_dead(&pg, Some(100))
                    .await
                    .unwrap();
                if n == 0 {
                    return total;
                }
                total += n;
            }
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    assert_eq!(total, 2000);
    let ready: i64 = client
        .query_one("SELECT ready FROM inbox_stats('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(ready, 2000);
}

/// A dead job of a group, requeued while its group has no head, becomes the head at once; the
/// options form enqueues into groups with priorities.
#[tokio::test]
async fn a_requeued_job_of_an_idle_group_runs_at_once() {
    let db = TestDb::new().await;
    let (pg, queue, client) = setup(&db).await;
    let options = EnqueueOptions::default().group_key("g").priority(3);
    let id = queue
        .enqueue_with(&pg, &1, &options)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease_ids(&client).await, [id]);
    client
        .execute("SELECT inbox_dead('jobs', $1, 1, 'x')", &[&id])
        .await
        .unwrap();
    assert!(queue.requeue(&pg, id).await.unwrap());
    assert_eq!(lease_ids(&client).await, [id]);
    pg.execute(&Statement::new("SELECT inbox_ack('jobs', $1::int8, 1)").bind(id))
        .await
        .unwrap();
    assert_eq!(queue.stats(&pg).await.unwrap(), Default::default());
}
