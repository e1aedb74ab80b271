//! What operators and exporters read: every queue of the database with its counts and ages
//! (`inbox_queues`, `inbox_metrics`), one queue's jobs by state (`inbox_jobs`), and the ledger
//! purge in bounded steps that a caller commits one by one (`inbox_purge` with `max`).
//!
//! These are not on a worker's path, so their statements are built and run per call rather than
//! kept prepared; they are built from the same checked shapes as every other statement.

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::datum::{spi_result_datum, Bytea, Jsonb, RegClass};
use crate::error::*;
use crate::plans;
use crate::shape::{LedgerShape, Payload, QueueShape};
use crate::statements::{Sql, PURGE_BATCH};

// Browsing a queue's jobs (pages, counts, one job, dead letters by error): the same SQL in both
// builds, off the job path. After citus.sql, which also follows workflows.sql: one order, so that
// the generated schema is the same at every build.
extension_sql_file!(
    "../../sql/shared/browse.sql",
    name = "browse",
    requires = ["citus"]
);

/// The tables of queue shape that the caller may read: the columns every queue needs, of the
/// types `shape.rs` accepts, and no optional column of a type it would refuse (so loading the
/// shape of any table listed cannot fail). Partitions are left out: their parent is the queue.
const QUEUE_TABLES: &str = "\
SELECT c.oid, pg_catalog.quote_ident(n.nspname) OPERATOR(pg_catalog.||) '.' \
              OPERATOR(pg_catalog.||) pg_catalog.quote_ident(c.relname) \
  FROM pg_catalog.pg_class c \
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
 WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition \
   AND n.nspname <> 'information_schema' AND n.nspname !~ '^pg_(catalog|toast)' \
   AND NOT pg_catalog.pg_is_other_temp_schema(n.oid) \
   AND pg_catalog.has_schema_privilege(n.oid, 'USAGE') \
   AND pg_catalog.has_table_privilege(c.oid, 'SELECT') \
   AND 4 = (SELECT pg_catalog.count(*) FROM pg_catalog.pg_attribute a \
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
               AND ((a.attname IN ('id', 'attempt') AND a.atttypid IN ('int2'::pg_catalog.regtype, 'int4'::pg_catalog.regtype, 'int8'::pg_catalog.regtype)) \
                 OR (a.attname = 'locked_until' AND a.atttypid = 'timestamptz'::pg_catalog.regtype) \
                 OR (a.attname = 'payload' AND a.atttypid IN ('jsonb'::pg_catalog.regtype, 'bytea'::pg_catalog.regtype)))) \
   AND NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a \
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
               AND ((a.attname IN ('key', 'last_error', 'group_key') AND a.atttypid NOT IN ('text'::pg_catalog.regtype, 'varchar'::pg_catalog.regtype)) \
                 OR (a.attname IN ('leased_at', 'dead_at', 'run_at') AND a.atttypid <> 'timestamptz'::pg_catalog.regtype) \
                 OR (a.attname = 'priority' AND a.atttypid NOT IN ('int2'::pg_catalog.regtype, 'int4'::pg_catalog.regtype, 'int8'::pg_catalog.regtype)) \
                 OR a.attname = 'ordering_key')) \
 ORDER BY n.nspname, c.relname";

/// The states a job can be seen in (`locked` is a row lock, invisible to other sessions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Ready,
    Delayed,
    Leased,
    Dead,
}

impl State {
    fn parse(text: &str) -> State {
        match text {
            "ready" => State::Ready,
            "delayed" => State::Delayed,
            "leased" => State::Leased,
            "dead" => State::Dead,
            other => raise(
                ERRCODE_INVALID_PARAMETER_VALUE,
                format!("unknown job state \"{other}\": expected ready, delayed, leased or dead"),
            ),
        }
    }
}

/// Whether the table has `$1`'s columns of dead-letter time and ordered groups, which tell a
/// dead job from one waiting behind its group's head (both have `locked_until = 'infinity'`).
const DEAD_LETTER_COLUMNS: &str = "\
SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND NOT attisdropped \
                  AND attname = 'dead_at' AND atttypid = 'timestamptz'::pg_catalog.regtype), \
       EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND NOT attisdropped \
                  AND attname = 'group_key' \
                  AND atttypid IN ('text'::pg_catalog.regtype, 'varchar'::pg_catalog.regtype))";

/// The conditions that tell a queue's states apart, `$1` being now, as `inbox_stats` counts
/// them: a job waiting behind its group's head is delayed (it is not due until its turn).
struct States {
    ready: &'static str,
    /// Due later than now, but not never: delayed or leased.
    timed: &'static str,
    leased: &'static str,
    dead: &'static str,
    /// Waiting behind its group's head (`locked_until = 'infinity'`, `dead_at` NULL).
    in_group: &'static str,
}

