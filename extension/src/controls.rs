//! Pausing and resuming queues, and their limits: `sql/shared/controls.sql` and
//! `sql/shared/limits.sql` have the functions (both builds); this build's leases, locks and
//! `inbox_sleep` read the state through [`control`]. A take from a queue with a concurrency or
//! a rate limit runs the statements of `inbox__limit_statements` itself ([`take_limited`]); one
//! with a limit per key goes through `inbox__take_limited`.
//!
//! Each backend keeps the set of paused and limited queues, read once and dropped by the relcache
//! invalidation that every change of `inbox_queue_controls` sends when it commits (its statement
//! trigger, as the schedules' table has), so that a lease on a queue that is not paused costs a
//! set lookup. [`paused`] takes in the invalidations that arrived before it looks (PostgreSQL
//! does so at each transaction's start, and at a table's first lock in it): a pause committed
//! before the call is seen, also by a lease inside a transaction that began earlier.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Oid};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::error::*;
use crate::plans::{self, Op};
use crate::statements::Sql;

const TABLE: &str = "inbox_queue_controls";

// inbox__required is the outbox's.
extension_sql_file!(
    "../../sql/shared/controls.sql",
    name = "controls",
    requires = ["outbox"]
);

// The limits' slots and the limited take (calls inbox__take_unlimited, queue.rs).
extension_sql_file!(
    "../../sql/shared/limits.sql",
    name = "limits",
    requires = ["controls"]
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
    /// The table as SQL, and the paused or limited queues as the user of this oid sees them
    /// (row-level security).
    static CONTROLS: RefCell<Option<Controls>> = const { RefCell::new(None) };
}

/// The table as SQL, the user whose view of it this is, and what each queue must heed.
type Controls = (String, Oid, HashMap<Oid, Control>);

/// What a take of a queue must heed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Control {
    /// Takes hand out nothing.
    pub paused: bool,
    /// The queue has a concurrency limit: a take gives each job one of its slots.
    pub concurrency: bool,
    /// The queue has a rate limit: likewise.
    pub rate: bool,
    /// The queue has a concurrency limit per key: takes go through `inbox__take_limited`.
    pub per_key: bool,
}

impl Control {
    /// Whether a take must give its jobs slots of some limit.
    pub fn limited(&self) -> bool {
        self.concurrency || self.rate || self.per_key
    }
}

/// Whether `queue` is paused (see [`control`]).
pub(crate) fn paused(client: &SpiClient<'_>, queue: Oid) -> bool {
    control(client, queue).paused
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: Oid) {
    if relid == pg_sys::InvalidOid || relid == TABLE_OID.with(Cell::get) {
        STALE.with(|stale| stale.set(true));
    }
}

/// Whether `queue` is paused or limited: at `READ COMMITTED`, by every change committed before
/// the call; in an older snapshot (`REPEATABLE READ`), as that snapshot shows it, read from the
/// table and not kept.
pub(crate) fn control(client: &SpiClient<'_>, queue: Oid) -> Control {
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
        CONTROLS.with(|cached| cached.borrow_mut().take());
    }
    if isolation < pg_sys::XACT_REPEATABLE_READ as i32 {
        let known = CONTROLS.with(|cached| {
            cached
                .borrow()
                .as_ref()
                .filter(|(_, seen_by, _)| *seen_by == user)
                .map(|(_, _, queues)| queues.get(&queue).copied().unwrap_or_default())
        });
        if let Some(known) = known {
            return known;
        }
    }
    let table = CONTROLS
        .with(|cached| cached.borrow().as_ref().map(|(table, _, _)| table.clone()))
        .unwrap_or_else(|| {
            let (table, oid) = crate::names::extension_table(client, TABLE);
            TABLE_OID.with(|cached| cached.set(oid));
            table
        });
    let read_committed = isolation < pg_sys::XACT_REPEATABLE_READ as i32;
    let read = || -> HashMap<Oid, Control> {
        client
            .select(
                &format!(
                    "SELECT queue::pg_catalog.oid, paused_at IS NOT NULL, \
                            concurrency IS NOT NULL, rate_limit IS NOT NULL, \
                            key_concurrency IS NOT NULL \
                       FROM {table} \
                      WHERE paused_at IS NOT NULL OR concurrency IS NOT NULL \
                         OR rate_limit IS NOT NULL OR key_concurrency IS NOT NULL"
                ),
                None,
                &[],
            )
            .unwrap_or_else(|e| internal(e))
            .filter_map(|row| {
                let queue = row.get::<Oid>(1).ok().flatten()?;
                let flag = |column| row.get::<bool>(column).ok().flatten().unwrap_or(false);
                let control = Control {
                    paused: flag(2),
                    concurrency: flag(3),
                    rate: flag(4),
                    per_key: flag(5),
                };
                Some((queue, control))
            })
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
    let control = queues.get(&queue).copied().unwrap_or_default();
    if read_committed {
        CONTROLS.with(|cached| *cached.borrow_mut() = Some((table, user, queues)));
    }
    control
}

