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
