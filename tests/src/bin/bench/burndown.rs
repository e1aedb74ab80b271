//! Figure 8, the burn-down: a queue filled beforehand (50,000 jobs; `--quick`: 10,000) and a
//! worker process started on it, timed until the queue is empty; against a process running the
//! hand-written raw loop that makes the same transactions.
//!
//! The child process (`inbox-bench child-burndown FORM SIDE JOBS`) runs one form on one side,
//! checks that every job was done, and prints its rate, its own CPU time, the CPU time of its
//! server backends and its peak RSS.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use inbox_client::worker::{transactional, Job, Outcome, Worker, WorkerHandle, ADAPTIVE_GROUP_MAX};
use inbox_client::{Database, PgDatabase, Statement};
use serde_json::Value;
use tokio_postgres::NoTls;

use super::figures::Payload;
use super::measure::{median, retrying, Row, Target};
use super::setup::{
    cpu_seconds, fill, peak_rss_kib, truncate, Ctx, Result, Side, DUE_IN_INDEX_ORDER,
};

/// The transactional worker's default, as a service writes it: `workers(8)` and nothing else.
const DEFAULT_WORKERS: usize = 8;
/// The group sizes tried for the transactional worker's best row.
const GROUPS: [usize; 3] = [32, 128, 512];
/// The plain worker: deliveries in flight, and jobs per lease and per ack.
const PLAIN_WORKERS: usize = 2_000;
const PLAIN_BATCH: usize = 500;
/// The raw plain loop: connections, each leasing and acking batches of `PLAIN_BATCH`.
const RAW_PLAIN_CONNECTIONS: usize = 4;

/// What a burn-down runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `Worker::transactional(..).workers(8)`, the handler inserting one row.
    Default,
    /// The same with `group_size(n)`.
    Group(usize),
    /// `Worker::plain` with a no-op handler.
    Plain,
}

impl Form {
    fn arg(self) -> String {
        match self {
            Form::Default => "default".to_owned(),
            Form::Group(n) => format!("group{n}"),
            Form::Plain => "plain".to_owned(),
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "default" => Some(Form::Default),
            "plain" => Some(Form::Plain),
            _ => text.strip_prefix("group")?.parse().ok().map(Form::Group),
        }
    }

    /// Whether the handler inserts a row per job (checked afterwards: each exactly once).
    fn inserts(self) -> bool {
        self != Form::Plain
    }
}

/// What a child process measured.
#[derive(Clone, Copy, Debug, Default)]
struct Burn {
    jobs_per_s: f64,
    client_cpu_us: f64,
    server_cpu_us: f64,
    rss_mib: f64,
}

/// Figure 8: each form, both sides, in alternating order over the run's rounds (medians).
pub async fn burndown(ctx: &Ctx) -> Result<Vec<Row>> {
    let jobs = if ctx.opts.quick { 10_000 } else { 50_000 };
    let rounds = if ctx.opts.quick { 1 } else { 2 };
    let mut rows = Vec::new();
    let (ours, theirs) = measure(ctx, Form::Default, jobs, rounds).await?;
    rows.extend(form_rows(
        "default tx worker, workers(8)",
        DEFAULT_WORKERS,
        (ours, theirs),
        Target::InboxAtLeast(26_000.0),
        format!(
            "Worker::transactional(..).workers(8), nothing else: adaptive groups of up to \
             {ADAPTIVE_GROUP_MAX}; raw: 8 connections, groups of {ADAPTIVE_GROUP_MAX} (lease, \
             BEGIN, one INSERT per job, DELETE of the group, lease of the next, COMMIT)"
        ),
    ));
    let mut best: Option<(usize, Burn, Burn)> = None;
    let mut tried = Vec::new();
    for group in GROUPS {
        let (ours, theirs) = measure(ctx, Form::Group(group), jobs, rounds).await?;
        tried.push(format!("{group}: {:.0}", ours.jobs_per_s));
        if best.is_none_or(|(_, b, _)| ours.jobs_per_s > b.jobs_per_s) {
            best = Some((group, ours, theirs));
        }
    }
    if let Some((group, ours, theirs)) = best {
        rows.extend(form_rows(
            &format!("tx worker, group_size({group})"),
            DEFAULT_WORKERS,
            (ours, theirs),
            Target::None,
            format!(
                "the best of group_size {} jobs/s, workers(8); raw: the same groups",
                tried.join(", ")
            ),
        ));
    }
    let (ours, theirs) = measure(ctx, Form::Plain, jobs, rounds).await?;
    rows.extend(form_rows(
        "plain worker, no-op",
        RAW_PLAIN_CONNECTIONS,
        (ours, theirs),
        Target::InboxAtLeast(145_000.0),
        format!(
            "Worker::plain(..).workers({PLAIN_WORKERS}).batch_size({PLAIN_BATCH}), at least \
             once; raw: {RAW_PLAIN_CONNECTIONS} connections leasing {PLAIN_BATCH} (UPDATE) and \
             acking them (DELETE), each in its own transaction"
        ),
    ));
    Ok(rows)
}

