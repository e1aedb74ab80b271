//! The benchmark of the `inbox` extension and its worker against raw SQL doing the same work on
//! the same PostgreSQL; run it with `./scripts/bench.sh [--quick]`, and see
//! `docs/benchmarks.md` for what each figure measures.
//!
//! ```text
//! inbox-bench [--quick] [--figures 1,3] [--connections 1,4,16] [--rounds N] [--duration-ms N]
//!             [--holds 120,600] [--docs]
//! inbox-bench docs [JSON]               make a results file (default: the latest) the docs' own
//! inbox-bench child-worker inbox|raw S   (figure 7's child process)
//! inbox-bench child-burndown FORM SIDE N (figure 8's child process)
//! ```
//!
//! Every figure runs both sides for the same window, interleaved over a few rounds (the median
//! of each side is kept), so the ratio holds on a noisy machine. Results go to the terminal and
//! to `target/bench/latest.{json,md,svg}`; `--docs` (or `inbox-bench docs` afterwards) makes them
//! the docs' own: `docs/bench.json`, `docs/bench.svg` and the table in `docs/benchmarks.md`.

#[path = "bench/burndown.rs"]
mod burndown;
#[path = "bench/citus.rs"]
mod citus;
#[path = "bench/dashboard.rs"]
mod dashboard;
#[path = "bench/failures.rs"]
mod failures;
#[path = "bench/figures.rs"]
mod figures;
#[path = "bench/groups.rs"]
mod groups;
#[path = "bench/held.rs"]
mod held;
#[path = "bench/limits.rs"]
mod limits;
#[path = "bench/measure.rs"]
mod measure;
#[path = "bench/outbox.rs"]
mod outbox;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/sessions.rs"]
mod sessions;
#[path = "bench/setup.rs"]
mod setup;
#[path = "bench/steps.rs"]
mod steps;
#[path = "bench/upkeep.rs"]
mod upkeep;
#[path = "bench/workflows.rs"]
mod workflows;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inbox_tests::results;
use measure::Row;
use setup::{Ctx, Opts, Result, Side};

const USAGE: &str = "usage: inbox-bench [--quick] [--figures 1,3] [--connections 1,4,16] \
                     [--rounds N] [--duration-ms N] [--holds 120,600] [--docs]\n       \
                     inbox-bench docs [JSON]\n       \
                     inbox-bench child-worker inbox|raw SECONDS\n       \
                     inbox-bench child-burndown default|groupN|plain inbox|raw JOBS";

/// The workspace's root (the results go under its `target/`, and to its `docs/` with `--docs`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn list<T: std::str::FromStr>(text: &str) -> Result<Vec<T>> {
    text.split(',')
        .map(|item| {
            item.trim()
                .parse()
                .map_err(|_| format!("not a number: {item}").into())
        })
        .collect()
}

/// The options of a run, and whether to make its results the docs' own.
fn parse(args: &[String]) -> Result<(Opts, bool)> {
    let quick = args.iter().any(|a| a == "--quick");
    let mut opts = if quick { Opts::quick() } else { Opts::full() };
    let mut docs = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| format!("{arg} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--quick" => {}
            "--docs" => docs = true,
            "--figures" => opts.figures = list(value()?)?,
            "--connections" => opts.connections = list(value()?)?,
            "--rounds" => opts.rounds = value()?.parse()?,
            "--duration-ms" => opts.duration = Duration::from_millis(value()?.parse()?),
            "--holds" => opts.holds = list(value()?)?,
            _ => return Err(format!("unknown argument {arg}\n{USAGE}").into()),
        }
    }
    Ok((opts, docs))
}

fn database_url() -> Result<String> {
    std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL (or use scripts/bench.sh)".into())
}

async fn header(ctx: &Ctx, args: &[String]) -> Result<report::Header> {
    let client = ctx.connect().await?;
    let version: String = client.query_one("SELECT version()", &[]).await?.get(0);
    let sync: String = client
        .query_one("SHOW synchronous_commit", &[])
        .await?
        .get(0);
    let command = std::iter::once("./scripts/bench.sh".to_owned())
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    Ok(report::Header {
        date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
        postgres: version,
        synchronous_commit: sync,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        mode: if ctx.opts.quick { "quick" } else { "full" }.to_owned(),
        command,
    })
}

