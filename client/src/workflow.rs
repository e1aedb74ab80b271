//! Workflows: jobs that run after others succeeded, batches with callbacks, kept results and
//! waiting for them (`sql/shared/workflows.sql` has all of it; this only calls it).
//!
//! A dependant's release, a batch's callbacks and a kept result commit in the transaction that
//! settles the job causing them, so none is lost or done twice by a crash.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::{stream, StreamExt};
use serde::Serialize;
use tokio::sync::{broadcast, Mutex};
use tokio_postgres::{AsyncMessage, NoTls};

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::pg::PgDatabase;
use crate::queue::{EnqueueOptions, Queue};
use crate::rows::Row;
use crate::sql;
use crate::statement::Statement;

/// A job of some queue: what a dependant waits for ([`Queue::job`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct JobRef {
    /// The job's queue, named as in SQL.
    pub queue: String,
    /// Its id in that queue.
    pub id: i64,
}

/// Where a job stands (`inbox_result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    /// Due and not taken.
    Ready,
    /// Due later (scheduled, or waiting for a retry).
    Scheduled,
    /// Held by a worker's lease.
    Running,
    /// Waiting behind its group's head.
    Waiting,
    /// Waiting for its parents to succeed.
    Blocked,
    /// Acked, its result kept.
    Succeeded,
    /// Dead-lettered.
    Dead,
    /// Cancelled (`inbox_cancel`).
    Cancelled,
    /// Not in its queue and no result kept: acked without one, discarded, or never enqueued.
    Gone,
}

impl JobState {
    fn from_sql(state: &str) -> Result<Self, DbError> {
        Ok(match state {
            "ready" => Self::Ready,
            "scheduled" => Self::Scheduled,
            "running" => Self::Running,
            "waiting" => Self::Waiting,
            "blocked" => Self::Blocked,
            "succeeded" => Self::Succeeded,
            "dead" => Self::Dead,
            "cancelled" => Self::Cancelled,
            other => {
                return Err(DbError::new(
                    ErrorKind::Other,
                    format!("unknown job state {other:?}"),
                ))
            }
        })
    }

    /// Whether the job will not run again by itself: succeeded, dead, cancelled or gone (a dead
    /// or cancelled job runs again only when an operator requeues it).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::Dead | Self::Cancelled | Self::Gone
        )
    }
}

/// A job's state, and its result or last error ([`Queue::result`]).
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// Where it stands.
    pub state: JobState,
    /// Deliveries so far (for a succeeded job, how many it took); `None` when gone.
    pub attempt: Option<i32>,
    /// What its handler acked with ([`Outcome::ack_with`](crate::worker::Outcome::ack_with)).
    pub result: Option<serde_json::Value>,
    /// Its last retry's error, or why it died.
    pub last_error: Option<String>,
    /// When it succeeded or died.
    pub finished_at: Option<DateTime<Utc>>,
    /// The last progress a delivery recorded
    /// ([`Job::set_progress`](crate::worker::Job::set_progress)), while the job is in its queue.
    pub progress: Option<serde_json::Value>,
}

impl JobResult {
    fn gone() -> Self {
        JobResult {
            state: JobState::Gone,
            attempt: None,
            result: None,
            last_error: None,
            finished_at: None,
            progress: None,
        }
    }

    fn read(row: Option<&Row>) -> Result<Self, DbError> {
        let Some(row) = row else {
            return Ok(Self::gone());
        };
        Ok(JobResult {
            state: JobState::from_sql(&row.get::<String>("state")?)?,
            attempt: row.get("attempt")?,
            result: row.get("result")?,
            last_error: row.get("last_error")?,
            finished_at: row.get("finished_at")?,
            progress: row.get("progress")?,
        })
    }
}

fn json<T: Serialize + ?Sized>(value: &T, what: &str) -> Result<serde_json::Value, DbError> {
    serde_json::to_value(value)
        .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("{what}: {e}")))
}

/// The parents as the statements take them: a JSON array of `[queue, id]` pairs.
fn parents(depends_on: &[JobRef]) -> serde_json::Value {
    depends_on
        .iter()
        .map(|job| serde_json::json!([job.queue, job.id]))
        .collect()
}

fn seconds(duration: Option<Duration>) -> Option<f64> {
    duration.map(|duration| duration.as_secs_f64())
}