/// The rows of one form: the rate (with its target), the CPU per job on both ends, the RSS.
fn form_rows(
    name: &str,
    connections: usize,
    (ours, theirs): (Burn, Burn),
    target: Target,
    note: String,
) -> Vec<Row> {
    let row = |what: &str, unit: &'static str, get: fn(&Burn) -> f64, target| {
        let row = Row::new(
            8,
            format!("8. burn-down, {name}{what}"),
            Some(connections),
            (Some(get(&ours)), Some(get(&theirs))),
            unit,
            target,
        );
        super::report::print_row(&row);
        row
    };
    vec![
        row("", "jobs/s", |b| b.jobs_per_s, target).note(note),
        row(", worker CPU/job", "us", |b| b.client_cpu_us, Target::None),
        row(", server CPU/job", "us", |b| b.server_cpu_us, Target::None),
        row(", peak RSS", "MiB", |b| b.rss_mib, Target::None),
    ]
}

/// Both sides of one form, `rounds` times, alternating which goes first; the median of each
/// figure of each side.
async fn measure(ctx: &Ctx, form: Form, jobs: u64, rounds: usize) -> Result<(Burn, Burn)> {
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            [Side::Inbox, Side::Raw]
        } else {
            [Side::Raw, Side::Inbox]
        };
        for side in order {
            let burn = retrying(|| run_child(ctx, form, side, jobs)).await?;
            if std::env::var_os("INBOX_BENCH_TRACE").is_some() {
                eprintln!("  {form:?} {side:?}: {burn:?}");
            }
            match side {
                Side::Inbox => ours.push(burn),
                Side::Raw => theirs.push(burn),
            }
        }
    }
    Ok((medians(&ours), medians(&theirs)))
}

fn medians(burns: &[Burn]) -> Burn {
    let of = |get: fn(&Burn) -> f64| median(burns.iter().map(get).collect());
    Burn {
        jobs_per_s: of(|b| b.jobs_per_s),
        client_cpu_us: of(|b| b.client_cpu_us),
        server_cpu_us: of(|b| b.server_cpu_us),
        rss_mib: of(|b| b.rss_mib),
    }
}

/// Fills the side's queue with `jobs`, runs the child process on it, and checks the end: the
/// queue empty, and for a handler that inserts, one row per job.
async fn run_child(ctx: &Ctx, form: Form, side: Side, jobs: u64) -> Result<Burn> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[side.queue(), side.done()]).await?;
    fill(&admin, side.queue(), jobs).await?;
    admin
        .batch_execute(&format!("VACUUM ANALYZE {}", side.queue()))
        .await?;
    let side_arg = match side {
        Side::Inbox => "inbox",
        Side::Raw => "raw",
    };
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args(["child-burndown", &form.arg(), side_arg, &jobs.to_string()])
        .env("DATABASE_URL", &ctx.url)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "child-burndown {form:?} {side:?} failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let field = |name: &str| -> Result<f64> {
        stdout
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("child-burndown printed no {name}: {stdout}").into())
    };
    let left: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {}", side.queue()), &[])
        .await?
        .get(0);
    if left != 0 {
        return Err(format!("{form:?} {side:?}: {left} jobs left in the queue").into());
    }
    if form.inserts() {
        let row = admin
            .query_one(
                &format!("SELECT count(*), count(DISTINCT n) FROM {}", side.done()),
                &[],
            )
            .await?;
        let (rows, distinct): (i64, i64) = (row.get(0), row.get(1));
        if rows != jobs as i64 || distinct != jobs as i64 {
            return Err(format!(
                "{form:?} {side:?}: {rows} effect rows ({distinct} distinct) for {jobs} jobs"
            )
            .into());
        }
    }
    let done = field("jobs=")?;
    Ok(Burn {
        jobs_per_s: done / field("secs=")?,
        client_cpu_us: field("client_cpu=")? * 1e6 / done,
        server_cpu_us: field("server_cpu=")? * 1e6 / done,
        rss_mib: field("vmhwm_kib=")? / 1024.0,
    })
}

