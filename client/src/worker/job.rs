//! What a handler receives and returns.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::database::Database;

use super::step::{StepError, Steps};
use super::tx::Tx;

/// Progress recorded by running handlers, by job, until the heartbeat sends it.
pub(crate) type ProgressNotes = Arc<Mutex<HashMap<i64, serde_json::Value>>>;

/// One delivery of a job: its payload decoded from JSON, and which delivery this is.
#[derive(Clone, Debug)]
pub struct Job<T> {
    /// The job's id in its queue table.
    pub id: i64,
    /// Deliveries so far, this one included (1 on the first).
    pub attempt: i32,
    /// The payload, decoded.
    pub payload: T,
    lost: CancellationToken,
    progress: ProgressNotes,
    steps: Steps,
}

impl<T> Job<T> {
    pub(crate) fn new(
        id: i64,
        attempt: i32,
        payload: T,
        lost: CancellationToken,
        progress: ProgressNotes,
        steps: Steps,
    ) -> Self {
        Job {
            id,
            attempt,
            payload,
            lost,
            progress,
            steps,
        }
    }

    /// Runs `step` once per job: its result is recorded in the database as soon as it returns,
    /// in a transaction of its own (not the delivery's, which may roll back), and a later
    /// delivery of the job (a retry, a lost lease, a crash) gets the recorded result instead of
    /// running `step` again. The way to call a service outside the database once per job, such
    /// as charging a card, when a later part of the handler may fail.
    ///
    /// A step is keyed by its queue, job and `name`; a name used twice in one delivery is an
    /// error ([`StepError::NameReused`]). If `step` fails or panics nothing is recorded, and the
    /// next delivery runs it again. The result goes through JSON (`serde_json`), so the type the
    /// next delivery asks for must read what this one wrote.
    ///
    /// What is guaranteed: a recorded step is not run again. What is not: a crash, or a lost
    /// connection, between the outside call and its record runs the call again on the next
    /// delivery. Pass [`step_key`](Job::step_key) to the outside service as its idempotency key,
    /// so that it can tell the repeat.
    ///
    /// Records are kept while the job is in its queue and deleted by the worker's upkeep
    /// (`inbox_purge_results`, every 10 s) once it is gone; `inbox_job_steps(queue, id)` lists
    /// them. Each record takes a connection of the worker's pool for one statement: the pool's
    /// connection beyond the worker's slots, shared with the heartbeat.
    ///
    /// ```no_run
    /// use inbox_client::worker::{HandlerResult, Job, Outcome, Tx};
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Refund { order_id: i64, cents: i64 }
    /// # async fn refund_card(order: i64, cents: i64, key: &str) -> Result<String, std::io::Error> { Ok(String::new()) }
    /// # async fn send_receipt(order: i64, key: &str) -> Result<(), std::io::Error> { Ok(()) }
    ///
    /// async fn refund(job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
    ///     let Refund { order_id, cents } = job.payload;
    ///     // Once per job, even when the receipt below fails and the job is retried.
    ///     let key = job.step_key("refund-card");
    ///     let refund_id: String = job
    ///         .step("refund-card", || refund_card(order_id, cents, &key))
    ///         .await?;
    ///     let key = job.step_key("receipt");
    ///     job.step("receipt", || send_receipt(order_id, &key)).await?;
    ///     tx.client()
    ///         .await?
    ///         .execute("UPDATE orders SET refund = $2 WHERE id = $1", &[&order_id, &refund_id])
    ///         .await?;
    ///     Ok(Outcome::ack())
    /// }
    /// ```
    ///
    /// # Errors
    /// [`StepError`]: the step failed, its name was used before in this delivery, its result
    /// does not convert to or from JSON, or the database failed.
    pub async fn step<R, F, Fut, E>(&self, name: &str, step: F) -> Result<R, StepError>
    where
        R: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<R, E>>,
        E: Into<Box<dyn StdError + Send + Sync>>,
    {
        self.steps.run(name, step).await
    }