impl States {
    fn of(client: &SpiClient<'_>, oid: pg_sys::Oid, queue: &QueueShape) -> States {
        let row = client
            .select(DEAD_LETTER_COLUMNS, None, &[oid.into()])
            .unwrap_or_else(|e| internal(e))
            .first();
        let has_dead_at = row.get::<bool>(1).ok().flatten().unwrap_or(false);
        let has_group_key = row.get::<bool>(2).ok().flatten().unwrap_or(false);
        States {
            ready: if queue.nullable_locked_until {
                "(locked_until IS NULL OR locked_until <= $1)"
            } else {
                "locked_until <= $1"
            },
            timed: "(locked_until > $1 AND locked_until < 'infinity')",
            // Without `leased_at` a delivered job waiting for its `locked_until` counts as
            // leased, as in `inbox_stats`.
            leased: if queue.has_leased_at {
                "leased_at IS NOT NULL"
            } else {
                "attempt > 0"
            },
            dead: if has_dead_at {
                "(locked_until = 'infinity' AND dead_at IS NOT NULL)"
            } else {
                "locked_until = 'infinity'"
            },
            in_group: if has_dead_at && has_group_key {
                "(locked_until = 'infinity' AND dead_at IS NULL)"
            } else {
                "false"
            },
        }
    }

    fn delayed(&self) -> String {
        format!(
            "(({} AND NOT ({})) OR {})",
            self.timed, self.leased, self.in_group
        )
    }

    fn leased(&self) -> String {
        format!("({} AND {})", self.timed, self.leased)
    }
}

/// `$1` now: the counts of `inbox_stats`, and the ages of the oldest ready job and of the oldest
/// lease (NULL where the table has no `leased_at`), in one scan.
fn metrics_sql(queue: &QueueShape, states: &States) -> Sql {
    let oldest_lease = if queue.has_leased_at {
        format!("$1 - min(leased_at) FILTER (WHERE {})", states.leased())
    } else {
        "NULL::interval".to_owned()
    };
    Sql {
        text: format!(
            "SELECT count(*) FILTER (WHERE {ready}), \
                    count(*) FILTER (WHERE {delayed}), \
                    count(*) FILTER (WHERE {leased}), \
                    count(*) FILTER (WHERE {dead}), \
                    $1 - min(locked_until) FILTER (WHERE locked_until <= $1), \
                    {oldest_lease} \
               FROM {table}",
            ready = states.ready,
            delayed = states.delayed(),
            leased = states.leased(),
            dead = states.dead,
            table = queue.table
        ),
        args: vec![pg_sys::TIMESTAMPTZOID],
    }
}

/// `$1` now, `$2` max: the jobs in `state` (all when `None`) by due time (`locked_until`, where
/// dead jobs and those waiting behind their group's head are at infinity), then id, each with its
/// state.
fn jobs_sql(queue: &QueueShape, states: &States, state: Option<State>) -> Sql {
    let filter = match state {
        None => "true".to_owned(),
        Some(State::Ready) => states.ready.to_owned(),
        Some(State::Delayed) => states.delayed(),
        Some(State::Leased) => states.leased(),
        Some(State::Dead) => states.dead.to_owned(),
    };
    let nulls = if queue.nullable_locked_until {
        " NULLS FIRST"
    } else {
        ""
    };
    let last_error = if queue.has_last_error {
        "last_error::text"
    } else {
        "NULL::text"
    };
    Sql {
        text: format!(
            "SELECT id::int8, \
                    CASE WHEN {dead} THEN 'dead' WHEN {ready} THEN 'ready' \
                         WHEN {leased} THEN 'leased' ELSE 'delayed' END, \
                    attempt::int4, locked_until, {last_error}, payload, \
                    NULLIF(pg_catalog.to_jsonb(q) OPERATOR(pg_catalog.->) 'progress', \
                                      'null'::pg_catalog.jsonb) \
               FROM {table} AS q WHERE {filter} ORDER BY locked_until{nulls}, id LIMIT $2",
            dead = states.dead,
            ready = states.ready,
            leased = states.leased(),
            table = queue.table
        ),
        args: vec![pg_sys::TIMESTAMPTZOID, pg_sys::INT8OID],
    }
}

/// `$1` older than, `$2` how many at most: one bounded batch, found first, then deleted by
/// `ctid` (as `inbox_purge` does).
fn purge_sql(ledger: &LedgerShape) -> Sql {
    let table = &ledger.table;
    Sql {
        text: format!(
            "DELETE FROM {table} WHERE ctid = ANY (ARRAY( \
                 SELECT ctid FROM {table} WHERE seen_at < $1 LIMIT $2))"
        ),
        args: vec![pg_sys::TIMESTAMPTZOID, pg_sys::INT8OID],
    }
}

