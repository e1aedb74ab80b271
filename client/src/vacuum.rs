//! Keeps a worker's queue or a relay's outbox small: vacuums it when its dead rows pile up, and
//! (for a worker) purges the results kept past their time.
//!
//! Every job leaves dead row versions (its lease's update, its ack's delete), and so does every
//! message relayed. Autovacuum visits a database at most once per `autovacuum_naptime` (a minute
//! by default), while a busy queue leaves tens of thousands of dead rows a second: its table and
//! indexes grow, and every lease walks over dead index entries. So the worker, and the relay,
//! look four times a second whether their table should be vacuumed (`inbox_vacuum_due`: enough
//! dead rows, no vacuum on it already, and the oldest snapshot moved since its last vacuum) and,
//! if so, run `VACUUM` on a connection of their own, outside any transaction. The vacuum never
//! blocks the table: it takes no lock that enqueues, leases, settlements or claims wait for,
//! skips a table that another vacuum works on (autovacuum, or another worker of the same queue:
//! at most one runs), and does not truncate the table.

use std::time::Duration;

use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;

use crate::error::DbError;
use crate::pg::PgDatabase;
use crate::sql;

/// How often the worker or relay looks whether its table should be vacuumed (a cheap query: the
/// statistics the server keeps, which its backends update about once a second).
const CHECK_EVERY: Duration = Duration::from_millis(250);

/// How many looks apart the worker purges expired results (`inbox_purge_results`): every 10 s.
const PURGE_EVERY: u32 = 40;

/// How many expired results one purge deletes at most (the next purge goes on).
const PURGE_MAX: i32 = 1_000;

/// `42883 undefined_function`: an extension too old to keep results.
const UNDEFINED_FUNCTION: &str = "42883";

/// What a vacuum loop keeps small.
pub(crate) struct Upkeep {
    pub db: PgDatabase,
    /// The table, as its owner names it (a queue or an outbox).
    pub table: String,
    /// Whether it also purges expired results, every 10 s (a worker's loop does).
    pub purge_results: bool,
    pub stop: CancellationToken,
}

/// Looks four times a second whether the table should be vacuumed, and vacuums it, and (with
/// `purge_results`) every 10 s purges expired results; until `stop`. A failure is logged and
/// tried again at the next look.
pub(crate) async fn run(shared: Upkeep) {
    let mut session: Option<Session> = None;
    let mut looks: u32 = 0;
    let mut purges = true;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CHECK_EVERY) => {}
            _ = shared.stop.cancelled() => return,
        }
        let current = match session.take() {
            Some(current) => current,
            None => match Session::open(&shared).await {
                Ok(opened) => opened,
                Err(error) => {
                    tracing::warn!(table = %shared.table, %error, "cannot connect to vacuum the table");
                    continue;
                }
            },
        };
        let vacuumed = tokio::select! {
            vacuumed = vacuum_if_due(&shared, current.client()) => vacuumed,
            // A long vacuum is not waited for at shutdown: dropping the connection ends it.
            _ = shared.stop.cancelled() => return,
        };
        looks = looks.wrapping_add(1);
        if shared.purge_results && purges && looks.is_multiple_of(PURGE_EVERY) && vacuumed.is_ok() {
            match purge_results(current.client()).await {
                Ok(purged) if purged > 0 => {
                    tracing::debug!(purged, "purged expired results");
                }
                Ok(_) => {}
                Err(error) if error.sqlstate() == Some(UNDEFINED_FUNCTION) => purges = false,
                Err(error) => tracing::warn!(%error, "purging expired results failed"),
            }
        }
        match vacuumed {
            Ok(_) => session = Some(current),
            Err(error) => {
                tracing::warn!(table = %shared.table, %error, "vacuuming the table failed");
            }
        }
    }
}

/// Vacuums the table if the extension says it is due; whether it did.
async fn vacuum_if_due(shared: &Upkeep, client: &tokio_postgres::Client) -> Result<bool, DbError> {
    let due: Option<String> = client
        .query_one(sql::VACUUM_DUE, &[&shared.table])
        .await?
        .try_get(0)?;
    let Some(table) = due else {
        return Ok(false);
    };
    let started = std::time::Instant::now();
    client.batch_execute(&sql::vacuum(&table)).await?;
    tracing::debug!(table = %shared.table, took = ?started.elapsed(), "vacuumed the table");
    Ok(true)
}

/// Deletes up to [`PURGE_MAX`] expired results and day-old finished batches; how many.
async fn purge_results(client: &tokio_postgres::Client) -> Result<i64, DbError> {
    Ok(client
        .query_one(sql::PURGE_RESULTS, &[&PURGE_MAX])
        .await?
        .try_get(0)?)
}

/// The connection the vacuum runs on: one of its own when the port has connection settings
/// (a long vacuum then holds no pooled connection), else one from the pool.
enum Session {
    Own(tokio_postgres::Client),
    Pooled(deadpool_postgres::Object),
}

impl Session {
    async fn open(shared: &Upkeep) -> Result<Self, DbError> {
        match shared.db.config() {
            Some(config) => {
                let (client, connection) = config.connect(NoTls).await?;
                tokio::spawn(async move {
                    let _ = connection.await;
                });
                Ok(Self::Own(client))
            }
            None => Ok(Self::Pooled(shared.db.pool().get().await?)),
        }
    }

    fn client(&self) -> &tokio_postgres::Client {
        match self {
            Self::Own(client) => client,
            Self::Pooled(object) => object,
        }
    }
}
