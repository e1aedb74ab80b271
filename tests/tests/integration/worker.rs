//! The worker on the real database: exactly-once effects of transactional handlers under
//! failures, lease expiry and heartbeats, shutdown, grouped commits, plain mode, undecodable
//! payloads and NOTIFY wake-ups.
//!
//! Most tests write an effect row per delivery into a table with no unique constraint, then count
//! the rows per job: a count of exactly one for every finished job is what "exactly once" means.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use inbox_client::worker::{
    transactional, Claim, HandlerError, HandlerResult, Job, Outcome, Worker, WorkerStats,
    LOCK_GROUP_MAX,
};
use inbox_client::{Database, ErrorKind, PgDatabase, Queue, QueueStats, Statement};
use inbox_tests::{PgBouncer, TestDb};

use crate::support::fast_retries;
use serde::{Deserialize, Serialize};
use tokio::sync::{RwLock, Semaphore};

// ------------------------------------------------------------------------------------------------
// Shared helpers
// ------------------------------------------------------------------------------------------------

/// Tests that put a heavy load on the two cores take this lock exclusively; tests with a timing
/// margin (lease, heartbeat, NOTIFY latency, shutdown deadline) share it, so they never run next
/// to a load test of this file.
static LOAD: RwLock<()> = RwLock::const_new(());

/// Silences the panics the chaos handlers raise on purpose (thousands of them); any other panic
/// is reported as usual.
fn quiet_chaos_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            if !message.starts_with("chaos:") {
                default(info);
            }
        }));
    });
}

/// A port with NOTIFY wake-ups over a pool of `size` connections to the test's schema.
fn port(db: &TestDb, size: usize) -> PgDatabase {
    PgDatabase::from_pool_and_config(db.pool(size), db.config())
}

/// How a test's worker reaches the database.
#[derive(Clone, Copy, Debug)]
enum Route {
    /// Directly, statements prepared, LISTEN on the same settings.
    Direct,
    /// Through a pgbouncer in transaction mode with as many server connections as the pool has
    /// client connections: unnamed statements, LISTEN on a direct connection.
    PgBouncer,
}

/// The port of `route` over `pool` connections, and the pgbouncer it goes through (to keep
/// until the test ends).
fn port_via(db: &TestDb, route: Route, pool: usize) -> (PgDatabase, Option<PgBouncer>) {
    match route {
        Route::Direct => (port(db, pool), None),
        Route::PgBouncer => {
            let bouncer = PgBouncer::start(db, pool);
            (bouncer.port_listening_directly(db, pool), Some(bouncer))
        }
    }
}

/// Creates the queue `jobs` with `count` jobs whose payloads are `0..count` (ids in the same
/// order), and the table `effects` the handlers write, with no unique constraint.
async fn setup_jobs(db: &TestDb, pool: usize, count: i64) -> PgDatabase {
    setup_jobs_on(port(db, pool), count).await
}

/// As [`setup_jobs`], through the port `pg`.
async fn setup_jobs_on(pg: PgDatabase, count: i64) -> PgDatabase {
    pg.execute(&Queue::new("jobs").create_statement())
        .await
        .unwrap();
    pg.execute(&Statement::new(
        "CREATE TABLE effects (n bigint NOT NULL, attempt int NOT NULL, \
         xid bigint NOT NULL DEFAULT txid_current())",
    ))
    .await
    .unwrap();
    if count > 0 {
        enqueue_range(&pg, 0, count).await;
    }
    pg
}

/// Enqueues the payloads `from..to` in one statement, in order.
async fn enqueue_range(pg: &PgDatabase, from: i64, to: i64) {
    pg.execute(
        &Statement::new(
            "SELECT count(*) FROM inbox_enqueue_batch('jobs', \
             ARRAY(SELECT to_jsonb(g) FROM generate_series($1::bigint, $2::bigint - 1) g))",
        )
        .bind(from)
        .bind(to),
    )
    .await
    .unwrap();
}

/// The effect rows written by a delivery, through its transaction (`xid` is the transaction's).
fn effect(job: &Job<i64>) -> Statement {
    Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
        .bind(job.payload)
        .bind(job.attempt)
}

/// One committed effect row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Effect {
    attempt: i32,
    xid: i64,
}

/// The committed effect rows, by job payload.
async fn effects(db: &TestDb) -> BTreeMap<i64, Vec<Effect>> {
    let client = db.client().await;
    let mut by_job: BTreeMap<i64, Vec<Effect>> = BTreeMap::new();
    for row in client
        .query(
            "SELECT n, attempt, xid FROM effects ORDER BY n, attempt",
            &[],
        )
        .await
        .unwrap()
    {
        by_job.entry(row.get(0)).or_default().push(Effect {
            attempt: row.get(1),
            xid: row.get(2),
        });
    }
    by_job
}

/// A job still in the queue table.
#[derive(Clone, Debug)]
struct Left {
    id: i64,
    n: i64,
    attempt: i32,
    dead: bool,
    due: bool,
    leased: bool,
    last_error: Option<String>,
}

/// The jobs still in `queue` (payload read as a bigint when it is one), by id.
async fn jobs_left(db: &TestDb, queue: &str) -> Vec<Left> {
    let client = db.client().await;
    let sql = format!(
        "SELECT id, CASE WHEN jsonb_typeof(payload) = 'number' THEN (payload #>> '{{}}')::bigint \
                         ELSE -1 END, \
                attempt, locked_until = 'infinity', locked_until <= clock_timestamp(), \
                leased_at IS NOT NULL, last_error \
           FROM {queue} ORDER BY id"
    );
    client
        .query(&sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| Left {
            id: row.get(0),
            n: row.get(1),
            attempt: row.get(2),
            dead: row.get(3),
            due: row.get(4),
            leased: row.get(5),
            last_error: row.get(6),
        })
        .collect()
}

async fn queue_stats(pg: &PgDatabase, queue: &str) -> QueueStats {
    Queue::new(queue).stats(pg).await.unwrap()
}

/// Runs `worker` until its queue is idle, failing the test if that takes longer than `limit`.
async fn drain<T: serde::de::DeserializeOwned + Send + 'static>(
    worker: Worker<T>,
    limit: Duration,
) -> WorkerStats {
    tokio::time::timeout(limit, worker.run_until_idle())
        .await
        .unwrap_or_else(|_| panic!("the worker did not empty its queue within {limit:?}"))
        .expect("the worker could not read its queue")
}

/// Polls `done` every 10 ms until it holds, failing the test after `limit`.
async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// 1. The refunds service of the guide, on PostgreSQL
// ------------------------------------------------------------------------------------------------

