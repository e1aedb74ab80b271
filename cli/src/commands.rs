//! The subcommands that run statements and print their results (`metrics` is in its own module).

use std::io::{BufRead, IsTerminal};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use tokio_postgres::Row;

use crate::db::Db;
use crate::error::CliError;
use crate::output::{age, line, preview, table, Output};
use crate::sql::{self, Sql};

/// How many characters of a payload a table shows.
pub const PREVIEW: usize = 48;

/// Dead jobs (or messages) requeued per transaction by `requeue --all`.
const REQUEUE_BATCH: i32 = 1_000;

fn counts(row: &Row, first: usize) -> [i64; 4] {
    [
        row.get(first),
        row.get(first + 1),
        row.get(first + 2),
        row.get(first + 3),
    ]
}

pub async fn queues(db: &Db, out: &Output) -> Result<(), CliError> {
    let rows = db.rows(&sql::QUEUES, &[]).await?;
    type QueueRow = (String, [i64; 4], Option<f64>, Option<f64>, Option<bool>);
    let queues: Vec<QueueRow> = rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                counts(row, 1),
                row.get(5),
                row.get(6),
                row.get(7),
            )
        })
        .collect();
    let value = Value::Array(
        queues
            .iter()
            .map(
                |(queue, [ready, delayed, leased, dead], ready_age, lease_age, paused)| {
                    json!({
                        "queue": queue, "ready": ready, "delayed": delayed, "leased": leased,
                        "dead": dead, "oldest_ready_age_seconds": ready_age,
                        "oldest_lease_age_seconds": lease_age, "paused": paused,
                    })
                },
            )
            .collect(),
    );
    out.emit(value, || {
        table(
            &[
                "queue",
                "ready",
                "delayed",
                "leased",
                "dead",
                "oldest ready",
                "oldest lease",
                "paused",
            ],
            queues
                .iter()
                .map(|(queue, counts, ready_age, lease_age, paused)| {
                    let mut cells = vec![queue.clone()];
                    cells.extend(counts.iter().map(i64::to_string));
                    cells.push(age(*ready_age));
                    cells.push(age(*lease_age));
                    cells.push(paused_cell(*paused));
                    cells
                })
                .collect(),
            &[1, 2, 3, 4, 5, 6],
        )
    });
    Ok(())
}

/// The header of `stats`' columns, and one row of them, for the table and for `--watch` lines.
const STATS_HEADER: [&str; 6] = [
    "ready",
    "delayed",
    "leased",
    "dead",
    "oldest ready",
    "paused",
];

fn stats_line(cells: &[String; 6]) -> String {
    format!(
        "{:>12} {:>10} {:>10} {:>10} {:>12} {:>6}",
        cells[0], cells[1], cells[2], cells[3], cells[4], cells[5]
    )
}

/// "yes" for a paused queue; empty for a running one, or an extension older than pausing.
fn paused_cell(paused: Option<bool>) -> String {
    if paused == Some(true) { "yes" } else { "" }.to_owned()
}

/// One reading of `inbox_stats`: the JSON object and the table cells.
async fn read_stats(db: &Db, queue: &str) -> Result<(Value, [String; 6]), CliError> {
    let row = db.one(&sql::STATS, &[&queue]).await?;
    let [ready, delayed, leased, dead] = counts(&row, 0);
    let ready_age: Option<f64> = row.get(4);
    let paused: Option<bool> = row.get(5);
    let value = json!({
        "queue": queue, "ready": ready, "delayed": delayed, "leased": leased, "dead": dead,
        "oldest_ready_age_seconds": ready_age, "paused": paused,
    });
    let cells = [
        ready.to_string(),
        delayed.to_string(),
        leased.to_string(),
        dead.to_string(),
        age(ready_age),
        paused_cell(paused),
    ];
    Ok((value, cells))
}

