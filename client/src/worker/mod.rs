//! Workers that lease jobs through the extension, run a handler, and settle each job.
//!
//! Build one with [`Worker::transactional`] (the handler writes through its delivery's
//! transaction, and those writes commit with the job's settlement: effects that are rows in the
//! queue's database happen exactly once) or [`Worker::plain`] (no transaction: the throughput
//! mode, for handlers whose effects are elsewhere, which are at least once and need an
//! idempotency key). Then [`start`](Worker::start) it, or run it to completion in a test with
//! [`run_until_idle`](Worker::run_until_idle).
//!
//! # Which claim to use
//!
//! - [`Claim::Lease`] (the default) commits a lease first (`inbox_lease`): the attempt is
//!   counted even if the process dies, so a job that crashes its worker is dead-lettered after
//!   `max_attempts` instead of crashing workers forever. The handler's transaction holds no
//!   lock while the lease is being taken, a heartbeat extends the lease while the handler runs,
//!   and settlement is fenced by the lease's token, so a handler that lost its lease (a long
//!   pause, a partition) commits nothing. It costs one more commit, but only when a slot starts
//!   on an idle queue: the lease of a slot's next group commits with its current group.
//! - [`Claim::Lock`] takes the jobs with `inbox_lock` inside the handler's transaction: lease,
//!   work and settlement are one transaction, the cheapest form. A crash rolls everything back,
//!   attempt included, and the row lock is held for the whole handler: use it for short
//!   handlers that cannot crash the process.
//!
//! # Groups
//!
//! A transactional worker commits several deliveries at once: each slot takes what is ready, up
//! to a group, runs the deliveries one after another in one transaction, and
//! settles the whole group (`inbox_ack_all`) in the round trip that commits it and takes the next
//! group. By default the groups adapt to the handlers: a slot starts with one job and doubles
//! while its groups finish within [`group_time`](Worker::group_time) (20 ms), up to
//! [`ADAPTIVE_GROUP_MAX`] (64), and takes fewer when deliveries are slow; a lone job runs and
//! commits at once. While other slots of the worker are idle, a slot takes only its share of a
//! group with them (half with one idle, one job with many) and wakes one of them when it got all
//! it asked for, so that at light load a job does not wait behind another job's handler while a
//! slot sleeps; under load no slot idles and the groups are whole.
//! [`group_size`](Worker::group_size) fixes the size instead (1: a commit per job).
//!
//! A delivery that fails (an error, a panic, or an outcome other than ack) must be undone alone.
//! Each delivery runs inside a savepoint, opened in the round trip of the handler's first
//! statement: a failure is undone to it and settled in the group's transaction, and the other
//! deliveries of the group are not run again. A transaction opens at most 64 savepoints (past
//! that, every snapshot in the server would look its subtransactions up in pg_subtrans); a leased
//! delivery past them runs without one, and if it fails, the group's transaction is rolled back,
//! the jobs still held are fenced again in a new transaction (`inbox_fence`; their leases kept
//! them meanwhile), the failed job is settled there, and the deliveries before it run again
//! (their writes were undone with it). Their effects in the database still commit exactly once;
//! effects outside it must be idempotent anyway (they are at least once in every mode). After
//! three replays in one group, or once a group has run for its time bound, the slot commits what
//! it has done and goes on in a new transaction.
//!
//! A locked group ([`Claim::Lock`]) holds its jobs by row locks only, which a rollback would give
//! up to other workers before the failure is recorded, so it never replays: it is at most
//! [`LOCK_GROUP_MAX`] (64) jobs, each inside its savepoint.
//!
//! # Isolation and conflicts
//!
//! Each delivery's transaction opens at the worker's [`isolation`](Worker::isolation) level
//! (READ COMMITTED by default). A handler that fails with a serialization failure or a deadlock
//! runs again at once, its attempt unspent, a bounded number of times
//! ([`conflict_reruns`](Worker::conflict_reruns)); [`handler_timeout`](Worker::handler_timeout)
//! bounds how long a handler may run.
//!
//! # Connection poolers
//!
//! A worker keeps no session state: its timeouts are set per transaction (`SET LOCAL`), and over
//! a port [`behind_pooler`](crate::PgDatabase::behind_pooler) it sends every statement unnamed
//! and never LISTENs through the pooler: it listens on the direct connection it was given
//! ([`with_listen_config`](crate::PgDatabase::with_listen_config)), or else polls at its
//! [`poll_interval`](Worker::poll_interval), which costs wake-up latency only. So it works
//! through pgbouncer in transaction mode (1.18 included, which keeps no prepared statements).

