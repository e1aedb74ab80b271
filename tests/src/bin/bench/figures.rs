//! One function per figure of the issue; each returns its rows.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker, WorkerHandle};
use inbox_client::{Database, PgDatabase, Statement, StatementMode};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;

use super::measure::{compare, percentile, reference, retrying, window, Row, Target};
use super::sessions::{run_clients, Session, Step};
use super::setup::*;

/// The payload of the benchmark's jobs: a number, and for figure 5 the enqueue's time.
#[derive(Deserialize)]
pub struct Payload {
    #[serde(default)]
    pub n: i64,
    #[serde(default)]
    t: Option<u64>,
}

/// Prints a row as soon as it is measured, and keeps it.
fn push(rows: &mut Vec<Row>, row: Row) {
    super::report::print_row(&row);
    rows.push(row);
}

/// Both sides of a client-loop figure at every connection count; `row` makes the row of a
/// connection count from the two rates.
async fn clients_figure(
    ctx: &Ctx,
    rows: &mut Vec<Row>,
    (inbox, raw): (Step, Step),
    row: impl Fn(usize, f64, f64) -> Row,
) -> Result<()> {
    for &n in &ctx.opts.connections {
        let (ours, theirs) = compare(
            ctx.opts.rounds,
            || run_clients(ctx, n, inbox),
            || run_clients(ctx, n, raw),
        )
        .await?;
        push(rows, row(n, ours, theirs));
    }
    Ok(())
}

/// A throughput row of `figure`.
fn rate_row<'a>(
    figure: u8,
    name: &'a str,
    unit: &'static str,
    target: Target,
) -> impl Fn(usize, f64, f64) -> Row + 'a {
    move |n, ours, theirs| {
        Row::new(
            figure,
            name,
            Some(n),
            (Some(ours), Some(theirs)),
            unit,
            target,
        )
    }
}

/// Figure 1: `inbox_claim` against `INSERT ... ON CONFLICT DO NOTHING`, new keys and 50% duplicates.
pub async fn claims(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (dup, name) in [
        (false, "1. claim, new keys"),
        (true, "1. claim, 50% duplicates"),
    ] {
        let steps = (
            Step::Claim {
                side: Side::Inbox,
                dup,
            },
            Step::Claim {
                side: Side::Raw,
                dup,
            },
        );
        clients_figure(
            ctx,
            &mut rows,
            steps,
            rate_row(1, name, "claims/s", Target::RatioAtLeast(0.95)),
        )
        .await?;
    }
    Ok(rows)
}

/// Figure 2: Enqueue against plain `INSERT`: one job per call (with NOTIFY, as by default, and without)
/// and batches of 100.
pub async fn enqueues(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (batch, notify, name) in [
        (1, true, "2. enqueue, 1 per call"),
        (1, false, "2. enqueue, 1 per call, notify off"),
        (100, true, "2. enqueue, batches of 100"),
    ] {
        let steps = (
            Step::Enqueue {
                side: Side::Inbox,
                batch,
                notify,
            },
            Step::Enqueue {
                side: Side::Raw,
                batch,
                notify,
            },
        );
        clients_figure(
            ctx,
            &mut rows,
            steps,
            rate_row(2, name, "jobs/s", Target::None),
        )
        .await?;
    }
    Ok(rows)
}

/// Figure 3: Jobs settled through the extension's functions against the same steps in raw SQL, and the
/// one-statement ceiling for reference.
pub async fn settles(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let target = Target::RatioAtLeast(0.95);
    for (inbox, raw, name) in [
        (
            Step::LeaseAck {
                side: Side::Inbox,
                batch: 1,
            },
            Step::LeaseAck {
                side: Side::Raw,
                batch: 1,
            },
            "3. lease, then ack",
        ),
        (
            Step::LockAck { side: Side::Inbox },
            Step::LockAck { side: Side::Raw },
            "3. lock + ack in one tx",
        ),
        (
            Step::LeaseAck {
                side: Side::Inbox,
                batch: 100,
            },
            Step::LeaseAck {
                side: Side::Raw,
                batch: 100,
            },
            "3. lease 100, then ack 100",
        ),
    ] {
        clients_figure(
            ctx,
            &mut rows,
            (inbox, raw),
            rate_row(3, name, "jobs/s", target),
        )
        .await?;
    }
    reference_rows(
        ctx,
        &mut rows,
        (3, "3. ref: single DELETE .. SKIP LOCKED"),
        Step::DeleteOne,
        "the ceiling for one job: lock and delete in one statement, raw SQL only",
    )
    .await?;
    Ok(rows)
}

