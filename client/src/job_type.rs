//! [`JobType`]: a payload type that names its queue.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::database::Database;
use crate::error::DbError;
use crate::queue::{EnqueueOptions, Queue};

/// A job's payload type, bound to the queue table its jobs go to: it is enqueued with
/// [`enqueue`](JobType::enqueue) and worked with
/// [`Worker::transactional_for`](crate::worker::Worker::transactional_for) or
/// [`Worker::plain_for`](crate::worker::Worker::plain_for), with no queue name repeated.
///
/// The payload travels as JSON (serde). Enqueueing goes through any [`Database`]: a pool, or a
/// transaction the caller holds ([`PgTransaction`](crate::PgTransaction), a handler's
/// [`Tx`](crate::worker::Tx)), where the job is enqueued only if that transaction commits.
///
/// ```no_run
/// use inbox_client::{Database, JobType, PgTransaction, Statement, EnqueueOptions};
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
/// # async fn run(db: &inbox_client::PgDatabase) -> Result<(), inbox_client::DbError> {
/// // In the caller's transaction: the order's update and its refund job commit together.
/// let mut client = db.pool().get().await?;
/// let tx = client.transaction().await?;
/// let port = PgTransaction::new(&tx);
/// port.execute(&Statement::new("UPDATE orders SET state = 'refunding' WHERE id = $1").bind(42_i64))
///     .await?;
/// Refund { order_id: 42, cents: 1999 }.enqueue(&port).await?;
/// // With options: deduplicated by key, a job of an ordered group.
/// Refund { order_id: 43, cents: 500 }
///     .enqueue_with(&port, &EnqueueOptions::default().key("refund-43").group_key("customer-7"))
///     .await?;
/// tx.commit().await?;
/// # Ok(())
/// # }
/// ```
pub trait JobType: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The queue table the jobs go to, named as in SQL (`"refund_jobs"`, `"app.jobs"`).
    const QUEUE: &'static str;

    /// The queue, for what else it does (counts, dead jobs, pause, schedules, batches).
    fn queue() -> Queue {
        Queue::new(Self::QUEUE)
    }

    /// Enqueues this job, due now, through `db` (inside its transaction, if it is one); returns
    /// the job's id.
    ///
    /// # Errors
    /// As [`Queue::enqueue`].
    fn enqueue(
        &self,
        db: &dyn Database,
    ) -> impl Future<Output = Result<Option<i64>, DbError>> + Send {
        async move { Self::queue().enqueue(db, self, None, None).await }
    }

    /// Enqueues this job with `options` (due time, key, priority, group, timeout) through `db`;
    /// returns the job's id, or `None` when a job with the same key is already queued.
    ///
    /// # Errors
    /// As [`Queue::enqueue_with`].
    fn enqueue_with(
        &self,
        db: &dyn Database,
        options: &EnqueueOptions,
    ) -> impl Future<Output = Result<Option<i64>, DbError>> + Send {
        async move { Self::queue().enqueue_with(db, self, options).await }
    }
}
