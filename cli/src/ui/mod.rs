//! `inbox ui`: a web dashboard of the database's queues and outboxes, served by this binary with
//! its assets embedded (no JavaScript build step).
//!
//! Every page and action calls the extension's functions through [`crate::sql`], as the other
//! subcommands do. What keeps it safe to run next to production:
//! - it listens on 127.0.0.1 unless told otherwise, and a non-loopback address needs `--token`
//!   (HTTP basic auth with the token as password, or `Authorization: Bearer`);
//! - `--read-only` is enforced here, not only in the pages: every POST is refused with 403;
//! - a POST from another site is refused (`Sec-Fetch-Site`, else `Origin` against the host the
//!   request was sent to, a proxy's `X-Forwarded-Host` included), so no CSRF token is needed;
//! - every response carries a Content-Security-Policy that allows only this server's own script
//!   and style;
//! - counts are exact up to a bound and the planner's estimate beyond it, cached for a few
//!   seconds across tabs, and bounded by a statement timeout: a page loads however big the queue;
//! - the overview's counts are read every 10 seconds by one task, whatever the number of open
//!   tabs, and kept for an hour: the charts of depth and throughput.

mod pages;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use deadpool_postgres::Pool;

use crate::db::{self, Secret};
use crate::error::CliError;

/// How `inbox ui` was asked to serve.
pub struct UiOptions {
    pub listen: String,
    /// The path prefix a reverse proxy serves the dashboard under (`/inbox`), or empty.
    pub base_path: String,
    pub read_only: bool,
    /// The password of HTTP basic auth (any user name) or the bearer token, when set.
    pub token: Option<String>,
}

/// The server's state, shared by every request.
pub struct App {
    pool: Pool,
    secret: Secret,
    base: String,
    read_only: bool,
    token: Option<String>,
    counts: Mutex<HashMap<CountKey, Count>>,
    /// The latest readings of every queue, which the overview shows.
    readings: RwLock<Option<Arc<Readings>>>,
    /// Each queue's readings of the last hour.
    history: Mutex<HashMap<String, VecDeque<Point>>>,
}

/// One reading of a queue: when, its depth, and the rows it had settled (None when unread).
type Point = (Instant, i64, Option<i64>);

/// One reading of every queue, with each queue's last hour.
pub struct Readings {
    pub at: String,
    pub queues: Vec<QueueReading>,
}

/// A queue's row of `inbox_queues()`, its depth (ready, delayed and running) at each reading of
/// the last hour, and the jobs it settled per second between them.
pub struct QueueReading {
    pub name: String,
    pub ready: i64,
    pub delayed: i64,
    pub leased: i64,
    pub dead: i64,
    pub oldest_ready: Option<f64>,
    pub oldest_lease: Option<f64>,
    pub paused: Option<bool>,
    pub depth: Vec<f64>,
    pub settled_per_second: Vec<f64>,
}

/// How often the overview's readings are taken, and how many are kept (an hour's).
const READ_EVERY: Duration = Duration::from_secs(10);
const READINGS_KEPT: usize = 360;

/// A count's filter: queue, state, priority, group, key.
type CountKey = (
    String,
    Option<String>,
    Option<i32>,
    Option<String>,
    Option<String>,
);

/// A count as `inbox_job_count` gave it, and when.
#[derive(Clone)]
pub struct Count {
    pub jobs: i64,
    pub exact: bool,
    pub taken: Instant,
    pub at: String,
}

/// How long a count is shown before it is taken again (all tabs share it).
const COUNT_TTL: Duration = Duration::from_secs(10);
/// Counts are exact up to this many jobs, then estimated.
const EXACT_UP_TO: i64 = 10_000;
/// No page waits longer than this for one statement.
const STATEMENT_TIMEOUT: &str = "5s";

impl App {
    /// The latest readings, taken now if there are none yet.
    pub async fn readings(&self) -> Result<Arc<Readings>, CliError> {
        if let Some(readings) = self.readings.read().unwrap().clone() {
            return Ok(readings);
        }
        self.read_queues().await
    }