/// A reference row of raw SQL only (no inbox side, no target) for each connection count.
async fn reference_rows(
    ctx: &Ctx,
    rows: &mut Vec<Row>,
    (figure, name): (u8, &str),
    step: Step,
    note: &str,
) -> Result<()> {
    for &n in &ctx.opts.connections {
        let ceiling = reference(ctx.opts.rounds, || run_clients(ctx, n, step)).await?;
        push(
            rows,
            Row::new(
                figure,
                name,
                Some(n),
                (None, Some(ceiling)),
                "jobs/s",
                Target::None,
            )
            .note(note),
        );
    }
    Ok(())
}

/// How figure 4 runs the project's worker.
#[derive(Clone, Copy, Debug)]
enum Form {
    Transactional {
        claim: Claim,
        group: usize,
    },
    /// The same with every statement sent unnamed (`StatementMode::Unnamed`, as behind a pooler
    /// in transaction mode), on the same direct connections: what a parse per statement costs.
    Unnamed {
        claim: Claim,
        group: usize,
    },
    /// `n` plain workers (one per connection of the raw side), 100 deliveries in flight each.
    Plain,
}

/// Runs the worker on the inbox queue (kept filled) with `connections` deliveries (or plain
/// workers) and returns the jobs it acks per second over the window.
async fn run_worker(ctx: &Ctx, connections: usize, form: Form) -> Result<f64> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[Q_INBOX, DONE_INBOX]).await?;
    let started = Arc::new(AtomicU64::new(0));
    let in_flight = match form {
        Form::Transactional { group, .. } | Form::Unnamed { group, .. } => group,
        Form::Plain => 100,
    };
    let depth = ctx.opts.depth(connections, in_flight);
    let refill = Refill::start(ctx, Q_INBOX, depth, started.clone()).await?;
    let handles = start_workers(ctx, connections, form, started)?;
    let rate = window(ctx, || handles.iter().map(|h| h.stats().acked).sum()).await?;
    futures_util::future::join_all(handles.into_iter().map(|h| h.shutdown(SHUTDOWN))).await;
    refill.stop().await?;
    Ok(rate)
}

/// How long a worker's shutdown may take once a window is measured. Deliveries finish within
/// milliseconds; a longer deadline would wait for the heartbeat's next tick (a third of the lease,
/// 10 s), which is when a worker stopped with deliveries in flight finds them all finished.
const SHUTDOWN: Duration = Duration::from_millis(300);

/// The handler of figures 4 and 7: inserts one row through the delivery's transaction.
fn insert_handler(started: Arc<AtomicU64>) -> impl inbox_client::worker::TxHandler<Payload> {
    transactional(move |job: Job<Payload>, tx: &dyn Database| {
        started.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            tx.execute(&Statement::new(INSERT_DONE).bind(job.payload.n))
                .await?;
            Ok(Outcome::ack())
        })
    })
}

/// The handler's insert (into `DONE_INBOX`).
const INSERT_DONE: &str = "INSERT INTO bench_done_inbox (n) VALUES ($1)";

fn start_workers(
    ctx: &Ctx,
    connections: usize,
    form: Form,
    started: Arc<AtomicU64>,
) -> Result<Vec<WorkerHandle>> {
    Ok(match form {
        Form::Transactional { claim, group } | Form::Unnamed { claim, group } => {
            let mut db = ctx.database(connections + 4)?;
            if let Form::Unnamed { .. } = form {
                db = db.with_statement_mode(StatementMode::Unnamed);
            }
            vec![Worker::transactional(db, Q_INBOX, insert_handler(started))
                .workers(connections)
                .claim(claim)
                .group_size(group)
                .start()]
        }
        Form::Plain => {
            // The queue never runs dry, so the plain workers share one pool and poll (no LISTEN
            // connection each).
            let db = PgDatabase::from_pool(ctx.pool(2 * connections + 2)?);
            (0..connections)
                .map(|_| {
                    let started = started.clone();
                    Worker::plain(db.clone(), Q_INBOX, move |_job: Job<Payload>| {
                        started.fetch_add(1, Ordering::Relaxed);
                        async { Ok(Outcome::ack()) }
                    })
                    .workers(100)
                    .batch_size(100)
                    .start()
                })
                .collect()
        }
    })
}

