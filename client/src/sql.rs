//! Every SQL string the client sends. The work is done by the extension's functions (see
//! `docs/sql-api.md`); these only call them. Table names travel as text parameters cast to
//! `regclass`, never formatted into the SQL.

/// `inbox_claim(ledger, key, seen_at)`: `true` the first time the key is recorded.
pub(crate) const LEDGER_CLAIM: &str =
    "SELECT inbox_claim($1::text::regclass, $2::text, $3::timestamptz) AS claimed";

/// `inbox_claim_or_fail(ledger, key, seen_at)`: claims the key or raises `23505`.
pub(crate) const LEDGER_CLAIM_OR_FAIL: &str =
    "SELECT inbox_claim_or_fail($1::text::regclass, $2::text, $3::timestamptz)";

/// `inbox_seen(ledger, key)`: whether the key is recorded.
pub(crate) const LEDGER_SEEN: &str = "SELECT inbox_seen($1::text::regclass, $2::text) AS seen";

/// `inbox_purge(ledger, older_than)`: deletes older keys and returns how many.
pub(crate) const LEDGER_PURGE: &str =
    "SELECT inbox_purge($1::text::regclass, $2::timestamptz) AS purged";

/// The head of the migration that creates a ledger; the quoted table name and `)` follow.
pub(crate) const LEDGER_CREATE_PREFIX: &str = "SELECT inbox_create_ledger(";

/// Opens the savepoint inside which [`PgTransaction`](crate::PgTransaction) runs a batch.
pub(crate) const BATCH_SAVEPOINT: &str = "SAVEPOINT inbox_client_batch";

/// Keeps the batch's work in the enclosing transaction.
pub(crate) const BATCH_RELEASE: &str = "RELEASE SAVEPOINT inbox_client_batch";

/// Undoes the batch's work and leaves the enclosing transaction usable.
pub(crate) const BATCH_ROLLBACK: &str =
    "ROLLBACK TO SAVEPOINT inbox_client_batch; RELEASE SAVEPOINT inbox_client_batch";

/// The savepoint inside which a worker runs each delivery of a locked job, so that a failure is
/// undone without giving up the transaction's row locks.
pub(crate) const DELIVERY_SAVEPOINT: &str = "SAVEPOINT inbox_delivery";

/// Undoes a locked delivery to its savepoint (which stays, as the next delivery's parent).
pub(crate) const DELIVERY_ROLLBACK: &str = "ROLLBACK TO SAVEPOINT inbox_delivery";

/// `inbox_lease(queue, max, lease)`: takes and leases due jobs (committed on its own).
pub(crate) const QUEUE_LEASE: &str =
    "SELECT id, attempt, token, payload, payload_bytes, extract(epoch FROM timeout)::float8 \
       FROM inbox_lease($1::text::regclass, $2::int4, $3::text::interval)";

/// `inbox_lock(queue, max)`: takes due jobs under the caller's transaction's row locks.
pub(crate) const QUEUE_LOCK: &str =
    "SELECT id, attempt, token, payload, payload_bytes, extract(epoch FROM timeout)::float8 \
       FROM inbox_lock($1::text::regclass, $2::int4)";

/// `inbox_ack(queue, ids, tokens)`: finishes many jobs; returns how many were still theirs.
pub(crate) const QUEUE_ACK_MANY: &str =
    "SELECT inbox_ack_batch($1::text::regclass, $2::int8[], $3::int8[])";

/// `inbox_ack_all(queue, ids, tokens)`: finishes every job of a group, or raises `55000` (and so
/// aborts the group's transaction) if any is no longer its token's.
pub(crate) const QUEUE_ACK_ALL: &str =
    "SELECT inbox_ack_all($1::text::regclass, $2::int8[], $3::int8[])";

/// `inbox_fence(queue, ids, tokens)`: locks the jobs of a replayed group that are still its own.
pub(crate) const QUEUE_FENCE: &str =
    "SELECT inbox_fence($1::text::regclass, $2::int8[], $3::int8[])";

/// `inbox_retry(queue, id, token, delay, error, max_attempts)`.
pub(crate) const QUEUE_RETRY: &str = "SELECT inbox_retry($1::text::regclass, $2::int8, $3::int8, \
     make_interval(secs => $4::float8), $5::text, $6::int4)";

/// `inbox_snooze(queue, id, token, delay)`.
pub(crate) const QUEUE_SNOOZE: &str =
    "SELECT inbox_snooze($1::text::regclass, $2::int8, $3::int8, \
     make_interval(secs => $4::float8))";

