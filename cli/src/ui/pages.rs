//! The dashboard's pages and actions. Each page reads through the extension's functions
//! ([`crate::sql`]); each action calls one and sends the browser back where it came from
//! (303), so that a reload never repeats it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::{html, Markup, DOCTYPE};
use serde::Deserialize;

use super::{App, Count};
use crate::error::CliError;
use crate::sql;

/// Jobs per page.
const PAGE: i32 = 50;
/// Dead-letter groups shown.
const GROUPS: i32 = 50;

/// A page, or the error that replaced it.
type Page = Result<Html<String>, PageError>;

/// A failed page or action, shown with the status that fits it.
pub struct PageError(StatusCode, String);

impl From<CliError> for PageError {
    fn from(error: CliError) -> Self {
        let status = match &error {
            // No such table, not a queue, or no such schedule.
            CliError::Database { sqlstate, .. }
                if sqlstate == "42P01" || sqlstate == "42703" || sqlstate == "42704" =>
            {
                StatusCode::NOT_FOUND
            }
            // The statement timed out.
            CliError::Database { sqlstate, .. } if sqlstate == "57014" => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            CliError::Database { sqlstate, .. } if sqlstate.starts_with("42") => {
                StatusCode::FORBIDDEN
            }
            CliError::Database { .. } | CliError::Usage(_) => StatusCode::BAD_REQUEST,
            CliError::NotFound(_) => StatusCode::NOT_FOUND,
            CliError::Connect(_) | CliError::Io(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        let message = match error {
            CliError::Database { sqlstate, message } => format!("{message} (SQLSTATE {sqlstate})"),
            CliError::Usage(m) | CliError::Connect(m) | CliError::NotFound(m) | CliError::Io(m) => {
                m
            }
        };
        PageError(status, message)
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = html! {
            (DOCTYPE)
            html lang="en" {
                head { meta charset="utf-8"; title { "inbox: error" } }
                body { h1 { (self.0.as_u16()) " " (self.0.canonical_reason().unwrap_or("")) } p.error { (self.1) } }
            }
        };
        (self.0, Html(body.into_string())).into_response()
    }
}

/// An error as the pages show it.
pub fn describe(error: CliError) -> String {
    PageError::from(error).1
}

pub async fn not_found() -> PageError {
    PageError(StatusCode::NOT_FOUND, "no such page".to_owned())
}

/// The time of day in UTC, as counts are labelled with it.
pub fn clock() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    )
}

/// A path segment with every byte outside the unreserved set percent-encoded.
fn segment(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// Seconds as the largest two units: `3m 12s`, `2h 5m`, `4d 1h`.
fn age(seconds: Option<f64>) -> String {
    let Some(seconds) = seconds else {
        return "–".to_owned();
    };
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, s / 60 % 60),
        _ => format!("{}d {}h", s / 86_400, s / 3600 % 24),
    }
}

/// A time as `to_json` spells it (`2026-12-03T20:04:45.823888+00:00`), to the second
/// (`2026-12-03 20:04:45+00:00`); `infinity` (dead, or waiting for its turn) as a dash.
fn when(text: Option<String>) -> String {
    match text.as_deref() {
        None => String::new(),
        Some("infinity") => "–".to_owned(),
        Some(text) => {
            let (date_time, zone) = match text.rfind(['+', '-']) {
                Some(at) if at > 10 => text.split_at(at),
                _ => (text, ""),
            };
            let seconds = date_time.split('.').next().unwrap_or(date_time);
            format!("{}{zone}", seconds.replacen('T', " ", 1))
        }
    }
}

/// A size in bytes as the largest unit that keeps it at least 1: `176 KiB`, `1.4 GiB`.
fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n.max(0) as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value >= 10.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn number(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// The frame of every page: the navigation, and `main`, which the page's script refreshes
/// while the tab is visible.
fn layout(app: &App, title: &str, crumbs: Markup, body: Markup) -> Html<String> {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · inbox" }
                link rel="icon" href=(app.link("/assets/favicon.svg")) type="image/svg+xml";
                link rel="stylesheet" href=(app.link("/assets/app.css"));
                script src=(app.link("/assets/app.js")) defer {}
            }
            body {
                header {
                    nav {
                        a.brand href=(home(app)) { "inbox" }
                        (crumbs)
                    }
                    @if app.read_only { span.badge title="Actions are refused by the server" { "read-only" } }
                }
                main data-live="5" {
                    (body)
                    p.updated { "Updated " (clock()) }
                }
            }
        }
    };
    Html(page.into_string())
}

