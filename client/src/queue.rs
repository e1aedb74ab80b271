//! [`Queue`]: a job queue table, as producers and operators see it.

use std::time::Duration;

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

/// How a job is enqueued, beyond its payload (see `inbox_enqueue`). `Default` is a job due now,
/// without a key, of priority 0 and in no group.
///
/// ```
/// use inbox_client::EnqueueOptions;
/// let options = EnqueueOptions::default().key("order-42").priority(10).group_key("customer-7");
/// assert_eq!(options.priority, 10);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnqueueOptions {
    /// When the job is due (now when `None`).
    pub run_at: Option<DateTime<Utc>>,
    /// Dedup key: while a job with this key is queued, enqueueing another inserts nothing.
    pub key: Option<String>,
    /// Higher runs first; the queue needs a `priority` column unless it is 0.
    pub priority: i32,
    /// Jobs of one group run one at a time, in enqueue order.
    pub group_key: Option<String>,
    /// Bounds the job's handler, in place of the worker's
    /// [`handler_timeout`](crate::worker::Worker::handler_timeout); the queue needs a `timeout`
    /// column.
    pub timeout: Option<Duration>,
}

impl EnqueueOptions {
    /// Due at `run_at`.
    pub fn run_at(mut self, run_at: DateTime<Utc>) -> Self {
        self.run_at = Some(run_at);
        self
    }

    /// Deduped by `key`.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Of priority `priority` (higher first).
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// In the ordered group `group_key`.
    pub fn group_key(mut self, group_key: impl Into<String>) -> Self {
        self.group_key = Some(group_key.into());
        self
    }

    /// Its handler bounded by `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// How a batch is enqueued (see `inbox_enqueue_batch`): one due time and priority for all its
/// jobs, and optionally a key and a group key per job (`None` for a job without one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOptions {
    /// When the jobs are due (now when `None`).
    pub run_at: Option<DateTime<Utc>>,
    /// One dedup key per payload.
    pub keys: Option<Vec<Option<String>>>,
    /// The jobs' priority.
    pub priority: i32,
    /// One group key per payload; within a group, jobs run in array order.
    pub group_keys: Option<Vec<Option<String>>>,
    /// Bounds each job's handler (see [`EnqueueOptions::timeout`]).
    pub timeout: Option<Duration>,
}

/// A dead-lettered job (see `inbox_dead_jobs`).
#[derive(Clone, Debug, PartialEq)]
pub struct DeadJob {
    /// The job's id.
    pub id: i64,
    /// Deliveries it had.
    pub attempt: i32,
    /// The last retry's error, or the dead-letter reason.
    pub last_error: Option<String>,
    /// When it was dead-lettered (`None` on a table without a `dead_at` column).
    pub dead_at: Option<DateTime<Utc>>,
    /// The payload of a `jsonb` queue.
    pub payload: Option<serde_json::Value>,
    /// The payload of a `bytea` queue.
    pub payload_bytes: Option<Vec<u8>>,
}

/// How many jobs of a queue are in each state, and whether it is paused (see `inbox_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Due and not taken.
    pub ready: i64,
    /// Scheduled for later, waiting for a retry, or waiting behind its group's head.
    pub delayed: i64,
    /// Held by a worker's lease.
    pub leased: i64,
    /// Dead-lettered, kept for an operator.
    pub dead: i64,
    /// Whether the queue is paused ([`Queue::pause`]): its ready jobs wait for the resume.
    pub paused: bool,
}

/// At most `starts` jobs of a queue start in any window of length `per` (see
/// [`Queue::set_rate_limit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// How many starts a window holds (1 to 10,000).
    pub starts: i32,
    /// The window (at most a day).
    pub per: Duration,
}

impl RateLimit {
    /// `starts` per `per`.
    pub fn new(starts: i32, per: Duration) -> Self {
        Self { starts, per }
    }
}