/// Figure 4: End-to-end jobs per second through the worker against hand-written raw loops.
pub async fn worker(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let group = 10;
    let forms = [
        (
            Form::Transactional {
                claim: Claim::Lease,
                group: 1,
            },
            Step::WorkerLoop {
                lock: false,
                group: 1,
            },
            "4. worker tx, lease".to_owned(),
        ),
        (
            Form::Transactional {
                claim: Claim::Lock,
                group: 1,
            },
            Step::WorkerLoop {
                lock: true,
                group: 1,
            },
            "4. worker tx, lock".to_owned(),
        ),
        (
            Form::Transactional {
                claim: Claim::Lease,
                group,
            },
            Step::WorkerLoop { lock: false, group },
            format!("4. worker tx, lease, group {group}"),
        ),
        (
            Form::Transactional {
                claim: Claim::Lock,
                group,
            },
            Step::WorkerLoop { lock: true, group },
            format!("4. worker tx, lock, group {group}"),
        ),
        (
            Form::Unnamed {
                claim: Claim::Lease,
                group,
            },
            Step::WorkerLoop { lock: false, group },
            format!("4. worker tx, lease, group {group}, unnamed statements"),
        ),
        (
            Form::Plain,
            Step::LeaseAck {
                side: Side::Raw,
                batch: 100,
            },
            "4. worker plain, no-op".to_owned(),
        ),
    ];
    for (form, raw, name) in forms {
        for &n in &ctx.opts.connections {
            let (ours, theirs) = compare(
                ctx.opts.rounds,
                || run_worker(ctx, n, form),
                || run_clients(ctx, n, raw),
            )
            .await?;
            let mut row = Row::new(
                4,
                name.clone(),
                Some(n),
                (Some(ours), Some(theirs)),
                "jobs/s",
                Target::RatioAtLeast(0.9),
            );
            if let Form::Plain = form {
                row = row.note(
                    "plain workers (100 deliveries each) against raw loops leasing 100 jobs \
                     (UPDATE) and acking them (DELETE), each in its own transaction",
                );
            }
            if let Form::Unnamed { .. } = form {
                row = row.note(
                    "the worker's and the handler's statements unnamed (the pooler mode) on a \
                     direct connection, against the raw loop's prepared statements",
                );
            }
            push(&mut rows, row);
        }
    }
    reference_rows(
        ctx,
        &mut rows,
        (4, "4. ref: batches of 100 deleted in one statement"),
        Step::DeleteBatch,
        "at most once: a job deleted as it is taken is lost if its handler fails",
    )
    .await?;
    Ok(rows)
}

/// One job of figure 5, in ms: enqueue call to handler start (the figure), and its two parts:
/// the enqueue call (its commit), and from the call's return to the handler's start.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub total: f64,
    commit: f64,
    after: f64,
}

/// Handler starts of figure 5's jobs: (n, stamped before the enqueue, handler start), in µs.
#[derive(Clone, Default)]
pub struct Samples(Arc<Mutex<Vec<(i64, u64, u64)>>>);

impl Samples {
    pub fn record(&self, payload: &Payload) {
        if let (Some(sent), Ok(mut samples)) = (payload.t, self.0.lock()) {
            samples.push((payload.n, sent, micros()));
        }
    }

    fn len(&self) -> usize {
        self.0.lock().map_or(0, |s| s.len())
    }

    /// Takes the samples recorded so far: how many, and each one's enqueue-to-handler time in
    /// ms (figure 12 reads them window by window, so that a long run keeps no more than one).
    pub fn take(&self) -> Vec<f64> {
        let samples = self.0.lock().map(|mut s| std::mem::take(&mut *s));
        samples
            .unwrap_or_default()
            .into_iter()
            .map(|(_, sent, started)| started.saturating_sub(sent) as f64 / 1000.0)
            .collect()
    }

    /// The latencies, given when each enqueue call returned (by job number).
    fn latencies(&self, returned: &[u64]) -> Vec<Latency> {
        let ms = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1000.0;
        let samples = self.0.lock().map(|s| s.clone()).unwrap_or_default();
        samples
            .into_iter()
            .filter_map(|(n, sent, started)| {
                let back = *returned.get(usize::try_from(n).ok()?)?;
                Some(Latency {
                    total: ms(sent, started),
                    commit: ms(sent, back),
                    after: ms(back, started),
                })
            })
            .collect()
    }
}

