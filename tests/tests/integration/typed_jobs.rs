//! Typed jobs and native async handlers on the real database: a payload type that names its
//! queue (`JobType`), handlers written as `async fn`s or trait impls in both modes, and the
//! delivery's transaction reached through the driver (`Tx::client`), whose writes commit with the
//! ack and with nothing else: not with a retry, an error, a panic, a lost lease or a cancel.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_client::worker::{
    AsyncHandler, AsyncTxHandler, Claim, HandlerResult, Job, Outcome, Tx, Worker, WorkerStats,
};
use inbox_client::{Database, EnqueueOptions, JobType, PgDatabase, PgTransaction, Statement};
use inbox_tests::TestDb;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::support::{effects, fast_retries, queue_with_effects, PATIENCE};

/// The payload of the queue `jobs` that `queue_with_effects` makes.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Numbered {
    n: i64,
}

impl JobType for Numbered {
    const QUEUE: &'static str = "jobs";
}

/// A job of a second queue, enqueued by handlers and never worked here.
#[derive(Debug, Serialize, Deserialize)]
struct FollowUp {
    n: i64,
}

impl JobType for FollowUp {
    const QUEUE: &'static str = "follow_ups";
}

async fn setup(db: &TestDb, jobs: i64) -> PgDatabase {
    let (pg, _) = queue_with_effects(db, 8, "").await;
    for n in 0..jobs {
        Numbered { n }.enqueue(&pg).await.unwrap();
    }
    pg
}

/// Records the delivery's effect through the driver, with typed parameters, as a statement
/// prepared on the connection: once it is cached, the insert is sent at the handler's first
/// poll, with no round trip to prepare it first (so it must already follow the savepoint).
async fn record_through_driver(job: &Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
    let client = tx.client().await?;
    let insert = client
        .prepare_cached("INSERT INTO effects (job, attempt) VALUES ($1, $2)")
        .await?;
    client
        .execute(&insert, &[&job.payload.n, &job.attempt])
        .await?;
    Ok(Outcome::ack())
}

/// The effects expected when every job of `0..jobs` committed its first attempt once.
fn once_each(jobs: i64) -> Vec<(i64, i32)> {
    (0..jobs).map(|n| (n, 1)).collect()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < 2 * PATIENCE,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// Handler forms
// ------------------------------------------------------------------------------------------------

/// A transactional handler with state, written as a trait impl.
struct Recorder {
    runs: Arc<AtomicUsize>,
}

impl AsyncTxHandler<Numbered> for Recorder {
    async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
        self.runs.fetch_add(1, Ordering::Relaxed);
        record_through_driver(&job, tx).await
    }
}

/// A transactional handler written as a plain `async fn`, through the port.
async fn record_through_port(job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
    tx.execute(
        &Statement::new("INSERT INTO effects (job, attempt) VALUES ($1, $2)")
            .bind(job.payload.n)
            .bind(job.attempt),
    )
    .await?;
    Ok(Outcome::ack())
}

/// A plain handler with state, written as a trait impl: it writes through a pool of its own.
struct PlainRecorder {
    pg: PgDatabase,
}

impl AsyncHandler<Numbered> for PlainRecorder {
    async fn handle(&self, job: Job<Numbered>) -> HandlerResult {
        self.pg
            .execute(
                &Statement::new("INSERT INTO effects (job, attempt) VALUES ($1, $2)")
                    .bind(job.payload.n)
                    .bind(job.attempt),
            )
            .await?;
        Ok(Outcome::ack())
    }
}

static PLAIN_RUNS: AtomicUsize = AtomicUsize::new(0);

