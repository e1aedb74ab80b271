//! Wakes idle workers when an enqueue commits, over a LISTEN connection of the worker's own.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{stream, StreamExt};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

use super::Shared;
use crate::error::DbError;
use crate::sql;

/// Listens on the queue's channel and wakes one idle task per notification; a lost connection
/// is opened again (and wakes a task, in case it missed something). Without connection settings
/// (a port built from a bare pool) the worker only polls.
pub(super) async fn run(shared: Arc<Shared>) {
    let Some(config) = shared.db.listen_config().cloned() else {
        tracing::info!(queue = %shared.queue, "no direct connection settings to LISTEN with; polling only");
        return;
    };
    while !shared.stop.is_cancelled() {
        if let Err(error) = listen(&shared, &config).await {
            tracing::warn!(queue = %shared.queue, %error, "LISTEN connection lost; reconnecting");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = shared.stop.cancelled() => return,
        }
    }
}

async fn listen(shared: &Shared, config: &tokio_postgres::Config) -> Result<(), DbError> {
    let (client, mut connection) = config.connect(NoTls).await?;
    let (notify, mut notifications) = mpsc::unbounded_channel();
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
    let channel: String = client
        .query_one(sql::QUEUE_CHANNEL, &[&shared.queue])
        .await?
        .try_get(0)?;
    client
        .batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\"")))
        .await?;
    shared.wake.notify_one();
    let result = loop {
        tokio::select! {
            received = notifications.recv() => match received {
                Some(()) => shared.wake.notify_one(),
                None => break Err(DbError::new(crate::error::ErrorKind::ConnectionLost, "the LISTEN connection closed")),
            },
            _ = shared.stop.cancelled() => break Ok(()),
        }
    };
    driver.abort();
    result
}
