//! Every statement the tool sends: calls of the extension's functions (docs/sql-api.md), with
//! their results cast for display. Table names travel as text parameters cast to `regclass`.
//! Timestamps are sent back as ISO 8601 text (`to_json`), which also spells `infinity`.

/// `inbox_queues()`: every queue with its counts and ages (in seconds).
pub const QUEUES: &str = "SELECT queue::text, ready, delayed, leased, dead, \
     extract(epoch FROM oldest_ready_age)::float8, extract(epoch FROM oldest_lease_age)::float8 \
     FROM inbox_queues()";

/// `inbox_stats(queue)`.
pub const STATS: &str = "SELECT ready, delayed, leased, dead, \
     extract(epoch FROM oldest_ready_age)::float8 FROM inbox_stats($1::text::regclass)";

/// `inbox_jobs(queue, state, max)`; bytea payloads in base64.
pub const JOBS: &str = "SELECT id, state, attempt, to_json(due) #>> '{}', last_error, payload, \
     encode(payload_bytes, 'base64') FROM inbox_jobs($1::text::regclass, $2::text, $3::int4)";

/// `inbox_dead_jobs(queue, max)`; bytea payloads in base64.
pub const DEAD_JOBS: &str = "SELECT id, attempt, last_error, to_json(dead_at) #>> '{}', \
     payload, encode(payload_bytes, 'base64') FROM inbox_dead_jobs($1::text::regclass, $2::int4)";

/// `inbox_requeue(queue, id)`: true when the job was dead and is due again.
pub const REQUEUE: &str = "SELECT inbox_requeue($1::text::regclass, $2::int8)";

/// `inbox_requeue_dead(queue, max)`: requeues up to `max` dead jobs, returns how many.
pub const REQUEUE_DEAD: &str = "SELECT inbox_requeue_dead($1::text::regclass, $2::int4)";

/// `inbox_discard(queue, id)`: true when the dead job was deleted.
pub const DISCARD: &str = "SELECT inbox_discard($1::text::regclass, $2::int8)";

/// `inbox_enqueue(queue, payload, run_at, key)`: the new id, NULL when the key is queued.
pub const ENQUEUE: &str = "SELECT inbox_enqueue($1::text::regclass, $2::jsonb, \
     coalesce($3::text::timestamptz, now()), $4::text)";

/// `inbox_enqueue(queue, payload, run_at, key, priority, group_key)`, for a job given a priority
/// or a group (0 is the function's default priority).
pub const ENQUEUE_PLACED: &str = "SELECT inbox_enqueue($1::text::regclass, $2::jsonb, \
     coalesce($3::text::timestamptz, now()), $4::text, coalesce($5::int4, 0), $6::text)";

/// `inbox_enqueue_batch(queue, payloads, run_at, keys, priority, group_keys)`: how many were
/// inserted, for jobs given a priority or a group.
pub const ENQUEUE_BATCH_PLACED: &str = "SELECT count(*) FROM inbox_enqueue_batch(\
     $1::text::regclass, $2::jsonb[], coalesce($3::text::timestamptz, now()), NULL::text[], \
     coalesce($4::int4, 0), $5::text[])";

/// `inbox_enqueue_batch(queue, payloads, run_at)`: how many were inserted.
pub const ENQUEUE_BATCH: &str = "SELECT count(*) FROM inbox_enqueue_batch($1::text::regclass, \
     $2::jsonb[], coalesce($3::text::timestamptz, now()))";

/// The purge's cutoff, fixed once for all its batches: now minus the duration, and whether the
/// duration is positive (no table is read).
pub const PURGE_CUTOFF: &str =
    "SELECT (now() - d)::text, d > interval '0' FROM CAST($1::text AS interval) AS d";

/// `inbox_purge(ledger, older_than, max)`: deletes at most `max` keys, returns how many.
pub const PURGE: &str = "SELECT inbox_purge($1::text::regclass, $2::text::timestamptz, $3::int8)";

/// `inbox_schedules(queue)`.
pub const SCHEDULES: &str = "SELECT name, cron, time_zone, payload, to_json(next_tick) #>> '{}' \
     FROM inbox_schedules($1::text::regclass)";

/// `inbox_metrics()`: the gauges of every queue.
pub const METRICS: &str = "SELECT queue, ready, delayed, leased, dead, oldest_ready_age_seconds, \
     oldest_lease_age_seconds FROM inbox_metrics()";
