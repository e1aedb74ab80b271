//! `inbox`: a dedup ledger and SKIP LOCKED job queues inside PostgreSQL.
//!
//! The job path's SQL functions are declared in [`ledger`], [`queue`] and [`worker_calls`]; the
//! SQL they run is in [`statements`], prepared once per table and backend by [`plans`]. What is
//! off the job path (operators' and exporters' functions, controls, workflows, the outbox's relay)
//! is SQL shared with the SQL-only build (`sql/shared/`), placed in the script by the module it
//! belongs to (`operators.rs` for dead letters, observability and purges). The public contract
//! (arguments, results, SQLSTATEs) is documented in `docs/sql-api.md`.
//!
//! The modules form layers, lowest first: a module names modules of lower layers, and of its own
//! layer only those listed before it, never a higher one (`../shared/tools/module-cycles.py
//! extension/src` finds no circle).
//! 1. [`error`], [`datum`], [`names`]: SQLSTATEs, the datums passed between SQL and the
//!    statements (and the clock), table names and the extension's own tables and schema; nothing
//!    here knows a queue.
//! 2. [`citus`], [`shape`]: a queue's or ledger's table, where Citus places it (checked first)
//!    and the columns, read from the catalog, that every statement is built from.
//! 3. [`statements`], [`plans`]: the SQL text built from a shape, and its prepared plans (and the
//!    shapes) kept per table and backend.
//! 4. [`head`], [`schedule`], [`take`], [`groups`], [`controls`], [`wakeups`]: the job path's
//!    mechanisms (where a scan starts, the ticks a take fires, the take, ordered groups, pauses
//!    and limits with their limited take, sleeping workers and `NOTIFY`), each with the SQL
//!    functions of its own (`inbox_schedule`, `inbox__groups_settled`, `inbox_sleep`, ...).
//! 5. [`ledger`], [`queue`], [`worker_calls`] (on `queue`'s batch ack), [`outbox`],
//!    [`workflows`], [`upkeep`], [`operators`]: the SQL-callable functions, built on the layers
//!    below.

use pgrx::prelude::*;

// 1. Errors, datums, names.
mod datum;
mod error;
mod names;

// 2. A table's shape.
mod citus;
mod shape;

// 3. SQL and its plans.
mod plans;
mod statements;

// 4. The job path's mechanisms.
mod controls;
mod groups;
mod head;
pub mod schedule;
mod take;
mod wakeups;

// 5. The SQL-callable functions.
pub mod ledger;
mod operators;
mod outbox;
pub mod queue;
mod upkeep;
pub mod worker_calls;
mod workflows;

#[cfg(any(test, feature = "pg_test"))]
mod pg_tests;

::pgrx::pg_module_magic!(name, version);

/// Whether enqueues send `NOTIFY` (the `inbox.notify` setting).
pub(crate) static NOTIFY: pgrx::GucSetting<bool> = pgrx::GucSetting::<bool>::new(true);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    pgrx::GucRegistry::define_bool_guc(
        c"inbox.notify",
        c"Whether enqueues wake the workers asleep on the queue (NOTIFY on its channel).",
        c"An enqueue notifies only when a worker sleeps on the queue (see inbox_sleep); with \
          this off, enqueues never notify and workers find new jobs when they poll.",
        &NOTIFY,
        pgrx::GucContext::Userset,
        pgrx::GucFlags::default(),
    );
    plans::register_invalidation_callback();
}

/// Hooks of `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