/// Dependencies take no group: a dependant waits outside its queue's takes, as a job behind its
/// group's head does.
fn check_no_group(options: &EnqueueOptions) -> Result<(), DbError> {
    match options.group_key {
        Some(_) => Err(DbError::new(
            ErrorKind::InvalidInput,
            "a job with parents or in a batch cannot have a group key",
        )),
        None => Ok(()),
    }
}

impl Queue {
    /// Job `id` of this queue, as a parent for [`enqueue_after`](Self::enqueue_after).
    pub fn job(&self, id: i64) -> JobRef {
        JobRef {
            queue: self.table().to_owned(),
            id,
        }
    }

    /// Enqueues `payload` to run only after every job of `depends_on` (of any queue) has
    /// succeeded, released in the transaction of the last one's ack; returns its id, or `None`
    /// when a job with its key is already queued. A parent that dies keeps it blocked until the
    /// parent is requeued and succeeds, or it is cancelled.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `payload` does not serialize or `options` has a group key;
    /// the database's error (`23503` for a parent its queue never had).
    pub async fn enqueue_after<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        payload: &T,
        depends_on: &[JobRef],
        options: &EnqueueOptions,
    ) -> Result<Option<i64>, DbError> {
        check_no_group(options)?;
        let statement = Statement::new(sql::QUEUE_ENQUEUE_AFTER)
            .bind(self.table())
            .bind(json(payload, "payload")?)
            .bind(parents(depends_on))
            .bind(options.run_at)
            .bind(options.key.clone())
            .bind(options.priority)
            .bind(seconds(options.timeout));
        db.query(&statement).await?.one()?.get("id")
    }

    /// Keeps the queue's succeeded jobs, with their results, for `keep` (`None`: none are kept,
    /// the default; a job acked with a result keeps it for a day then).
    ///
    /// # Errors
    /// The database's error (`22023` for a zero `keep`).
    pub async fn keep_results(
        &self,
        db: &dyn Database,
        keep: Option<Duration>,
    ) -> Result<(), DbError> {
        let statement = Statement::new(sql::QUEUE_KEEP_RESULTS)
            .bind(self.table())
            .bind(seconds(keep));
        db.query(&statement).await.map(drop)
    }

    /// Where job `id` stands, with its result or last error.
    ///
    /// # Errors
    /// The database's error.
    pub async fn result(&self, db: &dyn Database, id: i64) -> Result<JobResult, DbError> {
        let statement = Statement::new(sql::QUEUE_RESULT)
            .bind(self.table())
            .bind(id);
        JobResult::read(db.query(&statement).await?.first())
    }
}

/// Waits for jobs to finish ([`wait`](Self::wait)): woken by the `NOTIFY` that a job's settlement
/// sends when it commits (`inbox_result_channel`), over one direct connection shared by every
/// wait, or, behind a pooler in transaction mode, by polling `inbox_result`.
pub struct ResultWaiter {
    db: PgDatabase,
    every: Duration,
    listener: Option<Listener>,
}

/// The LISTEN connection: its notifications fanned out as `(channel, job id)`.
struct Listener {
    config: tokio_postgres::Config,
    state: Mutex<Option<Listening>>,
}

struct Listening {
    client: tokio_postgres::Client,
    /// The channels listened on, by queue.
    channels: HashMap<String, String>,
    sender: broadcast::Sender<(String, i64)>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// How often a listening wait looks again anyway (a notification is lost only with the
/// connection, which is then opened again).
const LISTEN_POLL: Duration = Duration::from_secs(1);

impl ResultWaiter {
    /// Waits through `db`: listening when it has direct connection settings
    /// ([`PgDatabase::listen_config`]), polling every 50 ms otherwise.
    pub fn new(db: &PgDatabase) -> Self {
        let listener = db.listen_config().map(|config| Listener {
            config: config.clone(),
            state: Mutex::new(None),
        });
        ResultWaiter {
            db: db.clone(),
            every: Duration::from_millis(50),
            listener,
        }
    }

    /// Waits through `db` by polling every `every`, never listening (for a pooler in transaction
    /// mode, where `LISTEN` does not work).
    pub fn polling(db: &PgDatabase, every: Duration) -> Self {
        ResultWaiter {
            db: db.clone(),
            every,
            listener: None,
        }
    }

