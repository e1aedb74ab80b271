//! [`Queue`]: a job queue table, as producers and operators see it.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::sql;
use crate::statement::Statement;

/// A job queue table of the extension, named as it is in SQL (`"refund_jobs"`, `"app.jobs"`).
///
/// Enqueueing goes through the [`Database`] port, so a job enqueued inside a handler's delivery
/// transaction ([`PgTransaction`](crate::PgTransaction)) becomes visible only if that
/// transaction commits: a chain of jobs that never sees a rolled-back step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queue {
    table: String,
}

/// How many jobs of a queue are in each state (see `inbox_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Due and not taken.
    pub ready: i64,
    /// Scheduled for later, or waiting for a retry.
    pub delayed: i64,
    /// Held by a worker's lease.
    pub leased: i64,
    /// Dead-lettered, kept for an operator.
    pub dead: i64,
}

impl Queue {
    /// The queue stored in `table`.
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
        }
    }

    /// The table's name as given.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The statement that creates the queue table unless it exists (`inbox_create_queue`).
    pub fn create_statement(&self) -> Statement {
        Statement::new(sql::QUEUE_CREATE).bind(self.table.as_str())
    }

    /// The statement that enqueues `payload` as JSON, due at `run_at` (now when `None`), deduped
    /// by `key`; run it alone or inside a batch or transaction.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `payload` does not serialize to JSON.
    pub fn enqueue_statement<T: Serialize + ?Sized>(
        &self,
        payload: &T,
        run_at: Option<DateTime<Utc>>,
        key: Option<&str>,
    ) -> Result<Statement, DbError> {
        let json = serde_json::to_value(payload)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payload: {e}")))?;
        Ok(Statement::new(sql::QUEUE_ENQUEUE)
            .bind(self.table.as_str())
            .bind(json)
            .bind(run_at)
            .bind(key.map(str::to_owned)))
    }

    /// Enqueues `payload` through `db`; returns the job's id, or `None` when a job with `key` is
    /// already queued. Idle workers are woken when the enqueue commits.
    ///
    /// # Errors
    /// As [`enqueue_statement`](Self::enqueue_statement), or the database's error.
    pub async fn enqueue<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        payload: &T,
        run_at: Option<DateTime<Utc>>,
        key: Option<&str>,
    ) -> Result<Option<i64>, DbError> {
        let rows = db
            .query(&self.enqueue_statement(payload, run_at, key)?)
            .await?;
        rows.one()?.get::<Option<i64>>("inbox_enqueue")
    }

    /// Enqueues every payload of `payloads` in one statement, due now, in order; returns the
    /// new jobs' ids.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when a payload does not serialize to JSON, or the database's
    /// error.
    pub async fn enqueue_batch<T: Serialize>(
        &self,
        db: &dyn Database,
        payloads: &[T],
    ) -> Result<Vec<i64>, DbError> {
        let json = serde_json::to_value(payloads)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payloads: {e}")))?;
        let statement = Statement::new(sql::QUEUE_ENQUEUE_BATCH)
            .bind(self.table.as_str())
            .bind(json);
        db.query(&statement)
            .await?
            .iter()
            .map(|row| row.get::<i64>("id"))
            .collect()
    }

    /// The queue's counts by state.
    ///
    /// # Errors
    /// The database's error.
    pub async fn stats(&self, db: &dyn Database) -> Result<QueueStats, DbError> {
        let rows = db
            .query(&Statement::new(sql::QUEUE_STATS).bind(self.table.as_str()))
            .await?;
        let row = rows.one()?;
        Ok(QueueStats {
            ready: row.get("ready")?,
            delayed: row.get("delayed")?,
            leased: row.get("leased")?,
            dead: row.get("dead")?,
        })
    }
}