/// A plain handler written as a plain `async fn`.
async fn count_plain(_job: Job<Numbered>) -> HandlerResult {
    PLAIN_RUNS.fetch_add(1, Ordering::Relaxed);
    Ok(Outcome::ack())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_handler_form_finishes_its_jobs_through_its_type_s_queue() {
    const JOBS: i64 = 40;
    let acked = |stats: WorkerStats| {
        assert_eq!(
            stats,
            WorkerStats {
                acked: JOBS as u64,
                ..WorkerStats::default()
            }
        );
    };

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let recorder = Recorder { runs: runs.clone() };
    acked(
        Worker::transactional_for(pg.clone(), recorder)
            .group_size(8)
            .run_until_idle()
            .await
            .unwrap(),
    );
    assert_eq!(runs.load(Ordering::Relaxed), JOBS as usize);
    assert_eq!(effects(&db).await, once_each(JOBS), "trait impl");

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    acked(
        Worker::transactional_for(pg.clone(), record_through_port)
            .run_until_idle()
            .await
            .unwrap(),
    );
    assert_eq!(effects(&db).await, once_each(JOBS), "async fn");

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    let closure = async |job: Job<Numbered>, tx: &Tx<'_>| record_through_driver(&job, tx).await;
    acked(
        Worker::transactional_for(pg.clone(), closure)
            .claim(Claim::Lock)
            .run_until_idle()
            .await
            .unwrap(),
    );
    assert_eq!(effects(&db).await, once_each(JOBS), "async closure");

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    acked(
        Worker::plain_for(pg.clone(), PlainRecorder { pg: pg.clone() })
            .poll_interval(Duration::from_millis(50))
            .run_until_idle()
            .await
            .unwrap(),
    );
    assert_eq!(effects(&db).await, once_each(JOBS), "plain trait impl");

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    PLAIN_RUNS.store(0, Ordering::Relaxed);
    acked(
        Worker::plain_for(pg.clone(), count_plain)
            .poll_interval(Duration::from_millis(50))
            .run_until_idle()
            .await
            .unwrap(),
    );
    assert_eq!(PLAIN_RUNS.load(Ordering::Relaxed), JOBS as usize);
}

// ------------------------------------------------------------------------------------------------
// The driver's writes commit with the ack, and only with it
// ------------------------------------------------------------------------------------------------

/// On its first attempt, job `n` writes its effect through the driver (the delivery's first
/// statement), checks through the port that the write is there, then: acks (`n % 4 == 0`),
/// asks for a retry (1), fails (2) or panics (3). Later attempts write and ack.
struct FirstAttemptFails;

impl AsyncTxHandler<Numbered> for FirstAttemptFails {
    async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
        record_through_driver(&job, tx).await?;
        // The port and the driver share the transaction: the port sees the driver's write.
        let seen = tx
            .query(
                &Statement::new("SELECT count(*) AS n FROM effects WHERE job = $1")
                    .bind(job.payload.n),
            )
            .await?
            .one()?
            .get::<i64>("n")?;
        assert_eq!(
            seen, 1,
            "the port sees this delivery's write through the driver, and only it"
        );
        if job.attempt > 1 {
            return Ok(Outcome::ack());
        }
        match job.payload.n % 4 {
            0 => Ok(Outcome::ack()),
            1 => Ok(Outcome::retry()),
            2 => Err("the first attempt fails".into()),
            _ => panic!("the first attempt panics"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn driver_writes_commit_with_the_ack_and_roll_back_with_a_retry_an_error_or_a_panic() {
    const JOBS: i64 = 32;
    // Lone deliveries; groups that replay a failure (leased); groups that undo it to the
    // delivery's savepoint (locked, where a write outside the savepoint would commit).
    for (claim, group) in [(Claim::Lease, 1), (Claim::Lease, 8), (Claim::Lock, 8)] {
        let db = TestDb::new().await;
        let pg = setup(&db, JOBS).await;
        let stats = Worker::transactional_for(pg.clone(), FirstAttemptFails)
            .claim(claim)
            .group_size(group)
            .retry(fast_retries(5))
            .run_until_idle()
            .await
            .unwrap();
        let expected: Vec<(i64, i32)> = (0..JOBS)
            .map(|n| (n, if n % 4 == 0 { 1 } else { 2 }))
            .collect();
        assert_eq!(effects(&db).await, expected, "{claim:?} x{group}");
        assert_eq!(stats.acked, JOBS as u64, "{claim:?} x{group}: {stats:?}");
        assert_eq!(
            stats.failed,
            JOBS as u64 / 2,
            "{claim:?} x{group}: {stats:?}"
        );
    }
}

/// A worker whose lease expires while its handler runs loses the job to another worker, and
/// what the stale handler wrote through the driver does not commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_lease_commits_nothing_written_through_the_driver() {
    struct Slow {
        runs: Arc<Mutex<Vec<i32>>>,
        second_started: Arc<Semaphore>,
    }

    impl AsyncTxHandler<Numbered> for Slow {
        async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
            record_through_driver(&job, tx).await?;
            self.runs.lock().unwrap().push(job.attempt);
            if job.attempt == 1 {
                // Outlive the lease, until the other worker has taken the job.
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let taken = tokio::time::timeout(PATIENCE, self.second_started.acquire()).await;
                assert!(taken.is_ok(), "no other worker took the expired job");
            } else {
                self.second_started.add_permits(1);
            }
            Ok(Outcome::ack())
        }
    }

    let db = TestDb::new().await;
    let pg = setup(&db, 1).await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let second_started = Arc::new(Semaphore::new(0));
    let handler = || Slow {
        runs: runs.clone(),
        second_started: second_started.clone(),
    };
    let stale = Worker::transactional_for(pg.clone(), handler())
        .workers(1)
        .lease(Duration::from_millis(300))
        .heartbeat(false)
        .poll_interval(Duration::from_millis(50))
        .start();
    wait_for("the first delivery", || !runs.lock().unwrap().is_empty()).await;
    let other = Worker::transactional_for(pg.clone(), handler())
        .workers(1)
        .poll_interval(Duration::from_millis(50))
        .start();
    wait_for("the stale settlement and the other's ack", || {
        stale.stats().lost == 1 && other.stats().acked == 1
    })
    .await;
    let stale = stale.shutdown(Duration::from_secs(5)).await;
    let other = other.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*runs.lock().unwrap(), vec![1, 2]);
    assert_eq!((stale.lost, stale.acked), (1, 0), "{stale:?}");
    assert_eq!((other.lost, other.acked), (0, 1), "{other:?}");
    assert_eq!(effects(&db).await, vec![(0, 2)]);
}

/// A running delivery cancelled: its handler is told, its ack is refused, and what it wrote
/// through the driver does not commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_delivery_commits_nothing_written_through_the_driver() {
    struct WaitsForCancel {
        runs: Arc<Mutex<Vec<&'static str>>>,
    }

    impl AsyncTxHandler<Numbered> for WaitsForCancel {
        async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
            record_through_driver(&job, tx).await?;
            self.runs.lock().unwrap().push("started");
            let told = tokio::time::timeout(PATIENCE, job.cancelled())
                .await
                .is_ok();
            self.runs
                .lock()
                .unwrap()
                .push(if told { "told" } else { "not told" });
            Ok(Outcome::ack())
        }
    }

    let db = TestDb::new().await;
    let pg = setup(&db, 0).await;
    let id = Numbered { n: 7 }.enqueue(&pg).await.unwrap().unwrap();
    let runs = Arc::new(Mutex::new(Vec::new()));
    let worker = Worker::transactional_for(pg.clone(), WaitsForCancel { runs: runs.clone() })
        .workers(1)
        .lease(Duration::from_millis(900))
        .poll_interval(Duration::from_millis(50))
        .start();
    wait_for("the delivery", || !runs.lock().unwrap().is_empty()).await;
    assert!(Numbered::queue().cancel(&pg, id).await.unwrap());
    wait_for("the handler to be told", || runs.lock().unwrap().len() == 2).await;
    // Long enough for a retry or a second delivery, were there one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    assert_eq!(*runs.lock().unwrap(), vec!["started", "told"]);
    assert_eq!(stats.acked, 0, "{stats:?}");
    assert_eq!(
        effects(&db).await,
        vec![],
        "the cancelled delivery's write committed"
    );
    let dead = Numbered::queue().dead_jobs(&pg, 10).await.unwrap();
    assert_eq!(
        dead.iter()
            .map(|job| (job.id, job.last_error.as_deref()))
            .collect::<Vec<_>>(),
        vec![(id, Some("cancelled"))]
    );
}