mod calls;
mod heartbeat;
mod job;
mod listen;
mod plain;
mod policy;
mod step;
mod transactional;
mod tx;

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::DbError;
use crate::job_type::JobType;
use crate::pg::PgDatabase;

pub use job::{
    transactional, AsyncHandler, AsyncTxFn, AsyncTxHandler, BoxFuture, Handler, HandlerError,
    HandlerResult, Job, Outcome, TxHandler,
};
pub use policy::RetryPolicy;
pub use step::StepError;
pub use tx::Tx;

/// How long a delivery slot (or plain fetcher) that just ran out of work waits before it looks
/// again, before it registers as asleep (`Shared::idle`); and how long no take may have found
/// work before the worker registers as asleep (`listen.rs`).
const DOZE: Duration = Duration::from_millis(2);

/// The largest group a transactional worker with adaptive groups (the default) commits at once.
pub const ADAPTIVE_GROUP_MAX: usize = 64;

/// The largest group of a worker with [`Claim::Lock`], whatever its
/// [`group_size`](Worker::group_size): each delivery of a locked group is a subtransaction, and a
/// transaction with more than 64 makes every snapshot in the server look them up in
/// `pg_subtrans`.
pub const LOCK_GROUP_MAX: usize = 64;

/// How a worker takes its jobs; see the [module documentation](self) for which to choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Claim {
    /// A committed lease (`inbox_lease`), extended by a heartbeat and fenced by its token.
    #[default]
    Lease,
    /// A row lock held by the delivery's transaction (`inbox_lock`); transactional mode only.
    Lock,
}

/// The isolation level each delivery's transaction opens at ([`Worker::isolation`]).
///
/// Above READ COMMITTED the transaction's snapshot is taken by its first statement, so a
/// transactional worker takes its leases outside it (each commits on its own, a round trip more
/// per group) and opens every group by fencing its jobs (`inbox_fence`): from then until the
/// commit no other transaction writes their rows, and the group's own settlement cannot conflict
/// with the heartbeat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    /// PostgreSQL's default: each statement sees what committed before it began.
    #[default]
    ReadCommitted,
    /// One snapshot for the whole transaction; a write to a row changed since fails with `40001`.
    RepeatableRead,
    /// As if the transactions ran one at a time; any that could not fails with `40001`.
    Serializable,
}

impl Isolation {
    /// The `BEGIN` that opens a transaction at this level.
    fn begin(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "BEGIN",
            Isolation::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Isolation::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }

    /// Whether the transaction's first statement fixes its snapshot.
    fn snapshot_per_transaction(self) -> bool {
        self != Isolation::ReadCommitted
    }
}

/// Counts of what a worker did, since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Jobs finished (in transactional mode: committed with their handler's writes).
    pub acked: u64,
    /// Deliveries settled for another attempt.
    pub retried: u64,
    /// Jobs dead-lettered: by the handler, past `max_attempts`, or with a payload that does not
    /// decode.
    pub dead: u64,
    /// Deliveries whose handler failed (an error or a panic); each is also retried or dead.
    pub failed: u64,
    /// Deliveries whose settlement was refused because another worker had taken the job since
    /// (their writes were rolled back).
    pub lost: u64,
    /// Deliveries run again at once, their attempt unspent, after a serialization failure
    /// (`40001`) or a deadlock (`40P01`) rolled their writes back.
    pub reran: u64,
    /// Deliveries settled to run again later, their attempt unspent ([`Outcome::Snooze`]).
    pub snoozed: u64,
}

#[derive(Default)]
struct Counters {
    acked: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    failed: AtomicU64,
    lost: AtomicU64,
    reran: AtomicU64,
    snoozed: AtomicU64,
}

impl Counters {
    fn add(&self, tally: &WorkerStats) {
        self.acked.fetch_add(tally.acked, Ordering::Relaxed);
        self.retried.fetch_add(tally.retried, Ordering::Relaxed);
        self.dead.fetch_add(tally.dead, Ordering::Relaxed);
        self.failed.fetch_add(tally.failed, Ordering::Relaxed);
        self.lost.fetch_add(tally.lost, Ordering::Relaxed);
        self.reran.fetch_add(tally.reran, Ordering::Relaxed);
        self.snoozed.fetch_add(tally.snoozed, Ordering::Relaxed);
    }

    fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            acked: self.acked.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            reran: self.reran.load(Ordering::Relaxed),
            snoozed: self.snoozed.load(Ordering::Relaxed),
        }
    }
}

/// A worker's settings.
#[derive(Clone, Debug)]
struct Settings {
    workers: usize,
    lease: Duration,
    heartbeat: bool,
    retry: RetryPolicy,
    claim: Claim,
    /// A fixed group size, or `None` for groups that adapt to the handlers.
    group_size: Option<usize>,
    group_time: Duration,
    batch_size: usize,
    poll_interval: Duration,
    vacuum: bool,
    statement_timeout: Duration,
    idle_in_transaction_timeout: Duration,
    isolation: Isolation,
    /// How long a handler may run before it is abandoned and its delivery fails.
    handler_timeout: Option<Duration>,
    /// How many times one delivery may run again after a serialization failure or a deadlock
    /// before it counts as a failed attempt.
    conflict_reruns: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            workers: 4,
            lease: Duration::from_secs(30),
            heartbeat: true,
            retry: RetryPolicy::default(),
            claim: Claim::Lease,
            group_size: None,
            group_time: Duration::from_millis(20),
            batch_size: 100,
            poll_interval: Duration::from_millis(500),
            vacuum: true,
            statement_timeout: Duration::from_secs(30),
            idle_in_transaction_timeout: Duration::from_secs(60),
            isolation: Isolation::ReadCommitted,
            handler_timeout: None,
            conflict_reruns: 3,
        }
    }
}

enum Mode<T> {
    Transactional(Arc<dyn job::Deliver<T>>),
    Plain(Arc<dyn Handler<T>>),
}

/// What a round trip may take beyond the statement timeout before its connection is given up.
const ROUND_TRIP_MARGIN: Duration = Duration::from_secs(2);

/// What every task of a running worker shares.
struct Shared {
    db: PgDatabase,
    queue: String,
    settings: Settings,
    counters: Counters,
    /// Wakes one idle task: a NOTIFY arrived, or a task found work and there may be more.
    wake: Notify,
    /// Tells the LISTEN session that a task found nothing to do (it registers as asleep).
    idle_slot: Notify,
    /// Tasks waiting in [`Shared::idle`] now: while some wait, a slot takes only its share of a
    /// group ([`Shared::share`]).
    idling: AtomicUsize,
    stop: CancellationToken,
    /// Leased jobs being worked on (id → token, and what tells their handler the lease is lost):
    /// what the heartbeat extends, and what a shutdown releases if their handlers had to be
    /// abandoned.
    in_flight: Mutex<HashMap<i64, (i64, CancellationToken)>>,
    /// Progress that running handlers recorded (`Job::set_progress`), by job, until the heartbeat
    /// sends it.
    progress: job::ProgressNotes,
    /// Where its handlers' durable steps are recorded (`Job::step`).
    steps: Arc<step::StepStore>,
    /// When a take last found work, in nanoseconds since `began`: the LISTEN session registers
    /// as asleep only once no take has found any for a doze (`listen.rs`).
    last_found: AtomicU64,
    began: std::time::Instant,
    /// Locked jobs whose delivery failed, by id, until their settlement commits (the delivery's
    /// writes were rolled back, or its settlement is in a transaction that a replay may still
    /// roll back): a slot that takes one in the moment its lock is released settles it as it
    /// failed, rather than run the attempt again.
    lock_failures: Mutex<HashMap<i64, LockFailure>>,
}

/// Counts a task out of [`Shared::idling`] when its wait ends.
struct Idling<'a>(&'a AtomicUsize);

impl Drop for Idling<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A failed delivery of a locked job, remembered until its settlement commits.
#[derive(Clone, Debug)]
struct LockFailure {
    token: i64,
    outcome: Outcome,
    failed: bool,
}

impl Shared {
    fn hold(&self, jobs: impl IntoIterator<Item = (i64, i64)>) {
        if let Ok(mut held) = self.in_flight.lock() {
            held.extend(
                jobs.into_iter()
                    .map(|(id, token)| (id, (token, CancellationToken::new()))),
            );
        }
    }

    /// What tells job `id`'s handler that its delivery was cancelled or its lease lost: the
    /// heartbeat's, for a leased job it extends; one that never fires otherwise (a locked job's
    /// row lock cannot be lost while its transaction runs).
    fn lost(&self, id: i64) -> CancellationToken {
        self.in_flight
            .lock()
            .ok()
            .and_then(|held| held.get(&id).map(|(_, lost)| lost.clone()))
            .unwrap_or_default()
    }

