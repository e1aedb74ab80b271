//! Extends the leases of jobs whose handlers are still running, and records the progress their
//! handlers noted (`Job::set_progress`).

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio_util::sync::CancellationToken;

use super::{calls, Shared};
use crate::error::ErrorKind;
use crate::sql;

/// `55P03 lock_not_available`: the heartbeat's lock timeout passed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// How often a stopping worker's heartbeat looks for its last deliveries to have finished.
const STOPPING_POLL: Duration = Duration::from_millis(10);

/// Every third of the lease, extends each in-flight job's lease by a full lease; until the
/// worker stops and its last deliveries have finished (a shutdown lets them finish, and they
/// keep their leases meanwhile). A refused extension means the delivery is over here (another
/// worker has the job, or it was cancelled): its handler is told (`Job::cancelled`), and would
/// find its settlement refused too.
pub(super) async fn run(shared: Arc<Shared>) {
    let lease = shared.settings.lease;
    let mut ticks = tokio::time::interval(lease / 3);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    let mut stopping = false;
    loop {
        let extend = tokio::select! {
            _ = ticks.tick() => true,
            _ = shared.stop.cancelled(), if !stopping => {
                stopping = true;
                true
            }
            // Once stopping, return as soon as the last delivery finished, not at the next tick
            // (a third of the lease away), which the shutdown would otherwise wait for.
            _ = tokio::time::sleep(STOPPING_POLL), if stopping => false,
        };
        let held: Vec<((i64, i64), CancellationToken)> = match shared.in_flight.lock() {
            Ok(held) => held
                .iter()
                .map(|(&id, (token, lost))| ((id, *token), lost.clone()))
                .collect(),
            Err(_) => return,
        };
        if held.is_empty() {
            if stopping {
                return;
            }
            continue;
        }
        if !extend {
            continue;
        }
        let client = match shared.db.pool().get().await {
            Ok(client) => client,
            Err(error) => {
                tracing::warn!(queue = %shared.queue, %error, "heartbeat cannot reach the database");
                continue;
            }
        };
        // A job whose row a replaying group has fenced is safe until that group commits: its
        // extension is skipped rather than waited for (each extension waits for its row lock for
        // a moment only), so the other jobs are extended in time.
        let statements = shared.db.statement_mode();
        let mut client = Some(client);
        // The progress handlers recorded since the last tick, each job's latest.
        let mut progress = match shared.progress.lock() {
            Ok(mut notes) => std::mem::take(&mut *notes),
            Err(_) => return,
        };
        for (job, lost) in held {
            let Some(conn) = client.as_ref() else { break };
            // Bounded like every round trip: on a connection that went silent the heartbeat
            // would stop for good, and every lease with it.
            let extended = shared
                .bounded(calls::extend(conn, statements, &shared.queue, job, lease))
                .await;
            if extended
                .as_ref()
                .is_err_and(|error| error.kind() == ErrorKind::ConnectionLost)
            {
                // Closed, never pooled again; the next tick takes another connection.
                if let Some(lost) = client.take() {
                    drop(Object::take(lost));
                }
            }
            match extended {
                Ok(true) => {
                    if let (Some(note), Some(conn)) = (progress.remove(&job.0), client.as_ref()) {
                        let noted = shared
                            .bounded(calls::with_json(
                                conn,
                                statements,
                                sql::QUEUE_SET_PROGRESS,
                                &shared.queue,
                                job,
                                &note,
                            ))
                            .await;
                        if let Err(error) = noted {
                            tracing::warn!(queue = %shared.queue, id = job.0, %error, "cannot record progress");
                        }
                    }
                }
                Ok(false) => {
                    // Settled meanwhile, taken by another worker, or cancelled (inbox_cancel):
                    // if its handler still runs, `Job::cancelled` tells it.
                    tracing::debug!(queue = %shared.queue, id = job.0, "lease already settled or lost");
                    lost.cancel();
                }
                Err(error) if error.sqlstate() == Some(LOCK_NOT_AVAILABLE) => {
                    tracing::debug!(queue = %shared.queue, id = job.0, "job fenced by its group; not extended")
                }
                Err(error) => {
                    tracing::warn!(queue = %shared.queue, id = job.0, %error, "heartbeat failed")
                }
            }
        }
        // Notes this round could not carry (its connection was lost) go with the next, unless
        // their handler noted something newer meanwhile.
        if !progress.is_empty() {
            if let Ok(mut notes) = shared.progress.lock() {
                for (id, note) in progress {
                    notes.entry(id).or_insert(note);
                }
            }
        }
    }
}
