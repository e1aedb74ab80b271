//! Durable steps ([`Job::step`](super::Job::step)): an external call's result, recorded once per
//! job in a transaction of its own (`inbox_record_step`), so that a later delivery of the job gets
//! it back instead of making the call again.

use std::collections::{HashMap, HashSet};
use std::error::Error as StdError;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::pg::PgDatabase;
use crate::statement::Statement;

/// `inbox_job_steps(queue, id)`: the job's recorded steps.
const JOB_STEPS: &str = "SELECT name, result FROM inbox_job_steps($1::text::regclass, $2::int8)";

/// `inbox_record_step(queue, id, attempt, name, result)`: records a step once; the record that
/// stands, and whether it is this one.
const RECORD_STEP: &str = "SELECT recorded, inserted FROM inbox_record_step($1::text::regclass, \
                           $2::int8, $3::int4, $4::text, $5::jsonb)";

/// How many times a step's record is tried when the connection fails: a step whose record is lost
/// runs again on the next delivery, so a short outage is worth waiting out.
const RECORD_TRIES: u32 = 3;

/// Why [`Job::step`](super::Job::step) returned no result. A handler that returns it with `?`
/// fails its delivery, which is retried by the worker's policy: the steps recorded so far are not
/// run again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The step's own closure failed: nothing was recorded, and the next delivery runs it again.
    #[error("step {name:?} failed: {source}")]
    Failed {
        /// The step's name.
        name: String,
        /// The closure's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The name was used by an earlier step of this delivery: each step of a job needs a name of
    /// its own, or the second would get the first's record.
    #[error("step {0:?} was already run by this delivery: each step needs a name of its own")]
    NameReused(String),
    /// The step's result does not serialise to JSON, or its record does not deserialise into the
    /// type asked for (the step's result type changed since it was recorded).
    #[error("step {name:?}: its result does not convert to or from JSON: {source}")]
    Json {
        /// The step's name.
        name: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The database failed reading the job's records, or recording this step's result. In the
    /// second case the step ran and its record is lost: the next delivery runs it again (which is
    /// what its [`step_key`](super::Job::step_key) is for).
    #[error("step {name:?}: {source}")]
    Database {
        /// The step's name.
        name: String,
        /// The database's error.
        #[source]
        source: DbError,
    },
}

/// The queue and the database a worker's steps are recorded in: one per worker.
#[derive(Debug)]
pub(crate) struct StepStore {
    db: PgDatabase,
    queue: String,
}

impl StepStore {
    pub(crate) fn new(db: PgDatabase, queue: String) -> Arc<Self> {
        Arc::new(Self { db, queue })
    }
}

/// The steps of one delivery: the job's records, read at its first step, and the names its steps
/// used so far.
#[derive(Debug, Default)]
struct Seen {
    recorded: Option<HashMap<String, serde_json::Value>>,
    used: HashSet<String>,
}

/// One delivery's steps, shared by the clones of its [`Job`](super::Job).
#[derive(Clone, Debug)]
pub(crate) struct Steps {
    store: Arc<StepStore>,
    id: i64,
    attempt: i32,
    seen: Arc<tokio::sync::Mutex<Seen>>,
}

impl Steps {
    pub(crate) fn new(store: &Arc<StepStore>, id: i64, attempt: i32) -> Self {
        Self {
            store: store.clone(),
            id,
            attempt,
            seen: Arc::default(),
        }
    }

    /// The key of step `name` of this job, the same in every delivery.
    pub(crate) fn key(&self, name: &str) -> String {
        format!("inbox:{}:{}:{}", self.store.queue, self.id, name)
    }

    pub(crate) async fn run<R, F, Fut, E>(&self, name: &str, step: F) -> Result<R, StepError>
    where
        R: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<R, E>>,
        E: Into<Box<dyn StdError + Send + Sync>>,
    {
        let recorded = {
            let mut seen = self.seen.lock().await;
            if !seen.used.insert(name.to_owned()) {
                return Err(StepError::NameReused(name.to_owned()));
            }
            if seen.recorded.is_none() {
                let recorded = self
                    .recorded()
                    .await
                    .map_err(|source| StepError::Database {
                        name: name.to_owned(),
                        source,
                    })?;
                seen.recorded = Some(recorded);
            }
            seen.recorded.as_ref().and_then(|r| r.get(name).cloned())
        };
        if let Some(recorded) = recorded {
            return decode(name, recorded);
        }
        // The lock is not held while the step runs: steps of one delivery may run side by side.
        let result = step().await.map_err(|source| StepError::Failed {
            name: name.to_owned(),
            source: source.into(),
        })?;
        let value = serde_json::to_value(&result).map_err(|source| StepError::Json {
            name: name.to_owned(),
            source,
        })?;
        let standing = self
            .record(name, value)
            .await
            .map_err(|source| StepError::Database {
                name: name.to_owned(),
                source,
            })?;
        match standing {
            None => Ok(result),
            // Another delivery of the job (one that held it before a lost lease) recorded the
            // step first: its record is the one every later delivery gets, so this one returns
            // it too.
            Some(earlier) => decode(name, earlier),
        }
    }

    async fn recorded(&self) -> Result<HashMap<String, serde_json::Value>, DbError> {
        let rows = self
            .store
            .db
            .query(
                &Statement::new(JOB_STEPS)
                    .bind(self.store.queue.as_str())
                    .bind(self.id),
            )
            .await?;
        rows.iter()
            .map(|row| Ok((row.get("name")?, row.get("result")?)))
            .collect()
    }

    /// Records `value`; `None` when it is the record that stands, or the earlier one.
    async fn record(
        &self,
        name: &str,
        value: serde_json::Value,
    ) -> Result<Option<serde_json::Value>, DbError> {
        let statement = Statement::new(RECORD_STEP)
            .bind(self.store.queue.as_str())
            .bind(self.id)
            .bind(self.attempt)
            .bind(name)
            .bind(value);
        let mut tries = 0;
        loop {
            tries += 1;
            match self.store.db.query(&statement).await {
                Ok(rows) => {
                    let row = rows.one()?;
                    return if row.get::<bool>("inserted")? {
                        Ok(None)
                    } else {
                        row.get("recorded").map(Some)
                    };
                }
                Err(error) if error.kind() == ErrorKind::ConnectionLost && tries < RECORD_TRIES => {
                    tracing::warn!(%error, step = name, "recording a step failed; trying again");
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(tries))).await;
                }
                Err(error) => return Err(error),
            }
        }
    }
}

fn decode<R: DeserializeOwned>(name: &str, value: serde_json::Value) -> Result<R, StepError> {
    serde_json::from_value(value).map_err(|source| StepError::Json {
        name: name.to_owned(),
        source,
    })
}
