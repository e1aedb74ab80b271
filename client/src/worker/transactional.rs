//! Transactional mode: a slot takes a group of jobs (what is ready, up to the group size), runs
//! their deliveries one after another in one transaction, and settles the whole group in the
//! round trip that commits it and takes the next group.
//!
//! A delivery that fails (an error, a panic, or an outcome other than ack) is undone alone. Where
//! it ran inside a savepoint, opened in the round trip of the handler's first statement, it is
//! undone to it and settled in the group's transaction, and the deliveries before it do not run
//! again (nor do their calls outside the database). A savepoint costs the server a
//! subtransaction (and, where the handler writes, a subtransaction id): in every delivery, they
//! took the default worker from 0.62 to 0.54 of its raw loop (benchmark figure 8) when nothing
//! fails. So a slot's leased deliveries open savepoints only
//! from its first failure on, until [`SAVEPOINTS_AFTER_FAILURE`] have passed without one. A
//! transaction opens at most [`SAVEPOINTS_MAX`], no more subtransactions than the server caches
//! per transaction (past that, every snapshot in the server looks them up in pg_subtrans).
//!
//! A leased delivery without a savepoint that fails rolls the group's transaction back, which is
//! replayed without it: the jobs still held are fenced again in the new
//! transaction (`inbox_fence`; their leases kept them while no transaction held them), the failed
//! job is settled there, and the deliveries before it run again. After [`MAX_REPLAYS`] replays
//! in one group, or once the group has run for its time bound, the slot commits what is done and
//! goes on with the rest in a new transaction, so a group costs at most a bounded number of runs
//! per job.
//!
//! A locked group cannot replay: its jobs are held only by the transaction's row locks, which a
//! rollback gives up, so another worker could take a failed job before its failure is recorded
//! and run that attempt again. So a locked group is at most [`LOCK_GROUP_MAX`] jobs, each inside
//! its savepoint.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Object;
use serde::de::DeserializeOwned;
use tokio_postgres::Statement;
use tracing::Instrument;

use super::calls::{self, Taken};
use super::job::Deliver;
use super::step;
use super::{
    catch_handler, outcome_of, Claim, Job, LockFailure, Outcome, Shared, Tx, WorkerStats,
    LOCK_GROUP_MAX,
};
use crate::error::{within, DbError, ErrorKind};
use crate::mode::{self, StatementMode};
use crate::sql;
use crate::tx::PgTransaction;

type Param = dyn tokio_postgres::types::ToSql + Sync;

/// The most savepoints one transaction of a group opens: PostgreSQL caches 64 subtransactions
/// per transaction (`PGPROC_MAX_CACHED_SUBXIDS`).
const SAVEPOINTS_MAX: usize = LOCK_GROUP_MAX;

/// How long a slot's leased deliveries keep opening savepoints after its last failure.
const SAVEPOINTS_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// Replays of one group after which every delivery commits on its own.
const MAX_REPLAYS: usize = 3;

/// How many times a fence that failed with a serialization failure is tried again.
const FENCE_TRIES: usize = 3;

/// `25P02 in_failed_sql_transaction`: a statement sent in a transaction that an error aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// How many slots a worker runs: one per delivery of `workers`, but each holds a pooled
/// connection for good, and one connection of the pool stays free for the heartbeat.
pub(super) fn slots(shared: &Shared) -> usize {
    let pool = shared.db.pool().status().max_size;
    shared.settings.workers.min(pool.saturating_sub(1)).max(1)
}

/// One delivery slot: takes a group of jobs, runs them one after another on one connection, and
/// commits the group; until the worker stops.
pub(super) async fn run<T: DeserializeOwned + Send + 'static>(
    shared: Arc<Shared>,
    handler: Arc<dyn Deliver<T>>,
) {
    let mut connection: Option<SlotConnection> = None;
    let mut size = GroupSize::new(&shared.settings);
    // Jobs taken for the next group, held by a committed lease or by the open transaction's locks.
    let mut next: Vec<Taken> = Vec::new();
    // Whether the slot has dozed since it last found work (`Shared::idle`).
    let mut dozed = false;
    while !(next.is_empty() && shared.stop.is_cancelled()) {
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
        let jobs = if next.is_empty() {
            let asked = size.asked(&shared);
            match take_first(&shared, &mut conn, asked).await {
                Ok(jobs) if jobs.is_empty() => {
                    connection = Some(conn);
                    shared.idle(dozed).await;
                    dozed = true;
                    continue;
                }
                Ok(jobs) => {
                    dozed = false;
                    shared.found_work();
                    shared.took(asked, jobs.len());
                    jobs
                }
                Err(error) => {
                    connection = recover_connection(&shared, conn, &error).await;
                    shared.back_off(&error).await;
                    continue;
                }
            }
        } else {
            std::mem::take(&mut next)
        };
        let held: Vec<(i64, i64)> = jobs.iter().map(|job| (job.id, job.token)).collect();
        let full = jobs.len() >= size.current;
        match run_group(&shared, &handler, &mut conn, jobs, &mut size).await {
            Ok(taken) => {
                next = taken;
                connection = Some(conn);
                if full {
                    // There may be more: let another idle slot look too.
                    shared.wake.notify_one();
                }
            }
            Err(error) => {
                // The group's leases expire (or its locks went with the transaction): nothing
                // of it is held any more by this slot, and no failure of it was settled (a
                // lock's delivery runs again with its attempt uncounted, as after a crash).
                for &(id, token) in &held {
                    shared.forget_lock_failure(id, token);
                }
                shared.release(held.into_iter().map(|(id, _)| id));
                connection = recover_connection(&shared, conn, &error).await;
                shared.back_off(&error).await;
            }
        }
    }
    if let Some(mut conn) = connection {
        if conn.in_transaction {
            let rollback = within(
                shared.round_trip_bound(),
                conn.client().batch_execute(sql::ROLLBACK),
            )
            .await;
            // Otherwise the connection is dropped in its transaction, and so closed.
            conn.in_transaction = !matches!(rollback, Ok(Ok(())));
        }
    }
}