/// Enqueues `count` jobs one by one with `sql` (`$1` the payload), 4 to 8 ms apart, stamping
/// each with the time just before the call; waits for `samples` to fill, and returns the
/// latencies.
async fn produce(ctx: &Ctx, sql: &str, count: usize, samples: &Samples) -> Result<Vec<Latency>> {
    let client = ctx.connect().await?;
    let statement = client.prepare(sql).await?;
    let mut rng = fastrand::Rng::new();
    let mut returned = Vec::with_capacity(count);
    for n in 0..count {
        let payload = json!({ "n": n, "t": micros() });
        client.query(&statement, &[&payload]).await?;
        returned.push(micros());
        let pause = 4_000 + rng.u64(..4_000);
        tokio::time::sleep(Duration::from_micros(pause)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while samples.len() < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(samples.latencies(&returned))
}

/// The project's side of figure 5, started: an idle transactional worker (lease) of `workers`
/// slots, woken by NOTIFY, whose handler records its start, writes its row and then takes
/// `handler` (if any).
pub async fn start_inbox_side(
    ctx: &Ctx,
    workers: usize,
    handler: Option<Duration>,
) -> Result<(WorkerHandle, Samples)> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[Q_INBOX, DONE_INBOX]).await?;
    let samples = Samples::default();
    let record = samples.clone();
    let run = transactional(move |job: Job<Payload>, tx: &dyn Database| {
        record.record(&job.payload);
        Box::pin(async move {
            tx.execute(&Statement::new(INSERT_DONE).bind(job.payload.n))
                .await?;
            if let Some(time) = handler {
                tokio::time::sleep(time).await;
            }
            Ok(Outcome::ack())
        })
    });
    let handle = Worker::transactional(ctx.database(workers + 4)?, Q_INBOX, run)
        .workers(workers)
        .start();
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((handle, samples))
}

/// The SQL of figure 5's enqueues on the project's side (`$1` the payload).
fn inbox_enqueue_sql() -> String {
    format!("SELECT inbox_enqueue('{Q_INBOX}'::regclass, $1::jsonb)")
}

/// The SQL of an open loop's enqueues on the project's side (`$1` the payloads, `jsonb[]`).
pub fn inbox_batch_sql() -> String {
    format!("SELECT count(*) FROM inbox_enqueue_batch('{Q_INBOX}'::regclass, $1::jsonb[])")
}

/// The project's side of figure 5: enqueues paced 4 to 8 ms apart.
async fn latency_inbox(ctx: &Ctx, connections: usize, count: usize) -> Result<Vec<Latency>> {
    let (handle, samples) = start_inbox_side(ctx, connections, None).await?;
    let latencies = produce(ctx, &inbox_enqueue_sql(), count, &samples).await;
    handle.shutdown(SHUTDOWN).await;
    latencies
}

/// The raw side of figure 5: the same loop by hand. A LISTEN connection wakes one idle consumer
/// per notification; a consumer leases with raw SQL until it finds nothing, running each job as
/// the worker does (insert, the handler's time if any, and delete in one transaction), then waits
/// (polling every 500 ms).
pub struct RawSide {
    /// The LISTEN connection's client: dropping it would close the connection.
    _listener: tokio_postgres::Client,
    pub samples: Samples,
    wake: Arc<Notify>,
    stop: Arc<AtomicBool>,
    consumers: tokio::task::JoinSet<Result<()>>,
    driver: tokio::task::JoinHandle<()>,
}

impl RawSide {
    /// The SQL of its enqueues (`$1` the payload).
    fn enqueue_sql() -> String {
        format!(
            "WITH job AS (INSERT INTO {Q_RAW} (payload) VALUES ($1) RETURNING id) \
             SELECT id, pg_notify('{Q_RAW}', '') FROM job"
        )
    }

    /// The SQL of its open loop's enqueues (`$1` the payloads, `jsonb[]`).
    pub fn batch_sql() -> String {
        format!(
            "WITH jobs AS (INSERT INTO {Q_RAW} (payload) SELECT unnest($1::jsonb[]) RETURNING id) \
             SELECT (SELECT count(*) FROM jobs), pg_notify('{Q_RAW}', '')"
        )
    }