    /// The idempotency key of step `name` of this job: the same in every delivery of the job
    /// and different for every other job and step (`inbox:<queue>:<job id>:<name>`). Pass it to
    /// the service a [`step`](Job::step) calls, so that a call repeated after a crash between
    /// the call and its record is recognised there.
    pub fn step_key(&self, name: &str) -> String {
        self.steps.key(name)
    }

    /// Records how far the handler got (a small JSON value, at most 8 KiB as text): the
    /// worker's heartbeat writes the latest one on the job's row with its next extension of the
    /// lease (`inbox_set_progress`, fenced by the lease), where `inbox_jobs`, `inbox_result` and
    /// `inbox jobs` show it. Only leased deliveries with the heartbeat on carry it.
    pub fn set_progress(&self, progress: serde_json::Value) {
        if let Ok(mut notes) = self.progress.lock() {
            notes.insert(self.id, progress);
        }
    }

    /// Completes once this delivery is over while its handler runs: the job was cancelled
    /// (`inbox_cancel`), or its lease was lost to another worker. The worker's heartbeat finds
    /// out (within a third of the lease, no `LISTEN` needed), so only leased deliveries with the
    /// heartbeat on are told. Whatever the handler does after that is not kept: its settlement
    /// is refused, and in transactional mode its writes roll back. A handler that waits on
    /// something slow can select on it to stop early.
    pub async fn cancelled(&self) {
        self.lost.cancelled().await;
    }

    /// Whether [`Job::cancelled`] has completed.
    pub fn is_cancelled(&self) -> bool {
        self.lost.is_cancelled()
    }
}

/// What becomes of a job after its handler ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done: the job is deleted (in transactional mode, in the commit of the handler's writes).
    Ack,
    /// Done, with a result that is kept (`inbox_result`) for the queue's retention, or a day:
    /// in transactional mode, recorded in the delivery's transaction, so that it commits with
    /// the handler's writes and the ack.
    AckWith {
        /// What the job produced.
        result: serde_json::Value,
    },
    /// Run it again after a delay; `None` takes the delay from the worker's
    /// [`RetryPolicy`](super::RetryPolicy). Past `max_attempts` the job is dead-lettered instead.
    Retry {
        /// The delay before the next delivery, or `None` for the policy's backoff.
        after: Option<Duration>,
        /// Recorded in the job's `last_error`.
        reason: Option<String>,
    },
    /// Run the job again after `after` without spending an attempt (its writes roll back, as for
    /// a retry): the next delivery reports the same attempt, and `max_attempts` is not reached by
    /// snoozing. Needs the queue's `snoozes` column (`inbox_create_queue` makes it).
    Snooze {
        /// The delay before the next delivery.
        after: Duration,
    },
    /// Dead-letter the job: it stays in the table, with `reason`, for an operator.
    Dead {
        /// Recorded in the job's `last_error`.
        reason: String,
    },
}

impl Outcome {
    /// The job is done.
    pub fn ack() -> Self {
        Outcome::Ack
    }

    /// The job is done, with `result` kept for whoever asks (`Queue::result`,
    /// `ResultWaiter::wait`).
    pub fn ack_with(result: serde_json::Value) -> Self {
        Outcome::AckWith { result }
    }

    /// Run the job again after the policy's backoff (the attempt counts).
    pub fn retry() -> Self {
        Outcome::Retry {
            after: None,
            reason: None,
        }
    }

    /// Run the job again after `delay` (the attempt counts).
    pub fn retry_after(delay: Duration) -> Self {
        Outcome::Retry {
            after: Some(delay),
            reason: None,
        }
    }

    /// Run the job again after `delay` without spending an attempt ([`Outcome::Snooze`]).
    pub fn snooze(delay: Duration) -> Self {
        Outcome::Snooze { after: delay }
    }

