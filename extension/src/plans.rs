//! Prepared statements kept per table for the life of the backend.
//!
//! Every statement the extension keeps is a [`Plan`], prepared through SPI: as the plan cache
//! chooses ([`plan`]), kept to its generic plan ([`generic_plan`]), or run on the latest committed
//! state ([`latest_plan`]). Only statements built for one call of a setup function (`citus.rs`,
//! the catalog reads of `shape.rs`) run unprepared, through pgrx's SPI client; the operators'
//! functions are SQL (`operators.rs`).
//!
//! The first call on a table reads its shape from the catalog and prepares the statement the
//! call needs; later calls reuse both. A relcache invalidation of the table (any DDL, and also
//! VACUUM and ANALYZE, which update its statistics) marks them stale, and the next call
//! prepares them again from the table as it is then. The invalidation callback only records
//! what went stale: it may run in the middle of executing one of these plans, which must not be
//! freed under it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use pgrx::pg_sys::{self, Oid};
use pgrx::spi::SpiClient;
use pgrx::FromDatum;

use crate::error::*;
use crate::shape::{LedgerShape, QueueShape};
use crate::statements::Sql;

/// The statements that are prepared per table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Claim,
    Seen,
    Enqueue,
    EnqueueBatch,
    Lease,
    LeaseOne,
    Lock,
    LockChosen,
    Ack,
    AckMany,
    Retry,
    Dead,
    Extend,
    Stats,
    GroupLock,
    GroupLockOne,
    QueueLock,
    GroupBusy,
    Promote,
    PromoteOne,
    Fence,
    PublishBytes,
    PublishJson,
    PublishHeaders,
    PublishLock,
    ReleaseDependants,
    TickInsert,
    LimitsAllow,
    TakeLimited,
    FreeSlots,
    FreeStarts,
    GiveSlots,
}

/// What must be dropped from the cache before its next use.
enum Stale {
    Table(Oid),
    All,
}

#[derive(Default)]
struct Cache {
    ledgers: HashMap<Oid, Rc<LedgerShape>>,
    queues: HashMap<Oid, Rc<QueueShape>>,
    plans: HashMap<(Oid, Op), Rc<Plan>>,
}

impl Cache {
    fn drop_stale(&mut self) {
        for stale in STALE.with(|stale| stale.take()) {
            match stale {
                Stale::All => {
                    self.ledgers.clear();
                    self.queues.clear();
                    self.plans.clear();
                }
                Stale::Table(oid) => {
                    self.ledgers.remove(&oid);
                    self.queues.remove(&oid);
                    self.plans.retain(|(table, _), _| *table != oid);
                }
            }
        }
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    /// Kept apart from `CACHE` so that the callback never contends for its borrow.
    static STALE: RefCell<Vec<Stale>> = const { RefCell::new(Vec::new()) };
}

/// Registers [`relcache_invalidated`]; called once, when the library loads.
pub(crate) fn register_invalidation_callback() {
    // SAFETY: called from _PG_init; the callback lives as long as the library.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_invalidated), pg_sys::Datum::from(0))
    };
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: Oid) {
    let stale = if relid == pg_sys::InvalidOid {
        Stale::All
    } else {
        Stale::Table(relid)
    };
    STALE.with(|pending| {
        let mut pending = pending.borrow_mut();
        // A backend busy with other tables' DDL would otherwise pile up entries.
        if pending.len() >= 64 {
            pending.clear();
            pending.push(Stale::All);
        }
        pending.push(stale);
    });
}

/// The shape of ledger `oid`, loaded on first use.
pub(crate) fn ledger(client: &SpiClient<'_>, oid: Oid) -> Rc<LedgerShape> {
    cached(
        oid,
        |cache| &mut cache.ledgers,
        || LedgerShape::load(client, oid),
    )
}

/// The shape of queue `oid`, loaded on first use.
pub(crate) fn queue(client: &SpiClient<'_>, oid: Oid) -> Rc<QueueShape> {
    cached(
        oid,
        |cache| &mut cache.queues,
        || QueueShape::load(client, oid),
    )
}

/// The entry `key` of one of the cache's maps, made by `load` on first use (and again once a
/// relcache invalidation dropped it).
fn cached<K: std::hash::Hash + Eq, V>(
    key: K,
    map: impl Fn(&mut Cache) -> &mut HashMap<K, Rc<V>>,
    load: impl FnOnce() -> V,
) -> Rc<V> {
    let hit = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        cache.drop_stale();
        map(&mut cache).get(&key).cloned()
    });
    if let Some(value) = hit {
        return value;
    }
    // Loading runs SPI, which may raise; nothing is borrowed while it does.
    let value = Rc::new(load());
    CACHE.with(|cache| map(&mut cache.borrow_mut()).insert(key, value.clone()));
    value
}