/// The child process: runs `form` on `side`'s queue until `jobs` are done, and prints what it
/// measured.
pub async fn child(ctx: &Ctx, args: &[String]) -> Result<()> {
    let usage = "child-burndown default|groupN|plain inbox|raw JOBS";
    let form = args.first().and_then(|a| Form::parse(a)).ok_or(usage)?;
    let side = match args.get(1).map(String::as_str) {
        Some("inbox") => Side::Inbox,
        Some("raw") => Side::Raw,
        _ => return Err(usage.into()),
    };
    let jobs: u64 = args.get(2).ok_or(usage)?.parse()?;
    let probe = ctx.connect().await?;
    let (client_before, server_before) = cpu_seconds(&probe).await?;
    let started = Instant::now();
    // The CPU times are read before the worker (or the raw loop) lets its connections go: a
    // backend that has exited can no longer be read.
    let (done, secs, (client_after, server_after)) = match side {
        Side::Inbox => {
            let handle = run_worker(ctx, form, jobs).await?;
            let (done, secs) = (handle.stats().acked, started.elapsed().as_secs_f64());
            let cpu = cpu_seconds(&probe).await?;
            handle.shutdown(Duration::from_millis(300)).await;
            (done, secs, cpu)
        }
        Side::Raw => {
            let (done, clients) = run_raw(ctx, form, jobs).await?;
            let secs = started.elapsed().as_secs_f64();
            let cpu = cpu_seconds(&probe).await?;
            drop(clients);
            (done, secs, cpu)
        }
    };
    println!(
        "jobs={done} secs={secs:.4} client_cpu={:.4} server_cpu={:.4} vmhwm_kib={}",
        client_after - client_before,
        server_after - server_before,
        peak_rss_kib().unwrap_or(0)
    );
    Ok(())
}

/// The handler's insert, as figure 4's.
const INSERT_DONE: &str = "INSERT INTO bench_done_inbox (n) VALUES ($1)";

