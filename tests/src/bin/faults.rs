//! The fault suite: every case runs on real PostgreSQL over real connections, injects
//! its fault, and checks what must hold against an effect table without a unique constraint.
//! Run it with `./scripts/faults.sh [--full]`; `docs/reliability.md` describes each case.
//!
//! ```text
//! faults [--full] [--cases 1,5,13] [--markdown PATH]
//! faults child --url URL --schema S ...     (the worker process of cases 3, 8, 16, 17, 19)
//! faults relay --url URL --schema S --nats URL   (case 15's relay process)
//! ```
//!
//! `INBOX_TEST_DATABASE_URL` names a database where `CREATE EXTENSION inbox` was run; cases that
//! need a database of their own create it on the same server, and cases that stop the server
//! start a throwaway cluster of their own from `INBOX_PG_CONFIG`'s installation. The table goes
//! to the terminal and, with `--markdown`, to a file; the last line is `N passed, M failed`.

#[path = "faults/cases/c01_lease_exclusivity.rs"]
mod c01;
#[path = "faults/cases/c02_random_outcomes.rs"]
mod c02;
#[path = "faults/cases/c03_sigkill.rs"]
mod c03;
#[path = "faults/cases/c04_terminate.rs"]
mod c04;
#[path = "faults/cases/c05_restart.rs"]
mod c05;
#[path = "faults/cases/c06_half_open.rs"]
mod c06;
#[path = "faults/cases/c07_poison.rs"]
mod c07;
#[path = "faults/cases/c08_clock_skew.rs"]
mod c08;
#[path = "faults/cases/c09_long_snapshot.rs"]
mod c09;
#[path = "faults/cases/c10_claim_races.rs"]
mod c10;
#[path = "faults/cases/c11_cancellation.rs"]
mod c11;
#[path = "faults/cases/c12_model.rs"]
mod c12;
#[path = "faults/cases/c13_hostile_input.rs"]
mod c13;
#[path = "faults/cases/c14_search_path.rs"]
mod c14;
#[path = "faults/cases/c15_outbox_relay.rs"]
mod c15;
#[path = "faults/cases/c16_limit_slots_sigkill.rs"]
mod c16;
#[path = "faults/cases/c17_workflows.rs"]
mod c17;
#[path = "faults/cases/c18_held_horizon_crashes.rs"]
mod c18;
#[path = "faults/cases/c19_steps_sigkill.rs"]
mod c19;
#[path = "faults/child.rs"]
mod child;
#[path = "faults/cluster.rs"]
mod cluster;
#[path = "faults/common.rs"]
mod common;
#[path = "faults/proxy.rs"]
mod proxy;
#[path = "faults/relay_child.rs"]
mod relay_child;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Ctx, Profile, Result, Row};

const USAGE: &str = "usage: faults [--full] [--cases 1,5,13] [--markdown PATH]\n       \
                     faults child --url URL --schema S [...]";

type CaseFuture = Pin<Box<dyn Future<Output = Result<Row>> + Send>>;

struct Case {
    number: u8,
    name: &'static str,
    /// Long cases start first and run beside the others.
    long: bool,
    /// The most a case may take before it counts as hung.
    limit: Duration,
    run: fn(Arc<Ctx>) -> CaseFuture,
}

macro_rules! case {
    ($number:expr, $module:ident, $long:expr, $limit_s:expr) => {
        Case {
            number: $number,
            name: $module::NAME,
            long: $long,
            limit: Duration::from_secs($limit_s),
            run: |ctx| Box::pin(async move { $module::run(&ctx).await }),
        }
    };
}