/// Whether the limits of `queue` would let a job start now (`inbox__limits_allow`).
pub(crate) fn limits_allow(client: &SpiClient<'_>, queue: Oid) -> bool {
    let schema = crate::names::schema(client);
    let plan = plans::plan(queue, Op::LimitsAllow, || Sql {
        text: format!("SELECT {schema}.inbox__limits_allow($1)"),
        args: vec![pg_sys::REGCLASSOID],
    });
    plan.read_rows(&[crate::datum::RegClass(queue).into()])
        .get::<bool>(0, 1)
        .unwrap_or(true)
}

/// The take of a queue with limits: as many of the first `max` due jobs as it can give a slot of
/// every limit. A queue limited per key is taken from by `inbox__take_limited`
/// (`sql/shared/limits.sql`), which calls back through `inbox__take_unlimited`; for the others
/// the same statements run here, prepared once: lock free slots, take that many jobs, give them
/// the slots (`inbox__limit_statements`).
pub(crate) fn take_limited(
    client: &mut SpiClient<'_>,
    queue: Oid,
    control: Control,
    max: i32,
    lease: Option<pgrx::datum::Interval>,
) -> Vec<crate::take::Delivery> {
    if control.per_key {
        return take_limited_in_sql(client, queue, max, lease);
    }
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let mut n = max;
    let running = control
        .concurrency
        .then(|| lock_slots(client, queue, Op::FreeSlots, &mut n, now));
    let starts =
        (control.rate && n > 0).then(|| lock_slots(client, queue, Op::FreeStarts, &mut n, now));
    if n < 1 {
        return Vec::new();
    }
    let deliveries = crate::take::take_jobs(client, queue, n, lease, None);
    if !deliveries.is_empty() {
        // The first slots locked, one per job; a rate slot's job is NULL (past the arrays' end).
        let taken = deliveries.len();
        let slots: Vec<Tid> = [running.as_deref(), starts.as_deref()]
            .into_iter()
            .flat_map(|locked| locked.unwrap_or_default().iter().take(taken).copied())
            .collect();
        let (jobs, tokens): (Vec<i64>, Vec<i64>) = match running {
            Some(_) => deliveries
                .iter()
                .map(|delivery| (delivery.0, delivery.2))
                .unzip(),
            None => (Vec::new(), Vec::new()),
        };
        limit_statement(client, queue, Op::GiveSlots).run(&[
            crate::datum::RegClass(queue).into(),
            slots.into(),
            jobs.into(),
            tokens.into(),
        ]);
    }
    deliveries
}

/// A row's address, as the statements of the limits name the slots they lock.
type Tid = pg_sys::ItemPointerData;