/// After an error, the connection rolled back for reuse, or `None` when it is in doubt (dropped
/// in a transaction, it is closed, and the pool replaces it).
async fn recover_connection(
    shared: &Shared,
    mut conn: SlotConnection,
    error: &DbError,
) -> Option<SlotConnection> {
    if error.kind() == ErrorKind::ConnectionLost {
        // Lost, or silent (no answer within the round-trip bound): closed, never pooled again.
        conn.in_transaction = true;
        return None;
    }
    // Bounded: on a connection that went silent the slot would hang here for good.
    let rolled_back = !conn.in_transaction
        || matches!(
            within(
                shared.round_trip_bound(),
                conn.client().batch_execute(sql::ROLLBACK)
            )
            .await,
            Ok(Ok(()))
        );
    rolled_back.then(|| {
        conn.in_transaction = false;
        conn
    })
}

/// The statements a slot pipelines: prepared once on its connection, or `None` when they are
/// sent unnamed ([`StatementMode::Unnamed`]).
struct Prepared {
    take: Option<Statement>,
    ack_all: Option<Statement>,
    fence: Option<Statement>,
}

/// One of the statements a slot pipelines.
#[derive(Clone, Copy)]
enum Call {
    Take,
    AckAll,
    Fence,
}

/// A pooled connection, held by this slot; its transactions set the delivery timeouts when they
/// begin, so the session keeps none of the worker's settings.
async fn open(shared: &Shared) -> Result<SlotConnection, DbError> {
    let client = shared.db.pool().get().await?;
    let settings = &shared.settings;
    let take = take_sql(shared);
    let prepared = match shared.db.statement_mode() {
        StatementMode::Prepared => {
            // Bounded like every round trip: a pooled connection that went silent while it sat
            // in the pool would otherwise hang the slot here for good.
            let prepares = async {
                Ok::<_, tokio_postgres::Error>(Prepared {
                    take: Some(client.prepare_cached(take).await?),
                    ack_all: Some(client.prepare_cached(sql::QUEUE_ACK_ALL).await?),
                    fence: Some(client.prepare_cached(sql::QUEUE_FENCE).await?),
                })
            };
            match within(shared.round_trip_bound(), prepares).await {
                Ok(prepared) => prepared?,
                Err(lost) => {
                    // Closed, never pooled again.
                    drop(Object::take(client));
                    return Err(lost);
                }
            }
        }
        StatementMode::Unnamed => Prepared {
            take: None,
            ack_all: None,
            fence: None,
        },
    };
    Ok(SlotConnection {
        client: Some(client),
        prepared,
        begins: sql::delivery_begins(
            settings.isolation.begin(),
            settings.statement_timeout.as_millis(),
            settings.idle_in_transaction_timeout.as_millis(),
        ),
        take,
        in_transaction: false,
    })
}

fn take_sql(shared: &Shared) -> &'static str {
    match shared.settings.claim {
        Claim::Lease => sql::QUEUE_LEASE,
        Claim::Lock => sql::QUEUE_LOCK,
    }
}

/// Takes what is ready, up to a group, and opens the group's transaction in the same round trip
/// (a lease commits first, on its own; a lock is taken inside the transaction).
async fn take_first(
    shared: &Shared,
    conn: &mut SlotConnection,
    max: usize,
) -> Result<Vec<Taken>, DbError> {
    conn.in_transaction = true;
    let bound = shared.round_trip_bound();
    let (begun, jobs) = match shared.settings.claim {
        Claim::Lease => {
            let (jobs, begun) = within(bound, async {
                tokio::join!(
                    take_query(shared, conn, max),
                    conn.client().batch_execute(&conn.begins.begin)
                )
            })
            .await?;
            (begun, jobs)
        }
        Claim::Lock => {
            within(bound, async {
                tokio::join!(
                    conn.client().batch_execute(&conn.begins.begin),
                    take_query(shared, conn, max)
                )
            })
            .await?
        }
    };
    // The lease committed on its own, before the BEGIN.
    let jobs = jobs?;
    hold_leased(shared, &jobs);
    if let Err(error) = begun {
        shared.release(jobs.iter().map(|job| job.id));
        return Err(error.into());
    }
    // Above READ COMMITTED the group's first statement locks its jobs' rows, so that its
    // settlement cannot conflict with a heartbeat's extension of them.
    let jobs = if shared.settings.isolation.snapshot_per_transaction() && !jobs.is_empty() {
        fence_taken(shared, conn, jobs).await?
    } else {
        jobs
    };
    if jobs.is_empty() {
        within(bound, conn.client().batch_execute(sql::ROLLBACK)).await??;
        conn.in_transaction = false;
    }
    Ok(jobs)
}

