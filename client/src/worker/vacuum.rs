//! Keeps the worker's queue small: vacuums it when its dead rows pile up.
//!
//! Every job leaves dead row versions (its lease's update, its ack's delete). Autovacuum visits a
//! database at most once per `autovacuum_naptime` (a minute by default), while a busy queue
//! leaves tens of thousands of dead rows a second: its table and indexes grow, and every lease
//! walks over dead index entries. So the worker looks four times a second whether the queue
//! should be vacuumed (`inbox_vacuum_due`: enough dead rows, no vacuum on it already, and the
//! oldest snapshot moved since its last vacuum) and, if so, runs `VACUUM` on a connection of its
//! own, outside any transaction. The vacuum never blocks the queue: it takes no lock that
//! enqueues, leases or settlements wait for, skips a queue that another vacuum works on
//! (autovacuum, or another worker of the same queue: at most one runs), and does not truncate the
//! table.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::NoTls;

use super::Shared;
use crate::error::DbError;
use crate::sql;

/// How often the worker looks whether its queue should be vacuumed (a cheap query: the
/// statistics the server keeps, which its backends update about once a second).
const CHECK_EVERY: Duration = Duration::from_millis(250);

/// Looks four times a second whether the queue should be vacuumed, and vacuums it; until the
/// worker stops. A failure is logged and tried again at the next look.
pub(super) async fn run(shared: Arc<Shared>) {
    let mut session: Option<Session> = None;
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
                    tracing::warn!(queue = %shared.queue, %error, "cannot connect to vacuum the queue");
                    continue;
                }
            },
        };
        let vacuumed = tokio::select! {
            vacuumed = vacuum_if_due(&shared, current.client()) => vacuumed,
            // A long vacuum is not waited for at shutdown: dropping the connection ends it.
            _ = shared.stop.cancelled() => return,
        };
        match vacuumed {
            Ok(_) => session = Some(current),
            Err(error) => {
                tracing::warn!(queue = %shared.queue, %error, "vacuuming the queue failed");
            }
        }
    }
}

/// Vacuums the queue if the extension says it is due; whether it did.
async fn vacuum_if_due(shared: &Shared, client: &tokio_postgres::Client) -> Result<bool, DbError> {
    let due: Option<String> = client
        .query_one(sql::QUEUE_VACUUM_DUE, &[&shared.queue])
        .await?
        .try_get(0)?;
    let Some(table) = due else {
        return Ok(false);
    };
    let started = std::time::Instant::now();
    client.batch_execute(&sql::vacuum(&table)).await?;
    tracing::debug!(queue = %shared.queue, took = ?started.elapsed(), "vacuumed the queue");
    Ok(true)
}

/// The connection the vacuum runs on: one of its own when the worker has connection settings
/// (a long vacuum then holds no pooled connection), else one from the pool.
enum Session {
    Own(tokio_postgres::Client),
    Pooled(deadpool_postgres::Object),
}

impl Session {
    async fn open(shared: &Shared) -> Result<Self, DbError> {
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