    /// Reads every queue once, adds the reading to each queue's hour, and keeps it as the latest.
    async fn read_queues(&self) -> Result<Arc<Readings>, CliError> {
        let rows = self.rows(&crate::sql::QUEUES, &[]).await?;
        let now = Instant::now();
        let mut queues = Vec::with_capacity(rows.len());
        for row in rows {
            let name: String = row.get(0);
            // A queue dropped meanwhile has no activity: its chart misses one point.
            let settled = self
                .one(&crate::sql::QUEUE_ACTIVITY, &[&name])
                .await
                .ok()
                .map(|activity| activity.get::<_, i64>(1));
            let (ready, delayed, leased): (i64, i64, i64) = (row.get(1), row.get(2), row.get(3));
            let mut history = self.history.lock().unwrap();
            let points = history.entry(name.clone()).or_default();
            points.push_back((now, ready + delayed + leased, settled));
            while points.len() > READINGS_KEPT {
                points.pop_front();
            }
            let depth = points.iter().map(|&(_, depth, _)| depth as f64).collect();
            let settled_per_second = points
                .iter()
                .zip(points.iter().skip(1))
                .map(
                    |(&(then, _, before), &(at, _, after))| match (before, after) {
                        // A reset of the statistics counts from zero again.
                        (Some(before), Some(after)) if after >= before => {
                            (after - before) as f64
                                / at.duration_since(then).as_secs_f64().max(1e-3)
                        }
                        _ => 0.0,
                    },
                )
                .collect();
            drop(history);
            queues.push(QueueReading {
                name,
                ready,
                delayed,
                leased,
                dead: row.get(4),
                oldest_ready: row.get(5),
                oldest_lease: row.get(6),
                paused: row.get(7),
                depth,
                settled_per_second,
            });
        }
        let names: std::collections::HashSet<&str> =
            queues.iter().map(|q| q.name.as_str()).collect();
        self.history
            .lock()
            .unwrap()
            .retain(|name, _| names.contains(name.as_str()));
        let readings = Arc::new(Readings {
            at: pages::clock(),
            queues,
        });
        *self.readings.write().unwrap() = Some(Arc::clone(&readings));
        Ok(readings)
    }

