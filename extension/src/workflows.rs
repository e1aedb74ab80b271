//! Workflows: kept results, dependencies and batches. `sql/shared/workflows.sql` has all of it
//! (both builds): nothing runs on a queue's hot path until one of its jobs takes part, and then
//! row triggers on the queue settle dependants, batches and results in the settling transaction.

use pgrx::prelude::*;

// inbox__check_queue and inbox_queue_controls are the controls'; placed after everything else
// that follows them, so that the schema's order is one and the same on every build.
extension_sql_file!(
    "../../sql/shared/workflows.sql",
    name = "workflows",
    requires = ["controls", "limits", "controls_changed"]
);
