//! Prepared statements kept per table for the life of the backend.
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
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;

use crate::error::*;
use crate::shape::{LedgerShape, QueueShape};
use crate::statements::Sql;

/// The statements that are prepared per table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Claim,
    Seen,
    Purge,
    Enqueue,
    EnqueueBatch,
    Lease,
    Lock,
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
    Requeue,
    RequeueDead,
    Discard,
    DeadJobs,
    Fence,
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
    plans: HashMap<(Oid, Op), Rc<OwnedPreparedStatement>>,
    latest: HashMap<(Oid, Op), Rc<LatestPlan>>,
}

impl Cache {
    fn drop_stale(&mut self) {
        for stale in STALE.with(|stale| stale.take()) {
            match stale {
                Stale::All => {
                    self.ledgers.clear();
                    self.queues.clear();
                    self.plans.clear();
                    self.latest.clear();
                }
                Stale::Table(oid) => {
                    self.ledgers.remove(&oid);
                    self.queues.remove(&oid);
                    self.plans.retain(|(table, _), _| *table != oid);
                    self.latest.retain(|(table, _), _| *table != oid);
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
    cached_shape(
        oid,
        |cache| &mut cache.ledgers,
        || LedgerShape::load(client, oid),
    )
}

/// The shape of queue `oid`, loaded on first use.
pub(crate) fn queue(client: &SpiClient<'_>, oid: Oid) -> Rc<QueueShape> {
    cached_shape(
        oid,
        |cache| &mut cache.queues,
        || QueueShape::load(client, oid),
    )
}

fn cached_shape<S>(
    oid: Oid,
    map: impl Fn(&mut Cache) -> &mut HashMap<Oid, Rc<S>>,
    load: impl FnOnce() -> S,
) -> Rc<S> {
    let cached = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        cache.drop_stale();
        map(&mut cache).get(&oid).cloned()
    });
    if let Some(shape) = cached {
        return shape;
    }
    // Loading runs SPI, which may raise; nothing is borrowed while it does.
    let shape = Rc::new(load());
    CACHE.with(|cache| map(&mut cache.borrow_mut()).insert(oid, shape.clone()));
    shape
}

/// The statement `op` for table `oid`, prepared from `build` on first use.
pub(crate) fn plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: impl FnOnce() -> Sql,
) -> Rc<OwnedPreparedStatement> {
    let cached = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        cache.drop_stale();
        cache.plans.get(&(oid, op)).cloned()
    });
    if let Some(plan) = cached {
        return plan;
    }
    let sql = build();
    let args: Vec<PgOid> = sql.args.iter().map(|&oid| PgOid::from(oid)).collect();
    let plan = client
        .prepare_mut(sql.text.as_str(), &args)
        .unwrap_or_else(|e| raise(ERRCODE_INTERNAL_ERROR, format!("preparing {op:?}: {e}")));
    let plan = Rc::new(plan.keep());
    CACHE.with(|cache| cache.borrow_mut().plans.insert((oid, op), plan.clone()));
    plan
}

/// Shorthand for the statements built from a ledger's shape.
pub(crate) fn ledger_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&LedgerShape) -> Sql,
) -> Rc<OwnedPreparedStatement> {
    plan(client, oid, op, || build(&ledger(client, oid)))
}

/// Shorthand for the statements built from a queue's shape.
pub(crate) fn queue_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&QueueShape) -> Sql,
) -> Rc<OwnedPreparedStatement> {
    plan(client, oid, op, || build(&queue(client, oid)))
}

/// A statement that reads the latest committed state of the table even in a `REPEATABLE READ`
/// or `SERIALIZABLE` transaction, whose own snapshot may predate it: the bookkeeping of ordered
/// groups, run under the group's lock, must see what the transactions that held the lock before
/// committed (as `REFERENCES` checks do). Under `READ COMMITTED` every statement sees that anyway.
///
/// pgrx's prepared statements cannot be run with a snapshot of one's own, so this one is
/// prepared and run through SPI directly.
pub(crate) struct LatestPlan(std::ptr::NonNull<pg_sys::_SPI_plan>);

impl Drop for LatestPlan {
    fn drop(&mut self) {
        // SAFETY: the plan was kept by SPI_keepplan and is freed once, here.
        unsafe {
            pg_sys::SPI_freeplan(self.0.as_ptr());
        }
    }
}

impl LatestPlan {
    fn prepare(op: Op, sql: Sql) -> LatestPlan {
        let text = std::ffi::CString::new(sql.text).expect("SQL without NUL bytes");
        let mut args = sql.args;
        // SAFETY: the text and the argument types outlive the call; SPI is connected.
        let plan =
            unsafe { pg_sys::SPI_prepare(text.as_ptr(), args.len() as i32, args.as_mut_ptr()) };
        let Some(plan) = std::ptr::NonNull::new(plan) else {
            // SAFETY: SPI_result is set by the failed SPI_prepare.
            let code = unsafe { pg_sys::SPI_result };
            raise(
                ERRCODE_INTERNAL_ERROR,
                format!("preparing {op:?}: SPI error {code}"),
            );
        };
        // SAFETY: a plan just prepared, kept once.
        unsafe { pg_sys::SPI_keepplan(plan.as_ptr()) };
        LatestPlan(plan)
    }

    /// Runs the statement on the latest committed state; returns how many rows it processed,
    /// whose values (if it returns any) are in `SPI_tuptable` until the next statement.
    pub fn run(&self, args: &[pgrx::datum::DatumWithOid<'_>]) -> usize {
        let mut values: Vec<pg_sys::Datum> = Vec::with_capacity(args.len());
        let mut nulls: Vec<std::ffi::c_char> = Vec::with_capacity(args.len());
        for arg in args {
            match arg.datum() {
                Some(datum) => {
                    values.push(datum.sans_lifetime());
                    nulls.push(b' ' as std::ffi::c_char);
                }
                None => {
                    values.push(pg_sys::Datum::from(0usize));
                    nulls.push(b'n' as std::ffi::c_char);
                }
            }
        }
        // SAFETY: SPI is connected (the caller holds a client), the plan is kept, and the
        // values match its argument types. The latest snapshot is copied by SPI when pushed.
        unsafe {
            let snapshot = if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
                pg_sys::GetLatestSnapshot()
            } else {
                std::ptr::null_mut()
            };
            pg_sys::SPI_tuptable = std::ptr::null_mut();
            let status = pg_sys::SPI_execute_snapshot(
                self.0.as_ptr(),
                values.as_mut_ptr(),
                nulls.as_ptr(),
                snapshot,
                std::ptr::null_mut(),
                false,
                false,
                0,
            );
            if status < 0 {
                raise(ERRCODE_INTERNAL_ERROR, format!("SPI error {status}"));
            }
            pg_sys::SPI_processed as usize
        }
    }
}

/// The statement `op` for queue `oid`, run on the latest committed state (see [`LatestPlan`]).
pub(crate) fn latest_plan(
    client: &SpiClient<'_>,
    oid: Oid,
    op: Op,
    build: fn(&QueueShape) -> Sql,
) -> Rc<LatestPlan> {
    let cached = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        cache.drop_stale();
        cache.latest.get(&(oid, op)).cloned()
    });
    if let Some(plan) = cached {
        return plan;
    }
    let plan = Rc::new(LatestPlan::prepare(op, build(&queue(client, oid))));
    CACHE.with(|cache| cache.borrow_mut().latest.insert((oid, op), plan.clone()));
    plan
}
