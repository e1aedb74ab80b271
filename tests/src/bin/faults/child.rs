//! The child worker process of cases 3, 16, 17 and 19 (killed with SIGKILL) and 8 (started under a
//! skewed clock): a transactional worker whose handler logs each delivery outside its
//! transaction, writes the effect through it, and acks. It runs until killed or until its stdin
//! closes.
//!
//! ```text
//! faults child --url URL --schema S --label L [--claim lease|lock] [--group N] [--workers N]
//!              [--max-attempts N] [--lease-ms N] [--heartbeat on|off] [--work-ms N] [--slow-ms N]
//!              [--ends on|off]
//! faults child --mode dag --url URL --schema S --label L [--claim lease|lock] [--lease-ms N]
//!              [--work-ms N] [--fail-pct N]
//! faults child --mode steps --url URL --schema S --label L [--group N] [--work-ms N]
//! ```
//! A job whose payload is at least 1,000,000 sleeps `--slow-ms` on its first delivery. With
//! `--ends on` the handler also sets its effect's `ended` (a column the case adds) to the
//! server's clock once its work is done, through the delivery's transaction, just before it acks.
//!
//! With `--mode dag` (case 17) it runs one slot on each of the queues of a random DAG
//! (`DAG_QUEUES`, payloads [`DagJob`]) and one on its batches' callback queue
//! (`DAG_CALLBACKS`), retrying forever: see [`dag`].
//!
//! With `--mode steps` (case 19) its handler makes one durable step per job before its effect:
//! see [`StepsHandler`].

use std::collections::HashMap;
use std::time::Duration;

use inbox_client::worker::{
    transactional, AsyncTxHandler, Claim, HandlerResult, Job, Outcome, RetryPolicy, Tx, Worker,
};
use inbox_client::{format_rfc3339, Database, DbError, JobType, PgDatabase, Statement};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use super::common::{pool_of, Result};

pub fn main(args: &[String]) -> i32 {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("faults child: {error}");
            2
        }
    }
}

async fn run(args: &[String]) -> Result<()> {
    let mut opts: HashMap<String, String> = HashMap::new();
    let mut args = args.iter();
    while let Some(name) = args.next() {
        let name = name.strip_prefix("--").ok_or("options are --name value")?;
        let value = args.next().ok_or("an option needs a value")?;
        opts.insert(name.to_owned(), value.clone());
    }
    let get = |name: &str| opts.get(name).cloned();
    let number = |name: &str, default: u64| -> Result<u64> {
        get(name).map_or(Ok(default), |v| {
            v.parse().map_err(|_| format!("--{name}: {v}").into())
        })
    };
    let url = get("url").ok_or("--url")?;
    let schema = get("schema").ok_or("--schema")?;
    let label = get("label").unwrap_or_else(|| "child".to_owned());
    let workers = number("workers", 4)? as usize;
    let group = number("group", 1)? as usize;
    let work_ms = number("work-ms", 20)?;
    let slow_ms = number("slow-ms", 0)?;
    let ends = get("ends").as_deref() == Some("on");
    let claim = match get("claim").as_deref() {
        None | Some("lease") => Claim::Lease,
        Some("lock") => Claim::Lock,
        Some(other) => return Err(format!("--claim {other}").into()),
    };
    let mut config: tokio_postgres::Config = url.parse()?;
    config.options(format!("-c search_path={schema},public"));
    config.application_name(&schema);
    if get("mode").as_deref() == Some("dag") {
        let settings = DagSettings {
            label,
            claim,
            lease: Duration::from_millis(number("lease-ms", 2000)?),
            work_ms,
            fail_pct: number("fail-pct", 0)?,
        };
        return dag(config, settings).await;
    }
    let db = PgDatabase::from_pool_and_config(pool_of(config.clone(), workers + 3), config);
    if get("mode").as_deref() == Some("steps") {
        let handler = StepsHandler {
            log: db.clone(),
            label,
            work_ms,
        };
        // The upkeep would purge the records of acked jobs, which the case reads at the end.
        let worker = Worker::transactional_for(db, handler)
            .workers(workers)
            .group_size(group)
            .lease(Duration::from_millis(number("lease-ms", 1000)?))
            .poll_interval(Duration::from_millis(50))
            .vacuum(false)
            .retry(RetryPolicy {
                base: Duration::from_millis(5),
                cap: Duration::from_millis(50),
                max_attempts: None,
                jitter: 0.0,
            })
            .start();
        println!("ready");
        stdin_closed().await;
        worker.shutdown(Duration::from_secs(5)).await;
        return Ok(());
    }
    let log = db.clone();
    let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
        let log = log.clone();
        let label = label.clone();
        Box::pin(async move {
            log.execute(
                &Statement::new("INSERT INTO deliveries (n, attempt, worker) VALUES ($1, $2, $3)")
                    .bind(job.payload)
                    .bind(job.attempt)
                    .bind(label.as_str()),
            )
            .await?;
            tx.execute(
                &Statement::new(
                    "INSERT INTO effects (n, attempt, worker, host_at) \
                     VALUES ($1, $2, $3, $4::text::timestamptz)",
                )
                .bind(job.payload)
                .bind(job.attempt)
                .bind(label.as_str())
                .bind(format_rfc3339(chrono::Utc::now())),
            )
            .await?;
            let pause = if job.payload >= 1_000_000 && job.attempt == 1 {
                slow_ms
            } else {
                fastrand::u64(0..=work_ms)
            };
            tokio::time::sleep(Duration::from_millis(pause)).await;
            if ends {
                tx.execute(
                    &Statement::new(
                        "UPDATE effects SET ended = clock_timestamp() \
                         WHERE n = $1 AND attempt = $2 AND worker = $3",
                    )
                    .bind(job.payload)
                    .bind(job.attempt)
                    .bind(label.as_str()),
                )
                .await?;
            }
            Ok(Outcome::ack())
        })
    });
    let max_attempts = number("max-attempts", 25)? as i32;
    let worker = Worker::transactional(db, "jobs", handler)
        .workers(workers)
        .group_size(group)
        .claim(claim)
        .lease(Duration::from_millis(number("lease-ms", 1000)?))
        .heartbeat(get("heartbeat").as_deref() != Some("off"))
        .poll_interval(Duration::from_millis(50))
        .retry(RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(50),
            max_attempts: Some(max_attempts),
            jitter: 0.0,
        })
        .start();
    println!("ready");
    stdin_closed().await;
    worker.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