/// `inbox_dead(queue, id, token, reason)`.
pub(crate) const QUEUE_DEAD: &str =
    "SELECT inbox_dead($1::text::regclass, $2::int8, $3::int8, $4::text)";

/// `inbox_extend(queue, id, token, lease)`: the heartbeat, waiting at most 200 ms for a row lock
/// (a replaying group's fence). The lock timeout is set for the statement's own transaction
/// only (`set_config(..., true)`, evaluated before the call), so no session state is left.
pub(crate) const HEARTBEAT_EXTEND: &str = "SELECT inbox_extend($1::text::regclass, $2::int8, \
     $3::int8, $4::text::interval) FROM set_config('lock_timeout', '200', true)";

/// `inbox_stats(queue)`, the counts only.
pub(crate) const QUEUE_STATS: &str =
    "SELECT ready, delayed, leased, dead, paused FROM inbox_stats($1::text::regclass)";

/// `inbox_channel(queue)`: the channel to LISTEN on.
pub(crate) const QUEUE_CHANNEL: &str = "SELECT inbox_channel($1::text::regclass)";

/// `inbox_enqueue(queue, payload, run_at, key, priority, group_key, timeout)`.
pub(crate) const QUEUE_ENQUEUE: &str = "SELECT inbox_enqueue($1::text::regclass, $2::jsonb, \
     coalesce($3::timestamptz, now()), $4::text, $5::int4, $6::text, $7::float8 * interval '1 second')";

/// `inbox_create_queue(name)`.
pub(crate) const QUEUE_CREATE: &str = "SELECT inbox_create_queue($1::text)::text";

/// The messages that open a delivery's transaction, each with its timeouts set for that
/// transaction only (`SET LOCAL`, in the same message as `BEGIN`: no extra round trip, and no
/// session state, which a pooler in transaction mode would hand to its next client).
pub(crate) struct DeliveryBegins {
    /// `BEGIN` and the timeouts.
    pub begin: String,
    /// Commits a group and opens the next group's transaction, in one message.
    pub commit_begin: String,
    /// Undoes a group's transaction and opens the one in which it is replayed, in one message.
    pub rollback_begin: String,
}

/// Bounds each statement and each idle moment of a delivery's transaction, so a stuck handler
/// cannot hold row locks or the vacuum horizon; the timeouts are milliseconds, and `begin` opens
/// the transaction at the worker's isolation level (`SET` takes no snapshot).
pub(crate) fn delivery_begins(begin: &str, statement_ms: u128, idle_ms: u128) -> DeliveryBegins {
    let begin = format!(
        "{begin}; SET LOCAL statement_timeout = {statement_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
    );
    DeliveryBegins {
        commit_begin: format!("{COMMIT}; {begin}"),
        rollback_begin: format!("{ROLLBACK}; {begin}"),
        begin,
    }
}

/// `inbox_enqueue_batch(queue, payloads, run_at, keys, priority, group_keys, timeout)`, the
/// payloads, keys and group keys each given as one JSON array (or NULL).
pub(crate) const QUEUE_ENQUEUE_BATCH: &str =
    "SELECT id FROM inbox_enqueue_batch($1::text::regclass, \
     ARRAY(SELECT e FROM jsonb_array_elements($2::jsonb) WITH ORDINALITY AS a(e, n) ORDER BY n), \
     coalesce($3::timestamptz, now()), \
     (SELECT array_agg(e ORDER BY n) FROM jsonb_array_elements_text($4::jsonb) WITH ORDINALITY AS a(e, n)), \
     $5::int4, \
     (SELECT array_agg(e ORDER BY n) FROM jsonb_array_elements_text($6::jsonb) WITH ORDINALITY AS a(e, n)), \
     $7::float8 * interval '1 second') AS id";

/// `inbox_pause(queue)`: leases and locks hand out nothing once the caller commits.
pub(crate) const QUEUE_PAUSE: &str = "SELECT inbox_pause($1::text::regclass) AS changed";

/// `inbox_resume(queue)`: a paused queue runs again once the caller commits.
pub(crate) const QUEUE_RESUME: &str = "SELECT inbox_resume($1::text::regclass) AS changed";

/// `inbox_paused_since(queue)`: since when the queue is paused (NULL while it runs).
pub(crate) const QUEUE_PAUSED_SINCE: &str =
    "SELECT inbox_paused_since($1::text::regclass) AS paused_at";

/// `inbox_set_concurrency(queue, n)`: at most n jobs running at once (NULL: no limit).
pub(crate) const QUEUE_SET_CONCURRENCY: &str =
    "SELECT inbox_set_concurrency($1::text::regclass, $2::int4)";

