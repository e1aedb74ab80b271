//! `inbox`: a dedup ledger and SKIP LOCKED job queues inside PostgreSQL.
//!
//! The job path's SQL functions are declared in [`ledger`], [`queue`] and [`worker_calls`]; the
//! SQL they run is in [`statements`], prepared once per table and backend by [`plans`]. What is
//! off the job path (operators' and exporters' functions, controls, workflows, the outbox's relay)
//! is SQL shared with the SQL-only build (`sql/shared/`), placed in the script by the module it
//! belongs to (`operators.rs` for dead letters, observability and purges). The public contract
//! (arguments, results, SQLSTATEs) is documented in `docs/sql-api.md`.

use pgrx::prelude::*;

mod citus;
mod controls;
mod datum;
mod error;
mod groups;
mod head;
pub mod ledger;
mod names;
mod operators;
mod outbox;
mod plans;
pub mod queue;
pub mod schedule;
mod shape;
mod statements;
mod take;
mod upkeep;
mod wakeups;
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
