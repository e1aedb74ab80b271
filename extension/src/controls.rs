//! Pausing and resuming queues: `sql/shared/controls.sql` has the functions (both builds); this
//! build's leases, locks and `inbox_sleep` read the pause through [`paused`].

use std::cell::RefCell;
use std::rc::Rc;

use pgrx::pg_sys::{self, Oid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;

use crate::error::*;

// inbox__required is the outbox's.
extension_sql_file!(
    "../../sql/shared/controls.sql",
    name = "controls",
    requires = ["outbox"]
);

thread_local! {
    /// The statement [`paused`] runs, prepared once per backend (its plan is kept valid by
    /// PostgreSQL's plan cache).
    static PAUSED: RefCell<Option<Rc<OwnedPreparedStatement>>> = const { RefCell::new(None) };
}

/// Whether `queue` is paused, as the statement's snapshot sees it: at `READ COMMITTED`, every
/// pause committed before the call.
pub(crate) fn paused(client: &SpiClient<'_>, queue: Oid) -> bool {
    let statement = PAUSED.with(|cached| cached.borrow().clone());
    let statement = statement.unwrap_or_else(|| {
        let table = controls_table(client);
        let statement = Rc::new(
            client
                .prepare_mut(
                    &format!(
                        "SELECT EXISTS (SELECT FROM {table} \
                                         WHERE queue OPERATOR(pg_catalog.=) $1 \
                                           AND paused_at IS NOT NULL)"
                    ),
                    &[PgOid::from(pg_sys::REGCLASSOID)],
                )
                .unwrap_or_else(|e| internal(e))
                .keep(),
        );
        PAUSED.with(|cached| *cached.borrow_mut() = Some(statement.clone()));
        statement
    });
    // SAFETY: an oid is passed by value.
    let queue = unsafe { pgrx::datum::DatumWithOid::new(queue, pg_sys::REGCLASSOID) };
    client
        .select(&*statement, None, &[queue])
        .and_then(|rows| rows.first().get_one::<bool>())
        .unwrap_or_else(|e| internal(e))
        .unwrap_or(false)
}

/// The extension's `inbox_queue_controls` as SQL, quoted and schema-qualified.
fn controls_table(client: &SpiClient<'_>) -> String {
    client
        .select(
            "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) \
               FROM pg_catalog.pg_extension e \
               JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) e.extnamespace \
                                         AND c.relname OPERATOR(pg_catalog.=) 'inbox_queue_controls' \
               JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
              WHERE e.extname OPERATOR(pg_catalog.=) 'inbox'",
            None,
            &[],
        )
        .and_then(|rows| rows.first().get_one::<String>())
        .unwrap_or_else(|e| internal(e))
        .unwrap_or_else(|| {
            raise(
                ERRCODE_UNDEFINED_TABLE,
                "the extension's table inbox_queue_controls is missing",
            )
        })
}
