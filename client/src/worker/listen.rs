//! The worker's idle side: its LISTEN session registers as asleep on the queue when a delivery
//! slot found nothing to do (twice: it dozes first, `Shared::idle`) and no take of the worker has
//! found work for a doze, so that enqueues wake it with `NOTIFY`; and it unregisters once woken,
//! so that enqueues into a busy queue notify no one (see `inbox_sleep` in `docs/sql-api.md`).
//!
//! No wake-up is lost: a slot that found nothing asks for the registration before it sleeps, and
//! the registration itself looks at the queue after the sleeper's lock is granted (`inbox_sleep`
//! returns false when a job is due, and a slot is woken to take it). From then on, until the
//! session unregisters, every enqueue notifies it. A slot that finds work wakes the next one
//! (`transactional.rs`, `plain.rs`), so jobs enqueued while the session is not registered are
//! found by the slots still awake, the last of which registers again when it runs out of work.

use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use crate::error::{DbError, ErrorKind};
use crate::listen::ListenSession;

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
    let mut session = ListenSession::open(config, &shared.queue).await?;
    // Anything enqueued while this session was not listening is found by a slot looking now.
    shared.wake.notify_one();
    let mut asleep = false;
    loop {
        tokio::select! {
            received = session.notifications.recv() => match received {
                Some(()) => {
                    shared.wake.notify_one();
                    if asleep {
                        session.stop_sleeping(&shared.queue).await?;
                        asleep = false;
                    }
                }
                None => return Err(DbError::new(ErrorKind::ConnectionLost, "the LISTEN connection closed")),
            },
            _ = shared.idle_slot.notified() => {
                if !asleep {
                    if !quiet(shared).await {
                        return Ok(());
                    }
                    asleep = session.sleep(&shared.queue).await?;
                    if !asleep {
                        // A job is due, or enqueues in flight kept the registration waiting: a
                        // slot looks (and the next idle slot asks again).
                        shared.wake.notify_one();
                    }
                }
            }
            _ = shared.stop.cancelled() => return Ok(()),
        }
    }
}

/// Waits until no take of the worker has found work for a doze (`false`: the worker stops).
/// While some slot still finds work, the worker is not asleep: that slot looks again when it is
/// done, and registering would only make every enqueue of the moment notify (each notifying
/// commit queues on `NOTIFY`'s lock). A job enqueued meanwhile is found when the registration
/// looks at the queue.
async fn quiet(shared: &Shared) -> bool {
    loop {
        let quiet = shared.quiet_for();
        if quiet >= super::DOZE {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(super::DOZE - quiet) => {}
            _ = shared.stop.cancelled() => return false,
        }
    }
}
