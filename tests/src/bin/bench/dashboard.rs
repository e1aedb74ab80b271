//! Figure 18: the dashboard's pages (`inbox ui`) on a queue of 1,000,000 jobs. Each row is the
//! slowest of a few loads of one page over HTTP, the first of them with no count cached, in
//! milliseconds; the target is under a second. One more row, for reference: the exact
//! `count(*)` of the queue that a dashboard without a bound on its counts runs at every load.
//!
//! The `inbox` binary is the one built beside this benchmark (`cargo build -p inbox-cli` in the
//! same profile; `scripts/bench.sh` builds it).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::measure::{Row, Target};
use super::setup::{Ctx, Result};

const JOBS: i64 = 1_000_000;
/// Loads of each page; the slowest is kept.
const LOADS: usize = 6;
const NOTE: &str = "the slowest of 6 loads over HTTP, the first with no count cached";

/// A running `inbox ui`, stopped when dropped.
struct Ui(Child);

impl Drop for Ui {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `inbox ui` on a free port; the dashboard's address.
fn start(url: &str) -> Result<(Ui, String)> {
    let binary = std::env::current_exe()?.with_file_name("inbox");
    if !binary.exists() {
        return Err(format!(
            "{} is missing: build it with `cargo build -p inbox-cli` in this benchmark's profile",
            binary.display()
        )
        .into());
    }
    let mut child = Command::new(&binary)
        .args(["ui", "--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stderr.take().ok_or("no standard error")?).read_line(&mut line)?;
    let ui = Ui(child);
    let address = line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .ok_or_else(|| format!("inbox ui did not start: {line:?}"))?
        .trim_end_matches('/')
        .to_owned();
    Ok((ui, address))
}

/// The slowest of [`LOADS`] loads of `url`, in milliseconds.
fn slowest_load(url: &str) -> Result<f64> {
    let mut slowest: f64 = 0.0;
    for _ in 0..LOADS {
        let started = Instant::now();
        let mut response = ureq::get(url).call()?;
        let body = response.body_mut().read_to_string()?;
        let took = started.elapsed().as_secs_f64() * 1000.0;
        if !body.contains("<main") {
            return Err(format!("{url}: not a page").into());
        }
        slowest = slowest.max(took);
    }
    Ok(slowest)
}

pub async fn dashboard(ctx: &Ctx) -> Result<Vec<Row>> {
    let client = ctx.connect().await?;
    // Rows as inbox_enqueue writes them, inserted in one statement; one job in 500 dead (of two
    // errors), one in 10,000 delayed, and 10,000 jobs of 100 ordered groups.
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS bench_ui CASCADE; CREATE SCHEMA bench_ui; \
             SELECT inbox_create_queue('bench_ui.big'); \
             INSERT INTO bench_ui.big (payload, key, priority) \
               SELECT jsonb_build_object('order', i), 'order-' || i, i % 3 \
                 FROM generate_series(1, {JOBS}) AS i; \
             UPDATE bench_ui.big SET locked_until = 'infinity', dead_at = now(), attempt = 3, \
                    last_error = CASE WHEN id / 500 % 2 = 0 THEN 'card declined' ELSE 'timeout' END \
              WHERE id % 500 = 0; \
             UPDATE bench_ui.big SET locked_until = now() + interval '1 hour' WHERE id % 10000 = 1; \
             SELECT count(*) FROM inbox_enqueue_batch('bench_ui.big', \
               ARRAY(SELECT jsonb_build_object('g', g) FROM generate_series(1, 10000) AS g), \
               group_keys => ARRAY(SELECT 'customer-' || g % 100 FROM generate_series(1, 10000) AS g))"
        ))
        .await?;
    // As autovacuum would have it after such a load (VACUUM runs outside a transaction block).
    client.batch_execute("VACUUM ANALYZE bench_ui.big").await?;
    let (_ui, address) = start(&ctx.url)?;
    let queue = format!("{address}/queues/bench_ui.big");
    let pages = [
        ("overview", address.clone() + "/"),
        ("a queue's newest jobs", queue.clone()),
        ("its dead jobs (a filter)", format!("{queue}?state=dead")),
        ("a page deep in the queue", format!("{queue}?before=500000")),
        ("a filter by key", format!("{queue}?key=order-777777")),
        ("one job", format!("{queue}/jobs/777777")),
        ("dead letters by error", format!("{queue}/dead")),
        ("ordered groups", format!("{queue}/groups")),
    ];
    let mut rows = Vec::new();
    for (name, url) in pages {
        let ms = tokio::task::spawn_blocking(move || slowest_load(&url).map_err(|e| e.to_string()))
            .await??;
        rows.push(
            Row::new(
                18,
                format!("dashboard on 1,000,000 jobs: {name}"),
                None,
                (Some(ms), None),
                "ms",
                Target::InboxBelow(1000.0),
            )
            .note(NOTE),
        );
    }
    let started = Instant::now();
    client
        .query_one("SELECT count(*) FROM bench_ui.big", &[])
        .await?;
    let exact = started.elapsed();
    rows.push(
        Row::new(
            18,
            "exact count(*) of the 1,000,000 jobs (what an unbounded count runs per load)",
            None,
            (Some(millis(exact)), None),
            "ms",
            Target::None,
        )
        .note("one statement, for reference"),
    );
    client.batch_execute("DROP SCHEMA bench_ui CASCADE").await?;
    Ok(rows)
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}