    /// A link to `path` (which starts with `/`) under the base path.
    pub fn link(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A pooled session whose statements time out (as [`STATEMENT_TIMEOUT`]).
    async fn session(&self) -> Result<deadpool_postgres::Object, CliError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => self.secret.error(e),
            other => CliError::Connect(format!("database connection: {other}")),
        })
    }

    pub async fn rows(
        &self,
        sql: &crate::sql::Sql,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, CliError> {
        let session = self.session().await?;
        session
            .query_typed(sql.text, &db::typed(sql, params))
            .await
            .map_err(|e| self.secret.error(e))
    }

    pub async fn one(
        &self,
        sql: &crate::sql::Sql,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<tokio_postgres::Row, CliError> {
        let session = self.session().await?;
        session
            .query_typed_one(sql.text, &db::typed(sql, params))
            .await
            .map_err(|e| self.secret.error(e))
    }

    /// The count of jobs under a filter, from the cache while it is fresh.
    pub async fn count(&self, key: CountKey) -> Result<Count, CliError> {
        if let Some(count) = self.counts.lock().unwrap().get(&key) {
            if count.taken.elapsed() < COUNT_TTL {
                return Ok(count.clone());
            }
        }
        let (queue, state, priority, group, job_key) = &key;
        let row = self
            .one(
                &crate::sql::JOB_COUNT,
                &[queue, state, priority, group, job_key, &EXACT_UP_TO],
            )
            .await?;
        let count = Count {
            jobs: row.get(0),
            exact: row.get(1),
            taken: Instant::now(),
            at: pages::clock(),
        };
        let mut counts = self.counts.lock().unwrap();
        counts.retain(|_, c| c.taken.elapsed() < COUNT_TTL);
        counts.insert(key, count.clone());
        Ok(count)
    }
}

/// Serves the dashboard until interrupted (Ctrl-C or SIGTERM). The database is read once before
/// listening, so a wrong URL or a database without the extension fails at once.
pub async fn serve(url: &str, options: UiOptions) -> Result<(), CliError> {
    let base = normalize_base(&options.base_path)?;
    let address: SocketAddr = tokio::net::lookup_host(&options.listen)
        .await
        .map_err(|e| CliError::Usage(format!("cannot resolve {}: {e}", options.listen)))?
        .next()
        .ok_or_else(|| CliError::Usage(format!("{} resolves to nothing", options.listen)))?;
    if !address.ip().is_loopback() && options.token.is_none() {
        return Err(CliError::Usage(format!(
            "{address} is reachable from other machines: give --token (or INBOX_UI_TOKEN), \
             or listen on 127.0.0.1"
        )));
    }
    let (mut config, secret) = db::config(url)?;
    // Each session's statements time out, so that no page waits on a slow count or a lock.
    let session_options = match config.get_options() {
        Some(given) => format!("{given} -c statement_timeout={STATEMENT_TIMEOUT}"),
        None => format!("-c statement_timeout={STATEMENT_TIMEOUT}"),
    };
    config.options(session_options);
    let pool = db::pool(config, 4)?;
    let app = Arc::new(App {
        pool,
        secret,
        base: base.clone(),
        read_only: options.read_only,
        token: options.token,
        counts: Mutex::new(HashMap::new()),
        readings: RwLock::new(None),
        history: Mutex::new(HashMap::new()),
    });
    app.read_queues().await.map_err(|e| match e {
        CliError::Database { sqlstate, message }
            if sqlstate.starts_with("28") || sqlstate == "3D000" =>
        {
            CliError::Connect(format!("{message} (SQLSTATE {sqlstate})"))
        }
        other => other,
    })?;
    // One task reads the queues for every tab; a failed reading leaves the last one up, its
    // time shown.
    let reader = Arc::clone(&app);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(READ_EVERY);
        every.tick().await;
        loop {
            every.tick().await;
            if let Err(error) = reader.read_queues().await {
                eprintln!(
                    "inbox ui: reading the queues failed: {}",
                    pages::describe(error)
                );
            }
        }
    });
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| CliError::Io(format!("cannot listen on {address}: {e}")))?;
    let local = listener.local_addr()?;
    eprintln!(
        "inbox ui: serving http://{local}{}{}",
        if base.is_empty() { "/" } else { &base },
        if app.read_only { " (read-only)" } else { "" }
    );
    axum::serve(listener, router(app))
        .with_graceful_shutdown(crate::metrics::shutdown())
        .await
        .map_err(|e| CliError::Io(format!("the dashboard's server failed: {e}")))
}

/// `/inbox/` or `inbox` as `/inbox`; `/` or empty as empty.
fn normalize_base(base: &str) -> Result<String, CliError> {
    let trimmed = base.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    if !trimmed
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-._~/".contains(c))
    {
        return Err(CliError::Usage(format!(
            "--base-path {base:?}: use letters, digits and - . _ ~ / only"
        )));
    }
    Ok(format!("/{trimmed}"))
}

fn router(app: Arc<App>) -> Router {
    let pages = Router::new()
        .route("/", get(pages::overview))
        .route("/queues/{queue}", get(pages::queue))
        .route("/queues/{queue}/dead", get(pages::dead_letters))
        .route("/queues/{queue}/groups", get(pages::groups))
        .route("/queues/{queue}/jobs/{id}", get(pages::job))
        .route("/queues/{queue}/{action}", post(pages::pause_or_resume))
        .route("/queues/{queue}/enqueue", post(pages::enqueue))
        .route("/queues/{queue}/dead/requeue", post(pages::requeue_dead))
        .route("/queues/{queue}/schedules/run", post(pages::run_schedule))
        .route("/queues/{queue}/matching", post(pages::act_on_matching))
        .route(
            "/queues/{queue}/jobs/{id}/{action}",
            post(pages::job_action),
        )
        .route("/assets/app.js", get(script))
        .route("/assets/app.css", get(style))
        .route("/assets/favicon.svg", get(icon))
        .fallback(pages::not_found)
        .with_state(Arc::clone(&app));
    let routes: Router = if app.base.is_empty() {
        pages
    } else {
        let home = app.base.clone();
        Router::new()
            .route(
                &format!("{home}/"),
                get(move || {
                    let home = home.clone();
                    async move { axum::response::Redirect::permanent(&home) }
                }),
            )
            .nest(&app.base, pages)
            .fallback(pages::not_found)
    };
    // Outside the base path too: every response carries the same headers and guards.
    routes.layer(middleware::from_fn_with_state(Arc::clone(&app), guard))
}