    pub async fn start(ctx: &Ctx, connections: usize, handler: Option<Duration>) -> Result<Self> {
        let admin = ctx.connect().await?;
        truncate(&admin, &[Q_RAW, DONE_RAW]).await?;
        let samples = Samples::default();
        let wake = Arc::new(Notify::new());
        let stop = Arc::new(AtomicBool::new(false));
        let (listener, mut connection) = ctx.config.connect(tokio_postgres::NoTls).await?;
        let notified = wake.clone();
        let driver = tokio::spawn(async move {
            let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(_) = message {
                    notified.notify_one();
                }
            }
        });
        listener.batch_execute(&format!("LISTEN {Q_RAW}")).await?;
        let mut consumers = tokio::task::JoinSet::new();
        for _ in 0..connections {
            let client = ctx.connect().await?;
            let take = client
                .prepare(&format!(
                    "UPDATE {Q_RAW} SET attempt = attempt + 1, \
                     locked_until = now() + interval '30 seconds', leased_at = now() \
                     WHERE id = (SELECT id FROM {Q_RAW} WHERE {DUE_IN_INDEX_ORDER} \
                     LIMIT 1 FOR UPDATE SKIP LOCKED) \
                     RETURNING id, attempt::int8, payload"
                ))
                .await?;
            let insert = client
                .prepare(&format!("INSERT INTO {DONE_RAW} (n) VALUES ($1)"))
                .await?;
            let ack = client
                .prepare(&format!(
                    "DELETE FROM {Q_RAW} WHERE id = $1 AND attempt = $2::int8 AND locked_until <> 'infinity'"
                ))
                .await?;
            let (wake, stop, record) = (wake.clone(), stop.clone(), samples.clone());
            let mut client = client;
            consumers.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Some(row) = client.query_opt(&take, &[]).await? else {
                        tokio::select! {
                            _ = wake.notified() => {}
                            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        }
                        continue;
                    };
                    wake.notify_one();
                    let (id, token): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
                    let payload: serde_json::Value = row.try_get(2)?;
                    let payload: Payload = serde_json::from_value(payload)?;
                    let tx = client.transaction().await?;
                    record.record(&payload);
                    tx.execute(&insert, &[&payload.n]).await?;
                    if let Some(time) = handler {
                        tokio::time::sleep(time).await;
                    }
                    tx.execute(&ack, &[&id, &token]).await?;
                    tx.commit().await?;
                }
                Result::Ok(())
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(Self {
            _listener: listener,
            samples,
            wake,
            stop,
            consumers,
            driver,
        })
    }

    pub async fn stop(mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        for _ in 0..self.consumers.len() {
            self.wake.notify_one();
        }
        while let Some(result) = self.consumers.join_next().await {
            result??;
        }
        self.driver.abort();
        Ok(())
    }
}

async fn latency_raw(ctx: &Ctx, connections: usize, count: usize) -> Result<Vec<Latency>> {
    let raw = RawSide::start(ctx, connections, None).await?;
    let latencies = produce(ctx, &RawSide::enqueue_sql(), count, &raw.samples).await;
    raw.stop().await?;
    latencies
}

/// The workers and the handler's time of figure 5's open-loop rows: many slots, short handlers,
/// as a service runs them.
const OPEN_LOOP_WORKERS: usize = 32;
const OPEN_LOOP_HANDLER: Duration = Duration::from_millis(1);

/// Enqueues `count` jobs with `sql` (`$1` the payloads, `jsonb[]`) at `rate` a second, in calls
/// of `rate / 1,000` jobs (one job a call up to 1,000 a second; an enqueue commits on its own),
/// from four connections on one schedule, each call sent at its time (or at once when its
/// connection is late) and its jobs stamped just before it; waits for `samples` to fill. Returns
/// the latencies and the rate the enqueues reached.
async fn produce_at(
    ctx: &Ctx,
    sql: &str,
    rate: usize,
    count: usize,
    samples: &Samples,
) -> Result<(Vec<Latency>, f64)> {
    const PRODUCERS: usize = 4;
    let per_call = (rate / 1_000).max(1);
    let calls = count.div_ceil(per_call);
    let returned: Arc<Vec<AtomicU64>> = Arc::new((0..count).map(|_| AtomicU64::new(0)).collect());
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for first in 0..PRODUCERS {
        let client = ctx.connect().await?;
        let statement = client.prepare(sql).await?;
        let returned = returned.clone();
        tasks.spawn(async move {
            for call in (first..calls).step_by(PRODUCERS) {
                let jobs = call * per_call..((call + 1) * per_call).min(count);
                let due = began + Duration::from_secs_f64(jobs.start as f64 / rate as f64);
                tokio::time::sleep_until(due.into()).await;
                let sent = micros();
                let payloads: Vec<serde_json::Value> =
                    jobs.clone().map(|n| json!({ "n": n, "t": sent })).collect();
                client.query(&statement, &[&payloads]).await?;
                let back = micros();
                for n in jobs {
                    returned[n].store(back, Ordering::Relaxed);
                }
            }
            Result::Ok(())
        });
    }
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    let reached = count as f64 / began.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(10);
    while samples.len() < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let returned: Vec<u64> = returned.iter().map(|t| t.load(Ordering::Relaxed)).collect();
    Ok((samples.latencies(&returned), reached))
}

/// The project's side of figure 5's open loop: the default transactional worker.
async fn open_loop_inbox(ctx: &Ctx, rate: usize, count: usize) -> Result<(Vec<Latency>, f64)> {
    let (handle, samples) =
        start_inbox_side(ctx, OPEN_LOOP_WORKERS, Some(OPEN_LOOP_HANDLER)).await?;
    let measured = produce_at(ctx, &inbox_batch_sql(), rate, count, &samples).await;
    handle.shutdown(SHUTDOWN).await;
    measured
}