/// A refund request, the payload of `refund_jobs`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Refund {
    order: i64,
    amount_cents: i32,
}

/// A receipt request, the payload of the mailer's `receipt_jobs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    order: i64,
}

/// An in-memory card processor, idempotent by order, that can time out on an order's first call.
#[derive(Default)]
struct CardProcessor {
    time_out_first_call: Mutex<HashSet<i64>>,
    calls: Mutex<Vec<(i64, i32)>>,
    refunded: Mutex<HashMap<i64, i32>>,
}

impl CardProcessor {
    /// Refunds the card (once per order, however often it is called); `false` on a time-out.
    fn refund(&self, refund: &Refund, attempt: i32) -> bool {
        self.calls.lock().unwrap().push((refund.order, attempt));
        if self
            .time_out_first_call
            .lock()
            .unwrap()
            .remove(&refund.order)
        {
            return false;
        }
        self.refunded
            .lock()
            .unwrap()
            .entry(refund.order)
            .or_insert(refund.amount_cents);
        true
    }

    fn calls(&self) -> Vec<(i64, i32)> {
        self.calls.lock().unwrap().clone()
    }
}

/// The refund handler: records the refund and its receipt through the delivery's transaction,
/// then calls the processor.
async fn issue_refund(
    processor: Arc<CardProcessor>,
    job: Job<Refund>,
    tx: &dyn Database,
) -> HandlerResult {
    let refund = job.payload;
    let record = Statement::new("INSERT INTO refunds (order_id, amount_cents) VALUES ($1, $2)")
        .bind(refund.order)
        .bind(refund.amount_cents);
    if let Err(error) = tx.execute(&record).await {
        // The transaction is unusable now: return without another statement; the worker rolls
        // the delivery's savepoint back before it settles the job.
        if error.kind() == ErrorKind::UniqueViolation {
            return Ok(Outcome::drop(format!(
                "duplicate refund of order {}: {error}",
                refund.order
            )));
        }
        return Err(error.into());
    }
    Queue::new("receipt_jobs")
        .enqueue(
            tx,
            &Receipt {
                order: refund.order,
            },
            None,
            None,
        )
        .await?;
    // The processor takes the order as its idempotency key: a repeated call refunds once.
    if !processor.refund(&refund, job.attempt) {
        // The retry rolls the record and the receipt back first.
        return Ok(Outcome::retry());
    }
    Ok(Outcome::ack())
}

/// The refunds service's tables and queues, and its worker.
async fn refunds_service(db: &TestDb) -> (PgDatabase, Arc<CardProcessor>) {
    let pg = port(db, 8);
    pg.execute(&Statement::new(
        "CREATE TABLE refunds (order_id bigint PRIMARY KEY, amount_cents int)",
    ))
    .await
    .unwrap();
    pg.execute(&Queue::new("refund_jobs").create_statement())
        .await
        .unwrap();
    pg.execute(&Queue::new("receipt_jobs").create_statement())
        .await
        .unwrap();
    (pg, Arc::new(CardProcessor::default()))
}

fn refunds_worker(pg: &PgDatabase, processor: &Arc<CardProcessor>) -> Worker<Refund> {
    let processor = processor.clone();
    let handler = transactional(move |job: Job<Refund>, tx: &dyn Database| {
        Box::pin(issue_refund(processor.clone(), job, tx))
    });
    Worker::transactional(pg.clone(), "refund_jobs", handler)
        .workers(1)
        .retry(fast_retries(5))
}

async fn publish(pg: &PgDatabase, refund: Refund) -> i64 {
    Queue::new("refund_jobs")
        .enqueue(pg, &refund, None, None)
        .await
        .unwrap()
        .unwrap()
}

/// The refunds recorded (order, amount) and the receipts queued.
async fn refunds_and_receipts(db: &TestDb) -> (Vec<(i64, i32)>, Vec<Receipt>) {
    let client = db.client().await;
    let refunds = client
        .query(
            "SELECT order_id, amount_cents FROM refunds ORDER BY order_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let receipts = client
        .query("SELECT payload FROM receipt_jobs ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| serde_json::from_value(row.get::<_, serde_json::Value>(0)).unwrap())
        .collect();
    (refunds, receipts)
}

const REFUND: Refund = Refund {
    order: 42,
    amount_cents: 1999,
};

/// A refund commits one record and one receipt, and finishes its job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refund_commits_one_record_and_one_receipt() {
    let db = TestDb::new().await;
    let (pg, processor) = refunds_service(&db).await;
    publish(&pg, REFUND).await;

    let stats = drain(refunds_worker(&pg, &processor), Duration::from_secs(30)).await;

    assert_eq!(
        refunds_and_receipts(&db).await,
        (vec![(42, 1999)], vec![Receipt { order: 42 }])
    );
    assert_eq!(processor.calls(), vec![(42, 1)]);
    assert!(jobs_left(&db, "refund_jobs").await.is_empty());
    assert_eq!(
        stats,
        WorkerStats {
            acked: 1,
            ..WorkerStats::default()
        }
    );
}

/// A refund whose first processor call times out is retried, and leaves one record and one
/// receipt, not two, after two processor calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refund_retried_after_a_timeout_leaves_one_record_and_one_receipt() {
    let db = TestDb::new().await;
    let (pg, processor) = refunds_service(&db).await;
    processor.time_out_first_call.lock().unwrap().insert(42);
    publish(&pg, REFUND).await;

    let stats = drain(refunds_worker(&pg, &processor), Duration::from_secs(30)).await;

    assert_eq!(
        refunds_and_receipts(&db).await,
        (vec![(42, 1999)], vec![Receipt { order: 42 }])
    );
    assert_eq!(processor.calls(), vec![(42, 1), (42, 2)]);
    assert_eq!(
        *processor.refunded.lock().unwrap(),
        HashMap::from([(42, 1999)])
    );
    assert!(jobs_left(&db, "refund_jobs").await.is_empty());
    assert_eq!(
        stats,
        WorkerStats {
            acked: 1,
            retried: 1,
            ..WorkerStats::default()
        }
    );
}