fn home(app: &App) -> String {
    if app.base.is_empty() {
        "/".to_owned()
    } else {
        app.base.clone()
    }
}

fn queue_link(app: &App, queue: &str) -> String {
    app.link(&format!("/queues/{}", segment(queue)))
}

/// A form that posts to `action` and comes back to `back`, with one button; hidden in read-only.
fn action_form(
    app: &App,
    action: &str,
    back: &str,
    label: &str,
    confirm: Option<&str>,
    fields: Markup,
) -> Markup {
    if app.read_only {
        return html! {};
    }
    html! {
        form.inline method="post" action=(action) data-confirm=[confirm] {
            input type="hidden" name="back" value=(back);
            (fields)
            button type="submit" { (label) }
        }
    }
}

// ---- the overview ----

pub async fn overview(State(app): State<Arc<App>>) -> Page {
    let readings = app.readings().await?;
    let outboxes = app.rows(&sql::OUTBOXES, &[]).await?;
    let ledgers = app.rows(&sql::LEDGERS, &[]).await?;
    let body = html! {
        h1 { "Queues" }
        @if readings.queues.is_empty() {
            p.empty { "No queues yet: " code { "SELECT inbox_create_queue('jobs')" } " makes one." }
        } @else {
            table #queues {
                thead { tr {
                    th { "queue" } th.n { "ready" } th.n { "delayed" } th.n { "running" } th.n { "dead" }
                    th.n { "oldest ready" } th.n { "oldest lease" } th { "state" }
                    th { "depth, last hour" } th { "settled per second" }
                } }
                tbody {
                    @for queue in &readings.queues {
                        @let name = &queue.name;
                        tr data-queue=(name) {
                            td { a href=(queue_link(&app, name)) { (name) } }
                            td.n data-count="ready" data-n=(queue.ready) { (number(queue.ready)) }
                            td.n data-count="delayed" data-n=(queue.delayed) { (number(queue.delayed)) }
                            td.n data-count="leased" data-n=(queue.leased) { (number(queue.leased)) }
                            td.n data-count="dead" data-n=(queue.dead) {
                                @if queue.dead > 0 {
                                    a href=(format!("{}/dead", queue_link(&app, name))) { (number(queue.dead)) }
                                } @else { "0" }
                            }
                            td.n { (age(queue.oldest_ready)) }
                            td.n { (age(queue.oldest_lease)) }
                            td { @if queue.paused == Some(true) { span.paused { "paused" } } @else { "running" } }
                            td { (sparkline(&queue.depth, &format!("{name}: jobs ready, delayed and running over the last hour"))) }
                            td.rate {
                                (sparkline(&queue.settled_per_second, &format!("{name}: jobs settled per second over the last hour")))
                                " " (queue.settled_per_second.last().map(|r| format!("{r:.1}")).unwrap_or_else(|| "–".to_owned()))
                            }
                        }
                    }
                }
            }
            p.at { "Read at " (readings.at) ", every 10 seconds; settled: acked or discarded, as PostgreSQL's statistics count deleted rows." }
        }
        @if !outboxes.is_empty() {
            h2 { "Outboxes" }
            table #outboxes {
                thead { tr {
                    th { "outbox" } th.n { "pending" } th.n { "sending" } th.n { "retrying" } th.n { "dead" }
                    th.n { "oldest unsent" } th.n { "sent" } th { "relay" }
                } }
                tbody {
                    @for row in &outboxes {
                        @let relay: Option<String> = row.get(9);
                        @let live: Option<bool> = row.get(11);
                        tr {
                            td { (row.get::<_, String>(0)) }
                            td.n { (number(row.get(1))) }
                            td.n { (number(row.get(2))) }
                            td.n { (number(row.get(3))) }
                            td.n { (number(row.get(4))) }
                            td.n { (age(row.get(5))) }
                            td.n { (number(row.get(6))) }
                            td {
                                @match relay {
                                    Some(relay) if live == Some(true) => { (relay) }
                                    Some(relay) => { span.warn { (relay) " (lease expired)" } }
                                    None => { span.warn { "none" } }
                                }
                            }
                        }
                    }
                }
            }
        }
        @if !ledgers.is_empty() {
            h2 { "Ledgers" }
            table #ledgers {
                thead { tr { th { "ledger" } th.n { "keys (estimated)" } th.n { "size" } } }
                tbody {
                    @for row in &ledgers {
                        @let name: String = row.get(0);
                        @let keys: Option<i64> = row.get(1);
                        tr data-ledger=(name) {
                            td { (name) }
                            td.n { @match keys { Some(keys) => { "about " (number(keys)) } None => { span.warn title="the table was never analyzed" { "not analyzed" } } } }
                            td.n { (bytes(row.get(2))) }
                        }
                    }
                }
            }
        }
    };
    Ok(layout(&app, "Queues", html! {}, body))
}

