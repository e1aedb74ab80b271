//! `inbox metrics`: every queue's gauges (`inbox_metrics()`) and every outbox's
//! (`inbox_outboxes()`) at `/metrics`, in the text format Prometheus scrapes (OpenMetrics), read
//! from the database at each scrape.

use std::io::Write;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use deadpool_postgres::Pool;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::db::{self, Secret};
use crate::error::CliError;
use crate::sql;

/// How long one scrape's query may run before the server cancels it.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

const CONTENT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    queue: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutboxLabels {
    outbox: String,
}

struct Exporter {
    pool: Pool,
    secret: Secret,
}

/// One queue's row of `inbox_metrics()`.
struct QueueGauges {
    queue: String,
    counts: [(&'static str, i64); 4],
    oldest_ready_age: f64,
    oldest_lease_age: Option<f64>,
    /// None for an extension that predates pausing.
    paused: Option<bool>,
}

/// One outbox's row of `inbox_outboxes()`.
struct OutboxGauges {
    outbox: String,
    backlog: i64,
    dead: i64,
    oldest_unsent_age: f64,
    sent: i64,
    duplicates: i64,
    failures: i64,
    oldest_publisher_age: f64,
}

/// One limited queue's row of `inbox_limits()`.
struct LimitGauges {
    queue: String,
    concurrency: Option<i32>,
    running: Option<i64>,
    rate_limit: Option<i32>,
    rate_period: Option<f64>,
    recent_starts: Option<i64>,
    key_concurrency: Option<i32>,
    keys_running: Option<i64>,
    most_running_per_key: Option<i64>,
}

/// What one scrape read.
struct Reading {
    queues: Vec<QueueGauges>,
    limits: Vec<LimitGauges>,
    outboxes: Vec<OutboxGauges>,
}

impl Exporter {
    async fn read(&self) -> Result<Reading, CliError> {
        let mut client = self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => self.secret.error(e),
            other => CliError::Connect(self.secret.scrub(other.to_string())),
        })?;
        // The timeout is the transaction's own, and each statement is unnamed: nothing of the
        // scrape is left on a server connection, or lost by a pooler in transaction mode.
        let timeout = SCRAPE_TIMEOUT.as_millis().to_string();
        let scrape = async {
            let mut tx = client.transaction().await?;
            tx.query_typed(
                sql::TRANSACTION_TIMEOUT.text,
                &db::typed(&sql::TRANSACTION_TIMEOUT, &[&timeout]),
            )
            .await?;
            let rows = tx
                .query_typed(sql::METRICS.text, &db::typed(&sql::METRICS, &[]))
                .await?;
            // Each in a savepoint: a database whose extension predates the limits or the
            // outboxes has no inbox_limits() or inbox_outboxes(), and still has its queues'
            // gauges.
            let mut optional = Vec::new();
            for statement in [&sql::LIMIT_METRICS, &sql::OUTBOX_METRICS] {
                let savepoint = tx.transaction().await?;
                match savepoint
                    .query_typed(statement.text, &db::typed(statement, &[]))
                    .await
                {
                    Ok(rows) => {
                        savepoint.commit().await?;
                        optional.push(rows);
                    }
                    Err(error)
                        if error.code()
                            == Some(&tokio_postgres::error::SqlState::UNDEFINED_FUNCTION) =>
                    {
                        savepoint.rollback().await?;
                        optional.push(Vec::new());
                    }
                    Err(error) => return Err(error),
                }
            }
            tx.commit().await?;
            let outbox_rows = optional.pop().unwrap_or_default();
            let limit_rows = optional.pop().unwrap_or_default();
            Ok((rows, limit_rows, outbox_rows))
        };
        let (rows, limit_rows, outbox_rows) = scrape.await.map_err(|e| self.secret.error(e))?;
        let limits = limit_rows
            .iter()
            .map(|row| LimitGauges {
                queue: row.get(0),
                concurrency: row.get(1),
                running: row.get(2),
                rate_limit: row.get(3),
                rate_period: row.get(4),
                recent_starts: row.get(5),
                key_concurrency: row.get(6),
                keys_running: row.get(7),
                most_running_per_key: row.get(8),
            })
            .collect();
        let outboxes = outbox_rows
            .iter()
            .map(|row| OutboxGauges {
                outbox: row.get(0),
                backlog: row.get(1),
                dead: row.get(2),
                oldest_unsent_age: row.get(3),
                sent: row.get(4),
                duplicates: row.get(5),
                failures: row.get(6),
                oldest_publisher_age: row.get(7),
            })
            .collect();
        let queues = rows
            .iter()
            .map(|row| QueueGauges {
                queue: row.get(0),
                counts: [
                    ("ready", row.get(1)),
                    ("delayed", row.get(2)),
                    ("leased", row.get(3)),
                    ("dead", row.get(4)),
                ],
                oldest_ready_age: row.get(5),
                oldest_lease_age: row.get(6),
                paused: row.get(7),
            })
            .collect();
        Ok(Reading {
            queues,
            limits,
            outboxes,
        })
    }