/// Fences freshly leased jobs as the first statement of their group's transaction; returns those
/// still held (a job's lease may have run out meanwhile), releasing the rest, or all of them on
/// an error.
async fn fence_taken(
    shared: &Shared,
    conn: &SlotConnection,
    jobs: Vec<Taken>,
) -> Result<Vec<Taken>, DbError> {
    let (ids, tokens) = fences(jobs.iter());
    let params: [&Param; 3] = [&shared.queue, &ids, &tokens];
    let fenced = match conn.query(Call::Fence, &params).await {
        Err(error) if error.kind() == ErrorKind::Retryable => {
            refence(shared, conn, &ids, &tokens).await
        }
        fenced => fenced,
    };
    let held: HashSet<i64> = match fenced.and_then(|rows| {
        rows.iter()
            .map(|row| row.try_get(0).map_err(DbError::from))
            .collect::<Result<_, _>>()
    }) {
        Ok(held) => held,
        Err(error) => {
            shared.release(ids);
            return Err(error);
        }
    };
    let (kept, lost): (Vec<Taken>, Vec<Taken>) =
        jobs.into_iter().partition(|job| held.contains(&job.id));
    shared.release(lost.iter().map(|job| job.id));
    shared.counters.add(&WorkerStats {
        lost: lost.len() as u64,
        ..WorkerStats::default()
    });
    Ok(kept)
}

/// The take statement (lease or lock) for up to a group of jobs. The caller records leased jobs
/// as held (for the heartbeat) once their lease is known to have committed: a lease whose commit
/// went unanswered must be left to expire.
async fn take_query(
    shared: &Shared,
    conn: &SlotConnection,
    max: usize,
) -> Result<Vec<Taken>, DbError> {
    let max = max as i32;
    let rows = match shared.settings.claim {
        Claim::Lease => {
            let lease = calls::interval(shared.settings.lease);
            conn.query(Call::Take, &[&shared.queue, &max, &lease])
                .await?
        }
        Claim::Lock => conn.query(Call::Take, &[&shared.queue, &max]).await?,
    };
    calls::read_taken(rows)
}

/// Records jobs whose lease committed as held by this worker (the heartbeat extends them).
fn hold_leased(shared: &Shared, jobs: &[Taken]) {
    shared.hold(
        jobs.iter()
            .filter(|job| job.token > 0)
            .map(|job| (job.id, job.token)),
    );
}

/// A delivery that was not acked, to be settled in the group's transaction.
struct Failure {
    job: Taken,
    outcome: Outcome,
    /// Whether the handler failed (an error or a panic), for the counts.
    failed: bool,
    /// What its settlement counted, the last time it was applied.
    tally: WorkerStats,
}

/// How a delivery ended.
enum Delivered {
    Ack,
    /// The transaction was already aborted when the handler ran: not this delivery's failure.
    Poisoned,
    /// Not acked; `wrote` when the handler ran (its writes must be undone), `saved` when it
    /// ran inside the delivery's savepoint (a locked job's), to which they can be.
    Failed {
        outcome: Outcome,
        failed: bool,
        wrote: bool,
        saved: bool,
    },
    /// The handler failed with a serialization failure or a deadlock (`reason`): its writes are
    /// to be undone and the delivery run again.
    Conflicted {
        reason: String,
        saved: bool,
    },
}

/// One group in its transaction: the jobs still to run, those run and awaiting the commit, and
/// the failed ones settled in the transaction.
struct Group {
    pending: VecDeque<Taken>,
    done: Vec<Taken>,
    failures: Vec<Failure>,
    replays: usize,
    /// When the group's current transaction began (the time bound runs from there).
    started: Instant,
    /// Deliveries run, replays included, and when the group began: how long one takes.
    runs: usize,
    began: Instant,
    /// Settlements or commits that failed, and how many the group may have: one per job it
    /// began with, and a few.
    recoveries: usize,
    most_recoveries: usize,
    /// How many times each job has run again after a serialization failure or a deadlock.
    reruns: HashMap<i64, u32>,
    /// Whether its leased deliveries open savepoints (see [`GroupSize::savepoints`]).
    savepoints: bool,
    /// The savepoints opened in the current transaction (at most [`SAVEPOINTS_MAX`]), and the
    /// jobs whose delivery opened one.
    opened: usize,
    saved: HashSet<i64>,
}

/// How many jobs a slot takes for its next group, and whether its leased deliveries open
/// savepoints.
struct GroupSize {
    current: usize,
    max: usize,
    adaptive: bool,
    /// Until when leased deliveries open savepoints: [`SAVEPOINTS_AFTER_FAILURE`] after the
    /// slot's last failure.
    savepoints_until: Option<Instant>,
}

impl GroupSize {
    fn new(settings: &super::Settings) -> Self {
        let most = match settings.claim {
            Claim::Lease => usize::MAX,
            Claim::Lock => LOCK_GROUP_MAX,
        };
        match settings.group_size {
            Some(n) => Self {
                current: n.min(most),
                max: n.min(most),
                adaptive: false,
                savepoints_until: None,
            },
            None => Self {
                current: 1,
                max: super::ADAPTIVE_GROUP_MAX.min(most),
                adaptive: true,
                savepoints_until: None,
            },
        }
    }

    /// How many jobs to take now: the group's size, or with adaptive groups its share while
    /// other slots are idle ([`Shared::share`]); a size set by `group_size` is kept as set.
    fn asked(&self, shared: &Shared) -> usize {
        if self.adaptive {
            shared.share(self.current)
        } else {
            self.current
        }
    }