/// `inbox pause` (`pause` true) and `inbox resume`: says whether it changed the queue.
pub async fn pause(db: &Db, out: &Output, queue: &str, pause: bool) -> Result<(), CliError> {
    let statement = if pause { &sql::PAUSE } else { &sql::RESUME };
    let changed: bool = db
        .one(statement, &[&queue])
        .await?
        .get::<_, Option<bool>>(0)
        .unwrap_or(false);
    let (verb, state) = if pause {
        ("paused", "was paused already")
    } else {
        ("resumed", "was not paused")
    };
    out.emit(json!({ "queue": queue, verb: changed }), || {
        if changed {
            format!("{verb} {queue}")
        } else {
            format!("{queue} {state}")
        }
    });
    Ok(())
}

/// A limit given on the command line: a number, or `none` for no limit.
#[derive(Clone, Copy, Debug)]
pub struct Limit(Option<i32>);

impl std::str::FromStr for Limit {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "none" {
            return Ok(Limit(None));
        }
        text.parse()
            .map(|n| Limit(Some(n)))
            .map_err(|_| format!("{text:?} is neither a number nor `none`"))
    }
}

/// The limits `inbox limits` sets before it shows them.
pub struct LimitChange {
    pub concurrency: Option<Limit>,
    /// The payload's field, and the limit per key.
    pub per_key: Option<(String, Limit)>,
    /// The count, and the window as an interval.
    pub rate: Option<(Limit, String)>,
}

/// Sets the limits `change` names (each in its own transaction, by the extension's functions),
/// then shows all of them and how much of them is in use.
pub async fn limits(
    db: &Db,
    out: &Output,
    queue: &str,
    change: LimitChange,
) -> Result<(), CliError> {
    if let Some(Limit(n)) = change.concurrency {
        db.one(&sql::SET_CONCURRENCY, &[&queue, &n, &None::<String>])
            .await?;
    }
    if let Some((field, Limit(n))) = &change.per_key {
        db.one(&sql::SET_CONCURRENCY, &[&queue, n, field]).await?;
    }
    if let Some((Limit(n), per)) = &change.rate {
        db.one(&sql::SET_RATE_LIMIT, &[&queue, n, per]).await?;
    }
    let row = db.one(&sql::LIMITS, &[&queue]).await?;
    let concurrency: Option<i32> = row.get(0);
    let running: Option<i64> = row.get(1);
    let rate: Option<i32> = row.get(2);
    let per: Option<String> = row.get(3);
    let recent: Option<i64> = row.get(4);
    let key_concurrency: Option<i32> = row.get(5);
    let per_key: Option<String> = row.get(6);
    let keys_running: Option<i64> = row.get(7);
    let most_per_key: Option<i64> = row.get(8);
    let value = json!({
        "queue": queue,
        "concurrency": concurrency,
        "running": running,
        "rate_limit": rate,
        "rate_period": per,
        "recent_starts": recent,
        "key_concurrency": key_concurrency,
        "per_key": per_key,
        "keys_running": keys_running,
        "most_running_per_key": most_per_key,
    });
    out.emit(value, || {
        let mut rows = Vec::new();
        if let Some(n) = concurrency {
            rows.push(vec![
                "concurrency".to_owned(),
                n.to_string(),
                format!("{} running", running.unwrap_or(0)),
            ]);
        }
        if let (Some(n), Some(field)) = (key_concurrency, &per_key) {
            rows.push(vec![
                format!("concurrency per {field}"),
                n.to_string(),
                format!(
                    "{} keys running, at most {} of one",
                    keys_running.unwrap_or(0),
                    most_per_key.unwrap_or(0)
                ),
            ]);
        }
        if let Some(n) = rate {
            rows.push(vec![
                "rate".to_owned(),
                format!("{n} per {}", per.as_deref().unwrap_or("?")),
                format!("{} started in the window", recent.unwrap_or(0)),
            ]);
        }
        if rows.is_empty() {
            format!("{queue} has no limits")
        } else {
            table(&["limit", "value", "in use"], rows, &[])
        }
    });
    Ok(())
}