/// Authentication, read-only mode and the same-origin rule for actions, then the headers every
/// response carries.
async fn guard(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        if !authorized(request.headers(), token) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Basic realm=\"inbox\"")],
                "authentication required\n",
            )
                .into_response();
        }
    }
    let safe = matches!(*request.method(), Method::GET | Method::HEAD);
    let mut response = if !safe && app.read_only {
        (StatusCode::FORBIDDEN, "the dashboard is read-only\n").into_response()
    } else if !safe && !same_origin(request.headers()) {
        (
            StatusCode::FORBIDDEN,
            "refused: the request came from another site\n",
        )
            .into_response()
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Whether the request carries the token: as basic auth's password (any user) or a bearer token.
fn authorized(headers: &HeaderMap, token: &str) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let given = if let Some(bearer) = value.strip_prefix("Bearer ") {
        bearer.to_owned()
    } else if let Some(basic) = value.strip_prefix("Basic ") {
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(basic.trim()) else {
            return false;
        };
        let text = String::from_utf8_lossy(&decoded).into_owned();
        match text.split_once(':') {
            Some((_, password)) => password.to_owned(),
            None => return false,
        }
    } else {
        return false;
    };
    constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// Compares without an early exit, so that the time taken tells nothing of the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a state-changing request comes from this dashboard's own pages. Browsers send
/// `Sec-Fetch-Site`; older ones an `Origin`, compared with the host the request was sent to
/// (or the one a proxy says it forwarded). A request with neither is not from a browser, so it
/// cannot be forged by another site; it still needs the token when one is set.
fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = text("sec-fetch-site") {
        return site == "same-origin";
    }
    let Some(origin) = text("origin") else {
        return true;
    };
    let Some(origin_host) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    [text("host"), text("x-forwarded-host")]
        .into_iter()
        .flatten()
        .any(|host| host.eq_ignore_ascii_case(origin_host))
}

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("assets/app.js"),
    )
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("assets/app.css"),
    )
}

async fn icon() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "image/svg+xml")],
        include_str!("assets/favicon.svg"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn an_action_from_another_site_is_refused() {
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "same-site")])));
        assert!(same_origin(&headers(&[
            ("origin", "http://127.0.0.1:8080"),
            ("host", "127.0.0.1:8080")
        ])));
        assert!(!same_origin(&headers(&[
            ("origin", "http://evil.example"),
            ("host", "127.0.0.1:8080")
        ])));
        // Behind a proxy that rewrites Host but says which host it forwarded.
        assert!(same_origin(&headers(&[
            ("origin", "https://ops.example.com"),
            ("host", "127.0.0.1:8080"),
            ("x-forwarded-host", "ops.example.com")
        ])));
        assert!(!same_origin(&headers(&[
            ("origin", "null"),
            ("host", "127.0.0.1:8080")
        ])));
        assert!(same_origin(&headers(&[("host", "127.0.0.1:8080")])));
    }

    #[test]
    fn the_token_is_taken_as_basic_auths_password_or_a_bearer_token() {
        assert!(authorized(
            &headers(&[("authorization", "Bearer s3cret")]),
            "s3cret"
        ));
        // "ops:s3cret"
        assert!(authorized(
            &headers(&[("authorization", "Basic b3BzOnMzY3JldA==")]),
            "s3cret"
        ));
        assert!(!authorized(
            &headers(&[("authorization", "Bearer s3cre")]),
            "s3cret"
        ));
        assert!(!authorized(&headers(&[]), "s3cret"));
    }

    #[test]
    fn a_base_path_is_normalized() {
        assert_eq!(normalize_base("").unwrap(), "");
        assert_eq!(normalize_base("/").unwrap(), "");
        assert_eq!(normalize_base("inbox/").unwrap(), "/inbox");
        assert_eq!(normalize_base("/ops/inbox").unwrap(), "/ops/inbox");
        assert!(normalize_base("/a b").is_err());
    }
}
