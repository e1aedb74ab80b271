//! Cancelling jobs over real connections: a waiting job becomes a dead one marked `cancelled`; a
//! running one is fenced (its writes roll back, it never runs again) and its handler is told by
//! the heartbeat; a job held by a lock is cancelled when that transaction ends.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;

async fn setup(db: &TestDb) -> (PgDatabase, Queue) {
    let pg = PgDatabase::from_pool_and_config(db.pool(8), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    pg.execute(&Statement::new("CREATE TABLE effects (n bigint)"))
        .await
        .unwrap();
    (pg, queue)
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn cancel(client: &tokio_postgres::Client, id: i64) -> bool {
    client
        .query_one("SELECT inbox_cancel('jobs', $1)", &[&id])
        .await
        .unwrap()
        .get(0)
}

/// A waiting job cancelled is dead with `last_error` 'cancelled': no lease takes it, the dead
/// jobs list it, a requeue runs it again. Cancelling it twice, or a job that is not there, says
/// false; bad input fails with a clear SQLSTATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_job_cancelled_is_kept_as_a_dead_job_marked_cancelled() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db).await;
    let client = db.client().await;
    let id = queue.enqueue(&pg, &1, None, None).await.unwrap().unwrap();
    let later = queue
        .enqueue(
            &pg,
            &2,
            Some(chrono::Utc::now() + chrono::Duration::hours(1)),
            None,
        )
        .await
        .unwrap()
        .unwrap();

    assert!(queue.cancel(&pg, id).await.unwrap());
    assert!(
        cancel(&client, later).await,
        "a delayed job was not cancelled"
    );
    assert!(!cancel(&client, id).await, "a job was cancelled twice");
    assert!(!cancel(&client, 999_999).await);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_lease('jobs', 10, '1 minute')"
        )
        .await,
        0
    );
    let dead = queue.dead_jobs(&pg, 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    assert!(dead
        .iter()
        .all(|job| job.last_error.as_deref() == Some("cancelled")));
    // Never delivered, so no attempt counted (docs/sql-api.md, inbox_cancel).
    assert!(dead.iter().all(|job| job.attempt == 0), "{dead:?}");
    assert!(queue.requeue(&pg, id).await.unwrap());
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_lease('jobs', 10, '1 minute')"
        )
        .await,
        1
    );

    client
        .batch_execute("CREATE TABLE plain (n int)")
        .await
        .unwrap();
    crate::support::assert_refused(
        &client,
        &[
            ("SELECT inbox_cancel(NULL, 1)", "22004"),
            ("SELECT inbox_cancel('jobs', NULL)", "22004"),
            ("SELECT inbox_cancel('nope', 1)", "42P01"),
            ("SELECT inbox_cancel('plain', 1)", "42703"),
        ],
    )
    .await;
}

/// A running delivery cancelled: the heartbeat finds its extension refused and tells the
/// handler (`Job::cancelled`), whose ack is then refused, so its write rolls back; the job stays
/// dead and never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_job_cancelled_is_told_its_writes_roll_back_and_it_never_runs_again() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db).await;
    let client = db.client().await;
    let id = queue
        .enqueue(&pg, &7_i64, None, None)
        .await
        .unwrap()
        .unwrap();
    let runs = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let runs = runs.clone();
        transactional(move |job: Job<i64>, tx: &dyn Database| {
            let runs = runs.clone();
            Box::pin(async move {
                tx.execute(&Statement::new("INSERT INTO effects VALUES ($1)").bind(job.payload))
                    .await?;
                runs.lock().unwrap().push("started");
                let told = tokio::time::timeout(Duration::from_secs(30), job.cancelled())
                    .await
                    .is_ok();
                runs.lock()
                    .unwrap()
                    .push(if told { "told" } else { "not told" });
                Ok(Outcome::ack())
            })
        })
    };
    // A short lease: the heartbeat runs every third of it.
    let worker = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(1)
        .lease(Duration::from_millis(900))
        .poll_interval(Duration::from_millis(50))
        .start();
    let started = Instant::now();
    while runs.lock().unwrap().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the job did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        cancel(&client, id).await,
        "the running job was not cancelled"
    );
    let cancelled = Instant::now();
    while runs.lock().unwrap().len() < 2 {
        assert!(
            cancelled.elapsed() < Duration::from_secs(20),
            "the handler was not told"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(*runs.lock().unwrap(), vec!["started", "told"]);
    // Long enough for a retry or a second delivery, were there one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    assert_eq!(runs.lock().unwrap().len(), 2, "the cancelled job ran again");
    assert_eq!(stats.acked, 0, "{stats:?}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM effects").await,
        0,
        "the cancelled delivery's write committed"
    );
    let dead = queue.dead_jobs(&pg, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].id, dead[0].last_error.as_deref()),
        (id, Some("cancelled"))
    );
}

/// A job held by an `inbox_lock` transaction is cancelled once that transaction ends: after a
/// rollback it is cancelled; after an ack in that transaction there is nothing to cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_locked_job_is_cancelled_when_its_transaction_ends() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db).await;
    for ack in [false, true] {
        let id = queue.enqueue(&pg, &1, None, None).await.unwrap().unwrap();
        let mut holder = db.client().await;
        let tx = holder.transaction().await.unwrap();
        let locked = tx
            .query_one("SELECT id, token FROM inbox_lock('jobs')", &[])
            .await
            .unwrap();
        assert_eq!(locked.get::<_, i64>(0), id);
        let token: i64 = locked.get(1);
        let other = db.client().await;
        let canceller = tokio::spawn(async move { cancel(&other, id).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !canceller.is_finished(),
            "the cancel did not wait for the lock"
        );
        if ack {
            assert!(tx
                .query_one("SELECT inbox_ack('jobs', $1, $2)", &[&id, &token])
                .await
                .unwrap()
                .get::<_, bool>(0));
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let cancelled = canceller.await.unwrap();
        assert_eq!(cancelled, !ack, "ack {ack}");
    }
}