/// Until when the queue's keys stay unique, set to `until` first when given.
pub async fn unique(
    db: &Db,
    out: &Output,
    queue: &str,
    until: Option<&str>,
) -> Result<(), CliError> {
    if let Some(until) = until {
        db.one(&sql::SET_UNIQUE, &[&queue, &until]).await?;
    }
    let until: String = db.one(&sql::UNIQUE_UNTIL, &[&queue]).await?.get(0);
    let value = json!({ "queue": queue, "until": until });
    out.emit(value, || {
        let held = match until.as_str() {
            "finished" => "until it is acked or dead-lettered",
            "started" => "until its first delivery starts",
            _ => "until it is acked",
        };
        format!("{queue}: a job holds its key {held} ({until})")
    });
    Ok(())
}

pub async fn stats(db: &Db, out: &Output, queue: &str, watch: Option<f64>) -> Result<(), CliError> {
    let Some(seconds) = watch else {
        let (value, cells) = read_stats(db, queue).await?;
        out.emit(value, || {
            table(&STATS_HEADER, vec![cells.to_vec()], &[0, 1, 2, 3, 4])
        });
        return Ok(());
    };
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(CliError::Usage(
            "--watch takes a positive number of seconds".into(),
        ));
    }
    let interval = Duration::from_secs_f64(seconds);
    // One line per refresh, like vmstat, so that it reads in a log too (JSON: one object a line).
    if !out.json() {
        line(&stats_line(&STATS_HEADER.map(str::to_owned)));
    }
    loop {
        let (value, cells) = read_stats(db, queue).await?;
        if out.json() {
            line(&value.to_string());
        } else {
            line(&stats_line(&cells));
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// A payload as JSON for scripts: the jsonb value, or the bytes in base64.
fn payload_value(json: Option<Value>, base64: Option<String>) -> Value {
    match (json, base64) {
        (Some(value), _) => json!({ "json": value }),
        (None, Some(bytes)) => json!({ "base64": bytes }),
        (None, None) => Value::Null,
    }
}

fn payload_text(json: &Option<Value>, base64: &Option<String>) -> String {
    match (json, base64) {
        (Some(value), _) => preview(&value.to_string(), PREVIEW),
        (None, Some(bytes)) => preview(&format!("base64:{bytes}"), PREVIEW),
        (None, None) => String::new(),
    }
}

pub async fn jobs(
    db: &Db,
    out: &Output,
    queue: &str,
    state: Option<&str>,
    limit: i32,
) -> Result<(), CliError> {
    let rows = db.rows(&sql::JOBS, &[&queue, &state, &limit]).await?;
    type JobRow = (
        i64,
        String,
        i32,
        Option<String>,
        Option<String>,
        Option<Value>,
        Option<String>,
        Option<Value>,
    );
    let jobs: Vec<JobRow> = rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
                row.get(6),
                row.get(7),
            )
        })
        .collect();
    let value = Value::Array(
        jobs.iter()
            .map(|(id, state, attempt, due, error, json, bytes, progress)| {
                json!({
                    "id": id, "state": state, "attempt": attempt, "due": due,
                    "last_error": error, "payload": payload_value(json.clone(), bytes.clone()),
                    "progress": progress,
                })
            })
            .collect(),
    );
    out.emit(value, || {
        table(
            &[
                "id",
                "state",
                "attempt",
                "due",
                "last error",
                "progress",
                "payload",
            ],
            jobs.iter()
                .map(|(id, state, attempt, due, error, json, bytes, progress)| {
                    vec![
                        id.to_string(),
                        state.clone(),
                        attempt.to_string(),
                        due.clone().unwrap_or_default(),
                        preview(error.as_deref().unwrap_or(""), PREVIEW),
                        progress
                            .as_ref()
                            .map(|p| preview(&p.to_string(), PREVIEW))
                            .unwrap_or_default(),
                        payload_text(json, bytes),
                    ]
                })
                .collect(),
            &[0, 2],
        )
    });
    Ok(())
}