/// A chart of `values` (oldest first) as an inline SVG line, scaled to its largest value.
fn sparkline(values: &[f64], label: &str) -> Markup {
    const WIDTH: f64 = 120.0;
    const HEIGHT: f64 = 24.0;
    if values.len() < 2 {
        return html! { span.spark-empty title="two readings are needed" { "–" } };
    }
    let top = values.iter().copied().fold(0.0, f64::max).max(1.0);
    let step = WIDTH / (values.len() - 1) as f64;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            format!(
                "{:.1},{:.1}",
                i as f64 * step,
                HEIGHT - 2.0 - v / top * (HEIGHT - 4.0)
            )
        })
        .collect();
    html! {
        svg.spark width="120" height="24" viewBox="0 0 120 24" role="img" aria-label=(label) {
            title { (label) ", at most " (number(top.round() as i64)) }
            polyline points=(points.join(" ")) fill="none" stroke="currentColor" stroke-width="1.5" {}
        }
    }
}

// ---- one queue ----

/// The jobs page's filter, as the URL holds it.
#[derive(Debug, Default, Deserialize)]
pub struct Filter {
    state: Option<String>,
    priority: Option<String>,
    group: Option<String>,
    key: Option<String>,
    before: Option<String>,
}

/// An empty field is no filter.
fn given(value: &Option<String>) -> Option<String> {
    value
        .as_ref()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

fn parse<T: std::str::FromStr>(value: &Option<String>, what: &str) -> Result<Option<T>, PageError> {
    given(value)
        .map(|v| {
            v.parse().map_err(|_| {
                PageError(
                    StatusCode::BAD_REQUEST,
                    format!("{what} must be a whole number: {v:?}"),
                )
            })
        })
        .transpose()
}

const STATES: [&str; 5] = ["ready", "delayed", "leased", "dead", "cancelled"];

pub async fn queue(
    State(app): State<Arc<App>>,
    Path(queue): Path<String>,
    Query(filter): Query<Filter>,
) -> Page {
    let name: String = app.one(&sql::TABLE_NAME, &[&queue]).await?.get(0);
    let state = given(&filter.state);
    let priority: Option<i32> = parse(&filter.priority, "priority")?;
    let group = given(&filter.group);
    let key = given(&filter.key);
    let before: Option<i64> = parse(&filter.before, "before")?;
    // The counts by state as the reader last took them (counting a big queue by state costs a
    // scan of it: one per 10 seconds, not one per load); a queue it has not read yet is counted
    // now. Whether it is paused is read at each load, so that a pause shows at once.
    let readings = app.readings().await?;
    let counts = match readings.queues.iter().find(|q| q.name == name) {
        Some(q) => (
            q.ready,
            q.delayed,
            q.leased,
            q.dead,
            q.oldest_ready,
            readings.at.clone(),
        ),
        None => {
            let stats = app.one(&sql::STATS, &[&name]).await?;
            (
                stats.get(0),
                stats.get(1),
                stats.get(2),
                stats.get(3),
                stats.get(4),
                clock(),
            )
        }
    };
    let paused: bool = app.one(&sql::PAUSED_SINCE, &[&name]).await?.get(0);
    let jobs = app
        .rows(
            &sql::JOB_PAGE,
            &[&name, &state, &priority, &group, &key, &before, &PAGE],
        )
        .await?;
    // A count that fails (it timed out) does not fail the page.
    let count = app
        .count((
            name.clone(),
            state.clone(),
            priority,
            group.clone(),
            key.clone(),
        ))
        .await
        .map_err(PageError::from);
    let schedules = app
        .rows(&sql::SCHEDULES, &[&name])
        .await
        .unwrap_or_default();
    let here = queue_link(&app, &name);
    let mut params: Vec<(&str, String)> = Vec::new();
    for (field, value) in [("state", &state), ("group", &group), ("key", &key)] {
        if let Some(value) = value {
            params.push((field, value.clone()));
        }
    }
    if let Some(priority) = priority {
        params.push(("priority", priority.to_string()));
    }
    let query = |extra: Option<(&str, String)>| -> String {
        let all: Vec<String> = params
            .iter()
            .cloned()
            .chain(extra)
            .map(|(k, v)| format!("{k}={}", segment(&v)))
            .collect();
        if all.is_empty() {
            here.clone()
        } else {
            format!("{here}?{}", all.join("&"))
        }
    };
    let this_page = query(before.map(|b| ("before", b.to_string())));
    let older = jobs
        .last()
        .map(|row| query(Some(("before", row.get::<_, i64>(0).to_string()))));
    let crumbs = html! { " / " a href=(here) { (name) } };
    let body = html! {
        h1 { (name) @if paused { " " span.paused { "paused" } } }
        p.stats {
            "ready " b { (number(counts.0)) } " · delayed " b { (number(counts.1)) }
            " · running " b { (number(counts.2)) } " · dead "
            a href=(format!("{here}/dead")) { b { (number(counts.3)) } }
            " · oldest ready " (age(counts.4))
            " · " a href=(format!("{here}/groups")) { "ordered groups" }
            span.at { " (counted " (counts.5) ")" }
        }
        div.actions {
            @if paused {
                (action_form(&app, &format!("{here}/resume"), &this_page, "Resume", None, html! {}))
            } @else {
                (action_form(&app, &format!("{here}/pause"), &this_page, "Pause", None, html! {}))
            }
        }
        form.filter method="get" action=(here) {
            label { "state " select name="state" {
                option value="" selected[state.is_none()] { "any" }
                @for s in STATES { option value=(s) selected[state.as_deref() == Some(s)] { (s) } }
            } }
            label { "priority " input type="number" name="priority" value=[priority] size="6"; }
            label { "group " input type="text" name="group" value=[group.as_deref()]; }
            label { "key " input type="text" name="key" value=[key.as_deref()]; }
            button type="submit" { "Filter" }
            " " a href=(here) { "clear" }
        }
        p.count #count {
            @match &count {
                Ok(Count { jobs, exact: true, at, .. }) => {
                    span data-exact="true" data-jobs=(jobs) { (number(*jobs)) } " jobs match" span.at { " (counted " (at) ")" }
                }
                Ok(Count { jobs, exact: false, at, .. }) => {
                    span data-exact="false" data-jobs=(jobs) { "about " (number(*jobs)) } " jobs match"
                    span.at { " (estimated by the planner " (at) ")" }
                }
                Err(error) => { span.warn { "not counted: " (error.1) } }
            }
        }
        @if !app.read_only && !params.is_empty() {
            @if let Ok(count) = &count {
                @let at_most = count.jobs.min(BULK as i64);
                @let fields = html! {
                    @for (field, value) in &params { input type="hidden" name=(field) value=(value); }
                };
                div.actions.bulk {
                    @let what = if count.jobs > BULK as i64 { format!("the oldest {} of the", number(at_most)) } else { "the".to_owned() };
                    @if state.as_deref() == Some("dead") || state.as_deref() == Some("cancelled") {
                        (action_form(&app, &format!("{here}/matching"), &this_page, &format!("Requeue {} matching", number(at_most)),
                            Some(&format!("Requeue {what} {} jobs this filter matches?", number(count.jobs))),
                            html! { (fields) input type="hidden" name="action" value="requeue"; }))
                        (action_form(&app, &format!("{here}/matching"), &this_page, &format!("Discard {} matching", number(at_most)),
                            Some(&format!("Delete {what} {} jobs this filter matches for good?", number(count.jobs))),
                            html! { (fields) input type="hidden" name="action" value="discard"; }))
                    } @else {
                        (action_form(&app, &format!("{here}/matching"), &this_page, &format!("Cancel {} matching", number(at_most)),
                            Some(&format!("Cancel {what} {} jobs this filter matches (dead ones are left)?", number(count.jobs))),
                            html! { (fields) input type="hidden" name="action" value="cancel"; }))
                    }
                }
            }
        }
        table #jobs {
            thead { tr {
                th.n { "id" } th { "state" } th.n { "attempt" } th.n { "priority" } th { "group" } th { "key" }
                th { "due / lease until" } th { "last error" } th {}
            } }
            tbody {
                @for row in &jobs {
                    @let id: i64 = row.get(0);
                    @let job_state: String = row.get(1);
                    @let job_link = format!("{here}/jobs/{id}");
                    tr data-id=(id) data-state=(job_state) {
                        td.n { a href=(job_link) { (id) } }
                        td {
                            span class=(format!("state {job_state}")) { (job_state) }
                            // Leased once and due again: its holder let the lease run out.
                            @if job_state == "ready" && row.get::<_, Option<String>>(8).is_some() {
                                " " span.warn.expired title="its lease ran out before it was settled" { "lease expired" }
                            }
                        }
                        td.n { (row.get::<_, i32>(2)) }
                        td.n { (row.get::<_, i32>(3)) }
                        td { (row.get::<_, Option<String>>(4).unwrap_or_default()) }
                        td { (row.get::<_, Option<String>>(5).unwrap_or_default()) }
                        td { (when(row.get(6))) }
                        td.error { (row.get::<_, Option<String>>(10).map(|e| truncate(&e, 120)).unwrap_or_default()) }
                        td { (job_actions(&app, &here, id, &job_state, &this_page)) }
                    }
                }
            }
        }
        @if jobs.is_empty() { p.empty { "No job matches." } }
        @if let Some(older) = older {
            @if jobs.len() as i32 == PAGE { p { a rel="next" href=(older) { "Older jobs →" } } }
        }
        @if !schedules.is_empty() {
            h2 { "Schedules" }
            table #schedules {
                thead { tr { th { "name" } th { "cron" } th { "time zone" } th { "last tick" } th { "next tick" } th {} } }
                tbody { @for row in &schedules { tr {
                    @let schedule: String = row.get(0);
                    td { (schedule) } td { code { (row.get::<_, String>(1)) } }
                    td { (row.get::<_, String>(2)) } td { (when(row.get(5))) } td { (when(row.get(4))) }
                    td { (action_form(&app, &format!("{here}/schedules/run"), &this_page, "Run now",
                            Some(format!("Enqueue a job of schedule {schedule} now?").as_str()),
                            html! { input type="hidden" name="name" value=(schedule); })) }
                } } }
            }
        }
        @if !app.read_only {
            h2 { "Enqueue a job" }
            form.enqueue method="post" action=(format!("{here}/enqueue")) {
                input type="hidden" name="back" value=(this_page);
                label { "payload (JSON) " textarea name="payload" rows="3" cols="60" required { "{}" } }
                label { "priority " input type="number" name="priority" value="0" size="6"; }
                label { "key " input type="text" name="key"; }
                label { "group " input type="text" name="group"; }
                button type="submit" { "Enqueue" }
            }
        }
    };
    Ok(layout(&app, &name, crumbs, body))
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// The buttons for one job in `state`.
fn job_actions(app: &App, here: &str, id: i64, state: &str, back: &str) -> Markup {
    let post = |action: &str| format!("{here}/jobs/{id}/{action}");
    html! {
        @if state == "dead" || state == "cancelled" {
            (action_form(app, &post("requeue"), back, "Requeue", None, html! {}))
            (action_form(app, &post("discard"), back, "Discard", Some("Delete this dead job for good?"), html! {}))
        } @else {
            (action_form(app, &post("cancel"), back, "Cancel", Some("Cancel this job?"), html! {}))
        }
    }
}