/// The same refund published twice is dropped the second time: one record, one receipt, and
/// the second job dead-lettered with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refund_published_twice_is_dropped_the_second_time() {
    let db = TestDb::new().await;
    let (pg, processor) = refunds_service(&db).await;
    let first = publish(&pg, REFUND).await;
    let second = publish(&pg, REFUND).await;

    let stats = drain(refunds_worker(&pg, &processor), Duration::from_secs(30)).await;

    assert_eq!(
        refunds_and_receipts(&db).await,
        (vec![(42, 1999)], vec![Receipt { order: 42 }])
    );
    assert_eq!(
        processor.calls(),
        vec![(42, 1)],
        "the duplicate never reached the processor"
    );
    let left = jobs_left(&db, "refund_jobs").await;
    assert_eq!(left.len(), 1, "{left:?}");
    let dropped = &left[0];
    assert_ne!(dropped.id, first);
    assert_eq!(dropped.id, second);
    assert!(dropped.dead && dropped.attempt == 1, "{dropped:?}");
    let reason = dropped.last_error.as_deref().unwrap_or_default();
    assert!(
        reason.starts_with("duplicate refund of order 42:") && reason.contains("23505"),
        "{reason}"
    );
    assert_eq!(
        stats,
        WorkerStats {
            acked: 1,
            dead: 1,
            ..WorkerStats::default()
        }
    );
}

// ------------------------------------------------------------------------------------------------
// 2. Chaos: many workers, random failures
// ------------------------------------------------------------------------------------------------

/// What a chaos handler does with one delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Ack,
    Retry,
    Error,
    Panic,
}

const CHAOS_MAX_ATTEMPTS: i32 = 5;

/// The fate of delivery `attempt` of job `n`: a hash of both (splitmix64), so every run is the
/// same. 15% each of retry, error and panic; 55% ack.
fn fate(n: i64, attempt: i32) -> Fate {
    let mut x = (n as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((attempt as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    match x % 100 {
        0..=14 => Fate::Retry,
        15..=29 => Fate::Error,
        30..=44 => Fate::Panic,
        _ => Fate::Ack,
    }
}

const CHAOS_ERROR: &str = "chaos: an error";
const CHAOS_PANIC: &str = "chaos: a panic";

/// What `count` chaos jobs must end as: the attempt that acked each finished job, the last error
/// recorded on each dead one, and the worker's counts.
struct Prediction {
    acked_at: HashMap<i64, i32>,
    dead: HashMap<i64, Option<String>>,
    stats: WorkerStats,
}

fn predict(count: i64) -> Prediction {
    let mut prediction = Prediction {
        acked_at: HashMap::new(),
        dead: HashMap::new(),
        stats: WorkerStats::default(),
    };
    for n in 0..count {
        let mut last_error = None;
        for attempt in 1..=CHAOS_MAX_ATTEMPTS {
            let fate = fate(n, attempt);
            match fate {
                Fate::Ack => {
                    prediction.acked_at.insert(n, attempt);
                    prediction.stats.acked += 1;
                    break;
                }
                Fate::Retry => {}
                Fate::Error => last_error = Some(CHAOS_ERROR.to_owned()),
                Fate::Panic => last_error = Some(format!("panic: {CHAOS_PANIC}")),
            }
            if fate != Fate::Retry {
                prediction.stats.failed += 1;
            }
            if attempt < CHAOS_MAX_ATTEMPTS {
                prediction.stats.retried += 1;
            } else {
                prediction.stats.dead += 1;
                prediction.dead.insert(n, last_error.clone());
            }
        }
    }
    prediction
}

async fn chaos_handle(job: Job<i64>, tx: &dyn Database) -> HandlerResult {
    tx.execute(&effect(&job)).await?;
    match fate(job.payload, job.attempt) {
        Fate::Ack => Ok(Outcome::ack()),
        Fate::Retry => Ok(Outcome::retry()),
        Fate::Error => Err(HandlerError::from(CHAOS_ERROR)),
        Fate::Panic => panic!("{}", CHAOS_PANIC),
    }
}

/// Runs `count` chaos jobs through 8 transactional workers (groups of `group_size`, or adaptive
/// groups by default) and checks every job's end against the prediction.
async fn chaos(count: i64, claim: Claim, group_size: Option<usize>) {
    chaos_via(Route::Direct, count, claim, group_size).await;
}

/// As [`chaos`], the worker reaching the database by `route`.
async fn chaos_via(route: Route, count: i64, claim: Claim, group_size: Option<usize>) {
    quiet_chaos_panics();
    let _load = LOAD.write().await;
    let db = TestDb::new().await;
    let (pg, _bouncer) = port_via(&db, route, 12);
    let pg = setup_jobs_on(pg, count).await;
    let prediction = predict(count);
    // The mix really has every outcome.
    assert!(prediction.stats.dead > 0 && prediction.stats.failed > 0);

    let handler = transactional(|job: Job<i64>, tx: &dyn Database| Box::pin(chaos_handle(job, tx)));
    let started = Instant::now();
    let worker = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(8)
        .claim(claim);
    let worker = match group_size {
        Some(n) => worker.group_size(n),
        None => worker,
    };
    let stats = drain(
        worker
            .retry(fast_retries(CHAOS_MAX_ATTEMPTS))
            // The heartbeat runs (the default), racing the retries.
            .poll_interval(Duration::from_millis(20)),
        Duration::from_secs(120),
    )
    .await;
    eprintln!(
        "chaos {route:?} {claim:?} x{group_size:?}: {count} jobs in {:?}: {stats:?}",
        started.elapsed()
    );

    // Every job is acked (gone) or dead-lettered, as predicted.
    let left = jobs_left(&db, "jobs").await;
    let dead: HashMap<i64, Option<String>> = left
        .iter()
        .map(|job| {
            assert!(job.dead && job.attempt == CHAOS_MAX_ATTEMPTS, "{job:?}");
            (job.n, job.last_error.clone())
        })
        .collect();
    assert_eq!(dead.len(), left.len(), "one row per job");
    assert_eq!(dead, prediction.dead);

    // Each acked job's effect exists exactly once, written by the delivery that acked it; a dead
    // job's writes were all rolled back.
    let effects = effects(&db).await;
    for n in 0..count {
        let attempts: Vec<i32> = effects
            .get(&n)
            .map(|rows| rows.iter().map(|e| e.attempt).collect())
            .unwrap_or_default();
        match prediction.acked_at.get(&n) {
            Some(&attempt) => assert_eq!(attempts, vec![attempt], "effects of acked job {n}"),
            None => assert!(attempts.is_empty(), "dead job {n} has effects {attempts:?}"),
        }
    }
    assert_eq!(
        effects.values().map(Vec::len).sum::<usize>(),
        prediction.acked_at.len()
    );
    assert_eq!(stats, prediction.stats);
}

/// 8 workers committing groups of 10 deliveries (a failed one replayed without, no savepoint) on
/// 20,000 jobs that randomly ack, retry, fail or panic: every job ends acked with exactly one
/// effect row or dead-lettered with none, exactly as predicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_groups_of_ten_every_job_acked_once_or_dead() {
    chaos(20_000, Claim::Lease, Some(10)).await;
}

/// The same chaos with the default groups, which adapt (up to 64 jobs): nearly every group has
/// failures in it, replayed without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_adaptive_groups_every_job_acked_once_or_dead() {
    chaos(20_000, Claim::Lease, None).await;
}

/// The same with row locks and adaptive groups: a failed delivery is undone to its savepoint,
/// its group's jobs still locked, and settled in the group's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_lock_adaptive_groups_every_job_acked_once_or_dead() {
    chaos(10_000, Claim::Lock, None).await;
}

