//! Job queues: enqueue, take with SKIP LOCKED (leased or row-locked), and fenced settlement.

use std::rc::Rc;

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::datum::{
    array_facts, clock_now, spi_result_datum, BigintArray, Bytea, ByteaArray, Jsonb, JsonbArray,
    RegClass, Text, TextArray,
};
use crate::error::*;
use crate::groups;
use crate::plans::{self, Op};
use crate::shape::{create_table, Payload, QueueShape};
use crate::statements;
use crate::take::{take_jobs, Delivery};
use crate::wakeups::{self, notify};

/// Creates the queue table `name` unless a valid one exists; returns it.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_create_queue(name: Option<&str>) -> RegClass {
    create_table(
        required(name, "name"),
        statements::create_queue,
        |client, oid| {
            plans::queue(client, oid);
        },
    )
}

/// The NOTIFY channel on which enqueues into `queue` announce new jobs.
#[pg_extern(immutable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_channel(queue: Option<RegClass>) -> String {
    wakeups::channel(required(queue, "queue").0)
}

/// Wakes the sessions asleep on `queue` once the caller commits, as an enqueue does: for rows
/// inserted by other means (the outbox's publishes, an application's own `INSERT`).
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_notify(queue: Option<RegClass>) {
    notify(required(queue, "queue").0)
}

/// Raises `22023` unless `interval` is positive (or, with `allow_zero`, zero).
fn check_interval(interval: Interval, argument: &str, allow_zero: bool) -> Interval {
    const DAY: i128 = 86_400_000_000;
    let micros = interval.months() as i128 * 30 * DAY
        + interval.days() as i128 * DAY
        + interval.micros() as i128;
    if micros < 0 || (micros == 0 && !allow_zero) {
        let bound = if allow_zero {
            "negative"
        } else {
            "zero or negative"
        };
        raise(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!("{argument} must not be {bound}"),
        );
    }
    interval
}

/// What an enqueue asks for beyond a payload, checked against the queue's shape.
struct Sends {
    payload: Payload,
    keys: bool,
    priority: bool,
    groups: bool,
    timeout: bool,
}

/// Checks what an enqueue sends against the queue's shape: `42804` for a payload of another type
/// than the queue stores, `42703` for keys, a priority or groups sent to a queue without the
/// columns they need.
fn check_enqueue(client: &SpiClient<'_>, queue: pg_sys::Oid, sends: Sends) -> Rc<QueueShape> {
    let shape = plans::queue(client, queue);
    if shape.payload != sends.payload {
        raise(
            ERRCODE_DATATYPE_MISMATCH,
            format!(
                "queue {} stores {} payloads, not {}",
                shape.table,
                shape.payload.type_name(),
                sends.payload.type_name()
            ),
        );
    }
    let missing = |column: &str, what: &str| {
        raise(
            ERRCODE_UNDEFINED_COLUMN,
            format!("queue {} has no column \"{column}\" {what}", shape.table),
        )
    };
    if sends.keys && !shape.has_key {
        missing("key", "to dedup by");
    }
    if sends.priority && !shape.has_priority {
        missing("priority", "to order by (only priority 0 can be enqueued)");
    }
    if sends.groups && !shape.has_group_key {
        missing("group_key", "to group by");
    }
    if sends.timeout && !shape.has_timeout {
        missing("timeout", "to keep a timeout in");
    }
    if sends.groups && !shape.has_dead_at {
        missing(
            "dead_at",
            "(ordered groups need it to tell a waiting job from a dead one)",
        );
    }
    shape
}