pub async fn dead(db: &Db, out: &Output, queue: &str, limit: i32) -> Result<(), CliError> {
    let rows = db.rows(&sql::DEAD_JOBS, &[&queue, &limit]).await?;
    type DeadRow = (
        i64,
        i32,
        Option<String>,
        Option<String>,
        Option<Value>,
        Option<String>,
    );
    let jobs: Vec<DeadRow> = rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
            )
        })
        .collect();
    let value = Value::Array(
        jobs.iter()
            .map(|(id, attempt, error, dead_at, json, bytes)| {
                json!({
                    "id": id, "attempt": attempt, "last_error": error, "dead_at": dead_at,
                    "payload": payload_value(json.clone(), bytes.clone()),
                })
            })
            .collect(),
    );
    out.emit(value, || {
        table(
            &["id", "attempt", "dead at", "last error", "payload"],
            jobs.iter()
                .map(|(id, attempt, error, dead_at, json, bytes)| {
                    vec![
                        id.to_string(),
                        attempt.to_string(),
                        dead_at.clone().unwrap_or_default(),
                        preview(error.as_deref().unwrap_or(""), PREVIEW),
                        payload_text(json, bytes),
                    ]
                })
                .collect(),
            &[0, 1],
        )
    });
    Ok(())
}

/// Runs `statement` (table, id) → boolean for each id of a dead row; reports those it did not
/// apply to (exit 4). The table is a queue, or an outbox (`noun` names what its rows are: "job",
/// "message").
pub async fn each_dead(
    db: &Db,
    out: &Output,
    statement: &Sql,
    target: (&str, &str),
    ids: &[i64],
    verb: &str,
) -> Result<(), CliError> {
    each_job(
        db,
        out,
        statement,
        target,
        ids,
        (verb, ("not_dead", "not dead (or gone)", "were not dead in")),
    )
    .await
}

/// As [`each_dead`], with the words for the ids it did not act on: their JSON key, how the
/// human line names them, and how the error says where.
async fn each_job(
    db: &Db,
    out: &Output,
    statement: &Sql,
    (queue, noun): (&str, &str),
    ids: &[i64],
    (verb, (missing_key, missing_text, missing_error)): (&str, (&str, &str, &str)),
) -> Result<(), CliError> {
    let mut done = Vec::new();
    let mut missing = Vec::new();
    for &id in ids {
        let applied: bool = db
            .one(statement, &[&queue, &id])
            .await?
            .get::<_, Option<bool>>(0)
            .unwrap_or(false);
        if applied {
            done.push(id);
        } else {
            missing.push(id);
        }
    }
    let mut value = serde_json::Map::new();
    value.insert(verb.to_owned(), json!(done));
    value.insert(missing_key.to_owned(), json!(missing));
    out.emit(Value::Object(value), || {
        let mut text = format!("{verb} {} {noun}(s)", done.len());
        if !missing.is_empty() {
            text.push_str(&format!("; {missing_text}: {missing:?}"));
        }
        text
    });
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CliError::NotFound(format!(
            "{} of {} {noun}(s) {missing_error} {queue}",
            missing.len(),
            ids.len()
        )))
    }
}

/// `inbox cancel`: each job becomes dead, marked cancelled; those gone or dead already exit 4.
pub async fn cancel(db: &Db, out: &Output, queue: &str, ids: &[i64]) -> Result<(), CliError> {
    each_job(
        db,
        out,
        &sql::CANCEL,
        (queue, "job"),
        ids,
        (
            "cancelled",
            (
                "not_cancelled",
                "gone or dead already",
                "were gone or dead already in",
            ),
        ),
    )
    .await
}

pub async fn requeue(
    db: &Db,
    out: &Output,
    queue: &str,
    ids: &[i64],
    all: bool,
) -> Result<(), CliError> {
    if !all {
        return each_dead(db, out, &sql::REQUEUE, (queue, "job"), ids, "requeued").await;
    }
    let requeued = requeue_all(db, &sql::REQUEUE_DEAD, queue).await?;
    out.emit(json!({ "requeued": requeued }), || {
        format!("requeued {requeued} job(s)")
    });
    Ok(())
}

