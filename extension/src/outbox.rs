//! The transactional outbox: `inbox_publish` records a message in the caller's transaction, and
//! relays claim, publish and settle them (`inbox_relay_*`). Off the job path, so written once for
//! both builds, in SQL: `sql/shared/outbox.sql` says how order per key is kept.

use pgrx::prelude::*;

// After the schedules' table: the install script keeps one order of its blocks.
extension_sql_file!(
    "../../sql/shared/outbox.sql",
    name = "outbox",
    requires = ["periodic_jobs"]
);