    /// Whether leased deliveries open savepoints now.
    fn savepoints(&self) -> bool {
        self.savepoints_until
            .is_some_and(|until| Instant::now() < until)
    }

    /// A delivery failed: leased deliveries open savepoints for a while.
    fn failed(&mut self) {
        self.savepoints_until = Some(Instant::now() + SAVEPOINTS_AFTER_FAILURE);
    }

    /// After a group of `runs` deliveries that took `elapsed`: twice the size, at most what fits
    /// in `bound` at that pace, between 1 and the maximum.
    fn update(&mut self, runs: usize, elapsed: std::time::Duration, bound: std::time::Duration) {
        if !self.adaptive || runs == 0 {
            return;
        }
        let per_run = elapsed.as_nanos() / runs as u128;
        let fits = bound.as_nanos().checked_div(per_run).unwrap_or(u128::MAX);
        let fits = usize::try_from(fits).unwrap_or(usize::MAX);
        self.current = (self.current * 2).min(fits).clamp(1, self.max);
    }
}

/// Runs a group whose transaction is open, and commits it; returns the jobs taken for the next
/// group in the commit's round trip (their transaction open), if any.
async fn run_group<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn Deliver<T>>,
    conn: &mut SlotConnection,
    jobs: Vec<Taken>,
    size: &mut GroupSize,
) -> Result<Vec<Taken>, DbError> {
    let mut group = Group {
        runs: 0,
        began: Instant::now(),
        recoveries: 0,
        most_recoveries: jobs.len() * (1 + shared.settings.conflict_reruns as usize)
            + MAX_REPLAYS
            + 1,
        reruns: HashMap::new(),
        savepoints: size.savepoints(),
        opened: 0,
        saved: HashSet::new(),
        pending: VecDeque::with_capacity(jobs.len()),
        done: Vec::with_capacity(jobs.len()),
        failures: Vec::new(),
        replays: 0,
        started: Instant::now(),
    };
    for job in jobs {
        // A locked job whose delivery here failed, taken again by this slot in the moment
        // between that delivery's rollback and its settlement: settled as it failed, not run.
        match shared.lock_failure(&job) {
            Some(failure) => group.failures.push(Failure {
                job,
                outcome: failure.outcome,
                failed: failure.failed,
                tally: WorkerStats::default(),
            }),
            None => group.pending.push_back(job),
        }
    }
    if !group.failures.is_empty() {
        group.settle_aparts(shared, conn).await?;
    }
    loop {
        while let Some(job) = group.pending.pop_front() {
            let span = tracing::info_span!("delivery", queue = %shared.queue, id = job.id, attempt = job.attempt);
            group.runs += 1;
            // A locked delivery always has its savepoint (a locked group is no larger).
            let saved = job.token < 0 || (group.savepoints && group.opened < SAVEPOINTS_MAX);
            if saved {
                group.opened += 1;
                group.saved.insert(job.id);
            }
            let delivered = deliver(shared, handler, conn, &job, saved)
                .instrument(span)
                .await;
            if !matches!(delivered, Delivered::Ack) {
                // From now on (the replay this failure may cost included) deliveries are undone
                // alone.
                size.failed();
                group.savepoints = true;
            }
            match delivered {
                Delivered::Ack => group.done.push(job),
                Delivered::Poisoned => {
                    group.pending.push_front(job);
                    // In a locked group the delivery that left its savepoint aborted is the one
                    // before: undone to that savepoint and retried. Otherwise, find it: from
                    // now on each delivery commits on its own, and the one whose commit fails
                    // is retried.
                    if !group.pin_on_last_delivery(shared, conn).await? {
                        group.one_by_one();
                        group.replay(shared, conn, None).await?;
                    }
                }
                Delivered::Failed {
                    outcome,
                    failed,
                    wrote,
                    saved,
                } => {
                    let failure = Failure {
                        job,
                        outcome,
                        failed,
                        tally: WorkerStats::default(),
                    };
                    group.fail(shared, conn, failure, wrote, saved).await?;
                }
                Delivered::Conflicted { reason, saved } => {
                    if group.rerun(shared, job.id) {
                        // Undone to its savepoint and run again in the same transaction at READ
                        // COMMITTED (a new snapshot per statement); above it, the transaction's
                        // snapshot would meet the same conflict, so the group is replayed.
                        group.pending.push_front(job);
                        let fresh = !shared.settings.isolation.snapshot_per_transaction();
                        if !(saved && fresh && undo_delivery(shared, conn).await) {
                            group.replay(shared, conn, None).await?;
                        }
                    } else {
                        let failure = Failure {
                            job,
                            outcome: Outcome::Retry {
                                after: None,
                                reason: Some(reason),
                            },
                            failed: true,
                            tally: WorkerStats::default(),
                        };
                        group.fail(shared, conn, failure, true, saved).await?;
                    }
                }
            }
            let overdue = group.replays > MAX_REPLAYS
                || group.started.elapsed() >= shared.settings.group_time;
            if overdue && !group.done.is_empty() && !group.pending.is_empty() {
                group.checkpoint(shared, conn).await?;
            }
        }
        if let Some(next) = group.finish(shared, conn, size).await? {
            return Ok(next);
        }
    }
}