#[allow(clippy::too_many_arguments)]
fn enqueue(
    queue: Option<RegClass>,
    payload: DatumWithOid<'_>,
    kind: Payload,
    run_at: Option<TimestampWithTimeZone>,
    key: Option<Text>,
    priority: Option<i32>,
    group_key: Option<String>,
    timeout: Option<Interval>,
) -> Option<i64> {
    let queue = required(queue, "queue").0;
    let run_at = finite_time(run_at, "run_at");
    let priority = required(priority, "priority");
    let timeout = timeout.map(|timeout| check_interval(timeout, "timeout", false));
    let id = Spi::connect_mut(|client| {
        let sends = Sends {
            payload: kind,
            keys: key.is_some(),
            priority: priority != 0,
            groups: group_key.is_some(),
            timeout: timeout.is_some(),
        };
        check_enqueue(client, queue, sends);
        // A job of a group whose head is there (or that has jobs waiting) waits its turn.
        let locked_until = match &group_key {
            Some(group) => {
                groups::lock(client, queue, std::slice::from_ref(group));
                if groups::busy(client, queue, group) {
                    TimestampWithTimeZone::positive_infinity()
                } else {
                    run_at
                }
            }
            None => run_at,
        };
        let plan = plans::queue_plan(client, queue, Op::Enqueue, statements::enqueue);
        let key = key.map_or_else(
            || DatumWithOid::null_oid(pg_sys::TEXTOID),
            DatumWithOid::from,
        );
        let args = [
            payload,
            locked_until.into(),
            key,
            priority.into(),
            groups::key_text(&group_key),
            run_at.into(),
            timeout.into(),
        ];
        // No row when the key is queued already.
        plan.rows(&args).get::<i64>(0, 1)
    });
    notify(queue);
    id
}

/// Enqueues one `jsonb` job, due at `run_at`; returns its id, or NULL when `key` is already queued.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_enqueue(
    queue: Option<RegClass>,
    payload: Option<Jsonb>,
    run_at: default!(Option<TimestampWithTimeZone>, "now()"),
    key: default!(Option<Text>, "NULL"),
    priority: default!(Option<i32>, 0),
    group_key: default!(Option<String>, "NULL"),
    timeout: default!(Option<Interval>, "NULL"),
) -> Option<i64> {
    let payload = required(payload, "payload").into();
    enqueue(
        queue,
        payload,
        Payload::Jsonb,
        run_at,
        key,
        priority,
        group_key,
        timeout,
    )
}

/// Enqueues one `bytea` job; as the `jsonb` form. It has a name of its own: were it an overload of
/// `inbox_enqueue`, a call with an untyped payload (a literal, or a parameter from a driver that
/// sends them untyped) would match both and fail as ambiguous.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_enqueue_bytes(
    queue: Option<RegClass>,
    payload: Option<Bytea>,
    run_at: default!(Option<TimestampWithTimeZone>, "now()"),
    key: default!(Option<Text>, "NULL"),
    priority: default!(Option<i32>, 0),
    group_key: default!(Option<String>, "NULL"),
    timeout: default!(Option<Interval>, "NULL"),
) -> Option<i64> {
    let payload = required(payload, "payload").into();
    enqueue(
        queue,
        payload,
        Payload::Bytea,
        run_at,
        key,
        priority,
        group_key,
        timeout,
    )
}

/// What a batch enqueue takes besides its payloads.
struct BatchOptions {
    run_at: Option<TimestampWithTimeZone>,
    keys: Option<TextArray>,
    priority: Option<i32>,
    group_keys: Option<TextArray>,
    timeout: Option<Interval>,
}

fn enqueue_batch(
    queue: Option<RegClass>,
    payloads: pg_sys::Datum,
    kind: Payload,
    options: BatchOptions,
) -> SetOfIterator<'static, i64> {
    let queue = required(queue, "queue").0;
    let run_at = finite_time(options.run_at, "run_at");
    let priority = required(options.priority, "priority");
    let timeout = options
        .timeout
        .map(|timeout| check_interval(timeout, "timeout", false));
    let count = array_facts(payloads, "payloads");
    if count.has_nulls {
        raise(
            ERRCODE_NULL_VALUE_NOT_ALLOWED,
            "payloads must not contain NULL",
        );
    }
    for (array, name) in [(options.keys, "keys"), (options.group_keys, "group_keys")] {
        if let Some(array) = array {
            let len = array_facts(array.0, name).len;
            if len != count.len {
                raise(
                    ERRCODE_ARRAY_ELEMENT_ERROR,
                    format!("{len} {name} given for {} payloads", count.len),
                );
            }
        }
    }
    let text_array = |array: Option<TextArray>| {
        array.map_or_else(
            || DatumWithOid::null_oid(pg_sys::TEXTARRAYOID),
            DatumWithOid::from,
        )
    };
    let ids = Spi::connect_mut(|client| {
        let sends = Sends {
            payload: kind,
            keys: options.keys.is_some(),
            priority: priority != 0,
            groups: options.group_keys.is_some(),
            timeout: timeout.is_some(),
        };
        check_enqueue(client, queue, sends);
        if let Some(keys) = options.group_keys {
            groups::lock(client, queue, &groups::keys_of(keys.0));
        }
        let plan = plans::queue_plan(client, queue, Op::EnqueueBatch, statements::enqueue_batch);
        // SAFETY: `payloads` is a non-NULL array of the queue's payload type.
        let payloads = unsafe { DatumWithOid::new(payloads, kind.array_type_oid()) };
        let args = [
            payloads,
            run_at.into(),
            text_array(options.keys),
            priority.into(),
            text_array(options.group_keys),
            timeout.into(),
        ];
        let rows = plan.rows(&args);
        let ids = (0..rows.len())
            .map(|row| rows.get::<i64>(row, 1).unwrap_or_default())
            .collect::<Vec<i64>>();
        // The batch's jobs of a group were inserted waiting: each group without a head gets one.
        if options.group_keys.is_some() {
            groups::promote(client, queue, text_array(options.group_keys));
        }
        ids
    });
    if !ids.is_empty() {
        notify(queue);
    }
    SetOfIterator::new(ids)
}

