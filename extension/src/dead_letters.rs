//! Dead-letter operations: list dead jobs, run them again, or delete them.
//!
//! A dead job stays in its queue with `locked_until = 'infinity'` (and, where the table has the
//! column, the time it died in `dead_at`). A requeued job runs again from its first attempt; one
//! of a group rejoins its group (see `statements::requeue`).

use pgrx::prelude::*;

use crate::datum::{spi_result_datum, Bytea, Jsonb, RegClass};
use crate::error::*;
use crate::groups;
use crate::plans::{self, Op};
use crate::queue::clock_now;
use crate::shape::Payload;
use crate::statements;

/// Raises `22023` unless `max` is at least one.
fn check_max(max: i64) {
    if max < 1 {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "max must be at least 1");
    }
}

/// Runs a requeue statement (`$1`, `$2` now) and promotes the heads of the groups it touched;
/// returns how many jobs it requeued.
fn requeue_with(
    queue: pg_sys::Oid,
    op: Op,
    build: fn(&crate::shape::QueueShape) -> statements::Sql,
    first: pgrx::datum::DatumWithOid<'_>,
) -> i64 {
    Spi::connect_mut(|client| {
        let rows = plans::queue_plan(client, queue, op, build).rows(&[first, clock_now()]);
        let groups: Vec<String> = (0..rows.len()).filter_map(|row| rows.get(row, 1)).collect();
        let requeued = rows.len() as i64;
        groups::settled(client, queue, groups);
        requeued
    })
}

/// Runs dead job `id` again: due now, its attempts counted from zero, its `last_error` kept.
/// False when the job is not dead (or not there).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_requeue(queue: Option<RegClass>, id: Option<i64>) -> bool {
    let queue = required(queue, "queue").0;
    let id = required(id, "id");
    requeue_with(queue, Op::Requeue, statements::requeue, id.into()) == 1
}

/// Runs all dead jobs again (or the `max` oldest); returns how many.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_requeue_dead(queue: Option<RegClass>, max: default!(Option<i32>, "NULL")) -> i64 {
    let queue = required(queue, "queue").0;
    if let Some(max) = max {
        check_max(max.into());
    }
    let max = max.map_or_else(
        || pgrx::datum::DatumWithOid::null_oid(pg_sys::INT8OID),
        |max| i64::from(max).into(),
    );
    requeue_with(queue, Op::RequeueDead, statements::requeue_dead, max)
}

/// Deletes dead job `id`; false when the job is not dead (or not there).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_discard(queue: Option<RegClass>, id: Option<i64>) -> bool {
    let queue = required(queue, "queue").0;
    let id = required(id, "id");
    Spi::connect_mut(|client| {
        plans::queue_plan(client, queue, Op::Discard, statements::discard).run(&[id.into()]) == 1
    })
}

type DeadJob = (
    i64,
    i32,
    Option<String>,
    Option<TimestampWithTimeZone>,
    Option<Jsonb>,
    Option<Bytea>,
);

/// Up to `max` dead jobs, oldest first.
#[pg_extern(stable, parallel_unsafe)]
#[allow(clippy::type_complexity)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_dead_jobs(
    queue: Option<RegClass>,
    max: default!(Option<i32>, 100),
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(attempt, i32),
        name!(last_error, Option<String>),
        name!(dead_at, Option<TimestampWithTimeZone>),
        name!(payload, Option<Jsonb>),
        name!(payload_bytes, Option<Bytea>),
    ),
> {
    let queue = required(queue, "queue").0;
    let max = required(max, "max");
    check_max(max.into());
    let jobs: Vec<DeadJob> = Spi::connect(|client| {
        let shape = plans::queue(client, queue);
        let plan = plans::queue_plan(client, queue, Op::DeadJobs, statements::dead_jobs);
        let found = plan.read_rows(&[max.into()]).len();
        (0..found)
            .map(|row| {
                // SAFETY: the statement returned `found` rows of (int8, int4, text, timestamptz,
                // payload); each value is copied out of SPI's memory before it is read.
                unsafe {
                    let id = spi_result_datum(row, 1).map_or(0, |d| d.value() as i64);
                    let attempt = spi_result_datum(row, 2).map_or(0, |d| d.value() as i32);
                    let last_error =
                        spi_result_datum(row, 3).and_then(|d| String::from_datum(d, false));
                    let dead_at = spi_result_datum(row, 4)
                        .and_then(|d| TimestampWithTimeZone::from_datum(d, false));
                    let payload = spi_result_datum(row, 5);
                    let (json, bytes) = match shape.payload {
                        Payload::Jsonb => (payload.map(Jsonb), None),
                        Payload::Bytea => (None, payload.map(Bytea)),
                    };
                    (id, attempt, last_error, dead_at, json, bytes)
                }
            })
            .collect()
    });
    TableIterator::new(jobs)
}