/// The same chaos on 5,000 jobs, each delivery in a transaction of its own after a committed
/// lease (two commits per delivery: 20,000 jobs take 35-50 s on two shared cores).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_lease_every_job_acked_once_or_dead() {
    chaos(5_000, Claim::Lease, Some(1)).await;
}

/// The same chaos on 5,000 jobs, each taken under a row lock by its delivery's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_lock_every_job_acked_once_or_dead() {
    chaos(5_000, Claim::Lock, Some(1)).await;
}

/// The adaptive chaos through pgbouncer in transaction mode (each transaction may run on another
/// server connection): the same ends, each acked job's effect exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_through_pgbouncer_every_job_acked_once_or_dead() {
    chaos_via(Route::PgBouncer, 5_000, Claim::Lease, None).await;
}

/// The same with row locks, through pgbouncer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_lock_through_pgbouncer_every_job_acked_once_or_dead() {
    chaos_via(Route::PgBouncer, 3_000, Claim::Lock, None).await;
}

// ------------------------------------------------------------------------------------------------
// 3 & 4. Leases: expiry and heartbeat
// ------------------------------------------------------------------------------------------------

/// A worker whose lease expires while its handler runs loses the job to another worker (attempt
/// 2), and the stale handler's writes do not commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_expired_mid_handler_commits_nothing_and_counts_lost() {
    let _load = LOAD.read().await;
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 8, 1).await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let second_started = Arc::new(Semaphore::new(0));
    let handler = {
        let (runs, second_started) = (runs.clone(), second_started.clone());
        transactional(move |job: Job<i64>, tx: &dyn Database| {
            let (runs, second_started) = (runs.clone(), second_started.clone());
            Box::pin(async move {
                tx.execute(&effect(&job)).await?;
                runs.lock().unwrap().push(job.attempt);
                if job.attempt == 1 {
                    // Outlive the 300 ms lease, and (so the outcome does not depend on timing)
                    // until the other worker has taken the job.
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    let taken =
                        tokio::time::timeout(Duration::from_secs(20), second_started.acquire())
                            .await;
                    assert!(taken.is_ok(), "no other worker took the expired job");
                } else {
                    second_started.add_permits(1);
                }
                Ok(Outcome::ack())
            })
        })
    };
    let stale = Worker::transactional(pg.clone(), "jobs", handler.clone())
        .workers(1)
        .lease(Duration::from_millis(300))
        .heartbeat(false)
        .poll_interval(Duration::from_millis(50))
        .start();
    wait_for("the first delivery", Duration::from_secs(10), || {
        !runs.lock().unwrap().is_empty()
    })
    .await;
    let other = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(1)
        .poll_interval(Duration::from_millis(50))
        .start();
    wait_for(
        "the stale delivery's settlement and the other's ack",
        Duration::from_secs(20),
        || stale.stats().lost == 1 && other.stats().acked == 1,
    )
    .await;
    let stale = stale.shutdown(Duration::from_secs(5)).await;
    let other = other.shutdown(Duration::from_secs(5)).await;

    assert_eq!(*runs.lock().unwrap(), vec![1, 2]);
    assert_eq!(
        stale,
        WorkerStats {
            lost: 1,
            ..WorkerStats::default()
        }
    );
    assert_eq!(
        other,
        WorkerStats {
            acked: 1,
            ..WorkerStats::default()
        }
    );
    let effects = effects(&db).await;
    let attempts: Vec<i32> = effects[&0].iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, vec![2], "only attempt 2's write committed");
    assert!(jobs_left(&db, "jobs").await.is_empty());
}

/// With the heartbeat on, a handler running 3.5 times its lease keeps the job: it acks on
/// attempt 1 and no other slot ever runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeat_keeps_a_long_handler_s_lease() {
    let _load = LOAD.read().await;
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 8, 1).await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let runs = runs.clone();
        transactional(move |job: Job<i64>, tx: &dyn Database| {
            let runs = runs.clone();
            Box::pin(async move {
                runs.lock().unwrap().push(job.attempt);
                tx.execute(&effect(&job)).await?;
                tokio::time::sleep(Duration::from_millis(3500)).await;
                Ok(Outcome::ack())
            })
        })
    };
    let stats = drain(
        Worker::transactional(pg.clone(), "jobs", handler)
            .workers(3)
            .lease(Duration::from_secs(1))
            .heartbeat(true)
            .poll_interval(Duration::from_millis(50)),
        Duration::from_secs(30),
    )
    .await;

    assert_eq!(*runs.lock().unwrap(), vec![1], "one delivery only");
    let effects = effects(&db).await;
    assert_eq!(
        effects[&0].iter().map(|e| e.attempt).collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(
        stats,
        WorkerStats {
            acked: 1,
            ..WorkerStats::default()
        }
    );
    assert!(jobs_left(&db, "jobs").await.is_empty());
}

/// A heartbeat that extends a lease after its delivery was released for a retry must not hide
/// the job for a whole lease: the retry's delay holds.
///
/// `inbox_retry` keeps the token valid, so without `inbox_extend` refusing a job that is no longer
/// leased, the heartbeat's extension of a snapshot taken before the release would still apply.
/// The test makes the race deterministic: it holds the pool's last connection, so the heartbeat
/// has taken its snapshot and waits for a connection until the retry has committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeat_after_a_retry_does_not_hide_the_job() {
    let _load = LOAD.read().await;
    let db = TestDb::new().await;
    // Two connections: one for the worker's slot, one the test holds.
    let pg = setup_jobs(&db, 2, 1).await;
    let starts = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let handler = {
        let starts = starts.clone();
        transactional(move |job: Job<i64>, _tx: &dyn Database| {
            let starts = starts.clone();
            Box::pin(async move {
                starts.lock().unwrap().push(Instant::now());
                if job.attempt > 1 {
                    return Ok(Outcome::ack());
                }
                // Past the first heartbeat tick (at a third of the 3 s lease).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Ok(Outcome::retry_after(Duration::from_millis(500)))
            })
        })
    };
    let held = pg.pool().get().await.unwrap();
    let handle = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(1)
        .lease(Duration::from_secs(3))
        .heartbeat(true)
        .poll_interval(Duration::from_millis(20))
        .start();
    wait_for("the retry", Duration::from_secs(10), || {
        handle.stats().retried == 1
    })
    .await;
    let retried = Instant::now();
    // The heartbeat gets its connection now, after the release.
    drop(held);
    wait_for("attempt 2", Duration::from_secs(10), || {
        starts.lock().unwrap().len() == 2
    })
    .await;
    let waited = starts.lock().unwrap()[1].duration_since(retried);
    handle.shutdown(Duration::from_secs(5)).await;
    assert!(
        waited < Duration::from_millis(2000),
        "attempt 2 started {waited:?} after a retry that asked for 500 ms"
    );
}