fn cases() -> Vec<Case> {
    vec![
        case!(1, c01, false, 300),
        case!(2, c02, false, 900),
        case!(3, c03, false, 900),
        case!(4, c04, false, 600),
        case!(5, c05, false, 600),
        case!(6, c06, false, 300),
        case!(7, c07, false, 300),
        case!(8, c08, false, 300),
        case!(9, c09, true, 900),
        case!(10, c10, false, 300),
        case!(11, c11, false, 300),
        case!(12, c12, false, 900),
        case!(13, c13, true, 900),
        case!(14, c14, false, 300),
        case!(15, c15, true, 900),
        case!(16, c16, false, 300),
        case!(17, c17, true, 900),
        case!(18, c18, true, 600),
        case!(19, c19, false, 600),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        std::process::exit(child::main(&args[1..]));
    }
    if args.first().map(String::as_str) == Some("relay") {
        std::process::exit(relay_child::main(&args[1..]));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(8)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(&args)) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("faults: {error}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

async fn run(args: &[String]) -> Result<bool> {
    let mut profile = Profile::Quick;
    let mut only: Option<Vec<u8>> = None;
    let mut markdown: Option<PathBuf> = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--full" => profile = Profile::Full,
            "--quick" => profile = Profile::Quick,
            "--cases" => {
                let list = args.next().ok_or("--cases needs a list")?;
                only = Some(
                    list.split(',')
                        .map(|n| n.trim().parse().map_err(|_| format!("not a case: {n}")))
                        .collect::<std::result::Result<_, _>>()?,
                );
            }
            "--markdown" => markdown = Some(args.next().ok_or("--markdown needs a path")?.into()),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    common::quiet_injected_panics();
    let ctx = Arc::new(Ctx::from_env(profile).await?);
    let selected: Vec<Case> = cases()
        .into_iter()
        .filter(|case| only.as_ref().is_none_or(|only| only.contains(&case.number)))
        .collect();
    let started = Instant::now();
    let mut long = Vec::new();
    let mut rows = Vec::new();
    for case in selected.iter().filter(|case| case.long) {
        let ctx = ctx.clone();
        let (number, name, limit, run) = (case.number, case.name, case.limit, case.run);
        long.push(tokio::spawn(async move {
            run_case(number, name, limit, run(ctx)).await
        }));
    }
    for case in selected.iter().filter(|case| !case.long) {
        rows.push(run_case(case.number, case.name, case.limit, (case.run)(ctx.clone())).await);
    }
    for handle in long {
        rows.push(handle.await?);
    }
    rows.sort_by_key(|row| row.case);
    let table = common::table(&rows, profile, started.elapsed());
    println!("\n{}", table.text);
    if let Some(path) = markdown {
        std::fs::write(&path, &table.markdown)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(rows.iter().all(Row::passed))
}

/// Runs one case on a task of its own, so that a panic or a hang fails that case only.
async fn run_case(number: u8, name: &'static str, limit: Duration, case: CaseFuture) -> Row {
    eprintln!("[faults] case {number}: {name} ...");
    let started = Instant::now();
    let mut task = tokio::spawn(case);
    let outcome = tokio::time::timeout(limit, &mut task).await;
    if outcome.is_err() {
        task.abort();
    }
    let mut row = match outcome {
        Ok(Ok(Ok(row))) => row,
        Ok(Ok(Err(error))) => {
            Row::failed(number, name, format!("error: {}", common::explain(&error)))
        }
        Ok(Err(join)) => Row::failed(number, name, format!("panicked: {}", panic_text(join))),
        Err(_) => Row::failed(
            number,
            name,
            format!("did not finish within {} s", limit.as_secs()),
        ),
    };
    row.seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "[faults] case {number}: {} in {:.1} s{}",
        if row.passed() { "pass" } else { "FAIL" },
        row.seconds,
        row.failures
            .iter()
            .take(common::SHOWN)
            .map(|f| format!("\n    - {f}"))
            .collect::<String>()
    );
    row
}

fn panic_text(join: tokio::task::JoinError) -> String {
    match join.try_into_panic() {
        Ok(panic) => panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".to_owned()),
        Err(join) => join.to_string(),
    }
}