/// The raw side of figure 5's open loop: as many connections as the worker has slots.
async fn open_loop_raw(ctx: &Ctx, rate: usize, count: usize) -> Result<(Vec<Latency>, f64)> {
    let raw = RawSide::start(ctx, OPEN_LOOP_WORKERS, Some(OPEN_LOOP_HANDLER)).await?;
    let measured = produce_at(ctx, &RawSide::batch_sql(), rate, count, &raw.samples).await;
    raw.stop().await?;
    measured
}

/// Figure 5's open loop: jobs offered at a fixed rate to 32 slots whose handlers take 1 ms,
/// p50 and p99 from enqueue to handler start, against the raw loop at the same rate.
async fn open_loop_latency(ctx: &Ctx, rows: &mut Vec<Row>) -> Result<()> {
    for rate in [1_000, 10_000] {
        // Seconds of offered load: a few thousand samples at each rate.
        let count = if ctx.opts.quick { rate } else { rate * 5 };
        let (ours, ours_rate) = retrying(|| open_loop_inbox(ctx, rate, count)).await?;
        let (theirs, theirs_rate) = retrying(|| open_loop_raw(ctx, rate, count)).await?;
        let sorted = |samples: &[Latency]| {
            let mut values: Vec<f64> = samples.iter().map(|l| l.total).collect();
            values.sort_by(f64::total_cmp);
            values
        };
        let (ours_sorted, theirs_sorted) = (sorted(&ours), sorted(&theirs));
        let note = format!(
            "{} and {} samples; enqueued at {ours_rate:.0} and {theirs_rate:.0} jobs/s",
            ours.len(),
            theirs.len()
        );
        for (p, target) in [(50.0, Target::None), (99.0, Target::InboxBelow(10.0))] {
            let values = (
                Some(percentile(&ours_sorted, p)),
                Some(percentile(&theirs_sorted, p)),
            );
            let name = format!("5. enqueue->handler p{p}, {rate} jobs/s offered, 1 ms handlers");
            let row = Row::new(5, name, Some(OPEN_LOOP_WORKERS), values, "ms", target);
            push(
                rows,
                if p > 50.0 {
                    row.note(note.clone())
                } else {
                    row
                },
            );
        }
    }
    Ok(())
}

/// Figure 5: Latency from enqueue to handler start, p50 and p99, idle workers woken by NOTIFY;
/// then the same at a fixed offered rate with 32 slots and 1 ms handlers.
pub async fn latency(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let rounds = if ctx.opts.quick { 1 } else { 2 };
    let per_round = ctx.opts.latency_samples / rounds;
    for &n in &ctx.opts.connections {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            if round % 2 == 0 {
                ours.extend(retrying(|| latency_inbox(ctx, n, per_round)).await?);
                theirs.extend(retrying(|| latency_raw(ctx, n, per_round)).await?);
            } else {
                theirs.extend(retrying(|| latency_raw(ctx, n, per_round)).await?);
                ours.extend(retrying(|| latency_inbox(ctx, n, per_round)).await?);
            }
        }
        let sorted = |samples: &[Latency], part: fn(&Latency) -> f64| {
            let mut values: Vec<f64> = samples.iter().map(part).collect();
            values.sort_by(f64::total_cmp);
            values
        };
        let total = (sorted(&ours, |l| l.total), sorted(&theirs, |l| l.total));
        // Where the time goes: the enqueue's own commit, then the wake-up, take and BEGIN.
        let parts = |samples: &[Latency]| {
            let (commit, after) = (sorted(samples, |l| l.commit), sorted(samples, |l| l.after));
            format!(
                "enqueue call p50 {:.1} / p99 {:.1} ms, then to handler p50 {:.1} / p99 {:.1} ms",
                percentile(&commit, 50.0),
                percentile(&commit, 99.0),
                percentile(&after, 50.0),
                percentile(&after, 99.0)
            )
        };
        let note = format!(
            "{} and {} samples; inbox: {}; raw: {}",
            ours.len(),
            theirs.len(),
            parts(&ours),
            parts(&theirs)
        );
        for (p, target) in [(50.0, Target::None), (99.0, Target::InboxBelow(10.0))] {
            let values = (Some(percentile(&total.0, p)), Some(percentile(&total.1, p)));
            let name = format!("5. enqueue->handler p{p}");
            let row = Row::new(5, name, Some(n), values, "ms", target);
            push(
                &mut rows,
                if p > 50.0 {
                    row.note(note.clone())
                } else {
                    row
                },
            );
        }
    }
    open_loop_latency(ctx, &mut rows).await?;
    Ok(rows)
}

/// The sizes of a churn queue at a point: total, heap, indexes (bytes), and its dead rows and
/// vacuums so far.
#[derive(Clone, Copy, Debug, Default)]
struct Size {
    total: i64,
    heap: i64,
    indexes: i64,
    dead: i64,
    vacuums: i64,
}

