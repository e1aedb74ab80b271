//! Wake-ups: an enqueue sends `NOTIFY` only when a worker sleeps on the queue.
//!
//! PostgreSQL serialises the commits of transactions that sent a `NOTIFY` (they hold one lock
//! from queueing the notification until their commit is flushed), so a queue that notified on
//! every enqueue could not take jobs from many connections at once. Here a worker that found
//! nothing to do registers its session as asleep on the queue, and an enqueue notifies only when
//! it finds a sleeper. A busy queue, whose workers never sleep, sends no `NOTIFY` at all.
//!
//! The registry is the lock manager: a sleeper holds a session-level `ShareLock` on an advisory
//! lock tag of the queue (`pg_locks`: `locktype = 'advisory'`, `classid` = the queue's oid,
//! `objid` = 0, `objsubid` = [`WAKE_LOCK`]), and an enqueue tries to take `RowExclusiveLock` on
//! the same tag without waiting, for the rest of its transaction. The two modes conflict with
//! each other but not with themselves: enqueues never wait for each other, and neither do
//! sleepers. A registration cannot outlive its session (the server releases its locks when the
//! session ends, however it ends), so a worker that died never makes enqueues notify.
//!
//! Why no wake-up is lost. An enqueue E inserts its job, tries the lock, and commits; a sleeper S
//! (already `LISTEN`ing on the queue's channel) takes its lock, then looks at the queue with a
//! snapshot taken after the lock was granted (`inbox_sleep`), and only then sleeps.
//! - E's try fails: S holds its lock, or waits for it. E notifies; the notification is delivered
//!   when E commits, to every session listening then, S included.
//! - E's try succeeds: no sleeper held or awaited the lock at that moment, and E keeps its lock
//!   until it ends. A sleeper asking later is granted its lock only after E committed (or rolled
//!   back), so its look at the queue sees E's job.
//!
//! In both cases a job committed while S sleeps either notified S or was seen by S before it
//! slept. (A lock is granted or refused at once, in the shared lock table: unlike a row of a
//! registry table, it needs no snapshot to be seen.) The price is that a sleeper waits, before it
//! sleeps, for the enqueues in flight on its queue to end.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Oid};
use pgrx::prelude::*;

use crate::datum::RegClass;
use crate::error::*;
use crate::plans;
use crate::statements;

/// `objsubid` of the wake-up lock in `pg_locks`. `pg_advisory_lock` uses 1 and 2 only, so no
/// advisory lock of an application can collide with it.
pub(crate) const WAKE_LOCK: u16 = 0x6962;

/// A sleeper's lock mode, and an enqueue's: they conflict, and neither conflicts with itself.
const SLEEPER: pg_sys::LOCKMODE = pg_sys::ShareLock as pg_sys::LOCKMODE;
const ENQUEUER: pg_sys::LOCKMODE = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;

fn tag(queue: Oid) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: MyDatabaseId is set once the backend is connected to its database.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: queue.to_u32(),
        locktag_field3: 0,
        locktag_field4: WAKE_LOCK,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Whether an enqueue into `queue` must notify: true when a session sleeps on it (or is about to).
/// When false, the calling transaction holds the enqueuer's lock until it ends, which keeps any
/// session from starting to sleep on the queue before this job is visible.
fn must_notify(queue: Oid) -> bool {
    let tag = tag(queue);
    // SAFETY: a valid tag of the user lock method, in a transaction (the lock is released with it).
    let taken = unsafe { pg_sys::LockAcquire(&tag, ENQUEUER, false, true) };
    taken == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// The NOTIFY channel on which enqueues into `queue` announce new jobs (`inbox_channel`).
pub(crate) fn channel(queue: Oid) -> String {
    format!("inbox_{}", queue.to_u32())
}

/// Wakes the workers asleep on the queue once the caller commits, unless `inbox.notify` is off;
/// sends nothing when none sleeps (see [`must_notify`]).
pub(crate) fn notify(queue: Oid) {
    if crate::NOTIFY.get() && must_notify(queue) {
        // SAFETY: pg_notify takes two text arguments, both given and non-NULL.
        unsafe {
            pgrx::direct_function_call::<()>(
                pg_sys::pg_notify,
                &[channel(queue).into_datum(), "".into_datum()],
            );
        }
    }
}

/// The current time, read from the clock.
fn now() -> DatumWithOid<'static> {
    // SAFETY: a timestamptz is an int64 passed by value.
    unsafe { DatumWithOid::new(pg_sys::GetCurrentTimestamp(), pg_sys::TIMESTAMPTZOID) }
}