/// The current time from the clock (not the transaction's start), as the queue functions use.
fn clock_now() -> DatumWithOid<'static> {
    // SAFETY: a timestamptz is an int64 passed by value.
    unsafe { DatumWithOid::new(pg_sys::GetCurrentTimestamp(), pg_sys::TIMESTAMPTZOID) }
}

/// One queue's counts and ages.
struct QueueMetrics {
    ready: i64,
    delayed: i64,
    leased: i64,
    dead: i64,
    oldest_ready_age: Option<Interval>,
    oldest_lease_age: Option<Interval>,
    /// Whether the table has `leased_at`, without which a lease's age is unknown.
    records_leases: bool,
    paused: bool,
}

fn queue_metrics(client: &SpiClient<'_>, oid: pg_sys::Oid) -> QueueMetrics {
    let shape = plans::queue(client, oid);
    let sql = metrics_sql(&shape, &States::of(client, oid, &shape));
    let row = client
        .select(sql.text.as_str(), None, &[clock_now()])
        .unwrap_or_else(|e| internal(e))
        .first();
    let count = |column| row.get::<i64>(column).ok().flatten().unwrap_or(0);
    QueueMetrics {
        ready: count(1),
        delayed: count(2),
        leased: count(3),
        dead: count(4),
        oldest_ready_age: row.get::<Interval>(5).ok().flatten(),
        oldest_lease_age: row.get::<Interval>(6).ok().flatten(),
        records_leases: shape.has_leased_at,
        paused: crate::controls::paused(client, oid),
    }
}

/// Every queue the caller may read, its schema-qualified name, and its metrics.
///
/// Each table is locked (`ACCESS SHARE`, as any query of it would be) before it is read, so that
/// it cannot be dropped while it is counted; a table that another transaction holds in `ACCESS
/// EXCLUSIVE` mode at that moment (a `DROP`, an `ALTER`, a `TRUNCATE`, a `VACUUM FULL`) is left
/// out of this call rather than waited for, so that a migration never stalls monitoring. A table
/// dropped between the listing and its lock is left out too (the lock brings the catalog caches
/// up to date, and the table is looked up again in them).
fn every_queue() -> Vec<(pg_sys::Oid, String, QueueMetrics)> {
    const MODE: pg_sys::LOCKMODE = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    Spi::connect(|client| {
        let candidates: Vec<(pg_sys::Oid, String)> = client
            .select(QUEUE_TABLES, None, &[])
            .unwrap_or_else(|e| internal(e))
            .map(|row| {
                (
                    row.get::<pg_sys::Oid>(1).ok().flatten().unwrap_or_default(),
                    row.get::<String>(2).ok().flatten().unwrap_or_default(),
                )
            })
            .collect();
        let mut queues = Vec::with_capacity(candidates.len());
        for (oid, name) in candidates {
            // SAFETY: lock-manager and syscache calls on an oid. A lock taken is released at the
            // end of the transaction, as the lock of any query would be; `get_rel_name` returns a
            // palloc'd copy, or NULL for an oid no longer in the catalog.
            let present = unsafe {
                if !pg_sys::ConditionalLockRelationOid(oid, MODE) {
                    continue;
                }
                let present = !pg_sys::get_rel_name(oid).is_null();
                if !present {
                    pg_sys::UnlockRelationOid(oid, MODE);
                }
                present
            };
            if present {
                queues.push((oid, name, queue_metrics(client, oid)));
            }
        }
        queues
    })
}

/// Every queue (table of queue shape) the caller may read, with its counts and ages.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn inbox_queues() -> TableIterator<
    'static,
    (
        name!(queue, RegClass),
        name!(ready, i64),
        name!(delayed, i64),
        name!(leased, i64),
        name!(dead, i64),
        name!(oldest_ready_age, Option<Interval>),
        name!(oldest_lease_age, Option<Interval>),
        name!(paused, bool),
    ),
> {
    TableIterator::new(every_queue().into_iter().map(|(oid, _, m)| {
        (
            RegClass(oid),
            m.ready,
            m.delayed,
            m.leased,
            m.dead,
            m.oldest_ready_age,
            m.oldest_lease_age,
            m.paused,
        )
    }))
}

fn seconds(interval: Option<Interval>) -> Option<f64> {
    const DAY: f64 = 86_400.0;
    interval.map(|i| {
        i.months() as f64 * 30.0 * DAY + i.days() as f64 * DAY + i.micros() as f64 / 1_000_000.0
    })
}

