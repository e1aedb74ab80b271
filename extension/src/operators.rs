//! What operators and exporters call is written once in SQL for both builds (`sql/shared/`):
//! dead letters, `inbox_queues`, `inbox_metrics`, `inbox_jobs`, the ledger purges and the job
//! browser. None is on a worker's path: each reads its table's shape from the catalog
//! (`shape.sql`) and builds its statement per call, where the job path keeps native plans. This
//! module only places the files in the extension's script; the group promotion a requeue needs is
//! `groups.rs`'s.

use pgrx::prelude::*;

// The queue and ledger shapes of the files below (and of browse.sql). After citus.sql, which also
// follows workflows.sql: one order, so that the generated schema is the same at every build.
extension_sql_file!(
    "../../sql/shared/shape.sql",
    name = "shape",
    requires = ["citus"]
);

// Browsing a queue's jobs (pages, counts, one job, dead letters by error).
extension_sql_file!(
    "../../sql/shared/browse.sql",
    name = "browse",
    requires = ["shape"]
);

// After schedule_runs.sql, which follows browse.sql.
extension_sql_file!(
    "../../sql/shared/dead_letters.sql",
    name = "dead_letters",
    requires = ["schedule_runs"]
);

extension_sql_file!(
    "../../sql/shared/observe.sql",
    name = "observe",
    requires = ["dead_letters"]
);

extension_sql_file!(
    "../../sql/shared/purge.sql",
    name = "purge",
    requires = ["observe"]
);