/// Gives up this session's sleeper lock on `queue`, if it holds one; whether it did.
fn release(queue: Oid) -> bool {
    let tag = tag(queue);
    // SAFETY: a valid tag; LockRelease is only called for a lock this session holds.
    unsafe { pg_sys::LockHeldByMe(&tag, SLEEPER) && pg_sys::LockRelease(&tag, SLEEPER, true) }
}

/// Whether `queue` has a job due now (and is not paused), seen with a snapshot taken at this
/// moment (not the statement's, which predates the wait for the lock).
fn job_due(queue: Oid) -> bool {
    Spi::connect(|client| {
        let sql = statements::due(&plans::queue(client, queue));
        // SAFETY: the snapshot is pushed and popped around one read-only SPI query, which uses
        // the active snapshot; an error pops it with the rest of the aborted transaction's state.
        unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
        // Nothing is due on a paused queue (its resume wakes the sleepers), nor on one whose
        // limits are full (a slot that frees is taken by the worker that freed it; one freed by
        // an expired lease is found by the sleepers' next poll).
        let control = crate::controls::control(client, queue);
        let due = if control.paused {
            Some(false)
        } else {
            client
                .select(sql.text.as_str(), None, &[now()])
                .and_then(|rows| rows.first().get_one::<bool>())
                .unwrap_or_else(|e| internal(e))
                .map(|due| {
                    due && (!control.limited() || crate::controls::limits_allow(client, queue))
                })
        };
        unsafe { pg_sys::PopActiveSnapshot() };
        due.unwrap_or(false)
    })
}

/// Registers this session as asleep on `queue`, so that enqueues into it send `NOTIFY` on
/// `inbox_channel(queue)`: returns true once registered. Returns false, registering nothing,
/// when a job is due already (look again instead of sleeping). The session must `LISTEN` on the
/// channel first; it stays registered until `inbox_stop_sleeping(queue)` or until it ends.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_sleep(queue: Option<RegClass>) -> bool {
    let queue = required(queue, "queue").0;
    // SAFETY: reads the transaction state.
    if unsafe { pg_sys::IsTransactionBlock() } {
        raise(
            ERRCODE_ACTIVE_SQL_TRANSACTION,
            "inbox_sleep cannot run inside a transaction block",
        );
    }
    // Raises 42P01/42804 unless `queue` is a queue table, before anything is registered.
    Spi::connect(|client| {
        plans::queue(client, queue);
    });
    let tag = tag(queue);
    // Waits for the enqueues in flight on the queue to end (see the module's comment).
    // SAFETY: a valid tag; a session lock outlives the transaction, as a registration must.
    let taken = unsafe { pg_sys::LockAcquire(&tag, SLEEPER, true, false) };
    if taken == pg_sys::LockAcquireResult::LOCKACQUIRE_ALREADY_HELD {
        // Registered already: keep a single hold, so that one release undoes it.
        // SAFETY: this session holds the lock twice now.
        unsafe { pg_sys::LockRelease(&tag, SLEEPER, true) };
    }
    let due = PgTryBuilder::new(|| job_due(queue))
        .catch_others(|error| {
            release(queue);
            error.rethrow()
        })
        .execute();
    if due {
        release(queue);
    }
    !due
}

/// Unregisters this session as asleep on `queue` (enqueues stop notifying it); whether it was.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_stop_sleeping(queue: Option<RegClass>) -> bool {
    release(required(queue, "queue").0)
}

/// The process ids of the sessions asleep on `queue` (see `inbox_sleep`).
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_sleepers(queue: Option<RegClass>) -> SetOfIterator<'static, i32> {
    let queue = required(queue, "queue").0;
    let pids = Spi::connect(|client| {
        let sql = statements::sleepers();
        // SAFETY: MyDatabaseId is set once the backend is connected to its database.
        let database = unsafe { DatumWithOid::new(pg_sys::MyDatabaseId, pg_sys::OIDOID) };
        // SAFETY: an oid is passed by value.
        let queue = unsafe { DatumWithOid::new(queue, pg_sys::OIDOID) };
        client
            .select(
                sql.text.as_str(),
                None,
                &[database, queue, i32::from(WAKE_LOCK).into()],
            )
            .unwrap_or_else(|e| internal(e))
            .map(|row| row.get::<i32>(1).ok().flatten().unwrap_or_default())
            .collect::<Vec<i32>>()
    });
    SetOfIterator::new(pids)
}