    /// Dead-letter the job with `reason`; it will not run again.
    pub fn dead(reason: impl Into<String>) -> Self {
        Outcome::Dead {
            reason: reason.into(),
        }
    }

    /// Drop the job (a duplicate, an invalid request): the same as [`dead`](Self::dead), so the
    /// job stays visible to an operator rather than vanishing.
    pub fn drop(reason: impl Into<String>) -> Self {
        Self::dead(reason)
    }
}

/// A handler's error: the delivery is retried like [`Outcome::retry`], its writes rolled back.
pub type HandlerError = Box<dyn StdError + Send + Sync>;

/// What a handler returns.
pub type HandlerResult = Result<Outcome, HandlerError>;

/// A boxed, sendable future borrowing for `'a`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A handler that writes through its delivery's transaction: what it writes through `tx`
/// commits together with the job's settlement on [`Outcome::Ack`], and not at all otherwise.
///
/// Any `Fn(Job<T>, &dyn Database) -> BoxFuture<HandlerResult>` is one; wrap a closure in
/// [`transactional`] to help type inference:
///
/// ```
/// use inbox_client::worker::{transactional, Outcome};
/// use inbox_client::{Database, Statement};
///
/// let handler = transactional(|job: inbox_client::worker::Job<i64>, tx: &dyn Database| {
///     Box::pin(async move {
///         tx.execute(&Statement::new("INSERT INTO done (n) VALUES ($1)").bind(job.payload))
///             .await?;
///         Ok(Outcome::ack())
///     })
/// });
/// # let _ = handler;
/// ```
pub trait TxHandler<T>: Send + Sync + 'static {
    /// Handles one delivery, writing through `tx`.
    fn handle<'a>(&'a self, job: Job<T>, tx: &'a dyn Database) -> BoxFuture<'a, HandlerResult>;
}

impl<T, F> TxHandler<T> for F
where
    F: for<'a> Fn(Job<T>, &'a dyn Database) -> BoxFuture<'a, HandlerResult> + Send + Sync + 'static,
{
    fn handle<'a>(&'a self, job: Job<T>, tx: &'a dyn Database) -> BoxFuture<'a, HandlerResult> {
        self(job, tx)
    }
}

/// Gives a closure the signature of a [`TxHandler`] (closures borrowing an argument need it
/// spelled out).
pub fn transactional<T, F>(handler: F) -> F
where
    F: for<'a> Fn(Job<T>, &'a dyn Database) -> BoxFuture<'a, HandlerResult> + Send + Sync + 'static,
{
    handler
}

/// A handler that needs no transaction (plain mode): it may write through a pool of its own,
/// and those writes commit on their own whatever the outcome.
pub trait Handler<T>: Send + Sync + 'static {
    /// Handles one delivery.
    fn handle(&self, job: Job<T>) -> BoxFuture<'static, HandlerResult>;
}

impl<T, F, Fut> Handler<T> for F
where
    F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'static,
{
    fn handle(&self, job: Job<T>) -> BoxFuture<'static, HandlerResult> {
        Box::pin(self(job))
    }
}

