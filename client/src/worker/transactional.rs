//! Transactional mode: each delivery runs on its group's transaction, inside a savepoint, and
//! its writes commit with its settlement.

use std::sync::Arc;

use deadpool_postgres::Object;
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
    let mut connection: Option<SlotConnection> = None;
    while !shared.stop.is_cancelled() {
        let mut conn = match connection.take() {
            Some(conn) => conn,
            None => match open(&shared).await {
                Ok(conn) => conn,
                Err(error) => {
                    shared.back_off(&error).await;
                    continue;
                }
            },
        };
        match run_group(&shared, &handler, &mut conn).await {
            Ok(found) => {
                connection = Some(conn);
                if found {
                    // There may be more: let another idle slot look too.
                    shared.wake.notify_one();
                } else {
                    shared.idle().await;
                }
            }
            Err(error) => {
                // A failed group's transaction is rolled back; a connection in doubt is not
                // reused (dropped in a transaction, it is closed), and the pool replaces it.
                let rolled_back = !conn.in_transaction
                    || (error.kind() != ErrorKind::ConnectionLost
                        && conn.client().batch_execute(sql::ROLLBACK).await.is_ok());
                if rolled_back {
                    conn.in_transaction = false;
                    connection = Some(conn);
                }
                shared.back_off(&error).await;
            }
        }
    }
}

/// A pooled connection, held by this slot, with the delivery timeouts set on its session.
async fn open(shared: &Shared) -> Result<SlotConnection, DbError> {
    let client = shared.db.pool().get().await?;
    let settings = &shared.settings;
    client
        .batch_execute(&sql::delivery_timeouts(
            settings.statement_timeout.as_millis(),
            settings.idle_in_transaction_timeout.as_millis(),
        ))
        .await?;
    Ok(SlotConnection {
        client: Some(client),
        in_transaction: false,
    })
}

/// Takes and runs one group; `Ok(false)` when there was nothing to take.
///
/// The transaction is driven with plain `BEGIN`/`SAVEPOINT`/`COMMIT` statements so that they can
/// share round trips: a lock is taken in the round trip of its `BEGIN`, and a single leased
/// delivery needs no savepoint at all (a failure rolls the whole transaction back and settles the
/// job after it: the lease keeps other workers away meanwhile).
async fn run_group<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn TxHandler<T>>,
    conn: &mut SlotConnection,
) -> Result<bool, DbError> {
    let group = shared.settings.group_size as i32;
    let queue = shared.queue.as_str();
    match shared.settings.claim {
        Claim::Lease => {
            let jobs = calls::lease(conn.client(), queue, group, shared.settings.lease).await?;
            if jobs.is_empty() {
                return Ok(false);
            }
            let ids: Vec<i64> = jobs.iter().map(|job| job.id).collect();
            shared.hold(jobs.iter().map(|job| (job.id, job.token)));
            let savepoints = jobs.len() > 1;
            let result = async {
                let mut tx = Tx::begin(conn, savepoints).await?;
                tx.run(shared, handler, jobs).await
            }
            .await;
            shared.release(ids);
            result.map(|()| true)
        }
        Claim::Lock => {
            // The lock needs the transaction: BEGIN goes first in the same round trip.
            conn.in_transaction = true;
            let client = conn.client();
            let (begun, jobs) = tokio::join!(
                client.batch_execute(sql::BEGIN),
                calls::lock(client, queue, group)
            );
            // On an error here the slot rolls the open transaction back (or drops the connection).
            begun?;
            let jobs = jobs?;
            // Each delivery runs in a savepoint even alone: a failure must be undone without
            // giving up the lock, or another slot could take the job before it is settled.
            let mut tx = Tx {
                conn,
                savepoints: true,
                savepoint_open: false,
            };
            if jobs.is_empty() {
                tx.end(sql::ROLLBACK).await?;
                return Ok(false);
            }
            tx.run(shared, handler, jobs).await.map(|()| true)
        }
    }
}

/// The pooled connection a slot holds. Dropped in the middle of a transaction (the worker
/// abandoned it at shutdown), it closes the connection rather than return it to the pool still in
/// the transaction; the server then rolls the transaction back.
struct SlotConnection {
    client: Option<Object>,
    in_transaction: bool,
}

impl SlotConnection {
    fn client(&self) -> &Object {
        self.client
            .as_ref()
            .expect("a slot connection holds its client until dropped")
    }
}

impl Drop for SlotConnection {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            if self.in_transaction {
                drop(Object::take(client));
            } else {
                // Back to the pool for other users, without the worker's timeouts: the connection
                // returns once reset (or is closed, if the runtime is gone).
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let _ = client.batch_execute(sql::RESET_TIMEOUTS).await;
                    });
                }
            }
        }
    }
}