// ------------------------------------------------------------------------------------------------
// 5. Shutdown
// ------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Mode {
    Transactional(Claim),
    Plain,
}

/// A worker of `mode` on `jobs` whose handler sleeps `sleep`, then writes its effect (through the
/// delivery's transaction, or in plain mode on its own) and acks.
fn sleepy_worker(pg: &PgDatabase, mode: Mode, sleep: Duration) -> Worker<i64> {
    match mode {
        Mode::Transactional(claim) => {
            let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
                Box::pin(async move {
                    tokio::time::sleep(sleep).await;
                    tx.execute(&effect(&job)).await?;
                    Ok(Outcome::ack())
                })
            });
            Worker::transactional(pg.clone(), "jobs", handler).claim(claim)
        }
        Mode::Plain => {
            let effects = pg.clone();
            Worker::plain(pg.clone(), "jobs", move |job: Job<i64>| {
                let effects = effects.clone();
                async move {
                    tokio::time::sleep(sleep).await;
                    effects.execute(&effect(&job)).await?;
                    Ok(Outcome::ack())
                }
            })
        }
    }
}

/// Checks that every job of `0..count` has exactly one effect and the queue is empty.
async fn assert_each_effect_once(db: &TestDb, count: i64) {
    let effects = effects(db).await;
    let wrong: Vec<_> = (0..count)
        .filter(|n| effects.get(n).map_or(0, Vec::len) != 1)
        .map(|n| (n, effects.get(&n).cloned().unwrap_or_default()))
        .collect();
    assert!(
        wrong.is_empty(),
        "jobs without exactly one effect: {wrong:?}"
    );
    assert_eq!(effects.len() as i64, count);
    assert!(jobs_left(db, "jobs").await.is_empty());
}

/// A shutdown under load returns once the deliveries in flight finished, loses no job and leaves
/// none leased: the acked jobs' effects are committed, every other job is due, and a new worker
/// finishes them, each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_under_load_loses_nothing_and_leaves_nothing_leased() {
    shutdown_under_load(Route::Direct).await;
}

/// The same shutdown through pgbouncer in transaction mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_through_pgbouncer_loses_nothing_and_leaves_nothing_leased() {
    shutdown_under_load(Route::PgBouncer).await;
}

async fn shutdown_under_load(route: Route) {
    let _load = LOAD.write().await;
    for mode in [
        Mode::Transactional(Claim::Lease),
        Mode::Transactional(Claim::Lock),
        Mode::Plain,
    ] {
        let db = TestDb::new().await;
        let (pg, _bouncer) = port_via(&db, route, 12);
        let pg = setup_jobs_on(pg, 2_000).await;
        let handle = sleepy_worker(&pg, mode, Duration::from_millis(4))
            .workers(4)
            .poll_interval(Duration::from_millis(20))
            .start();
        tokio::time::sleep(Duration::from_millis(200)).await;
        wait_for("some progress", Duration::from_secs(20), || {
            handle.stats().acked >= 20
        })
        .await;
        let asked = Instant::now();
        let stats = handle.shutdown(Duration::from_secs(5)).await;
        let took = asked.elapsed();
        // The deliveries in flight take milliseconds: the shutdown returns once they finished,
        // without waiting out its deadline.
        assert!(
            took < Duration::from_secs(4),
            "{mode:?}: the shutdown took {took:?}"
        );

        let queue = queue_stats(&pg, "jobs").await;
        let left = jobs_left(&db, "jobs").await;
        let done = effects(&db).await;
        assert_eq!(queue.leased, 0, "{mode:?}: {queue:?}");
        assert_eq!((queue.delayed, queue.dead), (0, 0), "{mode:?}: {queue:?}");
        assert_eq!(queue.ready, left.len() as i64, "{mode:?}");
        assert!(
            left.iter().all(|job| job.due && !job.leased && !job.dead),
            "{mode:?}"
        );
        assert!(
            !left.is_empty(),
            "{mode:?}: the shutdown came too late to test anything"
        );
        assert_eq!(done.len() as u64, stats.acked, "{mode:?}: {stats:?}");
        assert_eq!(done.len() + left.len(), 2_000, "{mode:?}");
        assert!(done.values().all(|rows| rows.len() == 1), "{mode:?}");
        assert!(
            left.iter().all(|job| !done.contains_key(&job.n)),
            "{mode:?}"
        );
        assert_eq!(
            (stats.retried, stats.dead, stats.failed, stats.lost),
            (0, 0, 0, 0),
            "{mode:?}"
        );

        let rest = drain(
            sleepy_worker(&pg, mode, Duration::ZERO).poll_interval(Duration::from_millis(20)),
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(rest.acked as usize, left.len(), "{mode:?}");
        assert_each_effect_once(&db, 2_000).await;
    }
}

/// Handlers that outlive the shutdown deadline are abandoned: their writes do not commit, and
/// their jobs are ready again at once (not leased) for the next worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_abandons_handlers_past_the_deadline_and_releases_their_jobs() {
    let _load = LOAD.read().await;
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let pg = setup_jobs(&db, 8, 6).await;
        let started = Arc::new(AtomicUsize::new(0));
        let handler = {
            let started = started.clone();
            transactional(move |job: Job<i64>, tx: &dyn Database| {
                let started = started.clone();
                Box::pin(async move {
                    tx.execute(&effect(&job)).await?;
                    started.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok(Outcome::ack())
                })
            })
        };
        let handle = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(2)
            .claim(claim)
            .start();
        wait_for("two handlers running", Duration::from_secs(10), || {
            started.load(Ordering::SeqCst) == 2
        })
        .await;
        let asked = Instant::now();
        let stats = handle.shutdown(Duration::from_millis(200)).await;
        let took = asked.elapsed();

        assert!(
            took < Duration::from_secs(4),
            "{claim:?}: the shutdown waited {took:?} for the handlers"
        );
        assert_eq!(stats, WorkerStats::default(), "{claim:?}");
        let queue = queue_stats(&pg, "jobs").await;
        assert_eq!(
            (queue.ready, queue.delayed, queue.leased, queue.dead),
            (6, 0, 0, 0),
            "{claim:?}: {queue:?}"
        );
        assert!(
            effects(&db).await.is_empty(),
            "{claim:?}: an abandoned write committed"
        );
        let left = jobs_left(&db, "jobs").await;
        let released: Vec<i64> = left
            .iter()
            .filter(|job| job.attempt > 0)
            .map(|job| job.n)
            .collect();
        match claim {
            // The two leases are released with their attempt counted.
            Claim::Lease => {
                assert_eq!(released, [0, 1], "{claim:?}: {left:?}");
                for job in left.iter().filter(|job| job.attempt > 0) {
                    assert_eq!(job.attempt, 1);
                    assert_eq!(job.last_error.as_deref(), Some("abandoned at shutdown"));
                }
            }
            // The row locks went with the rolled-back transactions, attempts uncounted.
            Claim::Lock => assert!(released.is_empty(), "{claim:?}: {left:?}"),
        }

        let rest = drain(
            sleepy_worker(&pg, Mode::Transactional(claim), Duration::ZERO)
                .poll_interval(Duration::from_millis(20)),
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(rest.acked, 6, "{claim:?}");
        assert_each_effect_once(&db, 6).await;
    }
}