async fn run(args: &[String]) -> Result<()> {
    let (opts, docs) = parse(args)?;
    let ctx = Ctx::new(&database_url()?, opts)?;
    setup::create_tables(&ctx.connect().await?).await?;
    let header = header(&ctx, args).await?;
    report::print_header(&header);
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut timings = Vec::new();
    for &figure in &ctx.opts.figures {
        let at = Instant::now();
        rows.extend(match figure {
            1 => figures::claims(&ctx).await?,
            2 => figures::enqueues(&ctx).await?,
            3 => figures::settles(&ctx).await?,
            4 => figures::worker(&ctx).await?,
            5 => figures::latency(&ctx).await?,
            6 => figures::bloat(&ctx).await?,
            7 => figures::memory(&ctx).await?,
            8 => burndown::burndown(&ctx).await?,
            9 => groups::groups(&ctx).await?,
            10 => upkeep::wakeups(&ctx).await?,
            11 => upkeep::bloat(&ctx).await?,
            12 => held::held_snapshot(&ctx).await?,
            13 => outbox::outbox(&ctx).await?,
            14 => limits::limits(&ctx).await?,
            15 => failures::failures(&ctx).await?,
            16 => workflows::workflows(&ctx).await?,
            17 => citus::citus(&ctx).await?,
            18 => dashboard::dashboard(&ctx).await?,
            19 => steps::steps(&ctx).await?,
            other => return Err(format!("there is no figure {other}").into()),
        });
        timings.push(format!("{figure}: {:.0} s", at.elapsed().as_secs_f64()));
    }
    if let Some(sql_only) = sql_only_ctx(&ctx).await? {
        let at = Instant::now();
        rows.extend(sql_only_rows(&sql_only).await?);
        timings.push(format!("SQL-only: {:.0} s", at.elapsed().as_secs_f64()));
    }
    report::print_table(&header, &rows);
    let json = report::to_json(&header, &rows)?;
    let dir = root().join("target/bench");
    report::write_all(&dir, &json)?;
    println!(
        "\nwrote {}/latest.{{json,md,svg}}; took {:.0} s (figure {})",
        dir.display(),
        started.elapsed().as_secs_f64(),
        timings.join(", ")
    );
    if docs {
        write_docs(&json)?;
    }
    Ok(())
}

/// The figures that are also measured on the SQL-only build (`SQL_ONLY_DATABASE_URL`, a database
/// where `sql/inbox-sql-only.sql` was installed): the calls and the worker, beside the same raw SQL.
const SQL_ONLY_FIGURES: [u8; 4] = [1, 2, 3, 4];

/// A context on the SQL-only build's database, when `SQL_ONLY_DATABASE_URL` names one and one of
/// [`SQL_ONLY_FIGURES`] was asked for.
async fn sql_only_ctx(ctx: &Ctx) -> Result<Option<Ctx>> {
    let Ok(url) = std::env::var("SQL_ONLY_DATABASE_URL") else {
        return Ok(None);
    };
    let mut opts = ctx.opts.clone();
    opts.figures.retain(|f| SQL_ONLY_FIGURES.contains(f));
    if opts.figures.is_empty() {
        return Ok(None);
    }
    let sql_only = Ctx::new(&url, opts)?;
    setup::create_tables(&sql_only.connect().await?).await?;
    Ok(Some(sql_only))
}

/// Figures 1 to 4 again on the SQL-only build; each row's name says so, and its ratio is to the
/// raw SQL measured in the same database.
async fn sql_only_rows(ctx: &Ctx) -> Result<Vec<Row>> {
    println!("\n-- the SQL-only build ({}) --", ctx.url);
    let mut rows = Vec::new();
    for &figure in &ctx.opts.figures {
        rows.extend(match figure {
            1 => figures::claims(ctx).await?,
            2 => figures::enqueues(ctx).await?,
            3 => figures::settles(ctx).await?,
            _ => figures::worker(ctx).await?,
        });
    }
    for row in &mut rows {
        row.name = format!("SQL-only build: {}", row.name);
    }
    Ok(rows)
}

/// Makes a run's results the docs' own: `docs/bench.json`, the chart `docs/bench.svg` and the
/// generated part of `docs/benchmarks.md`, all from `json` (the test `docs_figures` checks that
/// they agree, and that every figure the docs quote is in `docs/bench.json`).
fn write_docs(json: &serde_json::Value) -> Result<()> {
    let docs = root().join("docs");
    std::fs::write(
        docs.join("bench.json"),
        serde_json::to_string_pretty(json)? + "\n",
    )?;
    std::fs::write(docs.join("bench.svg"), results::svg(json))?;
    let page = docs.join("benchmarks.md");
    let markdown = std::fs::read_to_string(&page)?;
    std::fs::write(
        &page,
        results::replace_block(&markdown, &results::docs_block(json))?,
    )?;
    println!(
        "wrote docs/bench.json, docs/bench.svg and the results in {}",
        page.display()
    );
    Ok(())
}

/// `docs [JSON]`: makes a results file (default: the latest run's) the docs' own.
fn docs(args: &[String]) -> Result<()> {
    let json = args
        .first()
        .map_or_else(|| root().join("target/bench/latest.json"), PathBuf::from);
    write_docs(&serde_json::from_str(&std::fs::read_to_string(&json)?)?)
}

async fn child(args: &[String]) -> Result<()> {
    let side = match args.first().map(String::as_str) {
        Some("inbox") => Side::Inbox,
        Some("raw") => Side::Raw,
        _ => return Err(USAGE.into()),
    };
    let seconds = args.get(1).ok_or(USAGE)?.parse()?;
    let ctx = Ctx::new(&database_url()?, Opts::full())?;
    figures::child_worker(&ctx, side, seconds).await
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("docs") => docs(&args[1..]),
        Some("child-worker") => child(&args[1..]).await,
        Some("child-burndown") => match database_url().and_then(|url| Ctx::new(&url, Opts::full()))
        {
            Ok(ctx) => burndown::child(&ctx, &args[1..]).await,
            Err(error) => Err(error),
        },
        Some("-h" | "--help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => run(&args).await,
    };
    if let Err(error) = result {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        eprintln!("inbox-bench: {message}");
        std::process::exit(1);
    }
}
