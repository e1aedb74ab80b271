//! Plain mode: jobs leased in batches, handlers run concurrently with no transaction, and the
//! finished jobs acked in batches.
//!
//! A few fetchers share the worker's room for deliveries; each holds a pooled connection and, in
//! one round trip, acks what its handlers finished since its last call and leases as many jobs as
//! there is room for (two statements, each its own transaction, pipelined). Several fetchers keep
//! several leases in flight while the others' commits are being flushed.

use std::sync::Arc;

use deadpool_postgres::Object;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use super::calls::{self, Taken};
use super::step;
use super::{run_handler, Handler, Job, Outcome, Shared, WorkerStats};
use crate::error::{DbError, ErrorKind};
use crate::sql;

/// The most fetchers a plain worker runs.
const MAX_FETCHERS: usize = 4;

/// What a delivery tells its fetcher when it ends.
enum Finished {
    /// The handler acked: the fetcher acks the job in its next call.
    Ack(i64, i64),
    /// Settled (retried or dead-lettered) by the delivery itself, or left to its lease.
    Settled,
}

/// Runs the fetchers until the worker stops and every handler has finished.
pub(super) async fn run<T: DeserializeOwned + Send + 'static>(
    shared: Arc<Shared>,
    handler: Arc<dyn Handler<T>>,
) {
    let settings = &shared.settings;
    let fetchers = settings
        .workers
        .div_ceil(settings.batch_size)
        .clamp(1, MAX_FETCHERS);
    // The most a fetcher leases in one call: a batch, or its share of the room.
    let chunk = settings
        .batch_size
        .min(settings.workers.div_ceil(fetchers))
        .max(1);
    let room = Arc::new(Semaphore::new(settings.workers));
    let mut tasks = JoinSet::new();
    for _ in 0..fetchers {
        tasks.spawn(fetch(shared.clone(), handler.clone(), room.clone(), chunk));
    }
    while tasks.join_next().await.is_some() {}
}

/// What a fetcher has gathered for its next call.
#[derive(Default)]
struct Gathered {
    /// Finished deliveries to ack.
    done: Vec<(i64, i64)>,
    /// Room taken for new deliveries (permits of the shared room, held until they finish).
    room: usize,
}

/// One fetcher: leases while there is room, runs the handlers, and acks the
/// finished jobs with its next lease; until the worker stops and its handlers have finished.
/// The handlers of one lease run concurrently on one task.
///
/// A call is made once it carries half a chunk of acks or of room, or once none of the
/// fetcher's deliveries is running: calls stay large while handlers finish one by one.
async fn fetch<T: DeserializeOwned + Send + 'static>(
    shared: Arc<Shared>,
    handler: Arc<dyn Handler<T>>,
    room: Arc<Semaphore>,
    chunk: usize,
) {
    let enough = chunk.div_ceil(2);
    let (report, mut finished) = mpsc::unbounded_channel();
    let mut handlers = JoinSet::new();
    let mut running = 0_usize;
    let mut next = Gathered::default();
    let mut client = None;
    // Whether the last lease found nothing, and whether the fetcher has dozed since it last
    // found work (`Shared::idle`).
    let mut dry = false;
    let mut dozed = false;
    loop {
        let mut stopping = shared.stop.is_cancelled();
        loop {
            while let Ok(ended) = finished.try_recv() {
                running -= 1;
                if let Finished::Ack(id, token) = ended {
                    next.done.push((id, token));
                }
            }
            let leasing = !stopping && !dry;
            if leasing {
                let free = room.available_permits().min(chunk - next.room);
                if free > 0
                    && room
                        .try_acquire_many(free as u32)
                        .map(|p| p.forget())
                        .is_ok()
                {
                    next.room += free;
                }
            } else if next.room > 0 {
                room.add_permits(std::mem::take(&mut next.room));
            }
            let idle_now = running == 0;
            if next.done.len() >= enough
                || next.room >= enough
                || (idle_now && (next.room > 0 || !next.done.is_empty()))
                || (idle_now && stopping)
            {
                break;
            }
            tokio::select! {
                ended = finished.recv(), if running > 0 => {
                    if let Some(ended) = ended {
                        running -= 1;
                        if let Finished::Ack(id, token) = ended {
                            next.done.push((id, token));
                        }
                    }
                }
                permit = room.acquire_many(1), if leasing => {
                    if let Ok(permit) = permit {
                        permit.forget();
                        next.room += 1;
                    }
                }
                _ = shared.idle(dozed), if dry && !stopping => {
                    dry = false;
                    dozed = true;
                }
                _ = shared.stop.cancelled(), if !stopping => {}
            }
            stopping = shared.stop.is_cancelled();
        }
        if stopping && running == 0 && next.done.is_empty() {
            break;
        }
        if next.done.is_empty() && next.room == 0 {
            continue;
        }
        let conn = match client.take() {
            Some(conn) => conn,
            None => match shared.db.pool().get().await {
                Ok(conn) => conn,
                Err(error) => {
                    shared.back_off(&DbError::from(error)).await;
                    continue;
                }
            },
        };
        let call = std::mem::take(&mut next);
        // Bounded like every round trip: a connection gone silent would hang the fetcher.
        let answered = shared
            .bounded(ack_and_lease(&shared, &conn, &call.done, call.room))
            .await;
        match answered {
            Ok((acked, jobs)) => {
                client = Some(conn);
                if let Some(acked) = acked {
                    count_acks(&shared, &call.done, acked);
                }
                // Room not used goes back for the other fetchers.
                room.add_permits(call.room - jobs.len());
                dry = jobs.is_empty() && call.room > 0;
                if !jobs.is_empty() {
                    dozed = false;
                    shared.found_work();
                }
                // A full lease: there may be more, for a fetcher that is idle.
                if call.room > 0 && jobs.len() == call.room {
                    shared.wake.notify_one();
                }
                shared.hold(jobs.iter().map(|job| (job.id, job.token)));
                // One task per batch runs its handlers concurrently, each reported as it ends.
                if !jobs.is_empty() {
                    running += jobs.len();
                    let (shared, handler, report, room) = (
                        shared.clone(),
                        handler.clone(),
                        report.clone(),
                        room.clone(),
                    );
                    handlers.spawn(async move {
                        let mut deliveries: FuturesUnordered<_> = jobs
                            .into_iter()
                            .map(|job| {
                                let span = tracing::info_span!("delivery", queue = %shared.queue, id = job.id, attempt = job.attempt);
                                deliver(&shared, &*handler, job).instrument(span)
                            })
                            .collect();
                        while let Some(ended) = deliveries.next().await {
                            room.add_permits(1);
                            let _ = report.send(ended);
                        }
                    });
                }
                // Reap finished tasks so the set does not grow without bound.
                while handlers.try_join_next().is_some() {}
            }
            Err(error) => {
                // The acks may or may not have committed: the leases of those not acked expire
                // and the jobs run again (at least once).
                if !call.done.is_empty() {
                    tracing::warn!(%error, jobs = call.done.len(), "cannot ack; the leases will expire and the jobs run again");
                    shared.release(call.done.iter().map(|&(id, _)| id));
                }
                room.add_permits(call.room);
                if error.kind() == ErrorKind::ConnectionLost {
                    // Closed, never pooled again.
                    drop(Object::take(conn));
                }
                shared.back_off(&error).await;
            }
        }
    }
    while handlers.join_next().await.is_some() {}
}