/// The statement `op` for table `oid`, prepared from `build` on first use, and planned as
/// PostgreSQL's plan cache chooses (a custom plan while it costs less than the generic one).
pub(crate) fn plan(oid: Oid, op: Op, build: impl FnOnce() -> Sql) -> Rc<Plan> {
    prepared(oid, op, 0, build)
}

/// Shorthand for the statements built from a ledger's shape.
pub(crate) fn ledger_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&LedgerShape) -> Sql,
) -> Rc<Plan> {
    plan(oid, op, || build(&ledger(client, oid)))
}

/// Shorthand for the statements built from a queue's shape.
pub(crate) fn queue_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&QueueShape) -> Sql,
) -> Rc<Plan> {
    plan(oid, op, || build(&queue(client, oid)))
}

fn prepared(oid: Oid, op: Op, cursor_options: u32, build: impl FnOnce() -> Sql) -> Rc<Plan> {
    cached(
        (oid, op),
        |cache| &mut cache.plans,
        || Plan::prepare(op, build(), cursor_options),
    )
}

/// A statement prepared through SPI and kept for the life of the backend: every statement the
/// extension keeps is one. Besides the plan cache's own choice of plan ([`plan`]), it can keep to
/// the generic plan ([`generic_plan`]) and run on the latest committed state ([`latest_plan`]).
///
/// The generic plan: locks take `LIMIT $1` jobs, leases and the array settlements find `$1` ids
/// by primary key; left to choose, the plan cache plans them again on every call (a generic
/// plan's guess at the limit or the arrays' length looks costly; planning was a third of the
/// call's time, measured), while the generic plan, an index scan, is the right one. A `SET
/// plan_cache_mode` clause on the function would cost a GUC save and restore per call; the
/// cursor option asks for the same, per statement.
///
/// The latest committed state: the bookkeeping of ordered groups, run under the group's lock,
/// must see what the transactions that held the lock before committed (as `REFERENCES` checks
/// do), even in a `REPEATABLE READ` or `SERIALIZABLE` transaction whose own snapshot may predate
/// it. Under `READ COMMITTED` every statement sees that anyway.
pub(crate) struct Plan(std::ptr::NonNull<pg_sys::_SPI_plan>);

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the plan was kept by SPI_keepplan and is freed once, here.
        unsafe {
            pg_sys::SPI_freeplan(self.0.as_ptr());
        }
    }
}