/// `inbox_set_unique(queue, until)`: until when a job's key stays unique.
pub(crate) const QUEUE_SET_UNIQUE: &str = "SELECT inbox_set_unique($1::text::regclass, $2::text)";

/// `inbox_unique_until(queue)`.
pub(crate) const QUEUE_UNIQUE_UNTIL: &str = "SELECT inbox_unique_until($1::text::regclass)";

/// `inbox_set_rate_limit(queue, n, per)`: at most n starts in any window of `per` seconds.
pub(crate) const QUEUE_SET_RATE_LIMIT: &str = "SELECT inbox_set_rate_limit($1::text::regclass, \
     $2::int4, make_interval(secs => $3::float8))";

/// `inbox_set_concurrency(queue, n, per_key)`: at most n jobs of one key (the payload's field
/// `per_key`) running at once (NULL: no limit).
pub(crate) const QUEUE_SET_KEY_CONCURRENCY: &str =
    "SELECT inbox_set_concurrency($1::text::regclass, $2::int4, per_key => $3::text)";

/// `inbox_limits(queue)`: the limits and their use, the rate's window in seconds.
pub(crate) const QUEUE_LIMITS: &str = "SELECT concurrency, running, rate_limit, \
     extract(epoch FROM rate_period)::float8 AS rate_period, recent_starts, \
     key_concurrency, per_key, keys_running, most_running_per_key \
     FROM inbox_limits($1::text::regclass)";

/// `inbox_cancel(queue, id)`: a waiting or running job becomes dead, its delivery fenced.
pub(crate) const QUEUE_CANCEL: &str =
    "SELECT inbox_cancel($1::text::regclass, $2::int8) AS cancelled";

/// `inbox_requeue(queue, id)`: a dead job runs again.
pub(crate) const QUEUE_REQUEUE: &str =
    "SELECT inbox_requeue($1::text::regclass, $2::int8) AS requeued";

/// `inbox_requeue_dead(queue, max)`: dead jobs (all, or the `max` oldest) run again.
pub(crate) const QUEUE_REQUEUE_DEAD: &str =
    "SELECT inbox_requeue_dead($1::text::regclass, $2::int4) AS requeued";

/// `inbox_discard(queue, id)`: deletes a dead job.
pub(crate) const QUEUE_DISCARD: &str =
    "SELECT inbox_discard($1::text::regclass, $2::int8) AS discarded";

/// `inbox_dead_jobs(queue, max)`: the oldest dead jobs.
pub(crate) const QUEUE_DEAD_JOBS: &str =
    "SELECT id, attempt, last_error, dead_at, payload, payload_bytes \
       FROM inbox_dead_jobs($1::text::regclass, $2::int4)";

/// The statements with which a worker ends a delivery's transaction itself, so that they can
/// share round trips with its other statements (see [`delivery_begins`] for its beginnings).
pub(crate) const COMMIT: &str = "COMMIT";
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// `inbox_schedule(queue, name, cron, payload, time_zone)`: creates or replaces a schedule.
pub(crate) const SCHEDULE: &str = "SELECT inbox_schedule($1::text::regclass, $2::text, $3::text, \
     $4::jsonb, $5::text)";

/// `inbox_unschedule(queue, name)`: removes a schedule; `true` when it existed.
pub(crate) const UNSCHEDULE: &str =
    "SELECT inbox_unschedule($1::text::regclass, $2::text) AS removed";

/// `inbox_schedules(queue)`, a parked schedule's `'infinity'` read as NULL.
pub(crate) const SCHEDULES: &str = "SELECT name, cron, time_zone, payload, \
     CASE WHEN isfinite(next_tick) THEN next_tick END AS next_tick \
     FROM inbox_schedules($1::text::regclass)";

/// `inbox_sleep(queue)`: registers the LISTEN session as asleep on the queue, so enqueues notify
/// it; `false` (nothing registered) when a job is due already.
pub(crate) const QUEUE_SLEEP: &str = "SELECT inbox_sleep($1::text::regclass)";

/// `inbox_stop_sleeping(queue)`: enqueues stop notifying the LISTEN session.
pub(crate) const QUEUE_STOP_SLEEPING: &str = "SELECT inbox_stop_sleeping($1::text::regclass)";

/// Bounds how long the LISTEN session waits, before it sleeps, for enqueues in flight to end.
pub(crate) const SLEEP_LOCK_TIMEOUT: &str = "SET lock_timeout = '1s'";