async fn size(client: &tokio_postgres::Client, table: &str) -> Result<Size> {
    let row = client
        .query_one(
            "SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid), \
                    pg_indexes_size(c.oid), coalesce(s.n_dead_tup, 0), \
                    coalesce(s.autovacuum_count + s.vacuum_count, 0) \
               FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
              WHERE c.oid = $1::text::regclass",
            &[&table],
        )
        .await?;
    Ok(Size {
        total: row.try_get(0)?,
        heap: row.try_get(1)?,
        indexes: row.try_get(2)?,
        dead: row.try_get(3)?,
        vacuums: row.try_get(4)?,
    })
}

/// Passes `total` jobs through `table` at a steady depth of about 1,000 (two connections, each
/// enqueueing 100, leasing 100 and acking them, in turn); returns its size after `first` jobs
/// and after `total`, and the jobs per second.
async fn churn(ctx: &Ctx, side: Side, first: u64, total: u64) -> Result<(Size, Size, f64)> {
    let table = match side {
        Side::Inbox => CHURN_INBOX,
        Side::Raw => CHURN_RAW,
    };
    let admin = ctx.connect().await?;
    truncate(&admin, &[table]).await?;
    fill(&admin, table, 1_000).await?;
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let client = ctx.connect().await?;
        let sql = match side {
            Side::Inbox => [
                format!("SELECT inbox_enqueue_batch('{table}'::regclass, $1::jsonb[])"),
                format!("SELECT id, token FROM inbox_lease('{table}'::regclass, 100, interval '30 seconds')"),
                format!("SELECT inbox_ack_batch('{table}'::regclass, $1::int8[], $2::int8[])"),
            ],
            Side::Raw => [
                format!("INSERT INTO {table} (payload) SELECT p FROM unnest($1::jsonb[]) AS p"),
                format!(
                    "UPDATE {table} SET attempt = attempt + 1, locked_until = now() + interval '30 seconds', \
                     leased_at = now() WHERE id = ANY (ARRAY (SELECT id FROM {table} \
                     WHERE {DUE_IN_INDEX_ORDER} LIMIT 100 \
                     FOR UPDATE SKIP LOCKED)) RETURNING id, attempt::int8"
                ),
                format!(
                    "DELETE FROM {table} AS q USING unnest($1::int8[], $2::int8[]) AS s(id, token) \
                     WHERE q.id = s.id AND q.attempt = s.token AND q.locked_until <> 'infinity'"
                ),
            ],
        };
        let mut statements = Vec::new();
        for sql in &sql {
            statements.push(client.prepare(sql).await?);
        }
        let done = done.clone();
        tasks.spawn(async move {
            let mut n = 0_i64;
            while done.load(Ordering::Relaxed) < total {
                let payloads: Vec<serde_json::Value> = (0..100)
                    .map(|_| {
                        n += 1;
                        json!({ "n": n })
                    })
                    .collect();
                client.query(&statements[0], &[&payloads]).await?;
                let jobs = client.query(&statements[1], &[]).await?;
                let ids: Vec<i64> = jobs.iter().map(|r| r.get(0)).collect();
                let tokens: Vec<i64> = jobs.iter().map(|r| r.get(1)).collect();
                client.query(&statements[2], &[&ids, &tokens]).await?;
                done.fetch_add(ids.len() as u64, Ordering::Relaxed);
            }
            Result::Ok(())
        });
    }
    let started = Instant::now();
    let mut at_first = None;
    while !tasks.is_empty() {
        if at_first.is_none() && done.load(Ordering::Relaxed) >= first {
            at_first = Some(size(&admin, table).await?);
        }
        tokio::select! {
            joined = tasks.join_next() => if let Some(result) = joined { result??; },
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    let at_end = size(&admin, table).await?;
    Ok((at_first.unwrap_or_default(), at_end, rate))
}

/// Figure 6: Queue size after `total` jobs through a queue of steady depth, against its size after the
/// first `first` (both sides churn at the same time, so autovacuum's visits fall alike).
pub async fn bloat(ctx: &Ctx) -> Result<Vec<Row>> {
    let (first, total) = ctx.opts.churn;
    let (ours, theirs) = retrying(|| async {
        let (ours, theirs) = tokio::join!(
            churn(ctx, Side::Inbox, first, total),
            churn(ctx, Side::Raw, first, total)
        );
        Ok((ours?, theirs?))
    })
    .await?;
    let ((ours_first, ours_end, ours_rate), (theirs_first, theirs_end, theirs_rate)) =
        (ours, theirs);
    let mib = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
    let k = |n: u64| format!("{}k", n / 1000);
    let detail = |s: Size| {
        format!(
            "heap {:.1} MiB, indexes {:.1} MiB, {} dead rows, {} vacuums",
            mib(s.heap),
            mib(s.indexes),
            s.dead,
            s.vacuums
        )
    };
    let mut rows = Vec::new();
    push(
        &mut rows,
        Row::new(
            6,
            format!("6. queue size after {}", k(first)),
            Some(2),
            (Some(mib(ours_first.total)), Some(mib(theirs_first.total))),
            "MiB",
            Target::None,
        )
        .note(format!(
            "inbox: {}; raw: {}",
            detail(ours_first),
            detail(theirs_first)
        )),
    );
    push(
        &mut rows,
        Row::new(
            6,
            format!("6. queue size after {}", k(total)),
            Some(2),
            (Some(mib(ours_end.total)), Some(mib(theirs_end.total))),
            "MiB",
            Target::None,
        )
        .note(format!(
            "inbox: {}, {:.0} jobs/s; raw: {}, {:.0} jobs/s",
            detail(ours_end),
            ours_rate,
            detail(theirs_end),
            theirs_rate
        )),
    );
    let growth = |a: Size, b: Size| b.total as f64 / a.total.max(1) as f64;
    push(
        &mut rows,
        Row::new(
            6,
            format!("6. growth {} -> {}", k(first), k(total)),
            Some(2),
            (
                Some(growth(ours_first, ours_end)),
                Some(growth(theirs_first, theirs_end)),
            ),
            "x",
            Target::InboxBelow(2.0),
        ),
    );
    Ok(rows)
}

/// The child process of figure 7: runs a worker with 16 deliveries (the project's, or the raw
/// loop) on the prefilled queue for `seconds`, then prints its peak RSS and the jobs it did.
pub async fn child_worker(ctx: &Ctx, side: Side, seconds: u64) -> Result<()> {
    let deliveries = 16;
    let run_for = Duration::from_secs(seconds);
    let jobs = match side {
        Side::Inbox => {
            let started = Arc::new(AtomicU64::new(0));
            let db = ctx.database(deliveries + 4)?;
            let handle = Worker::transactional(db, Q_INBOX, insert_handler(started))
                .workers(deliveries)
                .start();
            tokio::time::sleep(run_for).await;
            handle.shutdown(SHUTDOWN).await.acked
        }
        Side::Raw => {
            let done = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..deliveries {
                let mut session = Session::open(
                    ctx,
                    Step::WorkerLoop {
                        lock: false,
                        group: 1,
                    },
                )
                .await?;
                let (done, stop) = (done.clone(), stop.clone());
                tasks.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        done.fetch_add(session.run().await?, Ordering::Relaxed);
                    }
                    Result::Ok(())
                });
            }
            tokio::time::sleep(run_for).await;
            stop.store(true, Ordering::Relaxed);
            while let Some(result) = tasks.join_next().await {
                result??;
            }
            done.load(Ordering::Relaxed)
        }
    };
    println!("vmhwm_kib={} jobs={jobs}", peak_rss_kib().unwrap_or(0));
    Ok(())
}

