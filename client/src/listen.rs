//! A LISTEN session on a queue's channel (an outbox is one too): a direct connection, not a
//! pooled one, whose notifications arrive on a channel, and which registers as asleep on the
//! table (`inbox_sleep`) so that commits into it notify. The worker's idle side
//! (`worker/listen.rs`) and the relay's (`outbox/relay.rs`) are built on it.

use futures_util::{stream, StreamExt};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, Config, NoTls};

use crate::error::DbError;
use crate::sql;

/// `55P03 lock_not_available`: commits in flight kept a registration waiting past its timeout.
const LOCK_NOT_AVAILABLE: &str = "55P03";

pub(crate) struct ListenSession {
    client: Client,
    /// One message per notification; closed when the connection is.
    pub notifications: mpsc::UnboundedReceiver<()>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for ListenSession {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl ListenSession {
    /// Connects with `config` and LISTENs on `table`'s channel (`inbox_channel`), with the lock
    /// timeout that bounds each registration's wait.
    pub async fn open(config: &Config, table: &str) -> Result<Self, DbError> {
        let (client, mut connection) = config.connect(NoTls).await?;
        let (notify, notifications) = mpsc::unbounded_channel();
        let driver = tokio::spawn(async move {
            let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        if notify.send(()).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        let session = ListenSession {
            client,
            notifications,
            driver,
        };
        let channel: String = session
            .client
            .query_one(sql::QUEUE_CHANNEL, &[&table])
            .await?
            .try_get(0)?;
        session
            .client
            .batch_execute(&format!(
                "{}; LISTEN \"{}\"",
                sql::SLEEP_LOCK_TIMEOUT,
                channel.replace('"', "\"\"")
            ))
            .await?;
        Ok(session)
    }

    /// Registers the session as asleep on `table`; whether it is. `false` when something is due
    /// already, or commits in flight kept the registration waiting past its lock timeout: the
    /// caller looks at the table instead.
    pub async fn sleep(&self, table: &str) -> Result<bool, DbError> {
        match self.client.query_one(sql::QUEUE_SLEEP, &[&table]).await {
            Ok(row) => Ok(row.try_get(0)?),
            Err(error) => {
                let error = DbError::from(error);
                if error.sqlstate() == Some(LOCK_NOT_AVAILABLE) {
                    Ok(false)
                } else {
                    Err(error)
                }
            }
        }
    }

    /// Unregisters the session: commits into `table` stop notifying it.
    pub async fn stop_sleeping(&self, table: &str) -> Result<(), DbError> {
        self.client
            .query_one(sql::QUEUE_STOP_SLEEPING, &[&table])
            .await?;
        Ok(())
    }
}