    /// The body of one scrape: the queues' gauges, and `inbox_up` 0 when they cannot be read.
    async fn scrape(&self) -> String {
        let started = Instant::now();
        let result = self.read().await;
        let mut registry = Registry::default();
        let up = Gauge::<i64>::default();
        registry.register(
            "inbox_up",
            "Whether the last scrape read the queues and outboxes from the database (1) or failed (0)",
            up.clone(),
        );
        match result {
            Ok(reading) => {
                up.set(1);
                register_queues(&mut registry, &reading.queues);
                register_limits(&mut registry, &reading.limits);
                register_outboxes(&mut registry, &reading.outboxes);
            }
            Err(error) => {
                // A log line; a closed standard error must not fail the scrape.
                let _ = writeln!(
                    std::io::stderr(),
                    "inbox metrics: scrape failed: {}",
                    describe(&error)
                );
            }
        }
        let duration = Gauge::<f64, AtomicU64>::default();
        duration.set(started.elapsed().as_secs_f64());
        registry.register(
            "inbox_scrape_duration_seconds",
            "How long reading the queues and outboxes from the database took",
            duration,
        );
        let mut body = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut body, &registry);
        body
    }
}

fn register_queues(registry: &mut Registry, queues: &[QueueGauges]) {
    let jobs = Family::<StateLabels, Gauge>::default();
    let ready_age = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
    let lease_age = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
    let paused = Family::<QueueLabels, Gauge>::default();
    for queue in queues {
        for (state, count) in queue.counts {
            jobs.get_or_create(&StateLabels {
                queue: queue.queue.clone(),
                state: state.to_owned(),
            })
            .set(count);
        }
        let labels = QueueLabels {
            queue: queue.queue.clone(),
        };
        ready_age.get_or_create(&labels).set(queue.oldest_ready_age);
        if let Some(age) = queue.oldest_lease_age {
            lease_age.get_or_create(&labels).set(age);
        }
        if let Some(is_paused) = queue.paused {
            paused.get_or_create(&labels).set(i64::from(is_paused));
        }
    }
    registry.register(
        "inbox_jobs",
        "Jobs per queue and state (ready, delayed, leased, dead)",
        jobs,
    );
    registry.register(
        "inbox_oldest_ready_age_seconds",
        "How long the oldest ready job has been due (0 when none is ready)",
        ready_age,
    );
    registry.register(
        "inbox_oldest_lease_age_seconds",
        "How long the oldest current lease has been held (0 when none; absent for tables without leased_at)",
        lease_age,
    );
    registry.register(
        "inbox_queue_paused",
        "Whether the queue is paused (1): its leases and locks hand out nothing until it is resumed",
        paused,
    );
}

/// The gauges of the queues' limits, present for the queues that have them.
fn register_limits(registry: &mut Registry, limits: &[LimitGauges]) {
    let int = |name: &str, help: &str, value: fn(&LimitGauges) -> Option<i64>| {
        let family = Family::<QueueLabels, Gauge>::default();
        for queue in limits {
            if let Some(value) = value(queue) {
                family
                    .get_or_create(&QueueLabels {
                        queue: queue.queue.clone(),
                    })
                    .set(value);
            }
        }
        (name.to_owned(), help.to_owned(), family)
    };
    let gauges = [
        int(
            "inbox_queue_concurrency_limit",
            "How many of the queue's jobs may run at once",
            |q| q.concurrency.map(i64::from),
        ),
        int(
            "inbox_queue_concurrency_running",
            "Leased jobs holding a slot of the queue's concurrency limit",
            |q| q.concurrency.and(q.running),
        ),
        int(
            "inbox_queue_rate_limit",
            "How many of the queue's jobs may start in a window of its rate limit",
            |q| q.rate_limit.map(i64::from),
        ),
        int(
            "inbox_queue_rate_limit_recent_starts",
            "Starts within the window of the rate limit that ends now",
            |q| q.rate_limit.and(q.recent_starts),
        ),
        int(
            "inbox_queue_key_concurrency_limit",
            "How many jobs of one key may run at once",
            |q| q.key_concurrency.map(i64::from),
        ),
        int(
            "inbox_queue_keys_running",
            "Keys with leased jobs holding their slots",
            |q| q.key_concurrency.and(q.keys_running),
        ),
        int(
            "inbox_queue_most_running_per_key",
            "The most leased jobs of one key holding its slots",
            |q| q.key_concurrency.and(q.most_running_per_key),
        ),
    ];
    for (name, help, family) in gauges {
        registry.register(name, help, family);
    }
    let window = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
    for queue in limits {
        if let (Some(_), Some(seconds)) = (queue.rate_limit, queue.rate_period) {
            window
                .get_or_create(&QueueLabels {
                    queue: queue.queue.clone(),
                })
                .set(seconds);
        }
    }
    registry.register(
        "inbox_queue_rate_limit_window_seconds",
        "The length of the window of the queue's rate limit",
        window,
    );
}