    fn release(&self, ids: impl IntoIterator<Item = i64>) {
        if let (Ok(mut held), Ok(mut progress)) = (self.in_flight.lock(), self.progress.lock()) {
            for id in ids {
                held.remove(&id);
                progress.remove(&id);
            }
        }
    }

    fn remember_lock_failure(&self, job: &calls::Taken, outcome: &Outcome, failed: bool) {
        if let Ok(mut failures) = self.lock_failures.lock() {
            failures.insert(job.id, LockFailure::new(job.token, outcome, failed));
        }
    }

    /// The remembered failure of this very delivery (same job, same token), if any.
    fn lock_failure(&self, job: &calls::Taken) -> Option<LockFailure> {
        if job.token >= 0 {
            return None;
        }
        let failures = self.lock_failures.lock().ok()?;
        failures
            .get(&job.id)
            .filter(|failure| failure.token == job.token)
            .cloned()
    }

    fn forget_lock_failure(&self, id: i64, token: i64) {
        if token >= 0 {
            return;
        }
        if let Ok(mut failures) = self.lock_failures.lock() {
            if failures.get(&id).is_some_and(|f| f.token == token) {
                failures.remove(&id);
            }
        }
    }

    /// Records that a take found work (see `last_found`).
    fn found_work(&self) {
        let now = u64::try_from(self.began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_found.store(now, Ordering::Relaxed);
    }

    /// How long no take has found work.
    fn quiet_for(&self) -> Duration {
        let last = Duration::from_nanos(self.last_found.load(Ordering::Relaxed));
        self.began.elapsed().saturating_sub(last)
    }

    /// After a take that found nothing: the first time since the slot last found work, a short
    /// doze ([`DOZE`]) before it looks again, without registering as asleep; after that, sleeps
    /// registered (enqueues notify it) until woken, the poll interval passes, or the worker
    /// stops. The doze keeps a worker that keeps up with its producers from registering in every
    /// moment its queue is empty: each registration makes the next enqueue notify, and
    /// notifying enqueues serialise their commits on `NOTIFY`'s lock (figure 10). A job enqueued
    /// during the doze waits for its end, a few milliseconds.
    async fn idle(&self, dozed: bool) {
        self.idling.fetch_add(1, Ordering::Relaxed);
        // Counted out however the wait ends, also when the caller drops it (plain.rs selects).
        let _counted = Idling(&self.idling);
        let wait = if dozed {
            self.idle_slot.notify_one();
            self.settings.poll_interval
        } else {
            DOZE.min(self.settings.poll_interval)
        };
        tokio::select! {
            _ = self.wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
            _ = self.stop.cancelled() => {}
        }
    }

    /// How many jobs a slot whose group is `size` takes now: all of it while no other task is
    /// idle, otherwise its share with the idle ones (at least one), so that at light load no job
    /// waits behind another job's handler while a slot sleeps. Under load no slot idles and the
    /// groups are whole.
    fn share(&self, size: usize) -> usize {
        size.div_ceil(self.idling.load(Ordering::Relaxed) + 1)
    }

    /// After a take of `asked` jobs that got `got`: when it got all it asked for (there may be
    /// more) and a task is idle, wakes one to look now rather than after this group.
    fn took(&self, asked: usize, got: usize) {
        if got >= asked && self.idling.load(Ordering::Relaxed) > 0 {
            self.wake.notify_one();
        }
    }

    /// How long the worker waits for an answer to one round trip: its statement timeout and a
    /// margin, past which the server would have answered with an error (`None` when statements
    /// are not bounded). Beyond it the connection is taken as lost: one that went silent without
    /// closing (half-open) would otherwise hang its slot for ever.
    fn round_trip_bound(&self) -> Option<Duration> {
        let timeout = self.settings.statement_timeout;
        (!timeout.is_zero()).then(|| timeout + ROUND_TRIP_MARGIN)
    }

    /// Runs a call of the worker within the round-trip bound; past it, the call fails with
    /// `ErrorKind::ConnectionLost` (and its connection must be closed, not pooled again).
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, DbError>>,
    ) -> Result<T, DbError> {
        crate::error::within(self.round_trip_bound(), call)
            .await
            .unwrap_or_else(Err)
    }