/// Enqueues many `jsonb` jobs in one statement; returns the ids inserted, in array order.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_enqueue_batch(
    queue: Option<RegClass>,
    payloads: Option<JsonbArray>,
    run_at: default!(Option<TimestampWithTimeZone>, "now()"),
    keys: default!(Option<TextArray>, "NULL"),
    priority: default!(Option<i32>, 0),
    group_keys: default!(Option<TextArray>, "NULL"),
    timeout: default!(Option<Interval>, "NULL"),
) -> SetOfIterator<'static, i64> {
    let options = BatchOptions {
        run_at,
        keys,
        priority,
        group_keys,
        timeout,
    };
    enqueue_batch(
        queue,
        required(payloads, "payloads").0,
        Payload::Jsonb,
        options,
    )
}

/// Enqueues many `bytea` jobs in one statement; as the `jsonb` form (named apart, as above).
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_enqueue_batch_bytes(
    queue: Option<RegClass>,
    payloads: Option<ByteaArray>,
    run_at: default!(Option<TimestampWithTimeZone>, "now()"),
    keys: default!(Option<TextArray>, "NULL"),
    priority: default!(Option<i32>, 0),
    group_keys: default!(Option<TextArray>, "NULL"),
    timeout: default!(Option<Interval>, "NULL"),
) -> SetOfIterator<'static, i64> {
    let options = BatchOptions {
        run_at,
        keys,
        priority,
        group_keys,
        timeout,
    };
    enqueue_batch(
        queue,
        required(payloads, "payloads").0,
        Payload::Bytea,
        options,
    )
}

/// Locks up to `max` due jobs and reads them; with `lease`, also leases them. A queue with limits
/// is taken from through `controls::take_limited`, unless `limits` is false (the call back of
/// `inbox__take_limited`, through `inbox__take_unlimited`, which may name the jobs it `chose`).
fn take(
    queue: Option<RegClass>,
    max: Option<i32>,
    lease: Option<Interval>,
    limits: bool,
    chose: Option<BigintArray>,
) -> Vec<Delivery> {
    let queue = required(queue, "queue").0;
    let max = required(max, "max");
    if max < 1 {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "max must be at least 1");
    }
    Spi::connect_mut(|client| {
        let control = crate::controls::control(client, queue);
        if control.paused {
            // Checked as a queue all the same (42P01, 42804, 42703), as when it runs.
            plans::queue(client, queue);
            return Vec::new();
        }
        if control.limited() && limits {
            return crate::controls::take_limited(client, queue, control, max, lease);
        }
        take_jobs(client, queue, max, lease, chose)
    })
}

/// Leases up to `max` due jobs for `lease`, in order, with `FOR UPDATE SKIP LOCKED`.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn inbox_lease(
    queue: Option<RegClass>,
    max: default!(Option<i32>, 1),
    lease: default!(Option<Interval>, "'30 seconds'"),
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(attempt, i32),
        name!(token, i64),
        name!(payload, Option<Jsonb>),
        name!(payload_bytes, Option<Bytea>),
        name!(timeout, Option<Interval>),
    ),
