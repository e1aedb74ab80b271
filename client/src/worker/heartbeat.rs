//! Extends the leases of jobs whose handlers are still running.

use std::sync::Arc;

use super::{calls, Shared};

/// Every third of the lease, extends each in-flight job's lease by a full lease; until the
/// worker stops and its last deliveries have finished (a shutdown lets them finish, and they
/// keep their leases meanwhile). A refused extension means another worker has the job: its
/// handler here will find its settlement refused too.
pub(super) async fn run(shared: Arc<Shared>) {
    let lease = shared.settings.lease;
    let mut ticks = tokio::time::interval(lease / 3);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shared.stop.cancelled(), if !stopping => stopping = true,
        }
        let held: Vec<(i64, i64)> = match shared.in_flight.lock() {
            Ok(held) => held.iter().map(|(&id, &token)| (id, token)).collect(),
            Err(_) => return,
        };
        if held.is_empty() {
            if stopping {
                return;
            }
            continue;
        }
        let client = match shared.db.pool().get().await {
            Ok(client) => client,
            Err(error) => {
                tracing::warn!(queue = %shared.queue, %error, "heartbeat cannot reach the database");
                continue;
            }
        };
        for job in held {
            match calls::extend(&client, &shared.queue, job, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::debug!(queue = %shared.queue, id = job.0, "lease already settled or lost")
                }
                Err(error) => {
                    tracing::warn!(queue = %shared.queue, id = job.0, %error, "heartbeat failed")
                }
            }
        }
    }
}
