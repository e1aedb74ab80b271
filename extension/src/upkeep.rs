//! Upkeep of a queue or an outbox: when to vacuum it.
//!
//! Every job leaves dead row versions behind (its lease's update, its ack's delete), and a queue
//! turning over thousands of jobs a second piles them up faster than autovacuum, which visits a
//! database once per `autovacuum_naptime` (a minute by default), can clear them: the table and
//! its indexes grow, and every lease walks over the dead entries at the head of its index. The
//! worker therefore vacuums its own queue, and the relay its outbox (`VACUUM` cannot run inside a
//! function); this file tells them when that is worth doing.

use std::cell::RefCell;
use std::collections::HashMap;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Oid, TransactionId};
use pgrx::prelude::*;

use crate::datum::RegClass;
use crate::error::*;
use crate::statements;

/// Dead rows below which a queue is never vacuumed by its worker, whatever its size.
pub(crate) const VACUUM_MIN_DEAD_ROWS: i64 = 1_000;
/// Dead rows, as a fraction of the live ones, below which a queue is not vacuumed (a deep queue
/// costs more to vacuum, as autovacuum's scale factor says).
pub(crate) const VACUUM_DEAD_FRACTION: f64 = 0.1;

thread_local! {
    /// The removal horizon when this session last answered that a queue should be vacuumed.
    static VACUUMED_AT: RefCell<HashMap<Oid, TransactionId>> = RefCell::new(HashMap::new());
}

/// The oldest transaction whose deletions a vacuum of `queue` must keep (the oldest snapshot).
fn removal_horizon(queue: Oid) -> TransactionId {
    // SAFETY: the table exists (it was checked in this transaction); it is opened with the
    // weakest lock, which only a DROP or ALTER would wait for, and closed at once.
    unsafe {
        let relation = pg_sys::relation_open(queue, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let horizon = pg_sys::GetOldestNonRemovableTransactionId(relation);
        pg_sys::relation_close(relation, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        horizon
    }
}

/// The qualified, quoted name of `queue` (a queue or an outbox: any table; 42809 for another
/// relation) when it should be vacuumed now, else NULL: when its dead
/// rows (as counted by the statistics system) reach 1,000 and a tenth of its live rows, no
/// vacuum is working on it, the caller may vacuum it (owns it or the database), and the oldest
/// snapshot moved since this session last answered yes (while it stands still, a vacuum could
/// not remove anything more).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_vacuum_due(queue: Option<RegClass>) -> Option<String> {
    let queue = required(queue, "queue").0;
    let (dead, live, running, permitted, name) = Spi::connect(|client| {
        let schema = crate::names::schema(client);
        client
            .select(
                &format!("SELECT {schema}.inbox__checked_columns($1, 'table', '{{}}', '', 0)"),
                None,
                &[RegClass(queue).into()],
            )
            .unwrap_or_else(|e| internal(e));
        let sql = statements::vacuum_facts();
        // SAFETY: an oid is passed by value.
        let oid = unsafe { DatumWithOid::new(queue, pg_sys::OIDOID) };
        let rows = client
            .select(sql.text.as_str(), None, &[oid])
            .unwrap_or_else(|e| internal(e));
        let row = rows.first();
        (
            row.get::<i64>(1).ok().flatten().unwrap_or(0),
            row.get::<i64>(2).ok().flatten().unwrap_or(0),
            row.get::<bool>(3).ok().flatten().unwrap_or(true),
            row.get::<bool>(4).ok().flatten().unwrap_or(false),
            row.get::<String>(5).ok().flatten(),
        )
    });
    let enough = dead >= VACUUM_MIN_DEAD_ROWS && dead as f64 >= VACUUM_DEAD_FRACTION * live as f64;
    if !enough || running || !permitted {
        return None;
    }
    let horizon = removal_horizon(queue);
    let moved = VACUUMED_AT.with(|at| {
        let mut at = at.borrow_mut();
        let moved = at.get(&queue) != Some(&horizon);
        at.insert(queue, horizon);
        moved
    });
    moved.then_some(name).flatten()
}