// ------------------------------------------------------------------------------------------------
// 6. Grouped commits
// ------------------------------------------------------------------------------------------------

/// In a group of 5 committed together, a delivery that asks for a retry, fails or panics rolls
/// back only its own writes: a leased group is rolled back and replayed without it, a locked one
/// undoes it to its savepoint; the other four commit in one transaction, and it is retried
/// (attempt 2) and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_commits_the_others_when_one_delivery_fails() {
    quiet_chaos_panics();
    for claim in [Claim::Lease, Claim::Lock] {
        for failure in [Fate::Retry, Fate::Error, Fate::Panic] {
            let db = TestDb::new().await;
            let pg = setup_jobs(&db, 8, 5).await;
            let runs = Arc::new(AtomicUsize::new(0));
            let handler = {
                let runs = runs.clone();
                transactional(move |job: Job<i64>, tx: &dyn Database| {
                    let runs = runs.clone();
                    Box::pin(async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tx.execute(&effect(&job)).await?;
                        if job.payload != 2 || job.attempt > 1 {
                            return Ok(Outcome::ack());
                        }
                        match failure {
                            Fate::Retry => Ok(Outcome::retry()),
                            Fate::Error => Err(HandlerError::from(CHAOS_ERROR)),
                            _ => panic!("{}", CHAOS_PANIC),
                        }
                    })
                })
            };
            let stats = drain(
                Worker::transactional(pg.clone(), "jobs", handler)
                    .workers(1)
                    .group_size(5)
                    // No time bound: the group commits once, however loaded the machine.
                    .group_time(Duration::from_secs(60))
                    .claim(claim)
                    .retry(fast_retries(5))
                    .poll_interval(Duration::from_millis(20)),
                Duration::from_secs(30),
            )
            .await;

            let case = format!("{claim:?}, {failure:?}");
            // Jobs 0 and 1 ran before job 2 failed: a leased group, whose slot had no failure
            // before, has no savepoints and is replayed without it, so they run again; a locked
            // group goes on from job 2's savepoint. Then job 2's second attempt.
            let expected_runs = match claim {
                Claim::Lease => 8,
                Claim::Lock => 6,
            };
            assert_eq!(runs.load(Ordering::SeqCst), expected_runs, "{case}");
            let effects = effects(&db).await;
            let mut group_xids = HashSet::new();
            for n in 0..5 {
                let rows = &effects[&n];
                assert_eq!(rows.len(), 1, "{case}: job {n}: {rows:?}");
                let expected = if n == 2 { 2 } else { 1 };
                assert_eq!(rows[0].attempt, expected, "{case}: job {n}");
                if n != 2 {
                    group_xids.insert(rows[0].xid);
                }
            }
            assert_eq!(group_xids.len(), 1, "{case}: the four committed together");
            assert!(!group_xids.contains(&effects[&2][0].xid), "{case}");
            assert!(jobs_left(&db, "jobs").await.is_empty(), "{case}");
            assert_eq!(
                stats,
                WorkerStats {
                    acked: 5,
                    retried: 1,
                    failed: u64::from(failure != Fate::Retry),
                    ..WorkerStats::default()
                },
                "{case}"
            );
        }
    }
}

/// After its first failure a slot's leased deliveries run inside savepoints: in groups of 10 of
/// 30 jobs, six of which fail their first attempt, only the first failure replays its group (the
/// two deliveries before it run again); every later failure is undone alone, and every effect
/// commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_failure_a_slots_deliveries_are_undone_alone() {
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 4, 30).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        transactional(move |job: Job<i64>, tx: &dyn Database| {
            let runs = runs.clone();
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tx.execute(&effect(&job)).await?;
                if job.payload % 5 == 2 && job.attempt == 1 {
                    return Err(HandlerError::from(CHAOS_ERROR));
                }
                Ok(Outcome::ack())
            })
        })
    };
    let stats = drain(
        Worker::transactional(pg.clone(), "jobs", handler)
            .workers(1)
            .group_size(10)
            .group_time(Duration::from_secs(60))
            .retry(fast_retries(5))
            .poll_interval(Duration::from_millis(20)),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(runs.load(Ordering::SeqCst), 30 + 6 + 2, "{stats:?}");
    assert_each_effect_once(&db, 30).await;
    assert_eq!((stats.acked, stats.retried, stats.failed), (30, 6, 6));
}

/// A connection killed before its group commits applies nothing of the group, and every job of
/// it runs again and completes exactly once (lease form: after the lease expires, as attempt 2;
/// lock form: at once, the attempt uncounted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_on_a_killed_connection_applies_nothing_and_runs_again() {
    killed_group(4).await;
}

/// The same with the connection killed in the middle of the group (its third delivery), the two
/// before it done and the two after it not yet run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_killed_mid_group_applies_nothing_and_runs_again() {
    killed_group(2).await;
}