    /// Waits up to `timeout` until job `id` of `queue` is final ([`JobState::is_final`]), and
    /// returns where it stands then (not final when the time ran out). Nothing is missed
    /// between the look and the wait: the wait listens before it looks.
    ///
    /// # Errors
    /// The database's error.
    pub async fn wait(
        &self,
        queue: &Queue,
        id: i64,
        timeout: Duration,
    ) -> Result<JobResult, DbError> {
        let deadline = Instant::now() + timeout;
        let mut notified = match &self.listener {
            Some(listener) => match listener.subscribe(&self.db, queue).await {
                Ok(subscribed) => Some(subscribed),
                Err(error) => {
                    tracing::warn!(queue = %queue.table(), %error, "cannot LISTEN for results; polling");
                    None
                }
            },
            None => None,
        };
        loop {
            let current = queue.result(&self.db, id).await?;
            let now = Instant::now();
            if current.state.is_final() || now >= deadline {
                return Ok(current);
            }
            let pause = match notified {
                Some(_) => LISTEN_POLL,
                None => self.every,
            }
            .min(deadline - now);
            match &mut notified {
                Some((channel, receiver)) => {
                    let heard = tokio::time::timeout(pause, async {
                        loop {
                            match receiver.recv().await {
                                Ok((on, job)) if on == *channel && job == id => return true,
                                Ok(_) => {}
                                // Missed some: look.
                                Err(broadcast::error::RecvError::Lagged(_)) => return true,
                                Err(broadcast::error::RecvError::Closed) => return false,
                            }
                        }
                    })
                    .await;
                    if heard == Ok(false) {
                        // The connection is gone: poll from here on.
                        notified = None;
                    }
                }
                None => tokio::time::sleep(pause).await,
            }
        }
    }
}

impl Listener {
    /// Listens on `queue`'s result channel (once per channel and connection) and returns the
    /// channel with a receiver subscribed before the caller looks.
    async fn subscribe(
        &self,
        db: &PgDatabase,
        queue: &Queue,
    ) -> Result<(String, broadcast::Receiver<(String, i64)>), DbError> {
        let mut state = self.state.lock().await;
        if state
            .as_ref()
            .is_some_and(|listening| listening.driver.is_finished())
        {
            *state = None;
        }
        if state.is_none() {
            *state = Some(self.connect().await?);
        }
        let listening = state.as_mut().expect("connected above");
        let receiver = listening.sender.subscribe();
        if let Some(channel) = listening.channels.get(queue.table()) {
            return Ok((channel.clone(), receiver));
        }
        let statement = Statement::new(sql::QUEUE_RESULT_CHANNEL).bind(queue.table());
        let channel: String = db.query(&statement).await?.one()?.get("channel")?;
        listening
            .client
            .batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\"")))
            .await?;
        listening
            .channels
            .insert(queue.table().to_owned(), channel.clone());
        Ok((channel, receiver))
    }

    async fn connect(&self) -> Result<Listening, DbError> {
        let (client, mut connection) = self.config.connect(NoTls).await?;
        let (sender, _) = broadcast::channel(4096);
        let fan_out = sender.clone();
        let driver = tokio::spawn(async move {
            let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(notification)) => {
                        if let Ok(id) = notification.payload().parse::<i64>() {
                            // No receiver at the moment is no error.
                            let _ = fan_out.send((notification.channel().to_owned(), id));
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        Ok(Listening {
            client,
            channels: HashMap::new(),
            sender,
            driver,
        })
    }
}

/// A batch's callbacks: jobs enqueued once, when the batch is sealed and its last member settled,
/// with the batch's counts under the payload's `"batch"` key.
#[derive(Clone, Debug, Default)]
pub struct BatchCallbacks {
    on_complete: Option<(String, serde_json::Value)>,
    on_failure: Option<(String, serde_json::Value)>,
}

impl BatchCallbacks {
    /// Enqueues `payload` (a JSON object) into `queue` when every member has settled, whatever
    /// their outcome.
    pub fn on_complete(mut self, queue: &Queue, payload: serde_json::Value) -> Self {
        self.on_complete = Some((queue.table().to_owned(), payload));
        self
    }

    /// Enqueues `payload` (a JSON object) into `queue` when every member has settled and one
    /// or more died.
    pub fn on_failure(mut self, queue: &Queue, payload: serde_json::Value) -> Self {
        self.on_failure = Some((queue.table().to_owned(), payload));
        self
    }
}

/// A batch's counts (`inbox_batch`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// Members added.
    pub members: i32,
    /// Members that succeeded.
    pub succeeded: i32,
    /// Members that died (dead-lettered or cancelled).
    pub died: i32,
    /// When it was opened.
    pub created_at: DateTime<Utc>,
    /// When it was sealed.
    pub sealed_at: Option<DateTime<Utc>>,
    /// When its last member settled and its callbacks were enqueued.
    pub finished_at: Option<DateTime<Utc>>,
}

/// A member of a batch and how it settled (`inbox_batch_members`).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMember {
    /// The member.
    pub job: JobRef,
    /// `None` while it runs; `"succeeded"` or `"died"`.
    pub outcome: Option<String>,
    /// Its kept result.
    pub result: Option<serde_json::Value>,
}