> {
    let lease = check_interval(required(lease, "lease"), "lease", false);
    TableIterator::new(take(queue, max, Some(lease), true, None))
}

/// Row-locks up to `max` due jobs in the caller's transaction, as `inbox_lease` picks them.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn inbox_lock(
    queue: Option<RegClass>,
    max: default!(Option<i32>, 1),
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(attempt, i32),
        name!(token, i64),
        name!(payload, Option<Jsonb>),
        name!(payload_bytes, Option<Bytea>),
        name!(timeout, Option<Interval>),
    ),
> {
    TableIterator::new(take(queue, max, None, true, None))
}

/// The take of a queue as if it had no limits: `inbox__take_limited` calls it for the jobs it has
/// slots for (a lease with `lease`, a lock without): the first `max` due jobs in the queue's
/// order or, given `chose`, those of them that are due and not locked.
#[pg_extern(volatile, parallel_unsafe, name = "inbox__take_unlimited")]
#[allow(clippy::type_complexity)]
fn take_unlimited(
    queue: Option<RegClass>,
    max: Option<i32>,
    lease: Option<Interval>,
    chose: default!(Option<BigintArray>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(attempt, i32),
        name!(token, i64),
        name!(payload, Option<Jsonb>),
        name!(payload_bytes, Option<Bytea>),
        name!(timeout, Option<Interval>),
    ),
> {
    let lease = lease.map(|lease| check_interval(lease, "lease", false));
    TableIterator::new(take(queue, max, lease, false, chose))
}

/// Runs one fenced settlement of job `id` under `token`; true when it applied.
fn settle(
    queue: Option<RegClass>,
    id: Option<i64>,
    token: Option<i64>,
    op: Op,
    build: fn(&crate::shape::QueueShape) -> statements::Sql,
    more: &[DatumWithOid<'_>],
) -> bool {
    let queue = required(queue, "queue").0;
    let id = required(id, "id");
    let token = required(token, "token");
    Spi::connect_mut(|client| {
        let plan = plans::queue_plan(client, queue, op, build);
        let mut args: Vec<DatumWithOid<'_>> = vec![id.into(), token.into()];
        // SAFETY: the extra arguments are borrowed for the duration of this call only.
        args.extend(
            more.iter()
                .map(|arg| unsafe { DatumWithOid::new_from_datum(arg.datum(), arg.oid()) }),
        );
        let rows = plan.rows(&args);
        let applied = rows.len() == 1;
        // A head that is done or dead hands its group on to the next job.
        let group = if applied && op != Op::Extend {
            rows.get::<String>(0, 1)
        } else {
            None
        };
        groups::settled(client, queue, group.into_iter().collect());
        applied
    })
}

/// Finishes (deletes) job `id` if `token` is still its delivery's.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_ack(queue: Option<RegClass>, id: Option<i64>, token: Option<i64>) -> bool {
    settle(queue, id, token, Op::Ack, statements::ack, &[])
}

/// Finishes many jobs in one statement; returns how many were still their tokens'. Named apart
/// from `inbox_ack`: an untyped `id` could be read as `bigint` or as `bigint[]`, so an overload
/// would make calls with untyped parameters ambiguous.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_ack_batch(
    queue: Option<RegClass>,
    ids: Option<BigintArray>,
    tokens: Option<BigintArray>,
) -> i64 {
    let queue = required(queue, "queue").0;
    ack_batch(queue, required(ids, "ids"), required(tokens, "tokens"))
}

/// Acks the jobs of `ids` still held by their `tokens`, and promotes the next job of every group
/// whose head it acked; returns how many it acked. `2202E` for arrays of unequal length.
pub(crate) fn ack_batch(queue: pg_sys::Oid, ids: BigintArray, tokens: BigintArray) -> i64 {
    crate::datum::same_length(&ids, &tokens);
    Spi::connect_mut(|client| {
        let plan = plans::generic_plan(client, queue, Op::AckMany, statements::ack_many);
        let acked = plan.run(&[ids.into(), tokens.into()]);
        let groups: Vec<String> = (0..acked)
            // SAFETY: the statement returned `acked` rows of one text column (the group or NULL).
            .filter_map(|row| unsafe { spi_result_datum(row, 1) })
            // SAFETY: a non-NULL text datum, copied into the current memory context.
            .filter_map(|group| unsafe { String::from_datum(group, false) })
            .collect();
        groups::settled(client, queue, groups);
        acked as i64
    })
}