/// `inbox_vacuum_due(table)`: the queue's or outbox's quoted name when its worker or relay
/// should vacuum it now.
pub(crate) const VACUUM_DUE: &str = "SELECT inbox_vacuum_due($1::text::regclass)";

/// Vacuums a queue or outbox without ever blocking it: one being vacuumed already (by autovacuum
/// or another worker) is skipped, and the table is not truncated (that would lock it). `table` is
/// the quoted name `inbox_vacuum_due` returned.
pub(crate) fn vacuum(table: &str) -> String {
    format!("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE OFF) {table}")
}

/// The parents of a dependant, sent as a JSON array of `[queue, id]` pairs ($n), as `inbox_job[]`.
macro_rules! parents {
    ($n:literal) => {
        concat!(
            "ARRAY(SELECT inbox_job((p->>0)::regclass, (p->>1)::int8) \
               FROM jsonb_array_elements(coalesce($",
            $n,
            "::jsonb, '[]')) WITH ORDINALITY AS a(p, n) ORDER BY n)"
        )
    };
}

/// `inbox_enqueue_after(queue, payload, depends_on, run_at, key, priority, timeout)`.
pub(crate) const QUEUE_ENQUEUE_AFTER: &str = concat!(
    "SELECT inbox_enqueue_after($1::text::regclass, $2::jsonb, ",
    parents!("3"),
    ", coalesce($4::timestamptz, now()), $5::text, $6::int4, \
     $7::float8 * interval '1 second') AS id"
);

/// `inbox_keep_results(queue, keep)`: how long succeeded jobs are kept (NULL: not at all).
pub(crate) const QUEUE_KEEP_RESULTS: &str =
    "SELECT inbox_keep_results($1::text::regclass, $2::float8 * interval '1 second')";

/// `inbox_result(queue, id)`: where a job stands; no row when it is gone.
pub(crate) const QUEUE_RESULT: &str =
    "SELECT state, attempt, result, last_error, finished_at, progress \
       FROM inbox_result($1::text::regclass, $2::int8)";

/// `inbox_result_channel(queue)`: where the queue announces settled jobs to waiters.
pub(crate) const QUEUE_RESULT_CHANNEL: &str =
    "SELECT inbox_result_channel($1::text::regclass) AS channel";

/// `inbox_set_result(queue, id, token, result)`: a delivery's result, ahead of its ack.
pub(crate) const QUEUE_SET_RESULT: &str =
    "SELECT inbox_set_result($1::text::regclass, $2::int8, $3::int8, $4::jsonb)";

/// `inbox_ack_with_result(queue, id, token, result)`: acks a job and keeps its result.
pub(crate) const QUEUE_ACK_WITH_RESULT: &str =
    "SELECT inbox_ack_with_result($1::text::regclass, $2::int8, $3::int8, $4::jsonb)";

/// `inbox_purge_results(max)`: deletes expired results and day-old finished batches.
pub(crate) const PURGE_RESULTS: &str = "SELECT inbox_purge_results($1::int4)";

/// `inbox_batch_open(on_complete_queue, on_complete, on_failure_queue, on_failure)`.
pub(crate) const BATCH_OPEN: &str = "SELECT inbox_batch_open($1::text::regclass, $2::jsonb, \
     $3::text::regclass, $4::jsonb) AS batch";

/// `inbox_batch_add(batch, queue, payload, depends_on, run_at, key, priority, timeout)`.
pub(crate) const BATCH_ADD: &str = concat!(
    "SELECT inbox_batch_add($1::int8, $2::text::regclass, $3::jsonb, ",
    parents!("4"),
    ", coalesce($5::timestamptz, now()), $6::text, $7::int4, \
     $8::float8 * interval '1 second') AS id"
);

/// `inbox_batch_seal(batch)`.
pub(crate) const BATCH_SEAL: &str = "SELECT inbox_batch_seal($1::int8) AS sealed";

/// `inbox_batch(batch)`: its counts.
pub(crate) const BATCH_STATUS: &str =
    "SELECT members, succeeded, died, created_at, sealed_at, finished_at FROM inbox_batch($1::int8)";

/// `inbox_batch_members(batch)`.
pub(crate) const BATCH_MEMBERS: &str =
    "SELECT queue::text AS queue, id, outcome, result FROM inbox_batch_members($1::int8)";

/// `inbox_set_progress(queue, id, token, progress)`: the heartbeat's note of a handler's progress.
pub(crate) const QUEUE_SET_PROGRESS: &str =
    "SELECT inbox_set_progress($1::text::regclass, $2::int8, $3::int8, $4::jsonb)";