/// A group of 5 whose connection is killed by the delivery of job `victim`.
async fn killed_group(victim: i64) {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let pg = setup_jobs(&db, 8, 5).await;
        let runs = Arc::new(AtomicUsize::new(0));
        let killed = Arc::new(AtomicBool::new(false));
        let killed_xid = Arc::new(Mutex::new(None::<i64>));
        let handler = {
            let (runs, killed, killed_xid) = (runs.clone(), killed.clone(), killed_xid.clone());
            transactional(move |job: Job<i64>, tx: &dyn Database| {
                let (runs, killed, killed_xid) = (runs.clone(), killed.clone(), killed_xid.clone());
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tx.execute(&effect(&job)).await?;
                    if job.payload == victim && !killed.swap(true, Ordering::SeqCst) {
                        let xid = tx
                            .query(&Statement::new("SELECT txid_current() AS xid"))
                            .await?
                            .one()?
                            .get::<i64>("xid")?;
                        *killed_xid.lock().unwrap() = Some(xid);
                        tx.execute(&Statement::new(
                            "SELECT pg_terminate_backend(pg_backend_pid())",
                        ))
                        .await?;
                    }
                    Ok(Outcome::ack())
                })
            })
        };
        let stats = drain(
            Worker::transactional(pg.clone(), "jobs", handler)
                .workers(1)
                .group_size(5)
                .group_time(Duration::from_secs(60))
                .claim(claim)
                .lease(Duration::from_secs(1))
                .poll_interval(Duration::from_millis(50)),
            Duration::from_secs(30),
        )
        .await;

        assert!(killed.load(Ordering::SeqCst), "{claim:?}");
        let killed_xid = killed_xid.lock().unwrap().expect("the killed group's xid");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            victim as usize + 1 + 5,
            "{claim:?}: {} run in the killed group, 5 again",
            victim + 1
        );
        let effects = effects(&db).await;
        let expected_attempt = match claim {
            Claim::Lease => 2,
            Claim::Lock => 1,
        };
        for n in 0..5 {
            let rows = &effects[&n];
            assert_eq!(rows.len(), 1, "{claim:?}: job {n}: {rows:?}");
            assert_ne!(rows[0].xid, killed_xid, "{claim:?}: job {n}");
            assert_eq!(rows[0].attempt, expected_attempt, "{claim:?}: job {n}");
        }
        assert!(jobs_left(&db, "jobs").await.is_empty(), "{claim:?}");
        assert_eq!(
            (stats.acked, stats.lost, stats.dead),
            (5, 0, 0),
            "{claim:?}"
        );
    }
}

/// A locked group is at most `LOCK_GROUP_MAX` (64) deliveries, whatever the group size asked
/// for: each is a subtransaction (its savepoint), and a transaction with more than 64 makes every
/// snapshot in the server look them up in `pg_subtrans`. 200 ready jobs, groups of 500 asked:
/// no transaction commits more than 64 effects, and each job's effect commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_groups_stay_within_the_subtransaction_cache() {
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 4, 200).await;
    let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(&effect(&job)).await?;
            Ok(Outcome::ack())
        })
    });
    let stats = drain(
        Worker::transactional(pg.clone(), "jobs", handler)
            .workers(1)
            .claim(Claim::Lock)
            .group_size(500)
            .group_time(Duration::from_secs(60))
            .poll_interval(Duration::from_millis(20)),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(stats.acked, 200);
    assert_each_effect_once(&db, 200).await;
    let client = db.client().await;
    let largest: i64 = client
        .query_one(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM effects GROUP BY xid) AS t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(largest, LOCK_GROUP_MAX as i64);
}

/// A handler that ignores a failed statement and acks leaves its group's transaction aborted:
/// the delivery after it, whose statement is refused, is not blamed; the group is replayed one
/// delivery per commit, the culprit's commit fails, and it alone is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_finds_the_delivery_that_left_its_transaction_aborted() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let pg = setup_jobs(&db, 8, 3).await;
        let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
            Box::pin(async move {
                tx.execute(&effect(&job)).await?;
                if job.payload == 0 && job.attempt == 1 {
                    // Ignored: the transaction is aborted now.
                    let _ = tx.execute(&Statement::new("SELECT 1 / 0")).await;
                }
                Ok(Outcome::ack())
            })
        });
        let stats = drain(
            Worker::transactional(pg.clone(), "jobs", handler)
                .workers(1)
                .group_size(3)
                .group_time(Duration::from_secs(60))
                .claim(claim)
                .retry(fast_retries(5))
                .poll_interval(Duration::from_millis(20)),
            Duration::from_secs(30),
        )
        .await;

        let effects = effects(&db).await;
        for n in 0..3 {
            let rows = &effects[&n];
            assert_eq!(rows.len(), 1, "{claim:?}: job {n}: {rows:?}");
            let expected = if n == 0 { 2 } else { 1 };
            assert_eq!(rows[0].attempt, expected, "{claim:?}: job {n}");
        }
        assert!(jobs_left(&db, "jobs").await.is_empty(), "{claim:?}");
        assert_eq!(
            stats,
            WorkerStats {
                acked: 3,
                retried: 1,
                ..WorkerStats::default()
            },
            "{claim:?}"
        );
    }
}

/// A job of a group whose lease is lost while the group runs (another worker leased it after the
/// lease expired) is left to that worker: the group is replayed without it, its other jobs
/// commit once, and the stale delivery's write never commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_with_a_lost_lease_commits_the_others_and_counts_it_lost() {
    let _load = LOAD.read().await;
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 8, 3).await;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let (runs, db_config) = (runs.clone(), db.config());
        transactional(move |job: Job<i64>, tx: &dyn Database| {
            let (runs, db_config) = (runs.clone(), db_config.clone());
            Box::pin(async move {
                tx.execute(&effect(&job)).await?;
                runs.lock().unwrap().push(job.payload);
                if job.payload == 1 && job.attempt == 1 {
                    // Another worker leases job 1 (its lease here has expired): what
                    // `inbox_lease` does to the row, written from another connection.
                    let (thief, connection) = db_config.connect(tokio_postgres::NoTls).await?;
                    tokio::spawn(connection);
                    thief
                        .execute(
                            "UPDATE jobs SET attempt = attempt + 1, \
                             locked_until = now() + interval '30 seconds' WHERE payload = '1'",
                            &[],
                        )
                        .await?;
                }
                Ok(Outcome::ack())
            })
        })
    };
    let stats = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(1)
        .group_size(3)
        .group_time(Duration::from_secs(60))
        .heartbeat(false)
        .poll_interval(Duration::from_millis(20))
        .start();
    wait_for("the group to settle", Duration::from_secs(20), || {
        let s = stats.stats();
        s.acked == 2 && s.lost == 1
    })
    .await;
    let stats = stats.shutdown(Duration::from_secs(5)).await;

    // Jobs 0 and 2 ran again in the replay; job 1 only once here.
    assert_eq!(*runs.lock().unwrap(), vec![0, 1, 2, 0, 2]);
    assert_eq!(
        stats,
        WorkerStats {
            acked: 2,
            lost: 1,
            ..WorkerStats::default()
        }
    );
    let effects = effects(&db).await;
    assert_eq!(
        effects.get(&1),
        None,
        "the stale delivery's write did not commit"
    );
    for n in [0, 2] {
        let rows = &effects[&n];
        assert_eq!(rows.len(), 1, "job {n}: {rows:?}");
        assert_eq!(rows[0].attempt, 1, "job {n}");
    }
    assert_eq!(effects[&0][0].xid, effects[&2][0].xid, "committed together");
    // Job 1 is the other worker's now: leased with attempt 2, untouched by the stale group.
    let left = jobs_left(&db, "jobs").await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].n == 1 && left[0].attempt == 2 && left[0].leased,
        "{left:?}"
    );
}