    /// Pauses after an error, so a database that is down is not hammered.
    async fn back_off(&self, error: &DbError) {
        tracing::warn!(queue = %self.queue, %error, "worker error; retrying shortly");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = self.stop.cancelled() => {}
        }
    }

    /// Why a delivery must not run its handler: its attempt is past `max_attempts` (earlier
    /// deliveries were counted but never settled, e.g. their worker was killed). It is then
    /// dead-lettered without running.
    fn past_max_attempts(&self, attempt: i32) -> Option<String> {
        self.settings
            .retry
            .max_attempts
            .filter(|&max| attempt > max)
            .map(|max| format!("attempt {attempt} is past max_attempts ({max}); not run"))
    }

    fn decode<T: DeserializeOwned>(&self, payload: &[u8]) -> Result<T, String> {
        serde_json::from_slice(payload).map_err(|e| format!("payload does not decode: {e}"))
    }
}

/// Runs a handler future, turning an error, a panic or a timeout into a retry.
async fn run_handler(
    future: BoxFuture<'_, HandlerResult>,
    timeout: Option<Duration>,
) -> (Outcome, bool) {
    outcome_of(catch_handler(future, timeout).await)
}

/// Runs a handler future, catching a panic; past `timeout` the future is dropped and the
/// handler fails with an error that says so.
async fn catch_handler(
    future: BoxFuture<'_, HandlerResult>,
    timeout: Option<Duration>,
) -> std::thread::Result<HandlerResult> {
    let caught = std::panic::AssertUnwindSafe(future).catch_unwind();
    match timeout {
        None => caught.await,
        Some(bound) => tokio::time::timeout(bound, caught)
            .await
            .unwrap_or_else(|_| {
                Ok(Err(format!(
                    "the handler ran past its timeout ({} ms)",
                    bound.as_millis()
                )
                .into()))
            }),
    }
}

/// What a handler's result (or panic) means for its job, and whether the handler failed.
fn outcome_of(result: std::thread::Result<HandlerResult>) -> (Outcome, bool) {
    match result {
        Ok(Ok(outcome)) => (outcome, false),
        Ok(Err(error)) => (
            Outcome::Retry {
                after: None,
                reason: Some(error.to_string()),
            },
            true,
        ),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "the handler panicked".to_owned());
            (
                Outcome::Retry {
                    after: None,
                    reason: Some(format!("panic: {message}")),
                },
                true,
            )
        }
    }
}

/// A worker for one queue table, not yet started.
pub struct Worker<T> {
    db: PgDatabase,
    queue: String,
    settings: Settings,
    mode: Mode<T>,
    _payload: PhantomData<fn() -> T>,
}

impl<T: JobType> Worker<T> {
    /// A transactional worker of `T`'s queue ([`JobType::QUEUE`]): `handler` (a type
    /// implementing [`AsyncTxHandler`], or an `async fn(Job<T>, &Tx<'_>) -> HandlerResult`)
    /// writes through each delivery's transaction ([`Tx`]), committed with the job's settlement
    /// on [`Outcome::Ack`] and rolled back otherwise.
    ///
    /// ```no_run
    /// use inbox_client::worker::{HandlerResult, Job, Outcome, Tx, Worker};
    /// use inbox_client::{JobType, PgDatabase};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Refund { order_id: i64, cents: i32 }
    /// # impl JobType for Refund { const QUEUE: &'static str = "refund_jobs"; }
    ///
    /// async fn refund(job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
    ///     let Refund { order_id, cents } = job.payload;
    ///     tx.client().await?
    ///         .execute("INSERT INTO refunds (order_id, cents) VALUES ($1, $2)", &[&order_id, &cents])
    ///         .await?;
    ///     Ok(Outcome::ack())
    /// }
    ///
    /// # async fn run(db: PgDatabase) {
    /// let worker = Worker::transactional_for(db, refund).workers(8).start();
    /// # let _ = worker;
    /// # }
    /// ```
    pub fn transactional_for(db: PgDatabase, handler: impl AsyncTxHandler<T>) -> Self {
        Self::new(
            db,
            T::QUEUE,
            Mode::Transactional(Arc::new(job::Native(handler))),
        )
    }

    /// A plain worker of `T`'s queue ([`JobType::QUEUE`]): `handler` (a type implementing
    /// [`AsyncHandler`], or an `async fn(Job<T>) -> HandlerResult`) runs with no transaction,
    /// as for [`plain`](Self::plain).
    pub fn plain_for(db: PgDatabase, handler: impl AsyncHandler<T>) -> Self {
        Self::new(
            db,
            T::QUEUE,
            Mode::Plain(Arc::new(job::NativePlain(Arc::new(handler)))),
        )
    }
}