/// Case 19's handler, on the queue `jobs` (payloads: numbers): it logs its delivery (in
/// `deliveries`, outside its transaction), then runs the step `call`, whose closure stands for a
/// call outside the database: it logs the call at once (in `calls`, committed on its own), works
/// 0 to `work_ms / 2` ms, and returns `n * 10`, which the step records. Then the handler works 0
/// to `work_ms` ms (a kill there finds the step recorded and the effect not committed) and writes
/// its effect through the delivery's transaction.
struct StepsHandler {
    log: PgDatabase,
    label: String,
    work_ms: u64,
}

/// Case 19's job: a number, on the queue `jobs`.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
struct Numbered(i64);

impl JobType for Numbered {
    const QUEUE: &'static str = "jobs";
}

impl AsyncTxHandler<Numbered> for StepsHandler {
    async fn handle(&self, job: Job<Numbered>, tx: &Tx<'_>) -> HandlerResult {
        let (n, attempt, worker) = (job.payload.0, job.attempt, self.label.as_str());
        self.log
            .execute(
                &Statement::new("INSERT INTO deliveries (n, attempt, worker) VALUES ($1, $2, $3)")
                    .bind(n)
                    .bind(attempt)
                    .bind(worker),
            )
            .await?;
        let called: i64 = job
            .step("call", || async {
                self.log
                    .execute(
                        &Statement::new(
                            "INSERT INTO calls (n, job, attempt, worker) VALUES ($1, $2, $3, $4)",
                        )
                        .bind(n)
                        .bind(job.id)
                        .bind(attempt)
                        .bind(worker),
                    )
                    .await?;
                pause(self.work_ms / 2).await;
                Ok::<_, DbError>(n * 10)
            })
            .await?;
        if called != n * 10 {
            return Err(format!("job {n}: the step gave {called}, not {}", n * 10).into());
        }
        pause(self.work_ms).await;
        tx.execute(
            &Statement::new("INSERT INTO effects (n, attempt, worker) VALUES ($1, $2, $3)")
                .bind(n)
                .bind(attempt)
                .bind(worker),
        )
        .await?;
        Ok(Outcome::ack())
    }
}

async fn pause(most_ms: u64) {
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=most_ms))).await;
}

/// Returns when the parent closes stdin (it went away); the child runs until then, or until it
/// is killed.
async fn stdin_closed() {
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0u8; 64];
    while stdin.read(&mut buffer).await.unwrap_or(0) > 0 {}
}

/// The queues of case 17's DAG, and the queue of its batches' callbacks.
pub const DAG_QUEUES: [&str; 3] = ["dag_a", "dag_b", "dag_c"];
pub const DAG_CALLBACKS: &str = "dag_callbacks";

/// A job of case 17's DAG: its number, and the numbers of the jobs it was enqueued after.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DagJob {
    pub n: i64,
    pub parents: Vec<i64>,
}

struct DagSettings {
    label: String,
    claim: Claim,
    lease: Duration,
    work_ms: u64,
    fail_pct: u64,
}

