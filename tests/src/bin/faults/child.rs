//! The child worker process of cases 3 and 16 (killed with SIGKILL) and 8 (started under a
//! skewed clock): a transactional worker whose handler logs each delivery outside its
//! transaction, writes the effect through it, and acks. It runs until killed or until its stdin
//! closes.
//!
//! ```text
//! faults child --url URL --schema S --label L [--claim lease|lock] [--group N] [--workers N]
//!              [--max-attempts N] [--lease-ms N] [--heartbeat on|off] [--work-ms N] [--slow-ms N]
//!              [--ends on|off]
//! ```
//! A job whose payload is at least 1,000,000 sleeps `--slow-ms` on its first delivery. With
//! `--ends on` the handler also sets its effect's `ended` (a column the case adds) to the
//! server's clock once its work is done, through the delivery's transaction, just before it acks.

use std::collections::HashMap;
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{format_rfc3339, Database, PgDatabase, Statement};
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
    let db = PgDatabase::from_pool_and_config(pool_of(config.clone(), workers + 3), config);
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
    // Runs until killed, or until the parent closes stdin (it went away).
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0u8; 64];
    while stdin.read(&mut buffer).await.unwrap_or(0) > 0 {}
    worker.shutdown(Duration::from_secs(5)).await;
    Ok(())
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
