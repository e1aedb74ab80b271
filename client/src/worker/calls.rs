//! The worker's calls of the extension's queue functions, over a pooled connection (in a
//! transaction or not), each through a statement prepared once per connection or, in
//! [`StatementMode::Unnamed`], sent unnamed.

use std::time::Duration;

use deadpool_postgres::Object;
use tokio_postgres::types::{FromSql, ToSql, Type};

use crate::error::DbError;
use crate::mode::{self, StatementMode};
use crate::sql;

/// A parameter of a call.
type Param<'a> = dyn ToSql + Sync + 'a;

/// Runs one of the client's statements on `client` as `statements` says, and returns its rows.
pub(crate) async fn rows(
    client: &Object,
    statements: StatementMode,
    statement: &str,
    params: &[&Param<'_>],
) -> Result<Vec<tokio_postgres::Row>, DbError> {
    match statements {
        StatementMode::Prepared => {
            let prepared = client.prepare_cached(statement).await?;
            Ok(client.query(&prepared, params).await?)
        }
        StatementMode::Unnamed => Ok(mode::run(&***client, statement, params).await?.rows),
    }
}

/// A job as `inbox_lease`/`inbox_lock` hand it over, its payload still undecoded.
#[derive(Debug)]
pub(crate) struct Taken {
    pub id: i64,
    pub attempt: i32,
    pub token: i64,
    pub payload: Vec<u8>,
    /// The job's own bound on its handler (`timeout` at enqueue).
    pub timeout: Option<Duration>,
}

/// A payload's bytes: the JSON text of a `jsonb` payload, or a `bytea` payload as stored.
struct PayloadBytes(Vec<u8>);

impl<'a> FromSql<'a> for PayloadBytes {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        // jsonb's binary form is a version byte (1) and the JSON text.
        match (ty, raw.split_first()) {
            (&Type::JSONB, Some((1, text))) => Ok(PayloadBytes(text.to_vec())),
            (&Type::JSONB, _) => Err("unsupported jsonb version".into()),
            _ => Ok(PayloadBytes(raw.to_vec())),
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSONB | Type::BYTEA)
    }
}

/// The jobs of an `inbox_lease`/`inbox_lock` result.
pub(crate) fn read_taken(rows: Vec<tokio_postgres::Row>) -> Result<Vec<Taken>, DbError> {
    rows.iter()
        .map(|row| {
            let json: Option<PayloadBytes> = row.try_get(3)?;
            let bytes: Option<PayloadBytes> = row.try_get(4)?;
            Ok(Taken {
                id: row.try_get(0)?,
                attempt: row.try_get(1)?,
                token: row.try_get(2)?,
                payload: json.or(bytes).map(|p| p.0).unwrap_or_default(),
                timeout: row
                    .try_get::<_, Option<f64>>(5)?
                    .map(Duration::from_secs_f64),
            })
        })
        .collect()
}

/// Leases up to `max` jobs for `lease` (commits with the statement when not in a transaction).
pub(crate) async fn lease(
    client: &Object,
    statements: StatementMode,
    queue: &str,
    max: i32,
    lease: Duration,
) -> Result<Vec<Taken>, DbError> {
    let params: [&Param<'_>; 3] = [&queue, &max, &interval(lease)];
    read_taken(rows(client, statements, sql::QUEUE_LEASE, &params).await?)
}

async fn one_bool(
    client: &Object,
    statements: StatementMode,
    statement: &str,
    params: &[&Param<'_>],
) -> Result<bool, DbError> {
    let rows = rows(client, statements, statement, params).await?;
    match rows.first() {
        Some(row) => Ok(row.try_get(0)?),
        None => Err(DbError::new(
            crate::error::ErrorKind::Other,
            "the extension's call returned no row",
        )),
    }
}

pub(crate) async fn retry(
    client: &Object,
    statements: StatementMode,
    queue: &str,
    job: (i64, i64),
    delay: Duration,
    error: Option<&str>,
    max_attempts: Option<i32>,
) -> Result<bool, DbError> {
    let seconds = delay.as_secs_f64();
    one_bool(
        client,
        statements,
        sql::QUEUE_RETRY,
        &[&queue, &job.0, &job.1, &seconds, &error, &max_attempts],
    )
    .await
}

pub(crate) async fn snooze(
    client: &Object,
    statements: StatementMode,
    queue: &str,
    job: (i64, i64),
    delay: Duration,
) -> Result<bool, DbError> {
    let seconds = delay.as_secs_f64();
    one_bool(
        client,
        statements,
        sql::QUEUE_SNOOZE,
        &[&queue, &job.0, &job.1, &seconds],
    )
    .await
}

pub(crate) async fn dead(
    client: &Object,
    statements: StatementMode,
    queue: &str,
    job: (i64, i64),
    reason: &str,
) -> Result<bool, DbError> {
    one_bool(
        client,
        statements,
        sql::QUEUE_DEAD,
        &[&queue, &job.0, &job.1, &reason],
    )
    .await
}

/// Runs `statement`, one of the calls that take a job's fence and a JSON value (its result or
/// its progress): `inbox_ack_with_result`, `inbox_set_result`, `inbox_set_progress`. Whether the
/// token still held the job.
pub(crate) async fn with_json(
    client: &Object,
    statements: StatementMode,
    statement: &str,
    queue: &str,
    job: (i64, i64),
    value: &serde_json::Value,
) -> Result<bool, DbError> {
    one_bool(
        client,
        statements,
        statement,
        &[&queue, &job.0, &job.1, value],
    )
    .await
}

pub(crate) async fn extend(
    client: &Object,
    statements: StatementMode,
    queue: &str,
    job: (i64, i64),
    lease: Duration,
) -> Result<bool, DbError> {
    one_bool(
        client,
        statements,
        sql::HEARTBEAT_EXTEND,
        &[&queue, &job.0, &job.1, &interval(lease)],
    )
    .await
}

/// Whether the queue has nothing ready, leased or delayed (dead jobs do not count).
pub(crate) async fn is_idle(
    client: &Object,
    statements: StatementMode,
    queue: &str,
) -> Result<bool, DbError> {
    let rows = rows(client, statements, sql::QUEUE_STATS, &[&queue]).await?;
    let row = rows.first().ok_or_else(|| {
        DbError::new(
            crate::error::ErrorKind::Other,
            "inbox_stats returned no row",
        )
    })?;
    let (ready, delayed, leased): (i64, i64, i64) =
        (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
    Ok(ready + delayed + leased == 0)
}

/// An interval as text PostgreSQL parses (`'1.5 seconds'`), since tokio-postgres has no
/// `interval` type.
pub(crate) fn interval(duration: Duration) -> String {
    format!("{} microseconds", duration.as_micros())
}
