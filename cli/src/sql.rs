//! Every statement the tool sends: calls of the extension's functions (docs/sql-api.md), with
//! their results cast for display. Table names travel as text parameters cast to `regclass`.
//! Timestamps are sent back as ISO 8601 text (`to_json`), which also spells `infinity`.
//!
//! Each statement carries its parameters' types (those of their casts), so that it runs as the
//! unnamed statement in one message: no named prepared statement exists for a pooler in
//! transaction mode to lose between two round trips (pgbouncer before 1.21).

use tokio_postgres::types::Type;

/// A statement and the types of its parameters, `$1` first.
pub struct Sql {
    pub text: &'static str,
    pub params: &'static [Type],
}

/// `inbox_queues()`: every queue with its counts, ages (in seconds) and whether it is paused
/// (read by name, so that an extension older than pausing answers NULL).
pub const QUEUES: Sql = Sql {
    text: "SELECT queue::text, ready, delayed, leased, dead, \
        extract(epoch FROM oldest_ready_age)::float8, extract(epoch FROM oldest_lease_age)::float8, \
        (to_jsonb(q) -> 'paused')::bool FROM inbox_queues() q",
    params: &[],
};

/// `inbox_stats(queue)`, its `paused` read as in [`QUEUES`].
pub const STATS: Sql = Sql {
    text: "SELECT ready, delayed, leased, dead, \
        extract(epoch FROM oldest_ready_age)::float8, (to_jsonb(s) -> 'paused')::bool \
        FROM inbox_stats($1::text::regclass) s",
    params: &[Type::TEXT],
};

/// `inbox_pause(queue)`: whether it was running.
pub const PAUSE: Sql = Sql {
    text: "SELECT inbox_pause($1::text::regclass)",
    params: &[Type::TEXT],
};