// ------------------------------------------------------------------------------------------------
// Typed enqueue
// ------------------------------------------------------------------------------------------------

/// A typed enqueue joins the transaction it is given: the caller's rollback leaves no job, its
/// commit one, and a handler's retry none of what it enqueued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_typed_enqueue_joins_the_caller_s_transaction() {
    let db = TestDb::new().await;
    let pg = setup(&db, 0).await;
    pg.execute(&FollowUp::queue().create_statement())
        .await
        .unwrap();
    let ready = |pg: PgDatabase| async move { Numbered::queue().stats(&pg).await.unwrap().ready };

    let mut client = pg.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    let id = Numbered { n: 1 }.enqueue(&port).await.unwrap();
    assert!(id.is_some());
    assert_eq!(ready(pg.clone()).await, 0, "visible before the commit");
    tx.rollback().await.unwrap();
    assert_eq!(
        ready(pg.clone()).await,
        0,
        "a rolled-back enqueue left a job"
    );

    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    let keyed = EnqueueOptions::default().key("one");
    assert!(Numbered { n: 2 }
        .enqueue_with(&port, &keyed)
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        Numbered { n: 3 }.enqueue_with(&port, &keyed).await.unwrap(),
        None,
        "a second job with the key was enqueued"
    );
    tx.commit().await.unwrap();
    assert_eq!(ready(pg.clone()).await, 1);
    drop(client);

    // From a handler: the follow-up of a retried attempt is rolled back with it.
    async fn follow_up(job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
        FollowUp {
            n: job.payload.n * 10 + i64::from(job.attempt),
        }
        .enqueue(tx)
        .await?;
        Ok(if job.attempt == 1 {
            Outcome::retry_after(Duration::from_millis(1))
        } else {
            Outcome::ack()
        })
    }
    let stats = Worker::transactional_for(pg.clone(), follow_up)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!((stats.acked, stats.retried), (1, 1), "{stats:?}");
    let follow_ups = pg
        .query(&Statement::new(
            "SELECT (payload->>'n')::bigint AS n FROM follow_ups",
        ))
        .await
        .unwrap();
    let payloads: Vec<i64> = follow_ups
        .iter()
        .map(|row| row.get::<i64>("n").unwrap())
        .collect();
    assert_eq!(
        payloads,
        vec![22],
        "only the acked attempt's follow-up commits"
    );
}
