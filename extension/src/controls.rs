//! Pausing and resuming queues: `sql/shared/controls.sql` has the functions (both builds); this
//! build's leases, locks and `inbox_sleep` read the pause through [`paused`].
//!
//! Each backend keeps the set of paused queues, read once and dropped by the relcache
//! invalidation that every change of `inbox_queue_controls` sends when it commits (its statement
//! trigger, as the schedules' table has), so that a lease on a queue that is not paused costs a
//! set lookup. [`paused`] takes in the invalidations that arrived before it looks (PostgreSQL
//! does so at each transaction's start, and at a table's first lock in it): a pause committed
//! before the call is seen, also by a lease inside a transaction that began earlier.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;

use pgrx::pg_sys::{self, Oid};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::error::*;

const TABLE: &str = "inbox_queue_controls";

// inbox__required is the outbox's.
extension_sql_file!(
    "../../sql/shared/controls.sql",
    name = "controls",
    requires = ["outbox"]
);

// The trigger function the schedules' table uses: it sends the table's relcache invalidation.
// `ALWAYS`: a subscriber's apply worker (session_replication_role = replica) must tell too.
extension_sql!(
    r#"
CREATE TRIGGER inbox_queue_controls_changed AFTER INSERT OR UPDATE OR DELETE ON inbox_queue_controls
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_periodic_jobs_changed();
ALTER TABLE inbox_queue_controls ENABLE ALWAYS TRIGGER inbox_queue_controls_changed;
"#,
    name = "controls_changed",
    requires = ["controls", "periodic_jobs_changed"]
);

thread_local! {
    /// The oid of `inbox_queue_controls`, once looked up.
    static TABLE_OID: Cell<Oid> = const { Cell::new(pg_sys::InvalidOid) };
    static CALLBACK: Cell<bool> = const { Cell::new(false) };
    /// Set by the relcache callback: the set is read again before its next use.
    static STALE: Cell<bool> = const { Cell::new(false) };
    /// The table as SQL, and the paused queues as the user of this oid sees them (row-level
    /// security).
    static PAUSED: RefCell<Option<(String, Oid, HashSet<Oid>)>> = const { RefCell::new(None) };
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: Oid) {
    if relid == pg_sys::InvalidOid || relid == TABLE_OID.with(Cell::get) {
        STALE.with(|stale| stale.set(true));
    }
}

/// Whether `queue` is paused: at `READ COMMITTED`, by every pause committed before the call; in
/// an older snapshot (`REPEATABLE READ`), as that snapshot shows it, read from the table and not
/// kept.
pub(crate) fn paused(client: &SpiClient<'_>, queue: Oid) -> bool {
    if !CALLBACK.with(Cell::get) {
        // SAFETY: registered once per backend; the callback lives as long as the library.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(relcache_invalidated),
                pg_sys::Datum::from(0),
            )
        };
        CALLBACK.with(|registered| registered.set(true));
    }
    // SAFETY: processes the invalidations that other sessions' commits queued, as a lock does.
    unsafe { pg_sys::AcceptInvalidationMessages() };
    // SAFETY: reads the transaction's isolation level and the current user.
    let (isolation, user) = unsafe { (pg_sys::XactIsoLevel, pg_sys::GetUserId()) };
    if STALE.with(|stale| stale.replace(false)) {
        PAUSED.with(|cached| cached.borrow_mut().take());
    }
    if isolation < pg_sys::XACT_REPEATABLE_READ as i32 {
        let known = PAUSED.with(|cached| {
            cached
                .borrow()
                .as_ref()
                .filter(|(_, seen_by, _)| *seen_by == user)
                .map(|(_, _, queues)| queues.contains(&queue))
        });
        if let Some(known) = known {
            return known;
        }
    }
    let table = PAUSED
        .with(|cached| cached.borrow().as_ref().map(|(table, _, _)| table.clone()))
        .unwrap_or_else(|| {
            let (table, oid) = crate::names::extension_table(client, TABLE);
            TABLE_OID.with(|cached| cached.set(oid));
            table
        });
    let read_committed = isolation < pg_sys::XACT_REPEATABLE_READ as i32;
    let read = || -> HashSet<Oid> {
        client
            .select(
                &format!("SELECT queue::pg_catalog.oid FROM {table} WHERE paused_at IS NOT NULL"),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal(e))
            .filter_map(|row| row.get::<Oid>(1).ok().flatten())
            .collect()
    };
    let queues = if read_committed {
        // What is kept must be at least as new as the invalidations taken in above: the
        // statement's own snapshot may be older.
        // SAFETY: pushed and popped around one read-only SPI query, which uses the active
        // snapshot; an error pops it with the rest of the aborted transaction's state.
        unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
        let queues = read();
        unsafe { pg_sys::PopActiveSnapshot() };
        queues
    } else {
        read()
    };
    let paused = queues.contains(&queue);
    if read_committed {
        PAUSED.with(|cached| *cached.borrow_mut() = Some((table, user, queues)));
    }
    paused
}