/// `inbox_cancel(queue, id)`: whether it cancelled the job.
pub const CANCEL: Sql = Sql {
    text: "SELECT inbox_cancel($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_resume(queue)`: whether it was paused.
pub const RESUME: Sql = Sql {
    text: "SELECT inbox_resume($1::text::regclass)",
    params: &[Type::TEXT],
};

/// `inbox_set_concurrency(queue, n, per_key)`: at most n running at once, of the queue or of
/// one key (NULL n: no limit).
pub const SET_CONCURRENCY: Sql = Sql {
    text: "SELECT inbox_set_concurrency($1::text::regclass, $2::int4, per_key => $3::text)",
    params: &[Type::TEXT, Type::INT4, Type::TEXT],
};

/// `inbox_set_rate_limit(queue, n, per)`: at most n starts in any window of `per`.
pub const SET_RATE_LIMIT: Sql = Sql {
    text: "SELECT inbox_set_rate_limit($1::text::regclass, $2::int4, $3::text::interval)",
    params: &[Type::TEXT, Type::INT4, Type::TEXT],
};

/// `inbox_limits(queue)`, the rate's window as text.
/// `inbox_set_unique(queue, until)`: until when a job's key stays unique.
pub const SET_UNIQUE: Sql = Sql {
    text: "SELECT inbox_set_unique($1::text::regclass, $2::text)",
    params: &[Type::TEXT, Type::TEXT],
};

/// `inbox_unique_until(queue)`.
pub const UNIQUE_UNTIL: Sql = Sql {
    text: "SELECT inbox_unique_until($1::text::regclass)",
    params: &[Type::TEXT],
};

pub const LIMITS: Sql = Sql {
    text: "SELECT concurrency, running, rate_limit, rate_period::text, recent_starts, \
        key_concurrency, per_key, keys_running, most_running_per_key \
        FROM inbox_limits($1::text::regclass)",
    params: &[Type::TEXT],
};

/// `inbox_jobs(queue, state, max)`; bytea payloads in base64.
pub const JOBS: Sql = Sql {
    text: "SELECT id, state, attempt, to_json(due) #>> '{}', last_error, payload, \
        encode(payload_bytes, 'base64'), progress \
        FROM inbox_jobs($1::text::regclass, $2::text, $3::int4)",
    params: &[Type::TEXT, Type::TEXT, Type::INT4],
};

/// `inbox_dead_jobs(queue, max)`; bytea payloads in base64.
pub const DEAD_JOBS: Sql = Sql {
    text:
        "SELECT id, attempt, last_error, to_json(dead_at) #>> '{}', \
        payload, encode(payload_bytes, 'base64') FROM inbox_dead_jobs($1::text::regclass, $2::int4)",
    params: &[Type::TEXT, Type::INT4],
};

/// `inbox_requeue(queue, id)`: true when the job was dead and is due again.
pub const REQUEUE: Sql = Sql {
    text: "SELECT inbox_requeue($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_requeue_dead(queue, max)`: requeues up to `max` dead jobs, returns how many.
pub const REQUEUE_DEAD: Sql = Sql {
    text: "SELECT inbox_requeue_dead($1::text::regclass, $2::int4)",
    params: &[Type::TEXT, Type::INT4],
};

/// `inbox_discard(queue, id)`: true when the dead job was deleted.
pub const DISCARD: Sql = Sql {
    text: "SELECT inbox_discard($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_enqueue(queue, payload, run_at, key)`: the new id, NULL when the key is queued.
pub const ENQUEUE: Sql = Sql {
    text: "SELECT inbox_enqueue($1::text::regclass, $2::jsonb, \
        coalesce($3::text::timestamptz, now()), $4::text)",
    params: &[Type::TEXT, Type::JSONB, Type::TEXT, Type::TEXT],
};

/// `inbox_enqueue(queue, payload, run_at, key, priority, group_key)`, for a job given a priority
/// or a group (0 is the function's default priority).
pub const ENQUEUE_PLACED: Sql = Sql {
    text: "SELECT inbox_enqueue($1::text::regclass, $2::jsonb, \
        coalesce($3::text::timestamptz, now()), $4::text, coalesce($5::int4, 0), $6::text)",
    params: &[
        Type::TEXT,
        Type::JSONB,
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
        Type::TEXT,
    ],
};

/// `inbox_enqueue_batch(queue, payloads, run_at, keys, priority, group_keys)`: how many were
/// inserted, for jobs given a priority or a group.
pub const ENQUEUE_BATCH_PLACED: Sql = Sql {
    text: "SELECT count(*) FROM inbox_enqueue_batch(\
        $1::text::regclass, $2::jsonb[], coalesce($3::text::timestamptz, now()), NULL::text[], \
        coalesce($4::int4, 0), $5::text[])",
    params: &[
        Type::TEXT,
        Type::JSONB_ARRAY,
        Type::TEXT,
        Type::INT4,
        Type::TEXT_ARRAY,
    ],
};

/// `inbox_enqueue_batch(queue, payloads, run_at)`: how many were inserted.
pub const ENQUEUE_BATCH: Sql = Sql {
    text: "SELECT count(*) FROM inbox_enqueue_batch($1::text::regclass, \
        $2::jsonb[], coalesce($3::text::timestamptz, now()))",
    params: &[Type::TEXT, Type::JSONB_ARRAY, Type::TEXT],
};

/// The purge's cutoff, fixed once for all its batches: now minus the duration, and whether the
/// duration is positive (no table is read).
pub const PURGE_CUTOFF: Sql = Sql {
    text: "SELECT (now() - d)::text, d > interval '0' FROM CAST($1::text AS interval) AS d",
    params: &[Type::TEXT],
};

/// `inbox_purge(ledger, older_than, max)`: deletes at most `max` keys, returns how many.
pub const PURGE: Sql = Sql {
    text: "SELECT inbox_purge($1::text::regclass, $2::text::timestamptz, $3::int8)",
    params: &[Type::TEXT, Type::TEXT, Type::INT8],
};

/// `inbox_schedules(queue)`.
pub const SCHEDULES: Sql = Sql {
    text: "SELECT name, cron, time_zone, payload, to_json(next_tick) #>> '{}', \
               to_json(last_tick) #>> '{}' \
        FROM inbox_schedules($1::text::regclass)",
    params: &[Type::TEXT],
};

/// `inbox_run_schedule(queue, name)`: the id of the job it enqueued.
pub const RUN_SCHEDULE: Sql = Sql {
    text: "SELECT inbox_run_schedule($1::text::regclass, $2::text)",
    params: &[Type::TEXT, Type::TEXT],
};

/// `inbox_metrics()`: the gauges of every queue (`paused` read as in [`QUEUES`]).
pub const METRICS: Sql = Sql {
    text: "SELECT queue, ready, delayed, leased, dead, oldest_ready_age_seconds, \
        oldest_lease_age_seconds, (to_jsonb(m) -> 'paused')::bool FROM inbox_metrics() m",
    params: &[],
};

/// `inbox_limits(queue)` of every queue that has a limit (from `inbox_metrics()`), the rate's
/// window in seconds.
pub const LIMIT_METRICS: Sql = Sql {
    text: "SELECT m.queue, l.concurrency, l.running, l.rate_limit, \
        extract(epoch FROM l.rate_period)::float8, l.recent_starts, l.key_concurrency, \
        l.keys_running, l.most_running_per_key \
        FROM inbox_metrics() m, LATERAL inbox_limits(m.queue::regclass) l \
        WHERE l.concurrency IS NOT NULL OR l.rate_limit IS NOT NULL OR l.key_concurrency IS NOT NULL",
    params: &[],
};

/// `inbox_outboxes()`: every outbox with its counts, ages (in seconds), relay and what it sent.
/// Outboxes are named schema-qualified, as the metrics label them.
pub const OUTBOXES: Sql = Sql {
    text: "SELECT (pg_identify_object('pg_class'::regclass, outbox, 0)).identity, \
        pending, sending, retrying, dead, extract(epoch FROM oldest_unsent_age)::float8, \
        sent, duplicates, failures, relay, to_json(relay_lease_until) #>> '{}', \
        relay_lease_until > clock_timestamp(), extract(epoch FROM oldest_publisher_age)::float8 \
        FROM inbox_outboxes()",
    params: &[],
};

/// `inbox_outboxes()` for `/metrics`: the gauges of every outbox, ages 0 when there is none.
pub const OUTBOX_METRICS: Sql = Sql {
    text: "SELECT (pg_identify_object('pg_class'::regclass, outbox, 0)).identity, \
        pending + sending + retrying, dead, \
        coalesce(extract(epoch FROM oldest_unsent_age)::float8, 0), sent, duplicates, failures, \
        coalesce(extract(epoch FROM oldest_publisher_age)::float8, 0) FROM inbox_outboxes()",
    params: &[],
};

/// A table's schema-qualified name (`public.events`), as `outboxes`, the metrics and the
/// dashboard name an outbox or a queue; an error when there is no such table.
pub const TABLE_NAME: Sql = Sql {
    text: "SELECT (pg_identify_object('pg_class'::regclass, $1::text::regclass, 0)).identity",
    params: &[Type::TEXT],
};

/// `inbox_outbox_messages(outbox, state, max)`; payloads in base64 too, for bytes that are not
/// text.
pub const OUTBOX_MESSAGES: Sql = Sql {
    text: "SELECT id, state, subject, key, attempt, to_json(published_at) #>> '{}', \
        to_json(due) #>> '{}', last_error, payload, encode(payload, 'base64'), headers \
        FROM inbox_outbox_messages($1::text::regclass, $2::text, $3::int4)",
    params: &[Type::TEXT, Type::TEXT, Type::INT4],
};

/// `inbox_outbox_requeue(outbox, id)`: true when the message was dead and is due again.
pub const OUTBOX_REQUEUE: Sql = Sql {
    text: "SELECT inbox_outbox_requeue($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_outbox_requeue_dead(outbox, max)`: requeues up to `max` dead messages, returns how many.
pub const OUTBOX_REQUEUE_DEAD: Sql = Sql {
    text: "SELECT inbox_outbox_requeue_dead($1::text::regclass, $2::int4)",
    params: &[Type::TEXT, Type::INT4],
};

/// `inbox_outbox_discard(outbox, id)`: true when the dead message was deleted.
pub const OUTBOX_DISCARD: Sql = Sql {
    text: "SELECT inbox_outbox_discard($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `set_config('statement_timeout, ms, true)`: bounds the statements of the current transaction
/// only, so that no setting stays on a server connection a pooler shares.
pub const TRANSACTION_TIMEOUT: Sql = Sql {
    text: "SELECT set_config('statement_timeout', $1::text, true)",
    params: &[Type::TEXT],
};

/// `inbox_job_page(queue, state, priority, group_key, key, before, max)`: a page of jobs, newest
/// first, its times as text.
pub const JOB_PAGE: Sql = Sql {
    text: "SELECT id, state, attempt, priority, group_key, key, to_json(due) #>> '{}', \
        to_json(enqueued_at) #>> '{}', to_json(leased_at) #>> '{}', to_json(dead_at) #>> '{}', \
        last_error \
        FROM inbox_job_page($1::text::regclass, $2::text, $3::int4, $4::text, $5::text, $6::int8, $7::int4)",
    params: &[
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::INT4,
    ],
};

/// `inbox_job_count(queue, state, priority, group_key, key, exact_up_to)`: exact up to the bound,
/// the planner's estimate beyond.
pub const JOB_COUNT: Sql = Sql {
    text: "SELECT jobs, exact \
        FROM inbox_job_count($1::text::regclass, $2::text, $3::int4, $4::text, $5::text, $6::int8)",
    params: &[
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
    ],
};

/// `inbox_job_detail(queue, id)`: the job's state and its row, as indented JSON.
pub const JOB_DETAIL: Sql = Sql {
    text: "SELECT state, jsonb_pretty(job) FROM inbox_job_detail($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_result(queue, id)`: how a job that left its queue ended.
pub const JOB_RESULT: Sql = Sql {
    text: "SELECT state, jsonb_pretty(result), last_error, to_json(finished_at) #>> '{}' \
        FROM inbox_result($1::text::regclass, $2::int8)",
    params: &[Type::TEXT, Type::INT8],
};

/// `inbox_dead_letter_groups(queue, max)`: dead jobs by their last error.
pub const DEAD_LETTER_GROUPS: Sql = Sql {
    text: "SELECT last_error, jobs, to_json(first_dead_at) #>> '{}', \
        to_json(last_dead_at) #>> '{}', newest_id \
        FROM inbox_dead_letter_groups($1::text::regclass, $2::int4)",
    params: &[Type::TEXT, Type::INT4],
};

/// `inbox_requeue_dead_with_error(queue, last_error)`: how many it put back.
pub const REQUEUE_DEAD_WITH_ERROR: Sql = Sql {
    text: "SELECT inbox_requeue_dead_with_error($1::text::regclass, $2::text)",
    params: &[Type::TEXT, Type::TEXT],
};

/// `inbox_queue_activity(queue)`: the rows inserted into and deleted from the queue so far.
pub const QUEUE_ACTIVITY: Sql = Sql {
    text: "SELECT enqueued, settled FROM inbox_queue_activity($1::text::regclass)",
    params: &[Type::TEXT],
};

/// `inbox_blocked_groups(queue, max)`: groups with jobs waiting, and the head each waits on.
pub const BLOCKED_GROUPS: Sql = Sql {
    text: "SELECT group_key, waiting, head_id, head_state, head_attempt, \
        to_json(head_due) #>> '{}', head_last_error \
        FROM inbox_blocked_groups($1::text::regclass, $2::int4)",
    params: &[Type::TEXT, Type::INT4],
};

/// `inbox_paused_since(queue)`: when the queue was paused, NULL while it runs.
pub const PAUSED_SINCE: Sql = Sql {
    text: "SELECT inbox_paused_since($1::text::regclass) IS NOT NULL",
    params: &[Type::TEXT],
};

/// `inbox_ledgers()`: every ledger with its estimated keys and its size.
pub const LEDGERS: Sql = Sql {
    text: "SELECT (pg_identify_object('pg_class'::regclass, ledger, 0)).identity, keys_estimate, bytes \
        FROM inbox_ledgers()",
    params: &[],
};

/// `inbox_act_on_matching(queue, action, state, priority, group_key, key, max)`: how many jobs
/// it requeued, discarded or cancelled.
pub const ACT_ON_MATCHING: Sql = Sql {
    text:
        "SELECT inbox_act_on_matching($1::text::regclass, $2::text, $3::text, $4::int4, $5::text, \
        $6::text, $7::int4)",
    params: &[
        Type::TEXT,
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
        Type::TEXT,
        Type::TEXT,
        Type::INT4,
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [&Sql; 35] = [
        &QUEUES,
        &STATS,
        &JOBS,
        &DEAD_JOBS,
        &REQUEUE,
        &REQUEUE_DEAD,
        &DISCARD,
        &ENQUEUE,
        &ENQUEUE_PLACED,
        &ENQUEUE_BATCH_PLACED,
        &ENQUEUE_BATCH,
        &PURGE_CUTOFF,
        &PURGE,
        &SCHEDULES,
        &RUN_SCHEDULE,
        &METRICS,
        &OUTBOXES,
        &OUTBOX_METRICS,
        &TABLE_NAME,
        &OUTBOX_MESSAGES,
        &OUTBOX_REQUEUE,
        &OUTBOX_REQUEUE_DEAD,
        &OUTBOX_DISCARD,
        &TRANSACTION_TIMEOUT,
        &JOB_PAGE,
        &JOB_COUNT,
        &JOB_DETAIL,
        &JOB_RESULT,
        &DEAD_LETTER_GROUPS,
        &REQUEUE_DEAD_WITH_ERROR,
        &QUEUE_ACTIVITY,
        &BLOCKED_GROUPS,
        &PAUSED_SINCE,
        &LEDGERS,
        &ACT_ON_MATCHING,
    ];

    /// The type name of each `$n`'s first cast (`_jsonb` for `jsonb[]`), `$1` first; `None` for a
    /// parameter never cast. The statements hold no quoted `$`.
    fn casts(text: &str) -> Vec<Option<String>> {
        let mut casts: Vec<Option<String>> = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find('$') {
            rest = &rest[at + 1..];
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            let index: usize = rest[..digits].parse().expect("a parameter number");
            rest = &rest[digits..];
            if casts.len() < index {
                casts.resize(index, None);
            }
            let Some(cast) = rest.strip_prefix("::") else {
                continue;
            };
            let len = cast
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(cast.len());
            let name = if cast[len..].starts_with("[]") {
                format!("_{}", &cast[..len])
            } else {
                cast[..len].to_owned()
            };
            casts[index - 1].get_or_insert(name);
        }
        casts
    }

    #[test]
    fn each_statement_declares_the_types_of_its_parameters_casts() {
        for sql in ALL {
            let declared: Vec<Option<String>> = sql
                .params
                .iter()
                .map(|t| Some(t.name().to_owned()))
                .collect();
            assert_eq!(casts(sql.text), declared, "{}", sql.text);
        }
        assert_eq!(
            casts("SELECT f($2::int8[], $1::text::regclass, $1::int4)"),
            [Some("text".to_owned()), Some("_int8".to_owned())]
        );
        assert_eq!(casts("SELECT f($1)"), [None]);
    }
}