/// A batch of jobs whose callbacks are enqueued exactly once, in the transaction of the
/// settlement of its last member, after it is [sealed](Self::seal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch {
    id: i64,
}

impl Batch {
    /// Opens a batch with `callbacks`.
    ///
    /// # Errors
    /// The database's error (`22023` for a callback payload that is not an object, `42804` for
    /// a callback queue of `bytea` payloads).
    pub async fn open(db: &dyn Database, callbacks: &BatchCallbacks) -> Result<Self, DbError> {
        let split = |callback: &Option<(String, serde_json::Value)>| match callback {
            Some((queue, payload)) => (Some(queue.clone()), Some(payload.clone())),
            None => (None, None),
        };
        let (complete_queue, complete) = split(&callbacks.on_complete);
        let (failure_queue, failure) = split(&callbacks.on_failure);
        let statement = Statement::new(sql::BATCH_OPEN)
            .bind(complete_queue)
            .bind(complete)
            .bind(failure_queue)
            .bind(failure);
        let id = db.query(&statement).await?.one()?.get("batch")?;
        Ok(Batch { id })
    }

    /// The batch with id `id`.
    pub fn from_id(id: i64) -> Self {
        Batch { id }
    }

    /// Its id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Enqueues a member into `queue`, after `depends_on` when not empty; its id, or `None` when
    /// its key is already queued (it is then no member).
    ///
    /// # Errors
    /// As [`Queue::enqueue_after`]; `55000` once the batch is sealed, `02000` for no such batch.
    pub async fn add<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        queue: &Queue,
        payload: &T,
        depends_on: &[JobRef],
        options: &EnqueueOptions,
    ) -> Result<Option<i64>, DbError> {
        check_no_group(options)?;
        let statement = Statement::new(sql::BATCH_ADD)
            .bind(self.id)
            .bind(queue.table())
            .bind(json(payload, "payload")?)
            .bind(parents(depends_on))
            .bind(options.run_at)
            .bind(options.key.clone())
            .bind(options.priority)
            .bind(seconds(options.timeout));
        db.query(&statement).await?.one()?.get("id")
    }

    /// Seals the batch: no member is added after it, and its callbacks are enqueued once every
    /// member has settled (in this transaction, when they all have). `false` when it was sealed
    /// already.
    ///
    /// # Errors
    /// The database's error (`02000` for no such batch).
    pub async fn seal(&self, db: &dyn Database) -> Result<bool, DbError> {
        let statement = Statement::new(sql::BATCH_SEAL).bind(self.id);
        db.query(&statement).await?.one()?.get("sealed")
    }

    /// Its counts; `None` once it is purged (a day after it finished).
    ///
    /// # Errors
    /// The database's error.
    pub async fn status(&self, db: &dyn Database) -> Result<Option<BatchStatus>, DbError> {
        let statement = Statement::new(sql::BATCH_STATUS).bind(self.id);
        let rows = db.query(&statement).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        Ok(Some(BatchStatus {
            members: row.get("members")?,
            succeeded: row.get("succeeded")?,
            died: row.get("died")?,
            created_at: row.get("created_at")?,
            sealed_at: row.get("sealed_at")?,
            finished_at: row.get("finished_at")?,
        }))
    }

    /// Its members, how each settled and its kept result.
    ///
    /// # Errors
    /// The database's error.
    pub async fn members(&self, db: &dyn Database) -> Result<Vec<BatchMember>, DbError> {
        let statement = Statement::new(sql::BATCH_MEMBERS).bind(self.id);
        db.query(&statement)
            .await?
            .iter()
            .map(|row| {
                Ok(BatchMember {
                    job: JobRef {
                        queue: row.get("queue")?,
                        id: row.get("id")?,
                    },
                    outcome: row.get("outcome")?,
                    result: row.get("result")?,
                })
            })
            .collect()
    }
}
