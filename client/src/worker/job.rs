//! What a handler receives and returns.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::database::Database;

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
}

impl<T> Job<T> {
    pub(crate) fn new(
        id: i64,
        attempt: i32,
        payload: T,
        lost: CancellationToken,
        progress: ProgressNotes,
    ) -> Self {
        Job {
            id,
            attempt,
            payload,
            lost,
            progress,
        }
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
