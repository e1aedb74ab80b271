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
    let schema = crate::controls::schema(client);
    client
        .update(
            &format!("SELECT {schema}.inbox__citus_join_tenant($1)"),
            None,
            &[RegClass(table).into()],
        )
        .unwrap_or_else(|e| internal(e));
}

/// Whether Citus distributes `table` (false without Citus).
pub(crate) fn distributes(client: &SpiClient<'_>, table: Oid) -> bool {
    let schema = crate::controls::schema(client);
    client
        .select(
            &format!("SELECT ({schema}.inbox__citus_placement($1)).method IS NOT NULL"),
            None,
            &[RegClass(table).into()],
        )
        .and_then(|rows| rows.first().get_one::<bool>())
        .unwrap_or_else(|e| internal(e))
        .unwrap_or(false)
}

/// Raises 0A000 when `ledger` is hash-distributed: `inbox_purge` runs on its shards instead.
pub(crate) fn check_purge(client: &SpiClient<'_>, ledger: Oid) {
    call(
        client,
        "inbox__citus_check_purge($1)",
        &[RegClass(ledger).into()],
    );
}

/// Runs the extension's function `call` (schema-qualified here) with `args`.
fn call(client: &SpiClient<'_>, call: &str, args: &[pgrx::datum::DatumWithOid<'_>]) {
    let schema = crate::controls::schema(client);
    client
        .select(&format!("SELECT {schema}.{call}"), None, args)
        .unwrap_or_else(|e| internal(e));
}