/// A pool of the default size, as `PgDatabase::connect` builds it.
fn default_database(ctx: &Ctx) -> Result<PgDatabase> {
    let manager = Manager::from_config(
        ctx.config.clone(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(inbox_client::default_pool_size())
        .build()?;
    Ok(PgDatabase::from_pool_and_config(pool, ctx.config.clone()))
}

/// Runs the project's worker until `jobs` are acked; returns it still running.
async fn run_worker(ctx: &Ctx, form: Form, jobs: u64) -> Result<WorkerHandle> {
    let db = default_database(ctx)?;
    let handle = match form {
        Form::Default | Form::Group(_) => {
            let handler = transactional(|job: Job<Payload>, tx: &dyn Database| {
                Box::pin(async move {
                    tx.execute(&Statement::new(INSERT_DONE).bind(job.payload.n))
                        .await?;
                    Ok(Outcome::ack())
                })
            });
            let worker =
                Worker::transactional(db, Side::Inbox.queue(), handler).workers(DEFAULT_WORKERS);
            match form {
                Form::Group(n) => worker.group_size(n),
                _ => worker,
            }
            .start()
        }
        Form::Plain => Worker::plain(db, Side::Inbox.queue(), |_job: Job<Payload>| async {
            Ok(Outcome::ack())
        })
        .workers(PLAIN_WORKERS)
        .batch_size(PLAIN_BATCH)
        .start(),
    };
    watch_until(jobs, || handle.stats().acked, || false).await?;
    Ok(handle)
}

/// Waits until `count` reaches `jobs` (or `failed`), looking every 2 ms (a finer look costs the
/// process CPU of its own); at most 5 minutes.
async fn watch_until(jobs: u64, count: impl Fn() -> u64, failed: impl Fn() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while count() < jobs && !failed() {
        if Instant::now() > deadline {
            return Err(format!("only {} of {jobs} jobs done", count()).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// The raw loops: the same transactions as the worker, written by hand with prepared statements,
/// each statement awaited before the next; returns the jobs done and the connections, still open.
async fn run_raw(ctx: &Ctx, form: Form, jobs: u64) -> Result<(u64, Vec<tokio_postgres::Client>)> {
    let q = Side::Raw.queue();
    let (connections, batch) = match form {
        Form::Default => (DEFAULT_WORKERS, ADAPTIVE_GROUP_MAX),
        Form::Group(n) => (DEFAULT_WORKERS, n),
        Form::Plain => (RAW_PLAIN_CONNECTIONS, PLAIN_BATCH),
    };
    let lease = format!(
        "UPDATE {q} SET attempt = attempt + 1, locked_until = now() + interval '30 seconds', \
         leased_at = now() WHERE id = ANY (ARRAY (SELECT id FROM {q} WHERE {DUE_IN_INDEX_ORDER} \
         LIMIT {batch} FOR UPDATE SKIP LOCKED)) \
         RETURNING id, attempt::int8, payload"
    );
    let ack = format!(
        "DELETE FROM {q} AS q USING unnest($1::int8[], $2::int8[]) AS s(id, token) \
         WHERE q.id = s.id AND q.attempt = s.token AND q.locked_until <> 'infinity'"
    );
    let insert = format!("INSERT INTO {} (n) VALUES ($1)", Side::Raw.done());
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let mut client = ctx.connect().await?;
        let lease = client.prepare(&lease).await?;
        let ack = client.prepare(&ack).await?;
        let insert = client.prepare(&insert).await?;
        let (done, failed) = (done.clone(), failed.clone());
        let one_loop = async move {
            let mut rows = client.query(&lease, &[]).await?;
            while !rows.is_empty() {
                let mut ids = Vec::with_capacity(rows.len());
                let mut tokens = Vec::with_capacity(rows.len());
                let mut ns = Vec::with_capacity(rows.len());
                for row in &rows {
                    ids.push(row.try_get::<_, i64>(0)?);
                    tokens.push(row.try_get::<_, i64>(1)?);
                    let payload: Value = row.try_get(2)?;
                    ns.push(payload["n"].as_i64().unwrap_or_default());
                }
                if form == Form::Plain {
                    client.execute(&ack, &[&ids, &tokens]).await?;
                    done.fetch_add(ids.len() as u64, Ordering::Relaxed);
                    rows = client.query(&lease, &[]).await?;
                    continue;
                }
                let tx = client.transaction().await?;
                for n in &ns {
                    tx.execute(&insert, &[n]).await?;
                }
                let acked = tx.execute(&ack, &[&ids, &tokens]).await?;
                if acked != ids.len() as u64 {
                    return Err("a raw lease was lost".into());
                }
                let next = tx.query(&lease, &[]).await?;
                tx.commit().await?;
                done.fetch_add(ids.len() as u64, Ordering::Relaxed);
                rows = next;
            }
            Result::Ok(client)
        };
        tasks.spawn(async move {
            let ended = one_loop.await;
            failed.fetch_or(ended.is_err(), Ordering::Relaxed);
            ended
        });
    }
    // Watched as the worker is, so that both processes pay for the watch (about 2 µs a job).
    watch_until(
        jobs,
        || done.load(Ordering::Relaxed),
        || failed.load(Ordering::Relaxed),
    )
    .await?;
    let mut clients = Vec::new();
    while let Some(result) = tasks.join_next().await {
        clients.push(result??);
    }
    let done = done.load(Ordering::Relaxed);
    if done != jobs {
        return Err(format!("the raw loop did {done} of {jobs} jobs").into());
    }
    Ok((done, clients))
}
