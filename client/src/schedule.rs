//! Schedules of a [`Queue`]: periodic jobs that the extension enqueues exactly once per tick.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::queue::Queue;
use crate::sql;
use crate::statement::Statement;

/// A schedule of a queue, as `inbox_schedules` lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// The schedule's name, unique within its queue.
    pub name: String,
    /// Its cron expression: 5 fields, or 6 with seconds first.
    pub cron: String,
    /// The IANA time zone the expression is read in.
    pub time_zone: String,
    /// The payload of every job it enqueues.
    pub payload: serde_json::Value,
    /// The next tick it fires (in the past while no lease has fired a due tick yet); `None` for a
    /// schedule the extension parked because it can no longer compute its ticks.
    pub next_tick: Option<DateTime<Utc>>,
}

impl Queue {
    /// The statement that creates or replaces the schedule `name`: a job with `payload` at every
    /// tick of `cron` (5 fields, or 6 with seconds first) in `time_zone` (`"UTC"`,
    /// `"Europe/Paris"`). Declaring the same `cron` and `time_zone` again keeps the next tick.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `payload` does not serialize to JSON.
    pub fn schedule_statement<T: Serialize + ?Sized>(
        &self,
        name: &str,
        cron: &str,
        payload: &T,
        time_zone: &str,
    ) -> Result<Statement, DbError> {
        let json = serde_json::to_value(payload)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payload: {e}")))?;
        Ok(Statement::new(sql::SCHEDULE)
            .bind(self.table())
            .bind(name)
            .bind(cron)
            .bind(json)
            .bind(time_zone))
    }

    /// Creates or replaces the schedule `name` (see
    /// [`schedule_statement`](Self::schedule_statement)). Each tick becomes one job, enqueued by
    /// the first lease or lock of this queue after it, with the key
    /// `schedule:<name>:<tick in RFC 3339, UTC>`.
    ///
    /// # Errors
    /// As [`schedule_statement`](Self::schedule_statement); an invalid expression or time zone
    /// is the database's `22023` ([`ErrorKind::InvalidInput`]).
    pub async fn schedule<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        name: &str,
        cron: &str,
        payload: &T,
        time_zone: &str,
    ) -> Result<(), DbError> {
        db.execute(&self.schedule_statement(name, cron, payload, time_zone)?)
            .await
            .map(drop)
    }

    /// Removes the schedule `name`; `true` when it existed. Jobs it already enqueued stay queued.
    ///
    /// # Errors
    /// The database's error.
    pub async fn unschedule(&self, db: &dyn Database, name: &str) -> Result<bool, DbError> {
        let statement = Statement::new(sql::UNSCHEDULE)
            .bind(self.table())
            .bind(name);
        db.query(&statement).await?.one()?.get("removed")
    }

    /// The queue's schedules, by name.
    ///
    /// # Errors
    /// The database's error.
    pub async fn schedules(&self, db: &dyn Database) -> Result<Vec<Schedule>, DbError> {
        let rows = db
            .query(&Statement::new(sql::SCHEDULES).bind(self.table()))
            .await?;
        rows.iter()
            .map(|row| {
                Ok(Schedule {
                    name: row.get("name")?,
                    cron: row.get("cron")?,
                    time_zone: row.get("time_zone")?,
                    payload: row.get("payload")?,
                    next_tick: row.get("next_tick")?,
                })
            })
            .collect()
    }
}
