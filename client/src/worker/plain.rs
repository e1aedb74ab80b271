//! Plain mode: jobs leased in batches, handlers run concurrently with no transaction, and the
//! finished jobs acked in batches.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use super::calls::{self, Taken};
use super::{run_handler, Handler, Job, Outcome, Shared, WorkerStats};
use crate::error::DbError;

/// Leases jobs while there is room for them, runs each handler on a task of its own, and acks
/// the finished ones in batches; until the worker stops and every handler has finished.
pub(super) async fn run<T: DeserializeOwned + Send + 'static>(
    shared: Arc<Shared>,
    handler: Arc<dyn Handler<T>>,
) {
    let room = Arc::new(Semaphore::new(shared.settings.workers));
    let (acks, finished) = mpsc::unbounded_channel();
    let acker = tokio::spawn(ack_batches(shared.clone(), finished));
    let mut handlers = JoinSet::new();
    while !shared.stop.is_cancelled() {
        // Wait for room for one job, then take as much more as there is, up to a batch.
        let first = tokio::select! {
            permit = room.clone().acquire_owned() => permit,
            _ = shared.stop.cancelled() => break,
        };
        let Ok(first) = first else { break };
        let mut permits = vec![first];
        while permits.len() < shared.settings.batch_size {
            match room.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        let jobs = match lease(&shared, permits.len()).await {
            Ok(jobs) => jobs,
            Err(error) => {
                drop(permits);
                shared.back_off(&error).await;
                continue;
            }
        };
        if jobs.is_empty() {
            drop(permits);
            shared.idle().await;
            continue;
        }
        shared.hold(jobs.iter().map(|job| (job.id, job.token)));
        for (job, permit) in jobs.into_iter().zip(permits) {
            let (shared, handler, acks) = (shared.clone(), handler.clone(), acks.clone());
            let span = tracing::info_span!("delivery", queue = %shared.queue, id = job.id, attempt = job.attempt);
            handlers.spawn(
                async move {
                    deliver(&shared, &*handler, job, &acks).await;
                    drop(permit);
                }
                .instrument(span),
            );
        }
        // Reap finished tasks so the set does not grow without bound.
        while handlers.try_join_next().is_some() {}
    }
    while handlers.join_next().await.is_some() {}
    drop(acks);
    let _ = acker.await;
}

async fn lease(shared: &Shared, max: usize) -> Result<Vec<Taken>, DbError> {
    let client = shared.db.pool().get().await?;
    calls::lease(&client, &shared.queue, max as i32, shared.settings.lease).await
}

async fn deliver<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &dyn Handler<T>,
    job: Taken,
    acks: &mpsc::UnboundedSender<(i64, i64)>,
) {
    let mut tally = WorkerStats::default();
    let outcome = match shared.decode::<T>(&job.payload) {
        Ok(payload) => {
            let (outcome, failed) = run_handler(handler.handle(Job {
                id: job.id,
                attempt: job.attempt,
                payload,
            }))
            .await;
            tally.failed += u64::from(failed);
            outcome
        }
        Err(reason) => Outcome::Dead { reason },
    };
    if outcome == Outcome::Ack {
        shared.counters.add(&tally);
        if acks.send((job.id, job.token)).is_err() {
            tracing::warn!("the acker stopped; the job's lease will expire and it will run again");
        }
        return;
    }
    let settled = async {
        let client = shared.db.pool().get().await?;
        super::settle_failure(shared, &client, &job, outcome, &mut tally).await
    }
    .await;
    match settled {
        Ok(true) => {}
        Ok(false) => tally.lost += 1,
        Err(error) => {
            tracing::warn!(%error, "cannot settle; the lease will expire and the job run again")
        }
    }
    shared.release([job.id]);
    shared.counters.add(&tally);
}

/// Acks finished jobs: whatever has accumulated while the previous batch was being acked goes
/// in the next call, so a busy worker spends a fraction of a statement per job.
async fn ack_batches(shared: Arc<Shared>, mut finished: mpsc::UnboundedReceiver<(i64, i64)>) {
    let max = shared.settings.batch_size.max(1);
    let mut batch = Vec::with_capacity(max);
    while finished.recv_many(&mut batch, max).await > 0 {
        let (ids, tokens): (Vec<i64>, Vec<i64>) = batch.drain(..).unzip();
        let acked = async {
            let client = shared.db.pool().get().await?;
            calls::ack_many(&client, &shared.queue, &ids, &tokens).await
        }
        .await;
        let tally = match acked {
            Ok(acked) => WorkerStats {
                acked: acked as u64,
                lost: ids.len() as u64 - acked as u64,
                ..WorkerStats::default()
            },
            Err(error) => {
                tracing::warn!(%error, jobs = ids.len(), "cannot ack; the leases will expire and the jobs run again");
                WorkerStats::default()
            }
        };
        shared.release(ids);
        shared.counters.add(&tally);
    }
}