/// Runs one delivery's handler on the group's transaction, inside a savepoint when `saved`.
async fn deliver<T: DeserializeOwned + Send + 'static>(
    shared: &Shared,
    handler: &Arc<dyn Deliver<T>>,
    conn: &SlotConnection,
    job: &Taken,
    saved: bool,
) -> Delivered {
    if let Some(reason) = shared.past_max_attempts(job.attempt) {
        tracing::warn!(%reason, "dead-lettering a job whose attempts are spent");
        return Delivered::Failed {
            outcome: Outcome::Dead { reason },
            failed: false,
            wrote: false,
            saved: false,
        };
    }
    let payload = match shared.decode::<T>(&job.payload) {
        Ok(payload) => payload,
        Err(reason) => {
            tracing::warn!(%reason, "dead-lettering a payload that does not decode");
            return Delivered::Failed {
                outcome: Outcome::Dead { reason },
                failed: false,
                wrote: false,
                saved: false,
            };
        }
    };
    let port = PgTransaction::in_transaction(conn.client())
        .with_statement_mode(shared.db.statement_mode())
        .with_round_trip_bound(shared.round_trip_bound());
    let tx = Tx::new(conn.client(), port);
    let delivery = catch_handler(
        handler.deliver(
            Job::new(
                job.id,
                job.attempt,
                payload,
                shared.lost(job.id),
                shared.progress.clone(),
                step::Steps::new(&shared.steps, job.id, job.attempt),
            ),
            &tx,
        ),
        job.timeout.or(shared.settings.handler_timeout),
    );
    // The savepoint opens in the round trip of the handler's first statement (`biased`: its
    // message is sent first).
    let savepoint = async {
        if saved {
            within(
                shared.round_trip_bound(),
                conn.client().batch_execute(sql::DELIVERY_SAVEPOINT),
            )
            .await
            .is_ok_and(|opened| opened.is_ok())
        } else {
            true
        }
    };
    let (opened, result) = tokio::join!(biased; savepoint, delivery);
    if !opened {
        // The transaction was aborted before this delivery (or the connection is gone, which
        // the replay finds): its handler saw only errors.
        return Delivered::Poisoned;
    }
    // A handler that finds the transaction already aborted was poisoned by an earlier delivery
    // of the group that ignored a failed statement and acked. (Inside its own savepoint, the
    // abort can only be its own doing: a failure like any other.)
    if let (false, Ok(Err(error))) = (saved, &result) {
        let aborted = sqlstate(&**error) == Some(IN_FAILED_TRANSACTION);
        if aborted {
            return Delivered::Poisoned;
        }
    }
    if let Ok(Err(error)) = &result {
        if is_conflict(error.as_ref()) {
            return Delivered::Conflicted {
                reason: error.to_string(),
                saved,
            };
        }
    }
    let (outcome, failed) = outcome_of(result);
    match outcome {
        Outcome::Ack => Delivered::Ack,
        // The result is recorded in the delivery's transaction, ahead of the group's ack: a
        // delivery whose token was lost meanwhile is found by that ack, which undoes both.
        Outcome::AckWith { result } => {
            let fence = (job.id, job.token);
            let statements = shared.db.statement_mode();
            let recorded = within(
                shared.round_trip_bound(),
                calls::with_json(
                    conn.client(),
                    statements,
                    sql::QUEUE_SET_RESULT,
                    &shared.queue,
                    fence,
                    &result,
                ),
            )
            .await;
            match recorded {
                Ok(Ok(_)) => Delivered::Ack,
                Ok(Err(error)) | Err(error) => Delivered::Failed {
                    outcome: Outcome::Retry {
                        after: None,
                        reason: Some(format!("cannot keep the result: {error}")),
                    },
                    failed: true,
                    wrote: true,
                    saved,
                },
            }
        }
        outcome => Delivered::Failed {
            outcome,
            failed,
            wrote: true,
            saved,
        },
    }
}

/// Whether a handler's error is, or was caused by, a serialization failure or a deadlock: a
/// [`DbError`] of kind `Retryable` (or tokio-postgres's error with that SQLSTATE) anywhere in its
/// chain of sources, so that one wrapped with context is recognised too.
fn is_conflict(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source()).any(|cause| {
        match cause.downcast_ref::<DbError>() {
            Some(error) => error.kind() == ErrorKind::Retryable,
            None => sqlstate(cause)
                .is_some_and(|code| ErrorKind::from_sqlstate(code) == ErrorKind::Retryable),
        }
    })
}