/// Releases job `id` to run again after `delay`, or dead-letters it once it has had
/// `max_attempts` deliveries.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_retry(
    queue: Option<RegClass>,
    id: Option<i64>,
    token: Option<i64>,
    delay: default!(Option<Interval>, "'0 seconds'"),
    error: default!(Option<&str>, "NULL"),
    max_attempts: default!(Option<i32>, "NULL"),
) -> bool {
    let delay = check_interval(required(delay, "delay"), "delay", true);
    if max_attempts.is_some_and(|max| max < 1) {
        raise(
            ERRCODE_INVALID_PARAMETER_VALUE,
            "max_attempts must be at least 1",
        );
    }
    let error = error.map_or_else(
        || DatumWithOid::null_oid(pg_sys::TEXTOID),
        DatumWithOid::from,
    );
    let max = max_attempts.map_or_else(
        || DatumWithOid::null_oid(pg_sys::INT4OID),
        DatumWithOid::from,
    );
    settle(
        queue,
        id,
        token,
        Op::Retry,
        statements::retry,
        &[clock_now(), due_after(delay), max, error],
    )
}

/// The clock's time plus `delay`, as PostgreSQL adds them (months and days in the session's
/// time zone).
fn due_after(delay: Interval) -> DatumWithOid<'static> {
    // SAFETY: both arguments are given and non-NULL; the result is a timestamptz by value.
    let due = unsafe {
        pgrx::direct_function_call::<pgrx::datum::TimestampWithTimeZone>(
            pg_sys::timestamptz_pl_interval,
            &[
                Some(pg_sys::Datum::from(pg_sys::GetCurrentTimestamp())),
                delay.into_datum(),
            ],
        )
    };
    due.map_or_else(
        || DatumWithOid::null_oid(pg_sys::TIMESTAMPTZOID),
        DatumWithOid::from,
    )
}

/// Dead-letters job `id`, keeping it in the table with `reason`, for an operator.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_dead(
    queue: Option<RegClass>,
    id: Option<i64>,
    token: Option<i64>,
    reason: default!(Option<&str>, "NULL"),
) -> bool {
    let reason = reason.map_or_else(
        || DatumWithOid::null_oid(pg_sys::TEXTOID),
        DatumWithOid::from,
    );
    settle(
        queue,
        id,
        token,
        Op::Dead,
        statements::dead,
        &[reason, clock_now()],
    )
}

/// Keeps job `id` leased for `lease` from now: the heartbeat of a long handler.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_extend(
    queue: Option<RegClass>,
    id: Option<i64>,
    token: Option<i64>,
    lease: default!(Option<Interval>, "'30 seconds'"),
) -> bool {
    let lease = check_interval(required(lease, "lease"), "lease", false);
    settle(
        queue,
        id,
        token,
        Op::Extend,
        statements::extend,
        &[clock_now(), lease.into()],
    )
}

/// How many jobs are ready, delayed, leased and dead, how long the oldest ready one has waited,
/// and whether the queue is paused.
#[pg_extern(stable, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
#[allow(clippy::type_complexity)]
fn inbox_stats(
    queue: Option<RegClass>,
) -> TableIterator<
    'static,
    (
        name!(ready, i64),
        name!(delayed, i64),
        name!(leased, i64),
        name!(dead, i64),
        name!(oldest_ready_age, Option<Interval>),
        name!(paused, bool),
    ),
> {
    let queue = required(queue, "queue").0;
    let row = Spi::connect(|client| {
        let plan = plans::queue_plan(client, queue, Op::Stats, statements::stats);
        let rows = plan.read_rows(&[clock_now()]);
        let count = |column| rows.get::<i64>(0, column).unwrap_or(0);
        (
            count(1),
            count(2),
            count(3),
            count(4),
            rows.get::<Interval>(0, 5),
            crate::controls::paused(client, queue),
        )
    });
    TableIterator::once(row)
}
