//! Pausing and resuming a queue over real connections: a pause holds from its commit (leases and
//! locks hand out nothing, running deliveries settle), idle workers sleep on a paused queue
//! rather than poll, and a resume wakes them.

use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;

async fn setup(db: &TestDb, jobs: i64) -> (PgDatabase, Queue) {
    let pg = PgDatabase::from_pool_and_config(db.pool(12), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    pg.execute(&Statement::new(
        "CREATE TABLE done (n bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    ))
    .await
    .unwrap();
    let payloads: Vec<i64> = (0..jobs).collect();
    queue.enqueue_batch(&pg, &payloads).await.unwrap();
    (pg, queue)
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn lease_ids(client: &tokio_postgres::Client, call: &str) -> Vec<i64> {
    client
        .query(&format!("SELECT id FROM {call}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A pause takes hold when it commits: before that other sessions lease as usual; after it,
/// leases and locks return nothing while a delivery leased before it still settles; a resume
/// lets them take jobs again. Pausing or resuming twice changes nothing and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_holds_from_its_commit_until_the_resume() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, 5).await;
    let (mut admin, other) = (db.client().await, db.client().await);
    // A session that looked at the queue before the pause (so that it knows the queue as
    // running), and whose transaction began before the pause committed.
    let mut earlier = db.client().await;
    assert_eq!(lease_ids(&earlier, "inbox_lock('jobs', 1)").await.len(), 1);
    let earlier = earlier.transaction().await.unwrap();
    earlier.execute("SELECT 1", &[]).await.unwrap();

    let running = other
        .query_one(
            "SELECT id, token FROM inbox_lease('jobs', 1, '1 minute')",
            &[],
        )
        .await
        .unwrap();
    let (running_id, running_token): (i64, i64) = (running.get(0), running.get(1));

    let tx = admin.transaction().await.unwrap();
    assert!(tx
        .query_one("SELECT inbox_pause('jobs')", &[])
        .await
        .unwrap()
        .get::<_, bool>(0));
    assert_eq!(
        lease_ids(&other, "inbox_lease('jobs', 1, '1 minute')")
            .await
            .len(),
        1,
        "an uncommitted pause held"
    );
    tx.commit().await.unwrap();
    let in_earlier = earlier
        .query("SELECT id FROM inbox_lease('jobs', 10, '1 minute')", &[])
        .await
        .unwrap();
    assert!(
        in_earlier.is_empty(),
        "a transaction begun before the pause leased after it"
    );
    earlier.rollback().await.unwrap();

    assert!(
        !queue.pause(&pg).await.unwrap(),
        "a second pause changed something"
    );
    assert!(queue.paused_since(&pg).await.unwrap().is_some());
    assert!(lease_ids(&other, "inbox_lease('jobs', 10, '1 minute')")
        .await
        .is_empty());
    assert!(lease_ids(&other, "inbox_lock('jobs', 10)").await.is_empty());
    assert!(
        other
            .query_one(
                "SELECT inbox_ack('jobs', $1, $2)",
                &[&running_id, &running_token]
            )
            .await
            .unwrap()
            .get::<_, bool>(0),
        "a delivery leased before the pause could not settle"
    );
    assert_eq!(
        count(&admin, "SELECT ready FROM inbox_stats('jobs')").await,
        3,
        "a paused queue's waiting jobs are counted ready"
    );

    // A resume rolled back leaves the queue paused.
    let tx = admin.transaction().await.unwrap();
    tx.execute("SELECT inbox_resume('jobs')", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(lease_ids(&other, "inbox_lease('jobs', 10, '1 minute')")
        .await
        .is_empty());

    assert!(queue.resume(&pg).await.unwrap());
    assert!(
        !queue.resume(&pg).await.unwrap(),
        "a second resume changed something"
    );
    assert_eq!(queue.paused_since(&pg).await.unwrap(), None);
    assert_eq!(
        lease_ids(&other, "inbox_lease('jobs', 10, '1 minute')")
            .await
            .len(),
        3
    );
}

/// Workers busy on a queue stop taking jobs once a pause commits: what they had taken settles,
/// nothing starts after that, and they fall asleep on the queue (registered sleepers, not a
/// poll loop) with jobs still due. A resume wakes them and they finish the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_stop_at_a_pause_sleep_through_it_and_wake_at_the_resume() {
    const JOBS: i64 = 3_000;
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, JOBS).await;
    let admin = db.client().await;
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(&Statement::new("INSERT INTO done (n) VALUES ($1)").bind(job.payload))
                .await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(Outcome::ack())
        })
    });
    // Polling would find nothing while paused; a long poll interval shows the wake-up is a NOTIFY.
    let worker = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(8)
        .poll_interval(Duration::from_secs(30))
        .start();
    let started = Instant::now();
    while count(&admin, "SELECT count(*) FROM done").await < JOBS / 10 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the workers did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    assert!(queue.pause(&pg).await.unwrap());
    let paused_at: chrono::DateTime<chrono::Utc> = admin
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    // What was taken before the pause settles; then nothing more commits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let settled = count(&admin, "SELECT count(*) FROM done").await;
    let late: i64 = admin
        .query_one(
            "SELECT count(*) FROM done WHERE at > $1::timestamptz + interval '1 second'",
            &[&paused_at],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(late, 0, "deliveries ran more than a second after the pause");
    assert!(settled < JOBS, "the queue finished before the pause");
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&admin, "SELECT count(*) FROM inbox_sleepers('jobs')").await == 0 {
        assert!(
            Instant::now() < deadline,
            "no worker slept on the paused queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&admin, "SELECT count(*) FROM done").await,
        settled,
        "jobs ran while the queue was paused"
    );

    assert!(queue.resume(&pg).await.unwrap());
    // Woken, they take the next job at once (polling, they would wait out the 30 s interval);
    // the rest of the queue then takes as long as the machine needs (a loaded one running Citus
    // through a coordinator, slower than the resume's wake-up).
    let resumed = Instant::now();
    while count(&admin, "SELECT count(*) FROM done").await == settled {
        assert!(
            resumed.elapsed() < Duration::from_secs(10),
            "the workers did not wake at the resume"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while count(&admin, "SELECT count(*) FROM done").await < JOBS {
        assert!(
            resumed.elapsed() < Duration::from_secs(120),
            "the workers woke but did not finish the queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.acked, JOBS as u64);
}

/// Bad input fails with a clear SQLSTATE and changes nothing; a dropped queue takes its pause
/// with it (at once in the pgrx build, at the next pause or resume in the SQL-only build without
/// its event trigger).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_fails_clearly_and_a_dropped_queue_takes_its_pause() {
    let db = TestDb::new().await;
    setup(&db, 1).await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE plain (n int)")
        .await
        .unwrap();
    crate::support::assert_refused(
        &client,
        &[
            ("SELECT inbox_pause(NULL)", "22004"),
            ("SELECT inbox_resume(NULL)", "22004"),
            ("SELECT inbox_pause('nope')", "42P01"),
            ("SELECT inbox_pause('plain')", "42703"),
            ("SELECT inbox_resume('plain')", "42703"),
        ],
    )
    .await;
    // The table is the database's: other tests' queues have rows in it too.
    let jobs: u32 = client
        .query_one("SELECT 'jobs'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let rows = format!("SELECT count(*) FROM inbox_queue_controls WHERE queue::oid = {jobs}");
    assert_eq!(count(&client, &rows).await, 0, "bad input left a row");
    client
        .batch_execute("SELECT inbox_pause('jobs')")
        .await
        .unwrap();
    assert_eq!(count(&client, &rows).await, 1);
    // The pgrx build deletes the row in the DROP (an event trigger); the SQL-only build installed
    // without a superuser has none, and the next pause or resume deletes it.
    client
        .batch_execute(
            "DROP TABLE jobs; SELECT inbox_create_queue('kept'); SELECT inbox_resume('kept')",
        )
        .await
        .unwrap();
    assert_eq!(
        count(&client, &rows).await,
        0,
        "the dropped queue's pause stayed"
    );
}