/// Acks `acks` (if any) and leases up to `max` jobs (if any room) in one round trip; returns
/// how many of the acks applied, and the jobs leased.
async fn ack_and_lease(
    shared: &Shared,
    client: &deadpool_postgres::Client,
    acks: &[(i64, i64)],
    max: usize,
) -> Result<(Option<i64>, Vec<Taken>), DbError> {
    let ack = async {
        if acks.is_empty() {
            return Ok(None);
        }
        let (ids, tokens): (Vec<i64>, Vec<i64>) = acks.iter().copied().unzip();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&shared.queue, &ids, &tokens];
        let rows = calls::rows(
            client,
            shared.db.statement_mode(),
            sql::QUEUE_ACK_MANY,
            &params,
        )
        .await?;
        let row = rows.first().ok_or_else(|| {
            DbError::new(
                crate::error::ErrorKind::Other,
                "inbox_ack_batch returned no row",
            )
        })?;
        Ok::<_, DbError>(Some(row.try_get(0)?))
    };
    let lease = async {
        if max == 0 {
            return Ok(Vec::new());
        }
        let statements = shared.db.statement_mode();
        calls::lease(
            client,
            statements,
            &shared.queue,
            max as i32,
            shared.settings.lease,
        )
        .await
    };
    let (acked, leased) = tokio::join!(ack, lease);
    Ok((acked?, leased?))
}

fn count_acks(shared: &Shared, acks: &[(i64, i64)], acked: i64) {
    shared.release(acks.iter().map(|&(id, _)| id));
    shared.counters.add(&WorkerStats {
        acked: acked as u64,
        lost: acks.len() as u64 - acked as u64,
        ..WorkerStats::default()
    });
}

async fn deliver<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &dyn Handler<T>,
    job: Taken,
) -> Finished {
    let mut tally = WorkerStats::default();
    let decoded = match shared.past_max_attempts(job.attempt) {
        Some(reason) => Err(reason),
        None => shared.decode::<T>(&job.payload),
    };
    let outcome = match decoded {
        Ok(payload) => {
            let (outcome, failed) = run_handler(
                handler.handle(Job::new(
                    job.id,
                    job.attempt,
                    payload,
                    shared.lost(job.id),
                    shared.progress.clone(),
                    step::Steps::new(&shared.steps, job.id, job.attempt),
                )),
                job.timeout.or(shared.settings.handler_timeout),
            )
            .await;
            tally.failed += u64::from(failed);
            outcome
        }
        Err(reason) => Outcome::Dead { reason },
    };
    if outcome == Outcome::Ack {
        shared.counters.add(&tally);
        return Finished::Ack(job.id, job.token);
    }
    // Boxed: the settlement's futures are large, and every delivery in flight would carry them
    // (2,000 deliveries of 2.5 KB each, allocated and freed per batch).
    Box::pin(settle(shared, job, outcome, tally)).await
}

/// Settles a delivery that is not acked with others (retried, snoozed or dead-lettered, or acked
/// with a result) on a pooled connection.
async fn settle(shared: &Shared, job: Taken, outcome: Outcome, mut tally: WorkerStats) -> Finished {
    let settled = async {
        let client = shared.db.pool().get().await?;
        // Bounded like every round trip; a connection past the bound is closed.
        let settled = shared
            .bounded(super::settle_apart(
                shared, &client, &job, outcome, &mut tally,
            ))
            .await;
        if settled
            .as_ref()
            .is_err_and(|error| error.kind() == ErrorKind::ConnectionLost)
        {
            drop(Object::take(client));
        }
        settled
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
    Finished::Settled
}