fn register_outboxes(registry: &mut Registry, outboxes: &[OutboxGauges]) {
    let backlog = Family::<OutboxLabels, Gauge>::default();
    let dead = Family::<OutboxLabels, Gauge>::default();
    let unsent_age = Family::<OutboxLabels, Gauge<f64, AtomicU64>>::default();
    let publisher_age = Family::<OutboxLabels, Gauge<f64, AtomicU64>>::default();
    // What the relays did, as the database counts it: counters (`_total`), which a rate()
    // reads across relay restarts and takeovers.
    let sent = Family::<OutboxLabels, Counter>::default();
    let duplicates = Family::<OutboxLabels, Counter>::default();
    let failures = Family::<OutboxLabels, Counter>::default();
    let total = |n: i64| u64::try_from(n).unwrap_or(0);
    for outbox in outboxes {
        let labels = OutboxLabels {
            outbox: outbox.outbox.clone(),
        };
        backlog.get_or_create(&labels).set(outbox.backlog);
        dead.get_or_create(&labels).set(outbox.dead);
        unsent_age
            .get_or_create(&labels)
            .set(outbox.oldest_unsent_age);
        publisher_age
            .get_or_create(&labels)
            .set(outbox.oldest_publisher_age);
        sent.get_or_create(&labels).inc_by(total(outbox.sent));
        duplicates
            .get_or_create(&labels)
            .inc_by(total(outbox.duplicates));
        failures
            .get_or_create(&labels)
            .inc_by(total(outbox.failures));
    }
    registry.register(
        "inbox_outbox_backlog",
        "Messages per outbox not sent yet: pending, sending or waiting for a retry",
        backlog,
    );
    registry.register(
        "inbox_outbox_dead",
        "Dead-lettered messages per outbox",
        dead,
    );
    registry.register(
        "inbox_outbox_oldest_unsent_age_seconds",
        "How long ago the oldest message not sent (nor dead) was published (0 when none)",
        unsent_age,
    );
    registry.register(
        "inbox_outbox_sent",
        "Messages the relays sent and deleted",
        sent,
    );
    registry.register(
        "inbox_outbox_duplicate_acks",
        "Of the messages sent, those the broker acknowledged as duplicates",
        duplicates,
    );
    registry.register(
        "inbox_outbox_failures",
        "Failed publishes (each retried, or dead-lettered after the last attempt)",
        failures,
    );
    registry.register(
        "inbox_outbox_oldest_publisher_age_seconds",
        "Age of the oldest open transaction holding one of the outbox's keys, which holds later publishers of that key back (0 when none)",
        publisher_age,
    );
}

fn describe(error: &CliError) -> String {
    match error {
        CliError::Database { sqlstate, message } => format!("{message} (SQLSTATE {sqlstate})"),
        CliError::Usage(m) | CliError::Connect(m) | CliError::NotFound(m) | CliError::Io(m) => {
            m.clone()
        }
    }
}

async fn metrics(State(exporter): State<Arc<Exporter>>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(CONTENT_TYPE, CONTENT)],
        exporter.scrape().await,
    )
}

async fn index() -> &'static str {
    "inbox metrics: see /metrics\n"
}

/// Serves `/metrics` on `listen` until interrupted (Ctrl-C or SIGTERM). The database is read
/// once before listening, so a wrong URL or a database without the extension fails at once.
pub async fn serve(url: &str, listen: &str) -> Result<(), CliError> {
    let (config, secret) = db::config(url)?;
    let pool = db::pool(config, 2)?;
    let exporter = Arc::new(Exporter { pool, secret });
    exporter.read().await.map_err(|e| match e {
        // A session that cannot be opened is a connection failure, as for the other commands.
        CliError::Database { sqlstate, message }
            if sqlstate.starts_with("28") || sqlstate == "3D000" =>
        {
            CliError::Connect(format!("{message} (SQLSTATE {sqlstate})"))
        }
        other => other,
    })?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| CliError::Io(format!("cannot listen on {listen}: {e}")))?;
    let address = listener.local_addr()?;
    eprintln!("inbox metrics: serving http://{address}/metrics");
    let app = Router::new()
        .route("/", get(index))
        .route("/metrics", get(metrics))
        .with_state(exporter);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| CliError::Io(format!("the metrics server failed: {e}")))
}

pub(crate) async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