/// Runs `statement` (table, max) → how many were requeued until a batch comes back short, each
/// call its own transaction; returns how many in all.
pub async fn requeue_all(db: &Db, statement: &Sql, table: &str) -> Result<i64, CliError> {
    let mut requeued: i64 = 0;
    loop {
        let batch: i64 = db
            .one(statement, &[&table, &REQUEUE_BATCH])
            .await?
            .get::<_, Option<i64>>(0)
            .unwrap_or(0);
        requeued += batch;
        if batch < REQUEUE_BATCH as i64 {
            return Ok(requeued);
        }
    }
}

pub async fn discard(db: &Db, out: &Output, queue: &str, ids: &[i64]) -> Result<(), CliError> {
    each_dead(db, out, &sql::DISCARD, (queue, "job"), ids, "discarded").await
}

/// When and where enqueued jobs run: due time, priority, ordered group (each `None` for the
/// function's default).
#[derive(Clone, Copy)]
pub struct Placement<'a> {
    pub at: Option<&'a str>,
    pub priority: Option<i32>,
    pub group: Option<&'a str>,
}

impl Placement<'_> {
    /// Whether the call needs the arguments of priorities and groups.
    fn placed(&self) -> bool {
        self.priority.is_some() || self.group.is_some()
    }
}

/// What `inbox enqueue` was asked to do.
pub struct EnqueueRequest<'a> {
    pub queue: &'a str,
    pub payload: Option<&'a str>,
    pub key: Option<&'a str>,
    pub placement: Placement<'a>,
    pub batch: usize,
}

pub async fn enqueue(db: &Db, out: &Output, request: EnqueueRequest<'_>) -> Result<(), CliError> {
    let EnqueueRequest {
        queue,
        payload,
        key,
        placement,
        batch,
    } = request;
    match payload {
        Some(text) if text != "-" => {
            let payload: Value = serde_json::from_str(text)
                .map_err(|e| CliError::Usage(format!("the payload is not JSON: {e}")))?;
            let row = if placement.placed() {
                db.one(
                    &sql::ENQUEUE_PLACED,
                    &[
                        &queue,
                        &payload,
                        &placement.at,
                        &key,
                        &placement.priority,
                        &placement.group,
                    ],
                )
                .await?
            } else {
                db.one(&sql::ENQUEUE, &[&queue, &payload, &placement.at, &key])
                    .await?
            };
            let id: Option<i64> = row.get(0);
            out.emit(json!({ "id": id }), || match id {
                Some(id) => format!("enqueued job {id}"),
                None => "not enqueued: a job with this key is already queued".to_owned(),
            });
            Ok(())
        }
        _ => {
            if key.is_some() {
                return Err(CliError::Usage(
                    "--key applies to one job, not to jobs read from standard input".into(),
                ));
            }
            enqueue_lines(db, out, queue, placement, batch).await
        }
    }
}