/// A transactional handler written with a native `async fn`: what it writes through `tx` (the
/// [`Database`] port, or the driver's connection from [`Tx::client`]) commits together with the
/// job's settlement on [`Outcome::Ack`], and not at all otherwise.
///
/// Implement it on a type that holds what the handler needs (clients, settings), or pass an
/// `async fn(Job<T>, &Tx<'_>) -> HandlerResult` (or an async closure that captures nothing),
/// which is one already (see [`AsyncTxFn`]). Run it with
/// [`Worker::transactional_for`](super::Worker::transactional_for).
///
/// ```no_run
/// use inbox_client::worker::{AsyncTxHandler, HandlerResult, Job, Outcome, Tx, Worker};
/// use inbox_client::{JobType, PgDatabase};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Refund {
///     order_id: i64,
///     cents: i32,
/// }
///
/// impl JobType for Refund {
///     const QUEUE: &'static str = "refund_jobs";
/// }
///
/// struct Refunds {
///     max_cents: i32,
/// }
///
/// impl AsyncTxHandler<Refund> for Refunds {
///     async fn handle(&self, job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
///         let refund = &job.payload;
///         if refund.cents > self.max_cents {
///             return Ok(Outcome::dead("above the refund limit"));
///         }
///         tx.client()
///             .await?
///             .execute(
///                 "INSERT INTO refunds (order_id, cents) VALUES ($1, $2)",
///                 &[&refund.order_id, &refund.cents],
///             )
///             .await?;
///         Ok(Outcome::ack())
///     }
/// }
///
/// # async fn run(db: PgDatabase) {
/// let worker = Worker::transactional_for(db, Refunds { max_cents: 100_000 }).start();
/// # let _ = worker;
/// # }
/// ```
pub trait AsyncTxHandler<T>: Send + Sync + 'static {
    /// Handles one delivery, writing through `tx`.
    fn handle(&self, job: Job<T>, tx: &Tx<'_>) -> impl Future<Output = HandlerResult> + Send;
}

/// What makes an `async fn(Job<T>, &Tx<'_>) -> HandlerResult` an [`AsyncTxHandler`]: its future
/// borrows the transaction, so the function cannot be named by a plain `Fn(..) -> Fut` bound.
/// It is implemented for every such function, and for async closures that capture nothing
/// (`async |job: Job<T>, tx: &Tx<'_>| { .. }`); there is nothing to implement by hand.
///
/// A closure that captures state cannot be one (the future it returns would borrow the
/// closure, which a `Send` bound cannot yet be put on in stable Rust): put the state in a type
/// that implements [`AsyncTxHandler`].
///
/// ```no_run
/// use inbox_client::worker::{HandlerResult, Job, Outcome, Tx, Worker};
/// use inbox_client::{Database, JobType, PgDatabase, Statement};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Refund { order_id: i64 }
/// # impl JobType for Refund { const QUEUE: &'static str = "refund_jobs"; }
///
/// async fn refund(job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
///     tx.execute(&Statement::new("INSERT INTO refunds (order_id) VALUES ($1)")
///         .bind(job.payload.order_id))
///         .await?;
///     Ok(Outcome::ack())
/// }
///
/// # async fn run(db: PgDatabase) {
/// let worker = Worker::transactional_for(db.clone(), refund).start();
/// // Or inline:
/// let other = Worker::transactional_for(db, async |job: Job<Refund>, tx: &Tx<'_>| {
///     tx.client().await?
///         .execute("DELETE FROM holds WHERE order_id = $1", &[&job.payload.order_id])
///         .await?;
///     Ok(Outcome::ack())
/// })
/// .start();
/// # let _ = (worker, other);
/// # }
/// ```
pub trait AsyncTxFn<'a, T>: Send + Sync + 'static {
    /// The future of one call.
    type Future: Future<Output = HandlerResult> + Send + 'a;

    /// Calls the function.
    fn call(&'a self, job: Job<T>, tx: &'a Tx<'a>) -> Self::Future;
}

impl<'a, T, F, Fut> AsyncTxFn<'a, T> for F
where
    F: Fn(Job<T>, &'a Tx<'a>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&'a self, job: Job<T>, tx: &'a Tx<'a>) -> Fut {
        self(job, tx)
    }
}

impl<T: Send, F> AsyncTxHandler<T> for F
where
    F: for<'a> AsyncTxFn<'a, T>,
{
    // An `async fn`, so that the call's future may borrow for the shortest of the lifetimes.
    async fn handle(&self, job: Job<T>, tx: &Tx<'_>) -> HandlerResult {
        self.call(job, tx).await
    }
}

