//! Workflows: kept results, dependencies and batches, and durable steps' records.
//! `sql/shared/workflows.sql` and `sql/shared/steps.sql` have all of it (both builds) but the
//! release of dependants: nothing runs on a queue's hot path until one of its jobs takes part,
//! and then row triggers on the queue settle dependants, batches and results in the settling
//! transaction.

use pgrx::prelude::*;

use crate::datum::{BigintArray, RegClass, TimestamptzArray};
use crate::plans::{self, Op};
use crate::statements;

// inbox__check_queue and inbox_queue_controls are the controls'; placed after everything else
// that follows them, so that the schema's order is one and the same on every build.
extension_sql_file!(
    "../../sql/shared/workflows.sql",
    name = "workflows",
    requires = ["controls", "limits", "controls_changed"]
);

// Durable steps' records (both builds), purged with the results. After the last of the chain
// that orders the shared files (workflows, citus, shape, browse, schedule_runs, dead_letters,
// observe, purge): with only "workflows" required, builds placed it at different points of the
// schema, and the upgrade script changed from build to build.
extension_sql_file!(
    "../../sql/shared/steps.sql",
    name = "steps",
    requires = ["purge"]
);

// What only an extension has: `pg_dump` dumps the records, which later deliveries rely on.
extension_sql!(
    "SELECT pg_catalog.pg_extension_config_dump('inbox_steps', '');",
    name = "steps_dump",
    requires = ["steps"]
);

/// Makes the dependants `ids` of `queue`, whose last parent succeeded, due: each at its
/// `run_ats` entry, or now where that is NULL or past; a dependant cancelled meanwhile stays
/// dead, and nothing happens to a queue that was dropped. Run by the ack of their last parent
/// (sql/shared/workflows.sql, inbox__jobs_succeeded), once per acking statement: written natively
/// (sql/sql-only/55-workflows.sql has the SQL-only build's) so that its statement is planned once
/// per queue and session, where the PL/pgSQL version plans it at every ack.
#[pg_extern(volatile, parallel_unsafe, name = "inbox__release")]
#[search_path(pg_catalog, pg_temp)]
fn release(queue: RegClass, ids: BigintArray, run_ats: TimestamptzArray) {
    // SAFETY: a catalog lookup by oid; '\0' when no relation has it.
    if unsafe { pg_sys::get_rel_relkind(queue.0) } == 0 {
        return;
    }
    let released = Spi::connect_mut(|client| {
        let plan = plans::generic_plan(
            client,
            queue.0,
            Op::ReleaseDependants,
            statements::release_dependants,
        );
        plan.run(&[ids.into(), run_ats.into()])
    });
    if released > 0 {
        crate::wakeups::notify(queue.0);
    }
}