/// Case 17's workers: one slot on each DAG queue and one on the callback queue, every delivery
/// retried until it succeeds (no `max_attempts`). Each handler logs its delivery outside its
/// transaction (in `deliveries`, with whether it was drawn to fail), then, through the
/// delivery's transaction: a DAG job writes its effect (`effects`, with its id in its queue in
/// `job`, a column the case adds) and a violation row
/// (`violations`) for each of its parents whose effect it does not see committed; a callback
/// writes its batch's counts from the payload with how many of the batch's members' effects it
/// sees (`callbacks`). It works 0 to `--work-ms` ms, then fails (`--fail-pct` % of the
/// deliveries, drawn at random: its writes roll back and it is retried) or acks.
async fn dag(config: tokio_postgres::Config, settings: DagSettings) -> Result<()> {
    let db = PgDatabase::from_pool_and_config(pool_of(config.clone(), 8), config);
    let settings = std::sync::Arc::new(settings);
    let log = db.clone();
    let (s, l) = (settings.clone(), log.clone());
    let job = transactional(move |job: Job<DagJob>, tx: &dyn Database| {
        let (settings, log) = (s.clone(), l.clone());
        Box::pin(async move {
            let fails = log_delivery(&log, &settings, "dag", job.payload.n, job.attempt).await?;
            tx.execute(
                &Statement::new(
                    "INSERT INTO effects (n, attempt, worker, job) VALUES ($1, $2, $3, $4)",
                )
                .bind(job.payload.n)
                .bind(job.attempt)
                .bind(settings.label.as_str())
                .bind(job.id),
            )
            .await?;
            // Each parent's effect committed in the transaction of its ack, which released this
            // job: this statement's snapshot, taken after the job was taken, must see them all.
            tx.execute(
                &Statement::new(
                    "INSERT INTO violations (n, attempt, worker, parent) \
                     SELECT $1::int8, $2::int4, $3::text, p.value::int8 \
                       FROM jsonb_array_elements_text($4::jsonb) p \
                      WHERE NOT EXISTS (SELECT FROM effects e WHERE e.n = p.value::int8)",
                )
                .bind(job.payload.n)
                .bind(job.attempt)
                .bind(settings.label.as_str())
                .bind(serde_json::json!(job.payload.parents)),
            )
            .await?;
            finish(&settings, fails).await
        })
    });
    let (s, l) = (settings.clone(), log.clone());
    let callback = transactional(move |job: Job<serde_json::Value>, tx: &dyn Database| {
        let (settings, log) = (s.clone(), l.clone());
        Box::pin(async move {
            let counts = &job.payload["batch"];
            let batch = counts["id"].as_i64().unwrap_or(-1);
            let fails = log_delivery(&log, &settings, "callback", batch, job.attempt).await?;
            let count = |name: &str| counts[name].as_i64().unwrap_or(-1);
            tx.execute(
                &Statement::new(
                    "INSERT INTO callbacks (batch, members, succeeded, died, done, attempt, worker) \
                     SELECT $1::int8, $2::int4, $3::int4, $4::int4, count(DISTINCT e.n), \
                            $5::int4, $6::text FROM effects e \
                      WHERE e.n IN (SELECT jsonb_array_elements_text($7::jsonb)::int8)",
                )
                .bind(batch)
                .bind(count("members"))
                .bind(count("succeeded"))
                .bind(count("died"))
                .bind(job.attempt)
                .bind(settings.label.as_str())
                .bind(job.payload["members"].clone()),
            )
            .await?;
            finish(&settings, fails).await
        })
    });
    let retry = RetryPolicy {
        base: Duration::from_millis(5),
        cap: Duration::from_millis(50),
        max_attempts: None,
        jitter: 0.0,
    };
    let mut workers = Vec::new();
    for queue in DAG_QUEUES {
        workers.push(
            Worker::transactional(db.clone(), queue, job.clone())
                .workers(1)
                .claim(settings.claim)
                .lease(settings.lease)
                .poll_interval(Duration::from_millis(200))
                .retry(retry.clone())
                .start(),
        );
    }
    workers.push(
        Worker::transactional(db.clone(), DAG_CALLBACKS, callback)
            .workers(1)
            .claim(settings.claim)
            .lease(settings.lease)
            .poll_interval(Duration::from_millis(200))
            .retry(retry)
            .start(),
    );
    println!("ready");
    stdin_closed().await;
    for worker in workers {
        worker.shutdown(Duration::from_secs(5)).await;
    }
    Ok(())
}

/// Logs a delivery outside its transaction; whether it is drawn to fail.
async fn log_delivery(
    log: &PgDatabase,
    settings: &DagSettings,
    kind: &str,
    n: i64,
    attempt: i32,
) -> Result<bool> {
    let fails = fastrand::u64(0..100) < settings.fail_pct;
    log.execute(
        &Statement::new(
            "INSERT INTO deliveries (kind, n, attempt, worker, fails) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(kind)
        .bind(n)
        .bind(attempt)
        .bind(settings.label.as_str())
        .bind(fails),
    )
    .await?;
    Ok(fails)
}

/// Works 0 to `work_ms` ms, then fails (its writes roll back) or acks.
async fn finish(settings: &DagSettings, fails: bool) -> inbox_client::worker::HandlerResult {
    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=settings.work_ms))).await;
    if fails {
        return Err("injected failure".into());
    }
    Ok(Outcome::ack())
}

/// Starts the child worker with `args` (and `env`), its stdin a pipe the child watches.
pub fn spawn(
    exe: &std::path::Path,
    args: &[String],
    env: &[(&str, String)],
) -> Result<tokio::process::Child> {
    let mut command = tokio::process::Command::new(exe);
    command
        .arg("child")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    Ok(command.spawn()?)
}