impl<T: DeserializeOwned + Send + 'static> Worker<T> {
    /// A worker whose handler writes through each delivery's transaction, committed with the
    /// job's settlement on [`Outcome::Ack`] and rolled back otherwise.
    pub fn transactional(
        db: PgDatabase,
        queue: impl Into<String>,
        handler: impl TxHandler<T>,
    ) -> Self {
        Self::new(
            db,
            queue,
            Mode::Transactional(Arc::new(job::ThroughPort(handler))),
        )
    }

    /// A worker whose handler needs no transaction: jobs are leased and acked in batches.
    pub fn plain(db: PgDatabase, queue: impl Into<String>, handler: impl Handler<T>) -> Self {
        Self::new(db, queue, Mode::Plain(Arc::new(handler)))
    }

    fn new(db: PgDatabase, queue: impl Into<String>, mode: Mode<T>) -> Self {
        Self {
            db,
            queue: queue.into(),
            settings: Settings::default(),
            mode,
            _payload: PhantomData,
        }
    }

    /// How many deliveries run at once (default 4). A transactional worker runs them in slots
    /// that hold one pooled connection each, leaving one of the pool for the heartbeat: with a
    /// pool of `n` connections it runs at most `n - 1` slots ([`PgDatabase::connect`]'s pool has
    /// four per CPU, [`default_pool_size`]), and says so in a warning when that is fewer than
    /// asked; its groups make up for it.
    ///
    /// [`PgDatabase::connect`]: crate::PgDatabase::connect
    /// [`default_pool_size`]: crate::default_pool_size
    pub fn workers(mut self, n: usize) -> Self {
        self.settings.workers = n.max(1);
        self
    }

    /// How long a lease lasts before another worker may take the job (default 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease.max(Duration::from_millis(1));
        self
    }

    /// Whether leases are extended while their handlers run (default on; every third of the lease).
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.settings.heartbeat = on;
        self
    }

    /// The backoff and attempt limit for failed deliveries.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.settings.retry = policy;
        self
    }

    /// How a transactional worker takes its jobs (plain workers always lease).
    pub fn claim(mut self, claim: Claim) -> Self {
        self.settings.claim = claim;
        self
    }

    /// Deliveries a transactional worker commits together: each slot takes what is ready, up
    /// to `n` jobs, and commits them in one transaction; 1 commits every job on its own.
    ///
    /// By default the groups adapt to the handlers: a slot starts with one job, doubles its
    /// group while groups finish within [`group_time`](Worker::group_time), up to
    /// [`ADAPTIVE_GROUP_MAX`], and takes fewer when deliveries are slow, so slow handlers still
    /// run `workers` at a time and a lone job runs and commits at once. With [`Claim::Lock`] a
    /// group is at most [`LOCK_GROUP_MAX`] jobs, whatever `n`.
    pub fn group_size(mut self, n: usize) -> Self {
        self.settings.group_size = Some(n.max(1));
        self
    }

    /// How long a group runs before a transactional worker commits the deliveries it has done
    /// and goes on with the rest of the group in a new transaction (default 20 ms): a slow
    /// handler holds back the commit of the deliveries before it by at most about this long.
    pub fn group_time(mut self, bound: Duration) -> Self {
        self.settings.group_time = bound;
        self
    }

    /// The most jobs a plain worker leases in one call, and acks in one call (default 100).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.settings.batch_size = n.max(1);
        self
    }

    /// How often idle workers look for jobs without being woken by NOTIFY (default 500 ms); it
    /// also bounds how late a delayed job or retry starts.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Whether the worker vacuums its queue when dead rows pile up (default on): see
    /// `docs/operating.md`. Turn it off only where something else vacuums the queue every few
    /// seconds.
    pub fn vacuum(mut self, on: bool) -> Self {
        self.settings.vacuum = on;
        self
    }

    /// The `statement_timeout` of the worker's delivery transactions (default 30 s), set with
    /// `SET LOCAL` as each begins (no session setting is left on the connection).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.settings.statement_timeout = timeout;
        self
    }

    /// The `idle_in_transaction_session_timeout` of the worker's delivery transactions (default
    /// 60 s, set with `SET LOCAL` as each begins): a
    /// handler that keeps its transaction open without using it for longer loses its
    /// connection, its writes and its delivery, which is retried.
    pub fn idle_in_transaction_timeout(mut self, timeout: Duration) -> Self {
        self.settings.idle_in_transaction_timeout = timeout;
        self
    }

    /// Bounds each handler's run (default: unbounded). A handler still running after `timeout`
    /// is dropped where it waits, and its delivery fails like a handler error: retried after the
    /// retry policy's backoff (the attempt counts), or dead-lettered past `max_attempts`. In
    /// transactional mode its writes are rolled back; a statement it had sent finishes first
    /// (bounded by the [`statement_timeout`](Self::statement_timeout)). Calls it made outside the
    /// database may have taken effect, as with any retry. This is the queue's default: a job
    /// enqueued with a timeout of its own ([`EnqueueOptions::timeout`](crate::EnqueueOptions),
    /// `timeout =>` in SQL) is bounded by that instead.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = Some(timeout);
        self
    }

    /// The isolation level of each delivery's transaction (transactional mode; default
    /// [`Isolation::ReadCommitted`]). Above READ COMMITTED the worker needs [`Claim::Lease`]: a
    /// lock would be taken by the transaction's first statement, against a snapshot in which
    /// every job another worker settled meanwhile is a serialization failure.
    ///
    /// At every level, a delivery whose handler fails with a serialization failure (`40001`) or
    /// a deadlock (`40P01`), a [`DbError`] it returns or one among its error's sources, or whose
    /// group's commit does, is
    /// rolled back and run again at once, its attempt unspent and not counted as failed
    /// ([`WorkerStats::reran`]), up to [`conflict_reruns`](Self::conflict_reruns) times; after
    /// that it is a retry like any error.
    pub fn isolation(mut self, level: Isolation) -> Self {
        self.settings.isolation = level;
        self
    }

    /// How many times one delivery runs again at once after a serialization failure or a
    /// deadlock before it counts as a failed attempt (default 3; see
    /// [`isolation`](Self::isolation)).
    pub fn conflict_reruns(mut self, n: u32) -> Self {
        self.settings.conflict_reruns = n;
        self
    }

    /// Starts the worker's tasks on the current tokio runtime.
    ///
    /// # Panics
    /// When the worker is transactional with [`Claim::Lock`] and an [`isolation`](Self::isolation)
    /// above READ COMMITTED, which cannot work.
    pub fn start(self) -> WorkerHandle {
        let transactional = matches!(self.mode, Mode::Transactional(_));
        assert!(
            !(transactional
                && self.settings.claim == Claim::Lock
                && self.settings.isolation.snapshot_per_transaction()),
            "a worker with Claim::Lock runs at READ COMMITTED only; use Claim::Lease for {:?}",
            self.settings.isolation
        );
        let steps = step::StepStore::new(self.db.clone(), self.queue.clone());
        let shared = Arc::new(Shared {
            db: self.db,
            queue: self.queue,
            settings: self.settings,
            counters: Counters::default(),
            wake: Notify::new(),
            idle_slot: Notify::new(),
            idling: AtomicUsize::new(0),
            stop: CancellationToken::new(),
            in_flight: Mutex::new(HashMap::new()),
            progress: job::ProgressNotes::default(),
            steps,
            lock_failures: Mutex::new(HashMap::new()),
            last_found: AtomicU64::new(0),
            began: std::time::Instant::now(),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(listen::run(shared.clone()));
        if shared.settings.vacuum {
            tasks.spawn(crate::vacuum::run(crate::vacuum::Upkeep {
                db: shared.db.clone(),
                table: shared.queue.clone(),
                purge_results: true,
                stop: shared.stop.clone(),
            }));
        }
        let leases = shared.settings.claim == Claim::Lease || matches!(self.mode, Mode::Plain(_));
        if leases && shared.settings.heartbeat {
            tasks.spawn(heartbeat::run(shared.clone()));
        }
        match self.mode {
            Mode::Transactional(handler) => {
                let slots = transactional::slots(&shared);
                if slots < shared.settings.workers {
                    tracing::warn!(queue = %shared.queue, workers = shared.settings.workers, slots,
                        pool = shared.db.pool().status().max_size,
                        "the pool has room for fewer slots than workers asked for (one connection per slot, plus the heartbeat's)");
                }
                for _ in 0..slots {
                    tasks.spawn(transactional::run(shared.clone(), handler.clone()));
                }
            }
            Mode::Plain(handler) => {
                tasks.spawn(plain::run(shared.clone(), handler));
            }
        }
        WorkerHandle { shared, tasks }
    }

    /// Runs the worker until its queue has nothing ready, delayed or leased (dead jobs aside),
    /// then shuts it down: a helper for tests. Delayed jobs and retries are waited for, so use
    /// short retry delays in tests.
    ///
    /// # Errors
    /// The database's error when the queue cannot be read.
    pub async fn run_until_idle(self) -> Result<WorkerStats, DbError> {
        let handle = self.start();
        let idle = async {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let client = handle.shared.db.pool().get().await?;
                if calls::is_idle(
                    &client,
                    handle.shared.db.statement_mode(),
                    &handle.shared.queue,
                )
                .await?
                {
                    return Ok::<(), DbError>(());
                }
            }
        };
        let result = idle.await;
        let stats = handle.shutdown(Duration::from_secs(30)).await;
        result.map(|()| stats)
    }
}