/// Enqueues one job per non-empty line of standard input, `batch` per transaction. A line that
/// is not JSON stops the command before its batch is sent; the batches before it are committed
/// (the output says how many jobs), so a rerun can skip them.
async fn enqueue_lines(
    db: &Db,
    out: &Output,
    queue: &str,
    placement: Placement<'_>,
    batch: usize,
) -> Result<(), CliError> {
    let progress = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{spinner} {human_pos} jobs enqueued ({per_sec}) {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let (mut enqueued, mut lines_read) = (0i64, 0u64);
    let mut pending: Vec<Value> = Vec::with_capacity(batch);
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let failure = loop {
        let line = match lines.next() {
            None => break None,
            Some(Err(e)) => break Some(CliError::Io(format!("reading standard input: {e}"))),
            Some(Ok(line)) => line,
        };
        lines_read += 1;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(&line) {
            Ok(value) => pending.push(value),
            Err(e) => {
                break Some(CliError::Usage(format!(
                    "line {lines_read} is not JSON ({e}); {enqueued} job(s) from the lines before \
                     its batch were enqueued"
                )))
            }
        }
        if pending.len() == batch {
            enqueued += send_batch(db, queue, &pending, placement).await?;
            progress.set_position(enqueued as u64);
            pending.clear();
        }
    };
    if failure.is_none() && !pending.is_empty() {
        enqueued += send_batch(db, queue, &pending, placement).await?;
    }
    progress.finish_and_clear();
    if let Some(failure) = failure {
        return Err(failure);
    }
    out.emit(json!({ "enqueued": enqueued }), || {
        format!("enqueued {enqueued} job(s)")
    });
    Ok(())
}

async fn send_batch(
    db: &Db,
    queue: &str,
    payloads: &[Value],
    placement: Placement<'_>,
) -> Result<i64, CliError> {
    let row = if placement.placed() {
        let groups: Option<Vec<&str>> = placement.group.map(|group| vec![group; payloads.len()]);
        db.one(
            &sql::ENQUEUE_BATCH_PLACED,
            &[
                &queue,
                &payloads,
                &placement.at,
                &placement.priority,
                &groups,
            ],
        )
        .await?
    } else {
        db.one(&sql::ENQUEUE_BATCH, &[&queue, &payloads, &placement.at])
            .await?
    };
    Ok(row.get(0))
}

pub async fn purge(
    db: &Db,
    out: &Output,
    ledger: &str,
    older_than: &str,
    batch: i64,
) -> Result<(), CliError> {
    let cutoff = db.one(&sql::PURGE_CUTOFF, &[&older_than]).await?;
    if !cutoff.get::<_, bool>(1) {
        return Err(CliError::Usage(format!(
            "--older-than must be a positive duration, not {older_than:?}"
        )));
    }
    let cutoff: String = cutoff.get(0);
    let progress = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{spinner} {human_pos} keys purged ({per_sec}) {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let (mut purged, mut batches) = (0i64, 0u64);
    loop {
        // Each call is its own transaction (the session is in autocommit).
        let deleted: i64 = db
            .one(&sql::PURGE, &[&ledger, &cutoff, &batch])
            .await?
            .get(0);
        batches += 1;
        purged += deleted;
        progress.set_position(purged as u64);
        if deleted < batch {
            break;
        }
    }
    progress.finish_and_clear();
    out.emit(
        json!({ "purged": purged, "batches": batches, "older_than": cutoff }),
        || format!("purged {purged} key(s) seen before {cutoff}, in {batches} transaction(s)"),
    );
    Ok(())
}

pub async fn schedules(db: &Db, out: &Output, queue: &str) -> Result<(), CliError> {
    let rows = db.rows(&sql::SCHEDULES, &[&queue]).await?;
    type ScheduleRow = (
        String,
        String,
        String,
        Option<Value>,
        Option<String>,
        Option<String>,
    );
    let schedules: Vec<ScheduleRow> = rows
        .iter()
        .map(|row| {
            let (name, cron, zone) = (row.get(0), row.get(1), row.get(2));
            (name, cron, zone, row.get(3), row.get(4), row.get(5))
        })
        .collect();
    let value = Value::Array(
        schedules
            .iter()
            .map(|(name, cron, zone, payload, next, last)| {
                json!({
                    "name": name, "cron": cron, "time_zone": zone, "payload": payload,
                    "next_tick": next, "last_tick": last,
                })
            })
            .collect(),
    );
    out.emit(value, || {
        table(
            &[
                "name",
                "cron",
                "time zone",
                "last tick",
                "next tick",
                "payload",
            ],
            schedules
                .iter()
                .map(|(name, cron, zone, payload, next, last)| {
                    vec![
                        name.clone(),
                        cron.clone(),
                        zone.clone(),
                        last.clone().unwrap_or_default(),
                        next.clone().unwrap_or_default(),
                        payload
                            .as_ref()
                            .map(|p| preview(&p.to_string(), PREVIEW))
                            .unwrap_or_default(),
                    ]
                })
                .collect(),
            &[],
        )
    });
    Ok(())
}

/// Enqueues schedule `name`'s job now (`inbox_run_schedule`).
pub async fn run_schedule(db: &Db, out: &Output, queue: &str, name: &str) -> Result<(), CliError> {
    let id: i64 = db.one(&sql::RUN_SCHEDULE, &[&queue, &name]).await?.get(0);
    out.emit(
        json!({ "queue": queue, "schedule": name, "id": id }),
        || format!("enqueued job {id} of schedule {name} into {queue}"),
    );
    Ok(())
}
