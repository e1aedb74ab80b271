//! Transactional mode: each delivery runs on its group's transaction, inside a savepoint, and
//! its writes commit with its settlement.

use std::sync::Arc;

use deadpool_postgres::{Object, Transaction};
use serde::de::DeserializeOwned;
use tracing::Instrument;

use super::calls::{self, Taken};
use super::{run_handler, Claim, Job, Outcome, Shared, TxHandler, WorkerStats};
use crate::error::{DbError, ErrorKind};
use crate::sql;
use crate::tx::PgTransaction;

/// One delivery slot: takes a group of jobs, runs them one after another on one connection, and
/// commits the group; until the worker stops.
pub(super) async fn run<T: DeserializeOwned + Send + 'static>(
    shared: Arc<Shared>,
    handler: Arc<dyn TxHandler<T>>,
) {
    let mut connection: Option<Object> = None;
    while !shared.stop.is_cancelled() {
        let client = match connection.take() {
            Some(client) => client,
            None => match open(&shared).await {
                Ok(client) => client,
                Err(error) => {
                    shared.back_off(&error).await;
                    continue;
                }
            },
        };
        let mut client = client;
        match run_group(&shared, &handler, &mut client).await {
            Ok(found) => {
                connection = Some(client);
                if found {
                    // There may be more: let another idle slot look too.
                    shared.wake.notify_one();
                } else {
                    shared.idle().await;
                }
            }
            Err(error) => {
                // The failed transaction was rolled back when dropped; a connection in doubt is
                // not reused, and the pool replaces it.
                if error.kind() == ErrorKind::ConnectionLost {
                    drop(Object::take(client));
                } else {
                    connection = Some(client);
                }
                shared.back_off(&error).await;
            }
        }
    }
    if let Some(client) = connection {
        let _ = client.batch_execute(sql::RESET_TIMEOUTS).await;
    }
}

/// A pooled connection, held by this slot, with the delivery timeouts set on its session.
async fn open(shared: &Shared) -> Result<Object, DbError> {
    let client = shared.db.pool().get().await?;
    let settings = &shared.settings;
    client
        .batch_execute(&sql::delivery_timeouts(
            settings.statement_timeout.as_millis(),
            settings.idle_in_transaction_timeout.as_millis(),
        ))
        .await?;
    Ok(client)
}

/// Takes and runs one group; `Ok(false)` when there was nothing to take.
async fn run_group<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn TxHandler<T>>,
    client: &mut Object,
) -> Result<bool, DbError> {
    let group = shared.settings.group_size as i32;
    let queue = shared.queue.as_str();
    match shared.settings.claim {
        Claim::Lease => {
            let jobs = calls::lease(&*client, queue, group, shared.settings.lease).await?;
            if jobs.is_empty() {
                return Ok(false);
            }
            let ids: Vec<i64> = jobs.iter().map(|job| job.id).collect();
            shared.hold(jobs.iter().map(|job| (job.id, job.token)));
            let result = async {
                let tx = client.transaction().await?;
                commit_group(shared, handler, tx, jobs).await
            }
            .await;
            shared.release(ids);
            result.map(|()| true)
        }
        Claim::Lock => {
            let tx = client.transaction().await?;
            let jobs = calls::lock(&tx, queue, group).await?;
            if jobs.is_empty() {
                tx.rollback().await?;
                return Ok(false);
            }
            commit_group(shared, handler, tx, jobs).await.map(|()| true)
        }
    }
}

/// Delivers each job in its savepoint of `tx`, then commits; the counts are added only once the
/// commit succeeded.
async fn commit_group<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn TxHandler<T>>,
    mut tx: Transaction<'_>,
    jobs: Vec<Taken>,
) -> Result<(), DbError> {
    let mut tally = WorkerStats::default();
    for job in jobs {
        let span = tracing::info_span!("delivery", queue = %shared.queue, id = job.id, attempt = job.attempt);
        deliver(shared, handler, &mut tx, job, &mut tally)
            .instrument(span)
            .await?;
    }
    tx.commit().await?;
    shared.counters.add(&tally);
    Ok(())
}

async fn deliver<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn TxHandler<T>>,
    tx: &mut Transaction<'_>,
    job: Taken,
    tally: &mut WorkerStats,
) -> Result<(), DbError> {
    let queue = shared.queue.as_str();
    let fence = (job.id, job.token);
    let payload = match shared.decode::<T>(&job.payload) {
        Ok(payload) => payload,
        Err(reason) => {
            tracing::warn!(%reason, "dead-lettering a payload that does not decode");
            return settle(shared, tx, &job, Outcome::Dead { reason }, tally).await;
        }
    };
    let savepoint = tx.savepoint("inbox_delivery").await?;
    let (outcome, failed) = {
        let port = PgTransaction::new(&savepoint);
        run_handler(handler.handle(
            Job {
                id: job.id,
                attempt: job.attempt,
                payload,
            },
            &port,
        ))
        .await
    };
    if failed {
        tally.failed += 1;
    }
    if outcome == Outcome::Ack {
        match calls::ack(&savepoint, queue, fence.0, fence.1).await {
            Ok(true) => {
                savepoint.commit().await?;
                tally.acked += 1;
                return Ok(());
            }
            Ok(false) => {
                savepoint.rollback().await?;
                tracing::warn!(
                    "the lease was lost to another worker; the handler's writes are rolled back"
                );
                tally.lost += 1;
                return Ok(());
            }
            Err(error) => {
                // The handler left its transaction unusable (a failed statement it ignored).
                savepoint.rollback().await?;
                let outcome = Outcome::Retry {
                    after: None,
                    reason: Some(error.to_string()),
                };
                return settle(shared, tx, &job, outcome, tally).await;
            }
        }
    }
    savepoint.rollback().await?;
    settle(shared, tx, &job, outcome, tally).await
}

/// Settles a job that was not acked, on the group's transaction.
async fn settle(
    shared: &Shared,
    tx: &Transaction<'_>,
    job: &Taken,
    outcome: Outcome,
    tally: &mut WorkerStats,
) -> Result<(), DbError> {
    let applied = super::settle_failure(shared, tx, job, outcome, tally).await?;
    if !applied {
        tally.lost += 1;
    }
    Ok(())
}