/// A running worker.
pub struct WorkerHandle {
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl WorkerHandle {
    /// What the worker has done so far.
    pub fn stats(&self) -> WorkerStats {
        self.shared.counters.snapshot()
    }

    /// Stops taking jobs, lets the deliveries in progress finish within `deadline`, then
    /// abandons those still running and releases their leases (they run again, with their
    /// attempt counted), so nothing stays leased that is not running. Returns the final counts.
    pub async fn shutdown(mut self, deadline: Duration) -> WorkerStats {
        self.shared.stop.cancel();
        let drained = tokio::time::timeout(deadline, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(queue = %self.shared.queue, "shutdown deadline passed; abandoning deliveries");
            self.tasks.shutdown().await;
        }
        release_abandoned(&self.shared).await;
        self.shared.counters.snapshot()
    }
}

/// Makes the leased jobs whose handlers were abandoned due again now.
async fn release_abandoned(shared: &Shared) {
    let abandoned: Vec<(i64, i64)> = match shared.in_flight.lock() {
        Ok(mut held) => held.drain().map(|(id, (token, _))| (id, token)).collect(),
        Err(_) => return,
    };
    if abandoned.is_empty() {
        return;
    }
    let Ok(client) = shared.db.pool().get().await else {
        tracing::warn!(queue = %shared.queue, jobs = abandoned.len(), "cannot release abandoned leases; they expire on their own");
        return;
    };
    for job in abandoned {
        let released = calls::retry(
            &client,
            shared.db.statement_mode(),
            &shared.queue,
            job,
            Duration::ZERO,
            Some("abandoned at shutdown"),
            None,
        )
        .await;
        if let Err(error) = released {
            tracing::warn!(queue = %shared.queue, id = job.0, %error, "cannot release an abandoned lease");
        }
    }
}

/// Settles a delivery that is not acked with others (a retry, snooze or dead-letter, or a plain
/// worker's ack with a result) through `client`, counting it in `tally`; `false` when the token
/// was no longer the job's.
async fn settle_apart(
    shared: &Shared,
    client: &deadpool_postgres::Object,
    job: &calls::Taken,
    outcome: Outcome,
    tally: &mut WorkerStats,
) -> Result<bool, DbError> {
    let fence = (job.id, job.token);
    match outcome {
        Outcome::Ack => Ok(true),
        Outcome::AckWith { result } => {
            let statements = shared.db.statement_mode();
            let applied = calls::with_json(
                client,
                statements,
                crate::sql::QUEUE_ACK_WITH_RESULT,
                &shared.queue,
                fence,
                &result,
            )
            .await?;
            tally.acked += u64::from(applied);
            Ok(applied)
        }
        Outcome::Snooze { after } => {
            let statements = shared.db.statement_mode();
            let applied = calls::snooze(client, statements, &shared.queue, fence, after).await?;
            tally.snoozed += u64::from(applied);
            Ok(applied)
        }
        Outcome::Dead { reason } => {
            let statements = shared.db.statement_mode();
            let applied = calls::dead(client, statements, &shared.queue, fence, &reason).await?;
            tally.dead += u64::from(applied);
            Ok(applied)
        }
        Outcome::Retry { after, reason } => {
            let policy = &shared.settings.retry;
            let delay = after.unwrap_or_else(|| policy.delay(job.attempt));
            let applied = calls::retry(
                client,
                shared.db.statement_mode(),
                &shared.queue,
                fence,
                delay,
                reason.as_deref(),
                policy.max_attempts,
            )
            .await?;
            if applied {
                if policy.max_attempts.is_some_and(|max| job.attempt >= max) {
                    tally.dead += 1;
                } else {
                    tally.retried += 1;
                }
            }
            Ok(applied)
        }
    }
}
