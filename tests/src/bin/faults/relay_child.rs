//! The relay process of case 15 (killed with SIGKILL again and again): an outbox relay into NATS
//! JetStream that runs until killed, or until its stdin closes.
//!
//! ```text
//! faults relay --url URL --schema S --nats URL [--lease-ms N] [--batch N]
//! ```

use std::collections::HashMap;
use std::time::Duration;

use inbox_client::outbox::{NatsSink, Relay};
use inbox_client::PgDatabase;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

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
            eprintln!("faults relay: {error}");
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
    let get = |name: &str| opts.get(name).cloned().ok_or(format!("--{name}"));
    let number = |name: &str, default: u64| -> Result<u64> {
        opts.get(name).map_or(Ok(default), |v| {
            v.parse().map_err(|_| format!("--{name}: {v}").into())
        })
    };
    let schema = get("schema")?;
    let mut config: tokio_postgres::Config = get("url")?.parse()?;
    config.options(format!("-c search_path={schema},public"));
    config.application_name(&schema);
    let db = PgDatabase::from_pool_and_config(pool_of(config.clone(), 4), config);
    let nats = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(get("nats")?)
        .await?;
    let relay = Relay::new(
        db,
        "events",
        NatsSink::new(async_nats::jetstream::new(nats)),
    )
    .lease(Duration::from_millis(number("lease-ms", 2000)?))
    .batch(number("batch", 1000)? as i32);
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));
    // Runs until killed, or until the parent closes stdin (it went away).
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0u8; 64];
    while stdin.read(&mut buffer).await.unwrap_or(0) > 0 {}
    stop.cancel();
    running.await??;
    Ok(())
}

/// Starts the relay process with `args`, its stdin a pipe it watches.
pub fn spawn(exe: &std::path::Path, args: &[String]) -> Result<tokio::process::Child> {
    Ok(tokio::process::Command::new(exe)
        .arg("relay")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?)
}