/// Runs `child-worker <side>` as a process of its own; returns its peak RSS (KiB) and jobs.
async fn spawn_child(ctx: &Ctx, side: &str) -> Result<(u64, u64)> {
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args(["child-worker", side, &ctx.opts.child_seconds.to_string()])
        .env("DATABASE_URL", &ctx.url)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "child-worker {side} failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let field = |name: &str| {
        stdout
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("child-worker {side} printed no {name}: {stdout}"))
    };
    Ok((field("vmhwm_kib=")?, field("jobs=")?))
}

/// Figure 7: Peak memory of a worker process running 16 concurrent deliveries, against a process running
/// the raw loop on 16 connections.
pub async fn memory(ctx: &Ctx) -> Result<Vec<Row>> {
    let admin = ctx.connect().await?;
    let jobs = 10_000 * ctx.opts.child_seconds;
    let mut measured = Vec::new();
    for (side, name) in [(Side::Inbox, "inbox"), (Side::Raw, "raw")] {
        truncate(&admin, &[side.queue(), side.done()]).await?;
        fill(&admin, side.queue(), jobs).await?;
        measured.push(retrying(|| spawn_child(ctx, name)).await?);
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    let mut rows = Vec::new();
    push(
        &mut rows,
        Row::new(
            7,
            "7. peak RSS, 16 deliveries",
            Some(16),
            (Some(mib(measured[0].0)), Some(mib(measured[1].0))),
            "MiB",
            Target::None,
        )
        .note(format!(
            "VmHWM of a child process running {} s: the transactional worker (lease, handler \
             inserting a row) did {} jobs, the raw loop {}",
            ctx.opts.child_seconds, measured[0].1, measured[1].1
        )),
    );
    Ok(rows)
}