// ---- one job ----

pub async fn job(State(app): State<Arc<App>>, Path((queue, id)): Path<(String, i64)>) -> Page {
    let name: String = app.one(&sql::TABLE_NAME, &[&queue]).await?.get(0);
    let here = queue_link(&app, &name);
    let detail = app.rows(&sql::JOB_DETAIL, &[&name, &id]).await?;
    let this_page = format!("{here}/jobs/{id}");
    let crumbs = html! { " / " a href=(here) { (name) } " / job " (id) };
    let body = match detail.first() {
        Some(row) => {
            let state: String = row.get(0);
            let job: String = row.get(1);
            let fields: serde_json::Value = serde_json::from_str(&job).unwrap_or_default();
            html! {
                h1 { "Job " (id) " " span class=(format!("state {state}")) #job-state { (state) } }
                div.actions { (job_actions(&app, &here, id, &state, &this_page)) }
                (job_summary(&state, &fields))
                (job_errors(&fields))
                h2 { "Row" }
                pre #job { (job) }
            }
        }
        None => {
            // Gone from the queue: acked, or discarded; a kept result says how it ended.
            let result = app.rows(&sql::JOB_RESULT, &[&name, &id]).await?;
            let result = result.first();
            html! {
                h1 { "Job " (id) }
                @match result {
                    Some(row) => {
                        @let state: String = row.get(0);
                        p { "No longer in the queue: " span class=(format!("state {state}")) #job-state { (state) }
                            @if let Some(at) = row.get::<_, Option<String>>(3) { ", at " (when(Some(at))) } }
                        @if let Some(result) = row.get::<_, Option<String>>(1) { h2 { "Result" } pre #result { (result) } }
                        @if let Some(error) = row.get::<_, Option<String>>(2) { h2 { "Last error" } pre.error { (error) } }
                    }
                    None => { p #job-state { "Not in the queue (acked or discarded)." } }
                }
            }
        }
    };
    Ok(layout(&app, &format!("{name} job {id}"), crumbs, body))
}

/// A job's columns as an operator reads them: when it is due or its lease expires, and the rest.
fn job_summary(state: &str, job: &serde_json::Value) -> Markup {
    let text = |column: &str| match job.get(column) {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(text)) => Some(text.clone()),
        Some(value) => Some(value.to_string()),
    };
    let locked_until = text("locked_until");
    let (due_label, due) = match state {
        "leased" => ("lease expires", locked_until),
        "dead" => ("died", text("dead_at").or(locked_until)),
        _ => ("due", text("run_at").or(locked_until)),
    };
    // A lease is held by the delivery whose token is its attempt: the one that may settle it.
    let holder = (state == "leased")
        .then(|| text("attempt").map(|attempt| format!("the delivery of token {attempt}")))
        .flatten();
    let rows = [
        ("attempt", text("attempt")),
        ("lease held by", holder),
        (due_label, due.map(|at| when(Some(at)))),
        ("leased at", text("leased_at").map(|at| when(Some(at)))),
        ("enqueued at", text("enqueued_at").map(|at| when(Some(at)))),
        ("priority", text("priority")),
        ("group", text("group_key")),
        ("key", text("key")),
        ("timeout", text("timeout")),
        ("snoozed", text("snoozes").filter(|n| n != "0")),
    ];
    let payload = job
        .get("payload")
        .filter(|payload| !payload.is_null())
        .map(|payload| serde_json::to_string_pretty(payload).unwrap_or_default())
        .or_else(|| text("payload_bytes"));
    html! {
        table.fields #job-fields {
            @for (label, value) in rows { @if let Some(value) = value {
                tr { th { (label) } td { (value) } }
            } }
        }
        @if let Some(payload) = payload { h2 { "Payload" } pre #payload { (payload) } }
        @if let Some(progress) = job.get("progress").filter(|p| !p.is_null()) {
            h2 { "Progress" } pre { (progress) }
        }
    }
}

/// Every failed attempt's error, newest first (the last twenty a queue keeps); a queue without
/// the `errors` column shows its last error.
fn job_errors(job: &serde_json::Value) -> Markup {
    let errors: Vec<&serde_json::Value> = job
        .get("errors")
        .and_then(|errors| errors.as_array())
        .map(|errors| errors.iter().rev().collect())
        .unwrap_or_default();
    let last_error = job.get("last_error").and_then(|error| error.as_str());
    html! {
        @if !errors.is_empty() {
            h2 { "Errors" }
            table #errors {
                thead { tr { th.n { "attempt" } th { "at" } th { "error" } } }
                tbody { @for error in errors { tr {
                    td.n { (error.get("attempt").map(|a| a.to_string()).unwrap_or_default()) }
                    td { (when(error.get("at").and_then(|at| at.as_str()).map(str::to_owned))) }
                    td { pre.error { (error.get("error").and_then(|e| e.as_str()).unwrap_or("(no error)")) } }
                } } }
            }
        } @else if let Some(error) = last_error {
            h2 { "Last error" } pre.error #errors { (error) }
        }
    }
}

// ---- dead letters ----

pub async fn dead_letters(State(app): State<Arc<App>>, Path(queue): Path<String>) -> Page {
    let name: String = app.one(&sql::TABLE_NAME, &[&queue]).await?.get(0);
    let here = queue_link(&app, &name);
    let groups = app
        .rows(&sql::DEAD_LETTER_GROUPS, &[&name, &GROUPS])
        .await?;
    let this_page = format!("{here}/dead");
    let crumbs = html! { " / " a href=(here) { (name) } " / dead letters" };
    let total: i64 = groups.iter().map(|row| row.get::<_, i64>(1)).sum();
    let body = html! {
        h1 { "Dead letters of " (name) }
        @if groups.is_empty() {
            p.empty { "No dead jobs." }
        } @else {
            p { (number(total)) " dead jobs in the " (groups.len()) " largest groups by last error." }
            table #dead-groups {
                thead { tr { th { "last error" } th.n { "jobs" } th { "first died" } th { "last died" } th {} } }
                tbody {
                    @for row in &groups {
                        @let error: Option<String> = row.get(0);
                        @let jobs: i64 = row.get(1);
                        @let newest: i64 = row.get(4);
                        @let confirm = format!("Requeue the {} dead jobs that died of this error?", number(jobs));
                        tr {
                            td.error {
                                a href=(format!("{here}/jobs/{newest}")) title="the newest job of this group" {
                                    (error.as_deref().map(|e| truncate(e, 200)).unwrap_or_else(|| "(no error)".to_owned()))
                                }
                            }
                            td.n { (number(jobs)) }
                            td { (when(row.get(2))) }
                            td { (when(row.get(3))) }
                            td {
                                (action_form(&app, &format!("{here}/dead/requeue"), &this_page,
                                    &format!("Requeue these {}", number(jobs)),
                                    Some(confirm.as_str()),
                                    html! { @if let Some(error) = &error { input type="hidden" name="error" value=(error); }
                                            @else { input type="hidden" name="no_error" value="1"; } }))
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(layout(&app, &format!("{name} dead letters"), crumbs, body))
}

// ---- ordered groups ----

/// Groups shown.
const BLOCKED: i32 = 50;

pub async fn groups(State(app): State<Arc<App>>, Path(queue): Path<String>) -> Page {
    let name: String = app.one(&sql::TABLE_NAME, &[&queue]).await?.get(0);
    let here = queue_link(&app, &name);
    let crumbs = html! { " / " a href=(here) { (name) } " / ordered groups" };
    let groups = match app.rows(&sql::BLOCKED_GROUPS, &[&name, &BLOCKED]).await {
        Ok(groups) => Some(groups),
        // A queue without group_key or dead_at has no ordered groups.
        Err(CliError::Database { sqlstate, .. }) if sqlstate == "42703" => None,
        Err(error) => return Err(error.into()),
    };
    let body = html! {
        h1 { "Ordered groups of " (name) }
        @match &groups {
            None => { p.empty { "This queue has no ordered groups (its table has no group_key or dead_at)." } }
            Some(groups) if groups.is_empty() => { p.empty { "No group has jobs waiting for their turn." } }
            Some(groups) => {
                p { "The groups with jobs waiting behind their head, the longest first: a group runs one job at a time, so each waits on its head." }
                table #groups {
                    thead { tr {
                        th { "group" } th.n { "waiting" } th.n { "head" } th { "head's state" } th.n { "attempt" }
                        th { "due / lease until" } th { "last error" }
                    } }
                    tbody {
                        @for row in groups {
                            @let head: Option<i64> = row.get(2);
                            @let state: Option<String> = row.get(3);
                            tr data-group=(row.get::<_, String>(0)) {
                                td { (row.get::<_, String>(0)) }
                                td.n { (number(row.get(1))) }
                                td.n { @match head { Some(id) => { a href=(format!("{here}/jobs/{id}")) { (id) } } None => { "none" } } }
                                td { @if let Some(state) = &state { span class=(format!("state {state}")) { (state) } } }
                                td.n { (row.get::<_, Option<i32>>(4).map(|a| a.to_string()).unwrap_or_default()) }
                                td { (when(row.get(5))) }
                                td.error { (row.get::<_, Option<String>>(6).map(|e| truncate(&e, 200)).unwrap_or_default()) }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(layout(
        &app,
        &format!("{name} ordered groups"),
        crumbs,
        body,
    ))
}

// ---- actions ----

/// Where an action sends the browser back to: a page of this dashboard, else the overview.
#[derive(Debug, Deserialize)]
pub struct Back {
    back: Option<String>,
}

fn back_to(app: &App, back: Option<String>) -> Response {
    let home = home(app);
    let target = back
        .filter(|b| {
            b.starts_with('/')
                && !b.starts_with("//")
                && (b == &home || b.starts_with(&format!("{}/", app.base)))
        })
        .unwrap_or(home);
    Redirect::to(&target).into_response()
}

/// Pauses (`action` "pause") or resumes the queue.
pub async fn pause_or_resume(
    State(app): State<Arc<App>>,
    Path((queue, action)): Path<(String, String)>,
    Form(back): Form<Back>,
) -> Result<Response, PageError> {
    let statement = match action.as_str() {
        "pause" => &sql::PAUSE,
        "resume" => &sql::RESUME,
        _ => {
            return Err(PageError(
                StatusCode::NOT_FOUND,
                format!("no action {action:?}"),
            ))
        }
    };
    app.one(statement, &[&queue]).await?;
    Ok(back_to(&app, back.back))
}

#[derive(Debug, Deserialize)]
pub struct Enqueue {
    back: Option<String>,
    payload: String,
    priority: Option<String>,
    key: Option<String>,
    group: Option<String>,
}

pub async fn enqueue(
    State(app): State<Arc<App>>,
    Path(queue): Path<String>,
    Form(form): Form<Enqueue>,
) -> Result<Response, PageError> {
    let payload: serde_json::Value = serde_json::from_str(&form.payload).map_err(|e| {
        PageError(
            StatusCode::BAD_REQUEST,
            format!("the payload is not JSON: {e}"),
        )
    })?;
    let priority: Option<i32> = parse(&form.priority, "priority")?;
    let no_time: Option<String> = None;
    app.one(
        &sql::ENQUEUE_PLACED,
        &[
            &queue,
            &payload,
            &no_time,
            &given(&form.key),
            &priority,
            &given(&form.group),
        ],
    )
    .await?;
    Ok(back_to(&app, form.back))
}

#[derive(Debug, Deserialize)]
pub struct RunSchedule {
    name: String,
}

/// Enqueues a schedule's job now, outside its timetable, and shows that job.
pub async fn run_schedule(
    State(app): State<Arc<App>>,
    Path(queue): Path<String>,
    Form(form): Form<RunSchedule>,
) -> Result<Response, PageError> {
    let id: i64 = app
        .one(&sql::RUN_SCHEDULE, &[&queue, &form.name])
        .await?
        .get(0);
    Ok(Redirect::to(&format!("{}/jobs/{id}", queue_link(&app, &queue))).into_response())
}

#[derive(Debug, Deserialize)]
pub struct RequeueDead {
    back: Option<String>,
    error: Option<String>,
    no_error: Option<String>,
}

pub async fn requeue_dead(
    State(app): State<Arc<App>>,
    Path(queue): Path<String>,
    Form(form): Form<RequeueDead>,
) -> Result<Response, PageError> {
    if form.error.is_none() && form.no_error.is_none() {
        return Err(PageError(
            StatusCode::BAD_REQUEST,
            "say which error's dead jobs to requeue".to_owned(),
        ));
    }
    app.one(&sql::REQUEUE_DEAD_WITH_ERROR, &[&queue, &form.error])
        .await?;
    Ok(back_to(&app, form.back))
}

/// Jobs a bulk action takes at most per click (the rest stay for the next).
const BULK: i32 = 1000;

#[derive(Debug, Deserialize)]
pub struct Matching {
    back: Option<String>,
    action: String,
    state: Option<String>,
    priority: Option<String>,
    group: Option<String>,
    key: Option<String>,
}

pub async fn act_on_matching(
    State(app): State<Arc<App>>,
    Path(queue): Path<String>,
    Form(form): Form<Matching>,
) -> Result<Response, PageError> {
    let priority: Option<i32> = parse(&form.priority, "priority")?;
    app.one(
        &sql::ACT_ON_MATCHING,
        &[
            &queue,
            &form.action,
            &given(&form.state),
            &priority,
            &given(&form.group),
            &given(&form.key),
            &BULK,
        ],
    )
    .await?;
    Ok(back_to(&app, form.back))
}

pub async fn job_action(
    State(app): State<Arc<App>>,
    Path((queue, id, action)): Path<(String, i64, String)>,
    Form(back): Form<Back>,
) -> Result<Response, PageError> {
    let statement = match action.as_str() {
        "requeue" => &sql::REQUEUE,
        "discard" => &sql::DISCARD,
        "cancel" => &sql::CANCEL,
        _ => {
            return Err(PageError(
                StatusCode::NOT_FOUND,
                format!("no action {action:?}"),
            ))
        }
    };
    let applied: bool = app.one(statement, &[&queue, &id]).await?.get(0);
    if !applied {
        return Err(PageError(
            StatusCode::CONFLICT,
            format!("job {id} was not in a state to {action} (it may have moved on meanwhile)"),
        ));
    }
    Ok(back_to(&app, back.back))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_numbers_and_ages_read_at_a_glance() {
        assert_eq!(
            when(Some("2026-12-03T20:04:45.823888+00:00".to_owned())),
            "2026-12-03 20:04:45+00:00"
        );
        assert_eq!(
            when(Some("2026-12-03T20:04:45-05:30".to_owned())),
            "2026-12-03 20:04:45-05:30"
        );
        assert_eq!(when(Some("infinity".to_owned())), "–");
        assert_eq!(when(None), "");
        assert_eq!(number(1_000_000), "1,000,000");
        assert_eq!(number(-1234), "-1,234");
        assert_eq!(number(12), "12");
        assert_eq!(bytes(180_224), "176 KiB");
        assert_eq!(bytes(1_503_238_554), "1.4 GiB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(age(Some(192.0)), "3m 12s");
        assert_eq!(age(Some(90_000.0)), "1d 1h");
        assert_eq!(age(None), "–");
        assert_eq!(segment("app.\"Odd Name\""), "app.%22Odd%20Name%22");
        assert_eq!(truncate("abcdef", 3), "abc…");
    }
}