/// The datums and null flags of `args`, as SPI takes them.
fn spi_args(args: &[pgrx::datum::DatumWithOid<'_>]) -> (Vec<pg_sys::Datum>, Vec<std::ffi::c_char>) {
    args.iter()
        .map(|arg| match arg.datum() {
            Some(datum) => (datum.sans_lifetime(), b' ' as std::ffi::c_char),
            None => (pg_sys::Datum::from(0usize), b'n' as std::ffi::c_char),
        })
        .unzip()
}

impl Plan {
    /// Prepares `sql` (`what` names it in an error) and keeps it until dropped.
    pub(crate) fn prepare(what: impl std::fmt::Debug, sql: Sql, cursor_options: u32) -> Plan {
        let text = std::ffi::CString::new(sql.text).expect("SQL without NUL bytes");
        let mut args = sql.args;
        // SAFETY: the text and the argument types outlive the call; SPI is connected.
        let plan = unsafe {
            pg_sys::SPI_prepare_cursor(
                text.as_ptr(),
                args.len() as i32,
                args.as_mut_ptr(),
                cursor_options as i32,
            )
        };
        let Some(plan) = std::ptr::NonNull::new(plan) else {
            // SAFETY: SPI_result is set by the failed SPI_prepare_cursor.
            let code = unsafe { pg_sys::SPI_result };
            raise(
                ERRCODE_INTERNAL_ERROR,
                format!("preparing {what:?}: SPI error {code}"),
            );
        };
        // SAFETY: a plan just prepared, kept once.
        unsafe { pg_sys::SPI_keepplan(plan.as_ptr()) };
        Plan(plan)
    }

    /// Runs the statement; returns how many rows it processed, whose values (if it returns any)
    /// are in `SPI_tuptable` until the next statement.
    pub fn run(&self, args: &[pgrx::datum::DatumWithOid<'_>]) -> usize {
        self.execute(args, false)
    }

    /// Runs the statement and returns its rows.
    pub fn rows(&self, args: &[pgrx::datum::DatumWithOid<'_>]) -> Rows {
        Rows::of_last(self.run(args))
    }

    /// Runs a statement that only reads on the calling statement's snapshot, as a `STABLE`
    /// function must (SPI's read-only mode), and returns its rows.
    pub fn read_rows(&self, args: &[pgrx::datum::DatumWithOid<'_>]) -> Rows {
        Rows::of_last(self.execute(args, true))
    }

    fn execute(&self, args: &[pgrx::datum::DatumWithOid<'_>], read_only: bool) -> usize {
        let (mut values, nulls) = spi_args(args);
        // SAFETY: SPI is connected (the caller holds a client), the plan is kept, and the
        // values match its argument types.
        let status = unsafe {
            pg_sys::SPI_tuptable = std::ptr::null_mut();
            pg_sys::SPI_execute_plan(
                self.0.as_ptr(),
                values.as_mut_ptr(),
                nulls.as_ptr(),
                read_only,
                0,
            )
        };
        processed(status)
    }

    /// Runs the statement on the latest committed state (see [`Plan`]), like [`Plan::run`].
    pub fn run_latest(&self, args: &[pgrx::datum::DatumWithOid<'_>]) -> usize {
        let (mut values, nulls) = spi_args(args);
        // SAFETY: as in `run`. The latest snapshot is copied by SPI when pushed.
        let status = unsafe {
            let snapshot = if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
                pg_sys::GetLatestSnapshot()
            } else {
                std::ptr::null_mut()
            };
            pg_sys::SPI_tuptable = std::ptr::null_mut();
            pg_sys::SPI_execute_snapshot(
                self.0.as_ptr(),
                values.as_mut_ptr(),
                nulls.as_ptr(),
                snapshot,
                std::ptr::null_mut(),
                false,
                false,
                0,
            )
        };
        processed(status)
    }
}

/// The rows a statement returned (or, for one without `RETURNING`, how many it wrote), read
/// while SPI is still connected: they stay in SPI's memory until it disconnects.
pub(crate) struct Rows {
    table: *mut pg_sys::SPITupleTable,
    len: usize,
}

impl Rows {
    /// The result of the statement that just ran, which processed `len` rows.
    fn of_last(len: usize) -> Rows {
        // SAFETY: set by the execution that just returned (NULL for one that returns no rows).
        let table = unsafe { pg_sys::SPI_tuptable };
        Rows { table, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Column `column` (from 1) of row `row`; `None` for NULL, or where there is no such row.
    pub fn get<T: FromDatum>(&self, row: usize, column: i32) -> Option<T> {
        if self.table.is_null() || row >= self.len {
            return None;
        }
        // SAFETY: the table holds `len` rows and is still in SPI's memory (see above); a
        // column out of range reads as NULL.
        unsafe {
            let tuple = *(*self.table).vals.add(row);
            let descriptor = (*self.table).tupdesc;
            let mut is_null = false;
            let datum = pg_sys::SPI_getbinval(tuple, descriptor, column, &mut is_null);
            T::from_polymorphic_datum(datum, is_null, pg_sys::SPI_gettypeid(descriptor, column))
        }
    }
}

/// The rows an SPI execution processed, or `XX000` for an SPI error code.
fn processed(status: i32) -> usize {
    if status < 0 {
        raise(ERRCODE_INTERNAL_ERROR, format!("SPI error {status}"));
    }
    // SAFETY: set by the execution that just returned.
    unsafe { pg_sys::SPI_processed as usize }
}

/// The statement `op` for queue `oid`, kept to its generic plan (see [`Plan`]).
pub(crate) fn generic_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&QueueShape) -> Sql,
) -> Rc<Plan> {
    prepared_generic(oid, op, || build(&queue(client, oid)))
}

/// The statement `op` for table `oid`, prepared from `build` on first use and kept to its
/// generic plan (see [`Plan`]).
pub(crate) fn prepared_generic(oid: Oid, op: Op, build: impl FnOnce() -> Sql) -> Rc<Plan> {
    prepared(oid, op, pg_sys::CURSOR_OPT_GENERIC_PLAN, build)
}

/// The statement `op` for queue `oid`, to run with [`Plan::run_latest`].
pub(crate) fn latest_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&QueueShape) -> Sql,
) -> Rc<Plan> {
    queue_plan(client, oid, op, build)
}