/// The gauges of every queue, for a monitoring system: counts per state, and ages in seconds
/// (0 when no job is ready or leased; the lease age is NULL where a table has no `leased_at`).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn inbox_metrics() -> TableIterator<
    'static,
    (
        name!(queue, String),
        name!(ready, i64),
        name!(delayed, i64),
        name!(leased, i64),
        name!(dead, i64),
        name!(oldest_ready_age_seconds, f64),
        name!(oldest_lease_age_seconds, Option<f64>),
        name!(paused, bool),
    ),
> {
    TableIterator::new(every_queue().into_iter().map(|(_, name, m)| {
        let oldest_lease = m
            .records_leases
            .then(|| seconds(m.oldest_lease_age).unwrap_or(0.0));
        (
            name,
            m.ready,
            m.delayed,
            m.leased,
            m.dead,
            seconds(m.oldest_ready_age).unwrap_or(0.0),
            oldest_lease,
            m.paused,
        )
    }))
}

/// One job as an operator sees it: `payload` for a `jsonb` queue, `payload_bytes` for a `bytea`
/// one, and the progress its running delivery recorded (`inbox_set_progress`).
type JobRow = (
    i64,
    String,
    i32,
    Option<TimestampWithTimeZone>,
    Option<String>,
    Option<Jsonb>,
    Option<Bytea>,
    Option<Jsonb>,
);

/// Up to `max` jobs of `queue` in `state` (`ready`, `delayed`, `leased`, `dead`; NULL for all),
/// in the order a lease takes them.
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn inbox_jobs(
    queue: Option<RegClass>,
    state: default!(Option<&str>, "NULL"),
    max: default!(Option<i32>, 100),
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(state, String),
        name!(attempt, i32),
        name!(due, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(payload, Option<Jsonb>),
        name!(payload_bytes, Option<Bytea>),
        name!(progress, Option<Jsonb>),
    ),
> {
    let queue = required(queue, "queue").0;
    let state = state.map(State::parse);
    let max = required(max, "max");
    if max < 1 {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "max must be at least 1");
    }
    let rows: Vec<JobRow> = Spi::connect(|client| {
        let shape = plans::queue(client, queue);
        let sql = jobs_sql(&shape, &States::of(client, queue, &shape), state);
        let table = client
            .select(sql.text.as_str(), None, &[clock_now(), (max as i64).into()])
            .unwrap_or_else(|e| internal(e));
        table
            .enumerate()
            .map(|(n, row)| {
                // SAFETY: the statement returned this row, with the payload in column 6, and SPI
                // is still connected; the datum is copied out of SPI's memory.
                let payload = unsafe { spi_result_datum(n, 6) };
                // SAFETY: as the payload's, column 7.
                let progress = unsafe { spi_result_datum(n, 7) };
                let (json, bytes) = match shape.payload {
                    Payload::Jsonb => (payload.map(Jsonb), None),
                    Payload::Bytea => (None, payload.map(Bytea)),
                };
                (
                    row.get::<i64>(1).ok().flatten().unwrap_or_default(),
                    row.get::<String>(2).ok().flatten().unwrap_or_default(),
                    row.get::<i32>(3).ok().flatten().unwrap_or_default(),
                    row.get::<TimestampWithTimeZone>(4).ok().flatten(),
                    row.get::<String>(5).ok().flatten(),
                    json,
                    bytes,
                    progress.map(Jsonb),
                )
            })
            .collect()
    });
    TableIterator::new(rows)
}

/// Deletes at most `max` keys of `ledger` seen before `older_than` and returns how many: a purge
/// that the caller bounds, committing each call on its own, so that purging millions of keys
/// never holds one long transaction (which would hold back vacuum everywhere).
#[pg_extern(volatile, parallel_unsafe, name = "inbox_purge")]
#[search_path(pg_catalog, pg_temp)]
fn inbox_purge_at_most(
    ledger: Option<RegClass>,
    older_than: Option<TimestampWithTimeZone>,
    max: Option<i64>,
) -> i64 {
    let ledger = required(ledger, "ledger").0;
    let older_than = required(older_than, "older_than");
    if !older_than.is_finite() {
        raise(
            ERRCODE_INVALID_PARAMETER_VALUE,
            "older_than must be a finite timestamp",
        );
    }
    let max = required(max, "max");
    if max < 1 {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "max must be at least 1");
    }
    Spi::connect_mut(|client| {
        crate::citus::check_purge(client, ledger);
        let sql = purge_sql(&plans::ledger(client, ledger));
        let mut purged = 0;
        while purged < max {
            let batch = (max - purged).min(PURGE_BATCH);
            let deleted = client
                .update(sql.text.as_str(), None, &[older_than.into(), batch.into()])
                .unwrap_or_else(|e| internal(e))
                .len() as i64;
            purged += deleted;
            if deleted < batch {
                break;
            }
        }
        purged
    })
}