/// The SQLSTATE of a handler's error: the port's ([`DbError`]) or the driver's, from a handler
/// that ran its own statements on [`Tx::client`].
fn sqlstate<'e>(error: &'e (dyn std::error::Error + 'static)) -> Option<&'e str> {
    match error.downcast_ref::<DbError>() {
        Some(error) => error.sqlstate(),
        None => error
            .downcast_ref::<tokio_postgres::Error>()?
            .code()
            .map(|code| code.code()),
    }
}

/// Undoes a locked delivery's writes to its savepoint, keeping the transaction's row locks;
/// `false` when that failed (the group is then replayed).
async fn undo_delivery(shared: &Shared, conn: &SlotConnection) -> bool {
    let undone = within(
        shared.round_trip_bound(),
        conn.client().batch_execute(sql::DELIVERY_ROLLBACK),
    )
    .await;
    matches!(undone, Ok(Ok(())))
}

/// Rolls the transaction back, opens a new one and fences in it the jobs given, as its first
/// statement; returns the rows of those still held. Above READ COMMITTED the fence fails with a
/// serialization failure when a heartbeat wrote a job's row after the snapshot was taken, and
/// is tried again.
async fn refence(
    shared: &Shared,
    conn: &SlotConnection,
    ids: &Vec<i64>,
    tokens: &Vec<i64>,
) -> Result<Vec<tokio_postgres::Row>, DbError> {
    let client = conn.client();
    let params: [&Param; 3] = [&shared.queue, ids, tokens];
    let mut tries = 0;
    loop {
        let (restarted, fenced) = within(shared.round_trip_bound(), async {
            tokio::join!(
                client.batch_execute(&conn.begins.rollback_begin),
                conn.query(Call::Fence, &params)
            )
        })
        .await?;
        restarted?;
        match fenced {
            Err(error) if error.kind() == ErrorKind::Retryable && tries < FENCE_TRIES => {
                tries += 1;
            }
            fenced => return fenced,
        }
    }
}

/// The ids and tokens of `jobs`, as the array arguments of the extension's calls.
fn fences<'a>(jobs: impl Iterator<Item = &'a Taken>) -> (Vec<i64>, Vec<i64>) {
    jobs.map(|job| (job.id, job.token)).unzip()
}

impl Group {
    /// Settles a delivery that was not acked: a locked one is undone to its savepoint, its job
    /// still locked, and settled at once; a leased group is replayed without it (its lease holds
    /// the job meanwhile).
    async fn fail(
        &mut self,
        shared: &Shared,
        conn: &mut SlotConnection,
        failure: Failure,
        wrote: bool,
        saved: bool,
    ) -> Result<(), DbError> {
        // A locked job's failure is remembered until the group commits, also when it is settled
        // in this transaction at once: a later replay of the group rolls that settlement back,
        // and another slot may take the job in that moment.
        if failure.job.token < 0 {
            shared.remember_lock_failure(&failure.job, &failure.outcome, failure.failed);
        }
        let undone = !wrote || (saved && undo_delivery(shared, conn).await);
        if !undone {
            return self.replay(shared, conn, Some(failure)).await;
        }
        self.failures.push(failure);
        let last = self.failures.len() - 1;
        self.settle(shared, conn, last).await
    }

    /// Whether job `id` may run again after a serialization failure or a deadlock (each
    /// delivery a bounded number of times); counted when it may.
    fn rerun(&mut self, shared: &Shared, id: i64) -> bool {
        let reruns = self.reruns.entry(id).or_insert(0);
        if *reruns >= shared.settings.conflict_reruns {
            return false;
        }
        *reruns += 1;
        tracing::debug!(queue = %shared.queue, id, "serialization failure or deadlock; running the delivery again");
        shared.counters.add(&WorkerStats {
            reran: 1,
            ..WorkerStats::default()
        });
        true
    }

    /// Rolls the transaction back (undoing every delivery of it), opens a new one and fences in
    /// it the jobs still held; `failure`, if it is still held, is settled there with the earlier
    /// failures, and the deliveries done so far are run again.
    async fn replay(
        &mut self,
        shared: &Shared,
        conn: &mut SlotConnection,
        failure: Option<Failure>,
    ) -> Result<(), DbError> {
        self.replays += 1;
        self.opened = 0;
        self.saved.clear();
        let mut again: Vec<Taken> = self.done.drain(..).collect();
        again.extend(self.pending.drain(..));
        let (ids, tokens) = fences(
            again
                .iter()
                .chain(failure.iter().map(|f| &f.job))
                .chain(self.failures.iter().map(|f| &f.job)),
        );
        let held = refence(shared, conn, &ids, &tokens).await?;
        let held: HashSet<i64> = held
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        let mut lost = WorkerStats::default();
        let mut keep = |job: &Taken| {
            let kept = held.contains(&job.id);
            if !kept && job.token > 0 {
                // Another worker took the job since its lease here ended.
                tracing::warn!(queue = %shared.queue, id = job.id, "the lease was lost to another worker; the handler's writes are rolled back");
                shared.release([job.id]);
                lost.lost += 1;
            }
            // A lock released by the rollback and taken by another slot is that slot's now
            // (and a failed one is settled there, as it failed here).
            kept
        };
        self.pending = again.into_iter().filter(|job| keep(job)).collect();
        self.failures.retain(|f| keep(&f.job));
        if let Some(failure) = failure.filter(|f| keep(&f.job)) {
            self.failures.push(failure);
        }
        shared.counters.add(&lost);
        self.settle_aparts(shared, conn).await
    }

    /// When the last delivery done ran inside its savepoint and the savepoint of the next could
    /// not be opened, that delivery acked though a statement of it had failed: it is undone to
    /// its savepoint and settled as a retry. `false` when that does not apply or did not work.
    async fn pin_on_last_delivery(
        &mut self,
        shared: &Shared,
        conn: &SlotConnection,
    ) -> Result<bool, DbError> {
        let saved = self
            .done
            .last()
            .is_some_and(|job| self.saved.contains(&job.id));
        if !saved || !undo_delivery(shared, conn).await {
            return Ok(false);
        }
        let job = self.done.pop().expect("a delivery done");
        let failure = Failure {
            job,
            outcome: Outcome::Retry {
                after: None,
                reason: Some(
                    "the handler acked after a statement of its delivery failed".to_owned(),
                ),
            },
            // It acked: not counted as a failed handler.
            failed: false,
            tally: WorkerStats::default(),
        };
        if failure.job.token < 0 {
            shared.remember_lock_failure(&failure.job, &failure.outcome, false);
        }
        self.failures.push(failure);
        let last = self.failures.len() - 1;
        self.settle(shared, conn, last).await?;
        Ok(true)
    }