/// Locks up to `n` free slots of a limit of `queue` (`op`: its statement), and lowers `n` to
/// the number locked.
fn lock_slots(client: &SpiClient<'_>, queue: Oid, op: Op, n: &mut i32, now: i64) -> Vec<Tid> {
    let plan = limit_statement(client, queue, op);
    // SAFETY: a timestamptz is an int64 passed by value.
    let now = unsafe { DatumWithOid::new(now, pg_sys::TIMESTAMPTZOID) };
    let args = [crate::datum::RegClass(queue).into(), (*n).into(), now];
    let slots = plan.rows(&args).get::<Vec<Tid>>(0, 1).unwrap_or_default();
    *n = (*n).min(slots.len() as i32);
    slots
}

/// Statement `op` of `inbox__limit_statements` for `queue`, kept to its generic plan: each finds
/// its slots by key.
fn limit_statement(client: &SpiClient<'_>, queue: Oid, op: Op) -> std::rc::Rc<plans::Plan> {
    let (column, args) = match op {
        Op::FreeSlots => (
            "free_slots",
            vec![pg_sys::REGCLASSOID, pg_sys::INT4OID, pg_sys::TIMESTAMPTZOID],
        ),
        Op::FreeStarts => (
            "free_starts",
            vec![pg_sys::REGCLASSOID, pg_sys::INT4OID, pg_sys::TIMESTAMPTZOID],
        ),
        Op::GiveSlots => (
            "give_slots",
            vec![
                pg_sys::REGCLASSOID,
                pg_sys::TIDARRAYOID,
                pg_sys::INT8ARRAYOID,
                pg_sys::INT8ARRAYOID,
            ],
        ),
        _ => raise(
            ERRCODE_INTERNAL_ERROR,
            format!("{op:?} is not a limit's statement"),
        ),
    };
    plans::prepared_generic(queue, op, || {
        let schema = crate::names::schema(client);
        let text = client
            .select(
                &format!("SELECT {column} FROM {schema}.inbox__limit_statements($1)"),
                None,
                &[crate::datum::RegClass(queue).into()],
            )
            .and_then(|rows| rows.first().get_one::<String>())
            .unwrap_or_else(|e| internal(e))
            .unwrap_or_else(|| raise(ERRCODE_INTERNAL_ERROR, format!("no statement {column}")));
        Sql { text, args }
    })
}

/// The take of a queue limited per key: `inbox__take_limited`.
fn take_limited_in_sql(
    client: &mut SpiClient<'_>,
    queue: Oid,
    max: i32,
    lease: Option<pgrx::datum::Interval>,
) -> Vec<crate::take::Delivery> {
    let schema = crate::names::schema(client);
    let plan = plans::plan(queue, Op::TakeLimited, || Sql {
        text: format!(
            "SELECT id, attempt, token, payload, payload_bytes, timeout \
               FROM {schema}.inbox__take_limited($1, $2, $3)"
        ),
        args: vec![pg_sys::REGCLASSOID, pg_sys::INT4OID, pg_sys::INTERVALOID],
    });
    let rows = plan.rows(&[
        crate::datum::RegClass(queue).into(),
        max.into(),
        lease.into(),
    ]);
    (0..rows.len())
        .map(|row| {
            // SAFETY: the last SPI result is this one, of (int8, int4, int8, jsonb, bytea,
            // interval) rows; the payloads are copied into the caller's memory context.
            unsafe {
                use crate::datum::spi_result_datum;
                (
                    spi_result_datum(row, 1).map_or(0, |d| d.value() as i64),
                    spi_result_datum(row, 2).map_or(0, |d| d.value() as i32),
                    spi_result_datum(row, 3).map_or(0, |d| d.value() as i64),
                    spi_result_datum(row, 4).map(crate::datum::Jsonb),
                    spi_result_datum(row, 5).map(crate::datum::Bytea),
                    spi_result_datum(row, 6)
                        .and_then(|d| pgrx::datum::Interval::from_datum(d, false)),
                )
            }
        })
        .collect()
}