/// A queue's limits and how much of them is in use (see `inbox_limits`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    /// How many jobs may run at once ([`Queue::set_concurrency`]).
    pub concurrency: Option<i32>,
    /// How many leased jobs hold a slot of that limit now.
    pub running: Option<i64>,
    /// How many jobs may start in a window ([`Queue::set_rate_limit`]).
    pub rate: Option<RateLimit>,
    /// How many started within the window that ends now.
    pub recent_starts: Option<i64>,
    /// How many jobs of one key may run at once ([`Queue::set_concurrency_per_key`]).
    pub key_concurrency: Option<i32>,
    /// The payload's field whose value is a job's key.
    pub per_key: Option<String>,
    /// How many keys have leased jobs holding their slots now.
    pub keys_running: Option<i64>,
    /// The most leased jobs of one key holding its slots now.
    pub most_running_per_key: Option<i64>,
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
        let options = EnqueueOptions {
            run_at,
            key: key.map(str::to_owned),
            ..EnqueueOptions::default()
        };
        self.enqueue_statement_with(payload, &options)
    }

    /// The statement that enqueues `payload` as JSON with `options`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `payload` does not serialize to JSON.
    pub fn enqueue_statement_with<T: Serialize + ?Sized>(
        &self,
        payload: &T,
        options: &EnqueueOptions,
    ) -> Result<Statement, DbError> {
        let json = serde_json::to_value(payload)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payload: {e}")))?;
        Ok(Statement::new(sql::QUEUE_ENQUEUE)
            .bind(self.table.as_str())
            .bind(json)
            .bind(options.run_at)
            .bind(options.key.clone())
            .bind(options.priority)
            .bind(options.group_key.clone())
            .bind(options.timeout.map(|timeout| timeout.as_secs_f64())))
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

    /// Enqueues `payload` with `options` (due time, key, priority, group); returns the job's id,
    /// or `None` when a job with the key is already queued.
    ///
    /// # Errors
    /// As [`enqueue_statement_with`](Self::enqueue_statement_with), or the database's error
    /// (`42703` when the queue lacks the column a priority or group needs).
    pub async fn enqueue_with<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        payload: &T,
        options: &EnqueueOptions,
    ) -> Result<Option<i64>, DbError> {
        let rows = db
            .query(&self.enqueue_statement_with(payload, options)?)
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
        self.enqueue_batch_with(db, payloads, &BatchOptions::default())
            .await
    }

    /// Enqueues every payload of `payloads` in one statement, in order, with `options`; returns
    /// the ids of the jobs inserted (those whose key was already queued are skipped).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when a payload does not serialize to JSON or `keys` or
    /// `group_keys` are not one per payload, or the database's error.
    pub async fn enqueue_batch_with<T: Serialize>(
        &self,
        db: &dyn Database,
        payloads: &[T],
        options: &BatchOptions,
    ) -> Result<Vec<i64>, DbError> {
        let json = serde_json::to_value(payloads)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payloads: {e}")))?;
        let per_job = |values: &Option<Vec<Option<String>>>, name: &str| match values {
            None => Ok(None),
            Some(values) if values.len() == payloads.len() => Ok(Some(serde_json::json!(values))),
            Some(values) => Err(DbError::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} {name} given for {} payloads",
                    values.len(),
                    payloads.len()
                ),
            )),
        };
        let statement = Statement::new(sql::QUEUE_ENQUEUE_BATCH)
            .bind(self.table.as_str())
            .bind(json)
            .bind(options.run_at)
            .bind(per_job(&options.keys, "keys")?)
            .bind(options.priority)
            .bind(per_job(&options.group_keys, "group_keys")?)
            .bind(options.timeout.map(|timeout| timeout.as_secs_f64()));
        db.query(&statement)
            .await?
            .iter()
            .map(|row| row.get::<i64>("id"))
            .collect()
    }

    /// Pauses the queue once `db`'s transaction commits (at once through a pool): from then on
    /// leases and locks hand out nothing, while deliveries already running finish and settle.
    /// Returns `false` when it was paused already.
    ///
    /// # Errors
    /// The database's error (`42703` for a table that is not a queue, `42501` without `UPDATE`
    /// on it).
    pub async fn pause(&self, db: &dyn Database) -> Result<bool, DbError> {
        let statement = Statement::new(sql::QUEUE_PAUSE).bind(self.table.as_str());
        db.query(&statement).await?.one()?.get("changed")
    }

    /// Resumes a paused queue once `db`'s transaction commits and wakes its sleeping workers.
    /// Returns `false` when it was not paused.
    ///
    /// # Errors
    /// As [`Queue::pause`].
    pub async fn resume(&self, db: &dyn Database) -> Result<bool, DbError> {
        let statement = Statement::new(sql::QUEUE_RESUME).bind(self.table.as_str());
        db.query(&statement).await?.one()?.get("changed")
    }

    /// Since when the queue is paused, or `None` while it runs.
    ///
    /// # Errors
    /// The database's error.
    pub async fn paused_since(&self, db: &dyn Database) -> Result<Option<DateTime<Utc>>, DbError> {
        let statement = Statement::new(sql::QUEUE_PAUSED_SINCE).bind(self.table.as_str());
        db.query(&statement).await?.one()?.get("paused_at")
    }

    /// Sets how many jobs of the queue may run at once across all its workers and processes
    /// (`None`: no limit), once `db`'s transaction commits. A job runs from its lease until it
    /// is settled or its lease expires; lowering the limit lets the jobs above it finish, and
    /// starts nothing until they have. Waits for the transactions holding its slots
    /// (`inbox_lock`) to end.
    ///
    /// # Errors
    /// The database's error (`22023` for a limit outside 1 to 10,000, `42703` for a table that
    /// does not record its leases).
    pub async fn set_concurrency(&self, db: &dyn Database, n: Option<i32>) -> Result<(), DbError> {
        let statement = Statement::new(sql::QUEUE_SET_CONCURRENCY)
            .bind(self.table.as_str())
            .bind(n);
        db.query(&statement).await.map(drop)
    }

    /// Sets how many jobs of one key may run at once across all the queue's workers and
    /// processes (`None`: no limit), once `db`'s transaction commits; a job's key is the value
    /// of its payload's field `per_key` (the same key for every payload without it). Keys with
    /// jobs due take turns, least recently served first, so one key's backlog does not hold the
    /// others back. One field per queue: setting another replaces the limit. It makes an index
    /// on the queue (as its owner; it waits for the queue's writers) and drops it with the limit.
    ///
    /// # Errors
    /// The database's error (`22023` for a limit outside 1 to 10,000 or an empty field, `42804`
    /// for a queue of `bytea` payloads, `42703` for a table that does not record its leases,
    /// `42501` for a role that does not own the queue).
    pub async fn set_concurrency_per_key(
        &self,
        db: &dyn Database,
        per_key: &str,
        n: Option<i32>,
    ) -> Result<(), DbError> {
        let statement = Statement::new(sql::QUEUE_SET_KEY_CONCURRENCY)
            .bind(self.table.as_str())
            .bind(n)
            .bind(per_key);
        db.query(&statement).await.map(drop)
    }

    /// Sets how many jobs of the queue may start in any window of `rate.per` (`None`: no limit),
    /// once `db`'s transaction commits. A start is a lease (or a lock), on the server's clock;
    /// a lease limited by it returns fewer jobs, and idle workers sleep until their next poll.
    ///
    /// # Errors
    /// The database's error (`22023` for a count outside 1 to 10,000 or a window that is not
    /// positive or longer than a day).
    pub async fn set_rate_limit(
        &self,
        db: &dyn Database,
        rate: Option<RateLimit>,
    ) -> Result<(), DbError> {
        let statement = Statement::new(sql::QUEUE_SET_RATE_LIMIT)
            .bind(self.table.as_str())
            .bind(rate.map(|rate| rate.starts))
            .bind(rate.map_or(1.0, |rate| rate.per.as_secs_f64()));
        db.query(&statement).await.map(drop)
    }

    /// Sets until when a job's key stays unique, once `db`'s transaction commits: an enqueue of
    /// a key that a job holds inserts nothing (and returns `None`), concurrent enqueues of one
    /// key insert it once. It replaces the queue's unique index on `key` (as the queue's owner;
    /// it waits for the queue's writers).
    ///
    /// # Errors
    /// The database's error (`23505` when jobs already queued hold one key under the new rule,
    /// which then changes nothing; `42703` for a table without `key`, or without `dead_at` for
    /// [`UniqueUntil::Finished`] and [`UniqueUntil::Started`]; `42501` for a role that does not
    /// own the queue).
    pub async fn set_unique(&self, db: &dyn Database, until: UniqueUntil) -> Result<(), DbError> {
        let statement = Statement::new(sql::QUEUE_SET_UNIQUE)
            .bind(self.table.as_str())
            .bind(until.as_sql());
        db.query(&statement).await.map(drop)
    }

    /// Until when a job's key stays unique.
    ///
    /// # Errors
    /// The database's error.
    pub async fn unique_until(&self, db: &dyn Database) -> Result<UniqueUntil, DbError> {
        let statement = Statement::new(sql::QUEUE_UNIQUE_UNTIL).bind(self.table.as_str());
        let rows = db.query(&statement).await?;
        let until: String = rows.one()?.get("inbox_unique_until")?;
        UniqueUntil::from_sql(&until).ok_or_else(|| {
            DbError::new(
                crate::error::ErrorKind::Other,
                format!("unexpected unique rule {until}"),
            )
        })
    }

    /// The queue's limits and how much of them is in use.
    ///
    /// # Errors
    /// The database's error.
    pub async fn limits(&self, db: &dyn Database) -> Result<QueueLimits, DbError> {
        let rows = db
            .query(&Statement::new(sql::QUEUE_LIMITS).bind(self.table.as_str()))
            .await?;
        let row = rows.one()?;
        let starts: Option<i32> = row.get("rate_limit")?;
        let per: Option<f64> = row.get("rate_period")?;
        Ok(QueueLimits {
            concurrency: row.get("concurrency")?,
            running: row.get("running")?,
            rate: starts.zip(per).map(|(starts, per)| RateLimit {
                starts,
                per: Duration::from_secs_f64(per.max(0.0)),
            }),
            recent_starts: row.get("recent_starts")?,
            key_concurrency: row.get("key_concurrency")?,
            per_key: row.get("per_key")?,
            keys_running: row.get("keys_running")?,
            most_running_per_key: row.get("most_running_per_key")?,
        })
    }

    /// Cancels job `id`, waiting or running: it becomes a dead job with `last_error`
    /// `cancelled` (requeue or discard it as any dead job), and a running delivery's settlement
    /// is refused from then on, so that its writes roll back; its handler learns of it from its
    /// heartbeat ([`Job::cancelled`](crate::worker::Job::cancelled)). A job held by a lock
    /// (`inbox_lock`) is cancelled when that transaction ends, unless it acked the job. `false`
    /// when the job is gone or dead already.
    ///
    /// # Errors
    /// The database's error.
    pub async fn cancel(&self, db: &dyn Database, id: i64) -> Result<bool, DbError> {
        let statement = Statement::new(sql::QUEUE_CANCEL)
            .bind(self.table.as_str())
            .bind(id);
        db.query(&statement).await?.one()?.get("cancelled")
    }

    /// Runs dead job `id` again (due now, attempts counted from zero; a job of a group rejoins
    /// it); `false` when the job is not dead.
    ///
    /// # Errors
    /// The database's error.
    pub async fn requeue(&self, db: &dyn Database, id: i64) -> Result<bool, DbError> {
        let statement = Statement::new(sql::QUEUE_REQUEUE)
            .bind(self.table.as_str())
            .bind(id);
        db.query(&statement).await?.one()?.get("requeued")
    }

    /// Runs the dead jobs again, oldest first: all of them, or at most `max`; returns how many.
    ///
    /// # Errors
    /// The database's error (`22023` for a `max` below 1).
    pub async fn requeue_dead(&self, db: &dyn Database, max: Option<i32>) -> Result<i64, DbError> {
        let statement = Statement::new(sql::QUEUE_REQUEUE_DEAD)
            .bind(self.table.as_str())
            .bind(max);
        db.query(&statement).await?.one()?.get("requeued")
    }

    /// Deletes dead job `id`; `false` when the job is not dead.
    ///
    /// # Errors
    /// The database's error.
    pub async fn discard(&self, db: &dyn Database, id: i64) -> Result<bool, DbError> {
        let statement = Statement::new(sql::QUEUE_DISCARD)
            .bind(self.table.as_str())
            .bind(id);
        db.query(&statement).await?.one()?.get("discarded")
    }

    /// The `max` oldest dead jobs.
    ///
    /// # Errors
    /// The database's error (`22023` for a `max` below 1).
    pub async fn dead_jobs(&self, db: &dyn Database, max: i32) -> Result<Vec<DeadJob>, DbError> {
        let statement = Statement::new(sql::QUEUE_DEAD_JOBS)
            .bind(self.table.as_str())
            .bind(max);
        db.query(&statement)
            .await?
            .iter()
            .map(|row| {
                Ok(DeadJob {
                    id: row.get("id")?,
                    attempt: row.get("attempt")?,
                    last_error: row.get("last_error")?,
                    dead_at: row.get("dead_at")?,
                    payload: row.get("payload")?,
                    payload_bytes: row.get("payload_bytes")?,
                })
            })
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
            paused: row.get("paused")?,
        })
    }
}

/// Until when a job's key stays unique ([`Queue::set_unique`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UniqueUntil {
    /// While the job exists: waiting, running, retrying or dead-lettered (the default).
    Acked,
    /// Until it is acked or dead-lettered: a dead job frees its key.
    Finished,
    /// Until its first delivery starts: a key can be queued again while its job runs (with
    /// [`Claim::Lock`](crate::worker::Claim::Lock), once the locking transaction commits).
    Started,
}

impl UniqueUntil {
    fn as_sql(self) -> &'static str {
        match self {
            UniqueUntil::Acked => "acked",
            UniqueUntil::Finished => "finished",
            UniqueUntil::Started => "started",
        }
    }

    fn from_sql(until: &str) -> Option<Self> {
        [Self::Acked, Self::Finished, Self::Started]
            .into_iter()
            .find(|rule| rule.as_sql() == until)
    }
}