    /// Settles every failure in the (new) transaction.
    async fn settle_aparts(
        &mut self,
        shared: &Shared,
        conn: &SlotConnection,
    ) -> Result<(), DbError> {
        for index in 0..self.failures.len() {
            self.settle(shared, conn, index).await?;
        }
        Ok(())
    }

    /// Settles failure `index` (retry or dead-letter) in the transaction.
    async fn settle(
        &mut self,
        shared: &Shared,
        conn: &SlotConnection,
        index: usize,
    ) -> Result<(), DbError> {
        let failure = &mut self.failures[index];
        let mut tally = WorkerStats::default();
        let applied = within(
            shared.round_trip_bound(),
            super::settle_apart(
                shared,
                conn.client(),
                &failure.job,
                failure.outcome.clone(),
                &mut tally,
            ),
        )
        .await??;
        tally.lost += u64::from(!applied);
        tally.failed += u64::from(failure.failed);
        failure.tally = tally;
        Ok(())
    }

    /// Commits the deliveries done and the failures settled so far, and goes on with the rest of
    /// the group in a new transaction (fenced again: a lock does not outlive its transaction).
    async fn checkpoint(
        &mut self,
        shared: &Shared,
        conn: &mut SlotConnection,
    ) -> Result<(), DbError> {
        let (ids, tokens) = fences(self.done.iter());
        let (rest_ids, rest_tokens) = fences(self.pending.iter());
        let client = conn.client();
        let done: [&Param; 3] = [&shared.queue, &ids, &tokens];
        let rest: [&Param; 3] = [&shared.queue, &rest_ids, &rest_tokens];
        let (acked, committed, fenced) = within(shared.round_trip_bound(), async {
            tokio::join!(
                conn.query(Call::AckAll, &done),
                client.batch_execute(&conn.begins.commit_begin),
                conn.query(Call::Fence, &rest)
            )
        })
        .await?;
        if let Err(error) = acked.and(committed.map_err(DbError::from)) {
            return self.recover(shared, conn, error).await;
        }
        self.committed(shared);
        let fenced = match fenced {
            // The new transaction's snapshot was older than a heartbeat's write of a job's row.
            Err(error) if error.kind() == ErrorKind::Retryable => {
                return self.replay(shared, conn, None).await
            }
            fenced => fenced?,
        };
        let held: HashSet<i64> = fenced
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        let mut lost = WorkerStats::default();
        self.pending.retain(|job| {
            let kept = held.contains(&job.id);
            if !kept && job.token > 0 {
                shared.release([job.id]);
                lost.lost += 1;
            }
            kept
        });
        shared.counters.add(&lost);
        self.opened = 0;
        self.saved.clear();
        self.started = Instant::now();
        Ok(())
    }

    /// Commits the group, taking the next one in the same round trip (unless the worker is
    /// stopping); `None` when the group must run again first (its settlement failed).
    async fn finish(
        &mut self,
        shared: &Shared,
        conn: &mut SlotConnection,
        size: &mut GroupSize,
    ) -> Result<Option<Vec<Taken>>, DbError> {
        size.update(self.runs, self.began.elapsed(), shared.settings.group_time);
        let (ids, tokens) = fences(self.done.iter());
        let stopping = shared.stop.is_cancelled();
        // Above READ COMMITTED the next lease is not taken in this transaction, against its old
        // snapshot: it commits on its own, before the next group's transaction begins.
        let apart = stopping || shared.settings.isolation.snapshot_per_transaction();
        let asked = size.asked(shared);
        let client = conn.client();
        let params: [&Param; 3] = [&shared.queue, &ids, &tokens];
        let ack = conn.query(Call::AckAll, &params);
        let bound = shared.round_trip_bound();
        let (settled, next) = if apart {
            let (acked, committed) = within(bound, async {
                tokio::join!(ack, client.batch_execute(sql::COMMIT))
            })
            .await?;
            (acked.and(committed.map_err(DbError::from)), Ok(Vec::new()))
        } else {
            match shared.settings.claim {
                // The next lease commits with this group.
                Claim::Lease => {
                    let (acked, next, committed) = within(bound, async {
                        tokio::join!(
                            ack,
                            take_query(shared, conn, asked),
                            client.batch_execute(&conn.begins.commit_begin)
                        )
                    })
                    .await?;
                    // An error of the ack comes first: it aborted the transaction, and with it the
                    // lease and the commit.
                    match (acked, next) {
                        (Ok(_), Ok(next)) => (committed.map_err(DbError::from).map(drop), Ok(next)),
                        (Err(error), next) => (Err(error), next),
                        (Ok(_), Err(error)) => (Err(error), Ok(Vec::new())),
                    }
                }
                // The next lock is taken in the next group's transaction.
                Claim::Lock => {
                    let (acked, committed, next) = within(bound, async {
                        tokio::join!(
                            ack,
                            client.batch_execute(&conn.begins.commit_begin),
                            take_query(shared, conn, asked)
                        )
                    })
                    .await?;
                    (acked.and(committed.map_err(DbError::from)), next)
                }
            }
        };
        // Until here the next group's jobs are not held: when the commit failed, a lease taken
        // in its transaction was rolled back too, or, when its answer was lost (an error or no
        // answer within the bound), it took and nothing works on its jobs here; either way the
        // heartbeat must not keep them (they run again after their lease).
        if let Err(error) = settled {
            return self.recover(shared, conn, error).await.map(|()| None);
        }
        self.committed(shared);
        if apart {
            conn.in_transaction = false;
        }
        let next = next?;
        hold_leased(shared, &next);
        if !next.is_empty() {
            shared.found_work();
            shared.took(asked, next.len());
        }
        if next.is_empty() && conn.in_transaction {
            within(bound, conn.client().batch_execute(sql::ROLLBACK)).await??;
            conn.in_transaction = false;
        }
        Ok(Some(next))
    }