/// A transaction begun on a slot's connection.
struct Tx<'c> {
    conn: &'c mut SlotConnection,
    /// Whether each delivery runs in a savepoint (several deliveries, or a lock to keep).
    savepoints: bool,
    savepoint_open: bool,
}

impl<'c> Tx<'c> {
    async fn begin(conn: &'c mut SlotConnection, savepoints: bool) -> Result<Tx<'c>, DbError> {
        conn.in_transaction = true;
        conn.client().batch_execute(sql::BEGIN).await?;
        Ok(Tx {
            conn,
            savepoints,
            savepoint_open: false,
        })
    }

    async fn end(&mut self, statement: &str) -> Result<(), DbError> {
        self.conn.client().batch_execute(statement).await?;
        self.conn.in_transaction = false;
        Ok(())
    }

    /// Delivers each job, then commits; the counts are added only once the commit succeeded.
    async fn run<T: DeserializeOwned + Send + 'static>(
        &mut self,
        shared: &Shared,
        handler: &Arc<dyn TxHandler<T>>,
        jobs: Vec<Taken>,
    ) -> Result<(), DbError> {
        let mut tally = WorkerStats::default();
        for job in jobs {
            let span = tracing::info_span!("delivery", queue = %shared.queue, id = job.id, attempt = job.attempt);
            self.deliver(shared, handler, job, &mut tally)
                .instrument(span)
                .await?;
        }
        // A single leased delivery that failed was rolled back and settled on its own already.
        if self.conn.in_transaction {
            self.end(sql::COMMIT).await?;
        }
        shared.counters.add(&tally);
        Ok(())
    }

    /// Opens the delivery's savepoint, releasing the previous delivery's (kept) one in the same
    /// round trip.
    async fn savepoint(&mut self) -> Result<(), DbError> {
        let statement = if self.savepoint_open {
            sql::NEXT_SAVEPOINT
        } else {
            sql::SAVEPOINT
        };
        self.conn.client().batch_execute(statement).await?;
        self.savepoint_open = true;
        Ok(())
    }

    /// Undoes the delivery's writes: back to its savepoint, or the whole transaction when it has
    /// none (its settlement then runs on its own, after it).
    async fn undo(&mut self) -> Result<(), DbError> {
        if self.savepoints {
            self.conn
                .client()
                .batch_execute(sql::ROLLBACK_TO_SAVEPOINT)
                .await?;
            Ok(())
        } else {
            self.end(sql::ROLLBACK).await
        }
    }

    async fn deliver<T: DeserializeOwned + Send + 'static>(
        &mut self,
        shared: &Shared,
        handler: &Arc<dyn TxHandler<T>>,
        job: Taken,
        tally: &mut WorkerStats,
    ) -> Result<(), DbError> {
        let payload = match shared.decode::<T>(&job.payload) {
            Ok(payload) => payload,
            Err(reason) => {
                tracing::warn!(%reason, "dead-lettering a payload that does not decode");
                return self
                    .settle(shared, &job, Outcome::Dead { reason }, tally)
                    .await;
            }
        };
        if self.savepoints {
            self.savepoint().await?;
        }
        let (outcome, failed) = {
            let port = PgTransaction::in_transaction(self.conn.client());
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
        tally.failed += u64::from(failed);
        let outcome = if outcome == Outcome::Ack {
            match calls::ack(self.conn.client(), &shared.queue, job.id, job.token).await {
                Ok(true) => {
                    tally.acked += 1;
                    return Ok(());
                }
                Ok(false) => {
                    self.undo().await?;
                    tracing::warn!("the lease was lost to another worker; the handler's writes are rolled back");
                    tally.lost += 1;
                    return Ok(());
                }
                // The handler left its transaction unusable (a failed statement it ignored).
                Err(error) => Outcome::Retry {
                    after: None,
                    reason: Some(error.to_string()),
                },
            }
        } else {
            outcome
        };
        self.undo().await?;
        self.settle(shared, &job, outcome, tally).await
    }

    /// Settles a job that was not acked: in the transaction, or on its own once the transaction
    /// was rolled back.
    async fn settle(
        &mut self,
        shared: &Shared,
        job: &Taken,
        outcome: Outcome,
        tally: &mut WorkerStats,
    ) -> Result<(), DbError> {
        let applied =
            super::settle_failure(shared, self.conn.client(), job, outcome, tally).await?;
        tally.lost += u64::from(!applied);
        Ok(())
    }
}
