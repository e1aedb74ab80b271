//! Citus: `sql/shared/citus.sql` (both builds) refuses a queue or a ledger that Citus places
//! where a job's statements cannot route to one node; a table's shape is read after that check.

use pgrx::pg_sys::Oid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::datum::RegClass;
use crate::error::internal;

extension_sql_file!(
    "../../sql/shared/citus.sql",
    name = "citus",
    requires = ["workflows"]
);

/// Raises 0A000 unless the queue or ledger `oid` is placed so that its statements route to one
/// node (a no-op without Citus).
pub(crate) fn check(client: &SpiClient<'_>, oid: Oid, kind: &str) {
    call(
        client,
        "inbox__citus_check($1, $2)",
        &[RegClass(oid).into(), kind.into()],
    );
}

/// Makes `table`, just created, one of its Citus distributed schema's tables, as a top-level
/// CREATE TABLE would have (a no-op without Citus).
pub(crate) fn join_tenant(client: &mut SpiClient<'_>, table: Oid) {
    // It creates the table's shards: not a read-only statement.
    let statement = format!(
        "SELECT {}",
        qualified(client, "inbox__citus_join_tenant($1)")
    );
    client
        .update(&statement, None, &[RegClass(table).into()])
        .unwrap_or_else(|e| internal(e));
}

/// Whether Citus distributes `table` (false without Citus).
pub(crate) fn distributes(client: &SpiClient<'_>, table: Oid) -> bool {
    client
        .select(
            &format!(
                "SELECT method FROM {}",
                qualified(client, "inbox__citus_placement($1)")
            ),
            None,
            &[RegClass(table).into()],
        )
        .and_then(|rows| rows.first().get_one::<String>())
        .unwrap_or_else(|e| internal(e))
        .is_some()
}

/// Runs the extension's function `call` with `args`.
fn call(client: &SpiClient<'_>, call: &str, args: &[pgrx::datum::DatumWithOid<'_>]) {
    client
        .select(&format!("SELECT {}", qualified(client, call)), None, args)
        .unwrap_or_else(|e| internal(e));
}

/// The extension's function `call`, qualified by the extension's schema.
fn qualified(client: &SpiClient<'_>, call: &str) -> String {
    format!("{}.{call}", crate::names::schema(client))
}