    /// From now on every delivery of the group commits on its own.
    fn one_by_one(&mut self) {
        self.replays = self.replays.max(MAX_REPLAYS + 1);
    }

    /// Counts what the commit that just succeeded applied.
    fn committed(&mut self, shared: &Shared) {
        let mut tally = WorkerStats {
            acked: self.done.len() as u64,
            ..WorkerStats::default()
        };
        let mut settled: Vec<i64> = self.done.drain(..).map(|job| job.id).collect();
        for failure in self.failures.drain(..) {
            tally.retried += failure.tally.retried;
            tally.dead += failure.tally.dead;
            tally.snoozed += failure.tally.snoozed;
            tally.failed += failure.tally.failed;
            tally.lost += failure.tally.lost;
            if failure.job.token < 0 {
                shared.forget_lock_failure(failure.job.id, failure.job.token);
            }
            settled.push(failure.job.id);
        }
        shared.release(settled);
        shared.counters.add(&tally);
    }

    /// After a settlement or a commit failed (the transaction is rolled back): a group whose
    /// jobs are no longer all held (`55000`) runs again without the lost ones; any other error
    /// is pinned on the single delivery of a group committed one by one (its handler left the
    /// transaction unusable, say), or else makes every delivery of the group commit on its own
    /// from now on, to find it.
    async fn recover(
        &mut self,
        shared: &Shared,
        conn: &mut SlotConnection,
        error: DbError,
    ) -> Result<(), DbError> {
        self.recoveries += 1;
        if error.kind() == ErrorKind::ConnectionLost || self.recoveries > self.most_recoveries {
            // Lost, or failing again and again without a delivery to blame: the slot gives the
            // group up (its leases expire, its locks went with the transaction).
            return Err(error);
        }
        if error.sqlstate() == Some("55000") {
            return self.replay(shared, conn, None).await;
        }
        // A commit that failed with a serialization failure or a deadlock runs the delivery again
        // when it was a group's only one, within the reruns a delivery has.
        let conflict = error.kind() == ErrorKind::Retryable;
        if conflict && self.done.len() == 1 && self.rerun(shared, self.done[0].id) {
            return self.replay(shared, conn, None).await;
        }
        if (conflict || self.replays > MAX_REPLAYS) && self.done.len() == 1 {
            let job = self.done.pop().expect("one delivery");
            let failure = Failure {
                job,
                outcome: Outcome::Retry {
                    after: None,
                    reason: Some(error.to_string()),
                },
                failed: false,
                tally: WorkerStats::default(),
            };
            if failure.job.token < 0 {
                shared.remember_lock_failure(&failure.job, &failure.outcome, false);
            }
            return self.replay(shared, conn, Some(failure)).await;
        }
        self.one_by_one();
        self.replay(shared, conn, None).await
    }
}

/// The pooled connection a slot holds. Dropped in the middle of a transaction (the worker
/// abandoned it at shutdown), it closes the connection rather than return it to the pool still in
/// the transaction; the server then rolls the transaction back.
struct SlotConnection {
    client: Option<Object>,
    prepared: Prepared,
    begins: sql::DeliveryBegins,
    /// The take statement's SQL (lease or lock).
    take: &'static str,
    in_transaction: bool,
}

impl SlotConnection {
    fn client(&self) -> &Object {
        self.client
            .as_ref()
            .expect("a slot connection holds its client until dropped")
    }

    /// Runs `call`: its prepared statement, or its SQL unnamed. The message is sent when the
    /// future is first polled, so calls joined together share a round trip in order.
    async fn query(
        &self,
        call: Call,
        params: &[&Param],
    ) -> Result<Vec<tokio_postgres::Row>, DbError> {
        let (prepared, sql) = match call {
            Call::Take => (&self.prepared.take, self.take),
            Call::AckAll => (&self.prepared.ack_all, sql::QUEUE_ACK_ALL),
            Call::Fence => (&self.prepared.fence, sql::QUEUE_FENCE),
        };
        match prepared {
            Some(prepared) => Ok(self.client().query(prepared, params).await?),
            None => Ok(mode::run(&***self.client(), sql, params).await?.rows),
        }
    }
}

impl Drop for SlotConnection {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            if self.in_transaction {
                drop(Object::take(client));
            }
            // Otherwise it goes back to the pool as it came: the worker's timeouts went with its
            // transactions.
        }
    }
}

/// A delivery of a locked job that failed, remembered until its settlement commits.
impl LockFailure {
    pub(super) fn new(token: i64, outcome: &Outcome, failed: bool) -> Self {
        Self {
            token,
            outcome: outcome.clone(),
            failed,
        }
    }
}