// ------------------------------------------------------------------------------------------------
// 7. Plain mode, and payloads that do not decode
// ------------------------------------------------------------------------------------------------

/// A plain worker with a no-op handler acks all of 5,000 jobs, each handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_worker_acks_every_job() {
    let _load = LOAD.write().await;
    let db = TestDb::new().await;
    let pg = setup_jobs(&db, 8, 5_000).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |_job: Job<i64>| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(Outcome::ack())
            }
        }
    };
    let started = Instant::now();
    let stats = drain(
        Worker::plain(pg.clone(), "jobs", handler)
            .workers(16)
            .poll_interval(Duration::from_millis(20)),
        Duration::from_secs(60),
    )
    .await;
    eprintln!("plain: 5,000 jobs in {:?}", started.elapsed());

    assert_eq!(runs.load(Ordering::SeqCst), 5_000);
    assert_eq!(
        stats,
        WorkerStats {
            acked: 5_000,
            ..WorkerStats::default()
        }
    );
    assert!(jobs_left(&db, "jobs").await.is_empty());
}

/// The payload type of the decode test.
#[derive(Debug, Deserialize)]
struct Numbered {
    #[allow(dead_code)]
    n: i64,
}

/// A payload that does not decode is dead-lettered on its first delivery with the decode error,
/// never reaching the handler, in transactional (both claims) and plain modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn undecodable_payload_is_dead_lettered_not_retried() {
    for mode in [
        Mode::Transactional(Claim::Lease),
        Mode::Transactional(Claim::Lock),
        Mode::Plain,
    ] {
        let db = TestDb::new().await;
        let pg = setup_jobs(&db, 8, 0).await;
        pg.execute(&Statement::new(
            "SELECT inbox_enqueue('jobs', '{\"wrong\": \"shape\"}'::jsonb), \
                    inbox_enqueue('jobs', '{\"n\": 7}'::jsonb)",
        ))
        .await
        .unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let worker = match mode {
            Mode::Transactional(claim) => {
                let runs = runs.clone();
                let handler = transactional(move |_job: Job<Numbered>, _tx: &dyn Database| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async { Ok(Outcome::ack()) })
                });
                Worker::transactional(pg.clone(), "jobs", handler).claim(claim)
            }
            Mode::Plain => {
                let runs = runs.clone();
                Worker::plain(pg.clone(), "jobs", move |_job: Job<Numbered>| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    async { Ok(Outcome::ack()) }
                })
            }
        };
        let stats = drain(
            worker
                .retry(fast_retries(5))
                .poll_interval(Duration::from_millis(20)),
            Duration::from_secs(30),
        )
        .await;

        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{mode:?}: only the valid job"
        );
        let left = jobs_left(&db, "jobs").await;
        assert_eq!(left.len(), 1, "{mode:?}: {left:?}");
        let job = &left[0];
        assert!(job.dead && job.attempt == 1, "{mode:?}: {job:?}");
        let reason = job.last_error.as_deref().unwrap_or_default();
        assert!(
            reason.starts_with("payload does not decode:") && reason.contains("missing field `n`"),
            "{mode:?}: {reason}"
        );
        assert_eq!(
            stats,
            WorkerStats {
                acked: 1,
                dead: 1,
                ..WorkerStats::default()
            },
            "{mode:?}"
        );
    }
}

// ------------------------------------------------------------------------------------------------
// 8. NOTIFY wake-ups
// ------------------------------------------------------------------------------------------------

/// Idle workers polling every 10 s handle a job enqueued after they went idle in well under a
/// second: the enqueue's NOTIFY wakes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_workers_wake_on_notify() {
    let _load = LOAD.read().await;
    for mode in [
        Mode::Transactional(Claim::Lease),
        Mode::Transactional(Claim::Lock),
        Mode::Plain,
    ] {
        let db = TestDb::new().await;
        let pg = setup_jobs(&db, 8, 0).await;
        let (handled, mut handled_at) = tokio::sync::mpsc::unbounded_channel();
        let worker = match mode {
            Mode::Transactional(claim) => {
                let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
                    let handled = handled.clone();
                    Box::pin(async move {
                        tx.execute(&effect(&job)).await?;
                        let _ = handled.send((job.payload, Instant::now()));
                        Ok(Outcome::ack())
                    })
                });
                Worker::transactional(pg.clone(), "jobs", handler).claim(claim)
            }
            Mode::Plain => Worker::plain(pg.clone(), "jobs", move |job: Job<i64>| {
                let handled = handled.clone();
                async move {
                    let _ = handled.send((job.payload, Instant::now()));
                    Ok(Outcome::ack())
                }
            }),
        };
        let handle = worker
            .workers(2)
            .poll_interval(Duration::from_secs(10))
            .start();
        // Wait until the worker found the queue empty and sleeps on it.
        let client = db.client().await;
        let listening = Instant::now();
        loop {
            let row = client
                .query_one("SELECT count(*) FROM inbox_sleepers('jobs')", &[])
                .await
                .unwrap();
            if row.get::<_, i64>(0) > 0 {
                break;
            }
            assert!(
                listening.elapsed() < Duration::from_secs(10),
                "{mode:?}: no LISTEN"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for n in 0..3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let enqueued = Instant::now();
            Queue::new("jobs")
                .enqueue(&pg, &n, None, None)
                .await
                .unwrap();
            let (job, at) = tokio::time::timeout(Duration::from_secs(5), handled_at.recv())
                .await
                .unwrap_or_else(|_| panic!("{mode:?}: job {n} not handled within 5 s"))
                .unwrap();
            assert_eq!(job, n, "{mode:?}");
            let latency = at.duration_since(enqueued);
            assert!(
                latency < Duration::from_secs(1),
                "{mode:?}: job {n} waited {latency:?}"
            );
        }
        let stats = handle.shutdown(Duration::from_secs(5)).await;
        assert_eq!(stats.acked, 3, "{mode:?}: {stats:?}");
    }
}
