//! Ordered groups: the jobs of one `group_key` run one at a time, in enqueue order.
//!
//! Only a group's head can be taken. The jobs behind it wait with `locked_until = 'infinity'`
//! and `dead_at` NULL, outside the lease index, so a lease costs the same however many jobs
//! wait behind busy heads. When a settlement removes the head (ack, or dead-letter: a dead head
//! no longer blocks its group), the oldest waiting job becomes the head in the same transaction.
//!
//! Enqueues into a group and promotions of its head are serialised by a transaction-scoped
//! advisory lock on (queue, hash of the key), held until commit (and the queue's own lock held
//! shared, or for an operation on many groups exclusively, in their place); the statements that decide
//! whether a new job waits, and which job is promoted, read the latest committed state (see
//! [`plans::Plan`]), so that a `REPEATABLE READ` transaction whose snapshot predates the
//! previous holder's commit neither leaves a job waiting behind a head that is gone nor starts a
//! second head.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Oid};
use pgrx::spi::SpiClient;
use pgrx::FromDatum;
use pgrx::{pg_extern, search_path};

use crate::error::*;
use crate::plans::{self, Op};
use crate::statements;

/// The advisory lock's first key: the queue's oid, as the int4 `pg_advisory_xact_lock` takes.
fn lock_key(queue: Oid) -> i32 {
    queue.to_u32() as i32
}

/// The most groups one operation locks one by one; beyond, it locks the whole queue.
const MOST_GROUP_LOCKS: usize = 64;

/// Takes the locks of `groups` (sorted, distinct) until the transaction ends: the queue's lock
/// shared and each group's, or for many groups the queue's lock exclusively.
pub(crate) fn lock(client: &mut SpiClient<'_>, queue: Oid, groups: &[String]) {
    // SAFETY: reads the transaction's isolation level.
    let isolation = unsafe { pg_sys::XactIsoLevel };
    if !groups.is_empty()
        && isolation >= pg_sys::XACT_REPEATABLE_READ as i32
        && crate::citus::distributes(client, queue)
    {
        // The latest committed state is read on this node only; Citus runs the statement on the
        // queue's node in the transaction's own snapshot, which may be older than the group.
        raise(
            ERRCODE_FEATURE_NOT_SUPPORTED,
            "ordered groups of a queue Citus distributes need READ COMMITTED: enqueue into groups \
             and settle their jobs in READ COMMITTED transactions",
        );
    }
    let key = lock_key(queue);
    match groups {
        [] => {}
        [group] => {
            plans::plan(queue, Op::GroupLockOne, statements::group_lock_one)
                .run(&[key.into(), group.as_str().into()]);
        }
        _ => {
            let wide = groups.len() > MOST_GROUP_LOCKS;
            plans::plan(queue, Op::QueueLock, statements::queue_lock)
                .run(&[key.into(), wide.into()]);
            if !wide {
                plans::plan(queue, Op::GroupLock, statements::group_lock)
                    .run(&[key.into(), DatumWithOid::from(groups.to_vec())]);
            }
        }
    }
}

/// The distinct group keys of a `text[]` argument, sorted.
pub(crate) fn keys_of(array: pg_sys::Datum) -> Vec<String> {
    // SAFETY: `array` is a non-NULL `text[]` argument of the current call.
    let keys = unsafe { Vec::<Option<String>>::from_datum(array, false) }.unwrap_or_default();
    let mut keys: Vec<String> = keys.into_iter().flatten().collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Whether `group` has a head or jobs waiting, so that a job enqueued now must wait. The
/// caller holds the group's lock.
pub(crate) fn busy(client: &SpiClient<'_>, queue: Oid, group: &str) -> bool {
    let plan = plans::latest_plan(client, queue, Op::GroupBusy, statements::group_busy);
    plan.run_latest(&[group.into()]);
    // SAFETY: the statement returned one row of one boolean; SPI is connected.
    unsafe { crate::datum::spi_result_datum(0, 1) }.is_some_and(|datum| datum.value() != 0)
}

/// Promotes the oldest waiting job of each of `groups` (a `text[]`) that has no head. The
/// caller holds the groups' locks.
pub(crate) fn promote(client: &SpiClient<'_>, queue: Oid, groups: DatumWithOid<'_>) {
    let plan = plans::latest_plan(client, queue, Op::Promote, statements::promote);
    plan.run_latest(&[groups, crate::datum::clock_now()]);
}

/// After a settlement or requeue changed the heads of `groups`: locks them and promotes the
/// next job of those left without a head.
pub(crate) fn settled(client: &mut SpiClient<'_>, queue: Oid, mut groups: Vec<String>) {
    groups.sort();
    groups.dedup();
    lock(client, queue, &groups);
    match groups.as_slice() {
        [] => {}
        // One group (a settlement): the simpler statement.
        [group] => {
            let plan = plans::latest_plan(client, queue, Op::PromoteOne, statements::promote_one);
            plan.run_latest(&[group.as_str().into(), crate::datum::clock_now()]);
        }
        _ => promote(client, queue, DatumWithOid::from(groups)),
    }
}

/// `settled` for the SQL functions shared with the SQL-only build (sql/shared/dead_letters.sql):
/// after a requeue of dead jobs of `groups`, locks them and promotes the next job of those left
/// without a head.
#[pg_extern(volatile, parallel_unsafe, name = "inbox__groups_settled")]
#[search_path(pg_catalog, pg_temp)]
fn groups_settled(queue: crate::datum::RegClass, groups: Vec<Option<String>>) {
    let groups = groups.into_iter().flatten().collect();
    pgrx::spi::Spi::connect_mut(|client| settled(client, queue.0, groups));
}

/// A group key argument's text, or `None`.
pub(crate) fn key_text(key: &Option<String>) -> DatumWithOid<'static> {
    match key {
        Some(key) => DatumWithOid::from(key.clone()),
        None => DatumWithOid::null_oid(pg_sys::TEXTOID),
    }
}