/// A handler that needs no transaction (plain mode), written with a native `async fn`: it may
/// write through a pool of its own, and those writes commit on their own whatever the outcome.
///
/// Implement it on a type that holds what the handler needs, or pass an
/// `async fn(Job<T>) -> HandlerResult` or a closure returning a future, which are ones already.
/// Run it with [`Worker::plain_for`](super::Worker::plain_for).
///
/// ```no_run
/// use inbox_client::worker::{AsyncHandler, HandlerResult, Job, Outcome, Worker};
/// use inbox_client::{JobType, PgDatabase};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Email {
///     to: String,
/// }
///
/// impl JobType for Email {
///     const QUEUE: &'static str = "email_jobs";
/// }
///
/// struct Mailer {
///     from: String,
/// }
///
/// impl AsyncHandler<Email> for Mailer {
///     async fn handle(&self, job: Job<Email>) -> HandlerResult {
///         println!("{} -> {}", self.from, job.payload.to);
///         Ok(Outcome::ack())
///     }
/// }
///
/// async fn log_email(job: Job<Email>) -> HandlerResult {
///     println!("to {}", job.payload.to);
///     Ok(Outcome::ack())
/// }
///
/// # async fn run(db: PgDatabase) {
/// let mailer = Worker::plain_for(db.clone(), Mailer { from: "shop@example.com".into() }).start();
/// let logger = Worker::plain_for(db, log_email).start();
/// # let _ = (mailer, logger);
/// # }
/// ```
///
/// A plain handler has no transaction to write in, so one that asks for it is refused:
///
/// ```compile_fail
/// use inbox_client::worker::{HandlerResult, Job, Outcome, Tx, Worker};
/// use inbox_client::{JobType, PgDatabase};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Email { to: String }
/// # impl JobType for Email { const QUEUE: &'static str = "email_jobs"; }
///
/// async fn send(job: Job<Email>, tx: &Tx<'_>) -> HandlerResult {
///     Ok(Outcome::ack())
/// }
///
/// # fn run(db: PgDatabase) {
/// let worker = Worker::plain_for(db, send);
/// # }
/// ```
pub trait AsyncHandler<T>: Send + Sync + 'static {
    /// Handles one delivery.
    fn handle(&self, job: Job<T>) -> impl Future<Output = HandlerResult> + Send;
}

impl<T, F, Fut> AsyncHandler<T> for F
where
    F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send,
{
    fn handle(&self, job: Job<T>) -> impl Future<Output = HandlerResult> + Send {
        self(job)
    }
}

/// What a transactional worker runs: a handler of either form behind one object.
pub(crate) trait Deliver<T>: Send + Sync + 'static {
    fn deliver<'a>(&'a self, job: Job<T>, tx: &'a Tx<'a>) -> BoxFuture<'a, HandlerResult>;
}

/// A [`TxHandler`], which sees the transaction as the port only.
pub(crate) struct ThroughPort<H>(pub(crate) H);

impl<T: 'static, H: TxHandler<T>> Deliver<T> for ThroughPort<H> {
    fn deliver<'a>(&'a self, job: Job<T>, tx: &'a Tx<'a>) -> BoxFuture<'a, HandlerResult> {
        self.0.handle(job, tx.database())
    }
}

/// An [`AsyncTxHandler`], its future boxed here rather than by the user.
pub(crate) struct Native<H>(pub(crate) H);

impl<T: Send + 'static, H: AsyncTxHandler<T>> Deliver<T> for Native<H> {
    fn deliver<'a>(&'a self, job: Job<T>, tx: &'a Tx<'a>) -> BoxFuture<'a, HandlerResult> {
        Box::pin(self.0.handle(job, tx))
    }
}

/// An [`AsyncHandler`] as the plain worker runs it: its future owns a share of the handler, as
/// the fetcher's tasks need.
pub(crate) struct NativePlain<H>(pub(crate) Arc<H>);

impl<T: Send + 'static, H: AsyncHandler<T>> Handler<T> for NativePlain<H> {
    fn handle(&self, job: Job<T>) -> BoxFuture<'static, HandlerResult> {
        let handler = self.0.clone();
        Box::pin(async move { handler.handle(job).await })
    }
}
