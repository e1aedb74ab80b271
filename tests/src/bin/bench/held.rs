//! Figure 12: the queue while something holds the MVCC horizon, as an open loop.
//!
//! Producers offer jobs at a fixed rate, 0.9 of the default worker's clean rate on this machine
//! (measured first, closed loop), while the default transactional worker drains them. After a
//! clean minute, each holder holds the horizon for each hold's length, and the queue then has
//! time to recover: a session idle in a transaction that has an xid, four `REPEATABLE READ`
//! transactions scanning the queue's table, and `pg_dump` of the database in a loop. The raw
//! `SKIP LOCKED` loop (figure 5's, as many connections as the worker has slots) runs the same
//! schedule after it, offered 0.9 of its own clean rate. Every 10 s: completions a second and their ratio
//! to the clean windows' median, the p99 from enqueue to handler start, the queue's size with
//! its indexes, and its dead tuples.
//!
//! What it shows depends on the server's vacuum: run it where autovacuum is on, as in
//! production (`INBOX_PG_FORCE_THROWAWAY=1 ./scripts/bench.sh --figures 12` starts a throwaway
//! server with the defaults); the row notes say what the server had.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::task::JoinSet;

use super::figures::{inbox_batch_sql, start_inbox_side, RawSide, Samples};
use super::measure::{median, percentile, Row, Target};
use super::setup::{micros, Ctx, Refill, Result, Side};
use super::upkeep::SHUTDOWN;

/// The default transactional worker's slots, and the raw loop's connections.
const WORKERS: usize = 4;
/// The windows every figure is read in.
const WINDOW: Duration = Duration::from_secs(10);
/// Producers' share of the clean rate.
const OFFERED: f64 = 0.9;

/// What holds the horizon.
#[derive(Clone, Copy, Debug)]
enum Holder {
    IdleXid,
    Readers,
    Dump,
}

impl Holder {
    const ALL: [Holder; 3] = [Holder::IdleXid, Holder::Readers, Holder::Dump];

    fn name(self) -> &'static str {
        match self {
            Holder::IdleXid => "idle in a transaction with an xid",
            Holder::Readers => "4 REPEATABLE READ readers of the queue",
            Holder::Dump => "pg_dump in a loop",
        }
    }
}

/// A holder at work, until stopped.
struct Holding {
    stop: Arc<AtomicBool>,
    tasks: JoinSet<Result<()>>,
}

impl Holding {
    async fn start(ctx: &Ctx, holder: Holder, queue: &'static str) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = JoinSet::new();
        match holder {
            Holder::IdleXid => {
                let client = ctx.connect().await?;
                client.batch_execute("BEGIN; SELECT txid_current()").await?;
                let stop = stop.clone();
                tasks.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    client.batch_execute("COMMIT").await?;
                    Ok(())
                });
            }
            Holder::Readers => {
                for _ in 0..4 {
                    let client = ctx.connect().await?;
                    // The snapshot is taken by the first count, and kept to the COMMIT.
                    client
                        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        .await?;
                    let scan = format!("SELECT count(*) FROM {queue}");
                    let stop = stop.clone();
                    tasks.spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            client.query_one(&scan, &[]).await?;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        client.batch_execute("COMMIT").await?;
                        Ok(())
                    });
                }
            }
            Holder::Dump => {
                let (url, stop) = (ctx.url.clone(), stop.clone());
                tasks.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let mut dump = tokio::process::Command::new("pg_dump")
                            .args(["--dbname", &url, "--file", "/dev/null"])
                            .kill_on_drop(true)
                            .spawn()
                            .map_err(|e| format!("pg_dump (postgresql-client): {e}"))?;
                        loop {
                            tokio::select! {
                                status = dump.wait() => {
                                    let status = status?;
                                    if !status.success() {
                                        return Err(format!("pg_dump failed: {status}").into());
                                    }
                                    break;
                                }
                                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                                    if stop.load(Ordering::Relaxed) {
                                        dump.kill().await?;
                                        return Ok(());
                                    }
                                }
                            }
                        }
                    }
                    Ok(())
                });
            }
        }
        Ok(Self { stop, tasks })
    }

    async fn stop(mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        while let Some(result) = self.tasks.join_next().await {
            result??;
        }
        Ok(())
    }
}

/// Producers enqueueing at a fixed rate until stopped: calls of `rate / 1,000` jobs (one a call
/// up to 1,000 a second) from four connections on one schedule, each sent at its time (or at
/// once when its connection is late), its jobs stamped just before it.
struct Producer {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    tasks: JoinSet<Result<()>>,
}

impl Producer {
    async fn start(ctx: &Ctx, sql: &str, rate: f64) -> Result<Self> {
        const PRODUCERS: usize = 4;
        let per_call = ((rate / 1_000.0) as usize).max(1);
        let began = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let mut tasks = JoinSet::new();
        for first in 0..PRODUCERS {
            let client = ctx.connect().await?;
            let statement = client.prepare(sql).await?;
            let (stop, sent) = (stop.clone(), sent.clone());
            tasks.spawn(async move {
                let mut call = first;
                while !stop.load(Ordering::Relaxed) {
                    let first_job = call * per_call;
                    let due = began + Duration::from_secs_f64(first_job as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                    let t = micros();
                    let payloads: Vec<serde_json::Value> = (first_job..first_job + per_call)
                        .map(|n| json!({ "n": n, "t": t }))
                        .collect();
                    client.query(&statement, &[&payloads]).await?;
                    sent.fetch_add(per_call as u64, Ordering::Relaxed);
                    call += PRODUCERS;
                }
                Result::Ok(())
            });
        }
        Ok(Self { stop, sent, tasks })
    }

    async fn stop(mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        while let Some(result) = self.tasks.join_next().await {
            result??;
        }
        Ok(())
    }
}

/// A side's consumer: the default transactional worker, or the raw loop.
enum Consumer {
    Inbox(inbox_client::worker::WorkerHandle),
    Raw(RawSide),
}

impl Consumer {
    /// Starts it on an emptied queue; the samples are its handler starts.
    async fn start(ctx: &Ctx, side: Side) -> Result<(Self, Samples)> {
        Ok(match side {
            Side::Inbox => {
                let (handle, samples) = start_inbox_side(ctx, WORKERS, None).await?;
                (Consumer::Inbox(handle), samples)
            }
            Side::Raw => {
                let raw = RawSide::start(ctx, WORKERS, None).await?;
                let samples = raw.samples.clone();
                (Consumer::Raw(raw), samples)
            }
        })
    }

    async fn stop(self) -> Result<()> {
        match self {
            Consumer::Inbox(handle) => {
                handle.shutdown(SHUTDOWN).await;
                Ok(())
            }
            Consumer::Raw(raw) => raw.stop().await,
        }
    }
}

/// A part of the schedule: `secs` clean, held by `holder`, or recovering after `after`.
#[derive(Clone, Copy, Debug)]
struct Phase {
    holder: Option<Holder>,
    /// The hold this phase recovers from, if it is a recovery.
    after: Option<(Holder, u64)>,
    secs: u64,
}

/// Clean, then each holder for each hold's length, each followed by its recovery (5 minutes
/// after a hold of 10 minutes or more, 2 minutes after shorter ones; in a quick run, as long
/// as the hold).
fn schedule(ctx: &Ctx) -> Vec<Phase> {
    let quick = ctx.opts.quick;
    let mut phases = vec![Phase {
        holder: None,
        after: None,
        secs: if quick { 20 } else { 60 },
    }];
    for &hold in &ctx.opts.holds {
        for holder in Holder::ALL {
            let recovery = match (quick, hold) {
                (true, _) => hold,
                (false, 600..) => 300,
                (false, _) => 120,
            };
            phases.push(Phase {
                holder: Some(holder),
                after: None,
                secs: hold,
            });
            phases.push(Phase {
                holder: None,
                after: Some((holder, hold)),
                secs: recovery,
            });
        }
    }
    phases
}

/// One 10-second window of a side's run.
#[derive(Clone, Copy, Debug)]
struct Window {
    phase: usize,
    done: f64,
    enqueued: f64,
    p99: f64,
    size_mb: f64,
    dead: i64,
}

/// The queue's size with its indexes (MB) and its dead tuples, from the statistics.
async fn table_state(client: &tokio_postgres::Client, queue: &str) -> Result<(f64, i64)> {
    let row = client
        .query_one(
            "SELECT pg_total_relation_size($1::text::regclass)::float8 / 1048576, \
                    coalesce((SELECT n_dead_tup FROM pg_stat_user_tables \
                               WHERE relid = $1::text::regclass), 0)",
            &[&queue],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// Runs the schedule on one side at `rate` jobs a second offered; returns its windows.
async fn run_side(ctx: &Ctx, side: Side, rate: f64, phases: &[Phase]) -> Result<Vec<Window>> {
    let (consumer, samples) = Consumer::start(ctx, side).await?;
    let sql = match side {
        Side::Inbox => inbox_batch_sql(),
        Side::Raw => RawSide::batch_sql(),
    };
    let producer = Producer::start(ctx, &sql, rate).await?;
    let probe = ctx.connect().await?;
    let mut windows = Vec::new();
    let mut tick = Instant::now();
    let mut last_sent = 0;
    for (i, phase) in phases.iter().enumerate() {
        let holding = match phase.holder {
            Some(holder) => Some(Holding::start(ctx, holder, side.queue()).await?),
            None => None,
        };
        for _ in 0..phase.secs.div_ceil(WINDOW.as_secs()) {
            tick += WINDOW;
            tokio::time::sleep_until(tick.into()).await;
            let mut latencies = samples.take();
            latencies.sort_by(f64::total_cmp);
            let sent = producer.sent.load(Ordering::Relaxed);
            let (size_mb, dead) = table_state(&probe, side.queue()).await?;
            let window = Window {
                phase: i,
                done: latencies.len() as f64 / WINDOW.as_secs_f64(),
                enqueued: (sent - last_sent) as f64 / WINDOW.as_secs_f64(),
                p99: percentile(&latencies, 99.0),
                size_mb,
                dead,
            };
            last_sent = sent;
            eprintln!(
                "  12. {side:?} {}: {:.0} done/s, {:.0} enqueued/s, p99 {:.1} ms, {:.1} MB, {} dead",
                describe(phase),
                window.done,
                window.enqueued,
                window.p99,
                window.size_mb,
                window.dead
            );
            windows.push(window);
        }
        if let Some(holding) = holding {
            holding.stop().await?;
        }
    }
    producer.stop().await?;
    consumer.stop().await?;
    Ok(windows)
}

fn describe(phase: &Phase) -> String {
    match (phase.holder, phase.after) {
        (Some(holder), _) => format!("{} ({} s)", holder.name(), phase.secs),
        (None, Some((holder, hold))) => format!("after {} ({hold} s)", holder.name()),
        (None, None) => "clean".to_owned(),
    }
}

/// A side's clean rate, closed loop: its jobs a second over the median second of a window on a
/// queue kept deep.
async fn clean_rate(ctx: &Ctx, side: Side) -> Result<f64> {
    let (consumer, samples) = Consumer::start(ctx, side).await?;
    let consumed = Arc::new(AtomicU64::new(0));
    // Stamped at 0: counted as samples, their latency unused.
    let refill = Refill::start_with(
        ctx,
        side.queue(),
        20_000,
        consumed.clone(),
        "jsonb_build_object('n', g, 't', 0)",
    )
    .await?;
    let seconds = if ctx.opts.quick { 5 } else { 20 };
    let mut rates = Vec::new();
    for second in 0..seconds + 2 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let done = samples.take().len() as u64;
        consumed.fetch_add(done, Ordering::Relaxed);
        // The first two seconds warm the consumer up.
        if second >= 2 {
            rates.push(done as f64);
        }
    }
    refill.stop().await?;
    consumer.stop().await?;
    Ok(median(rates))
}

/// Figure 12's rows: per hold, the worst window's ratio to the clean median and its p99 during
/// the hold, and the size after the recovery against the clean size; per-window notes.
pub async fn held_snapshot(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let client = ctx.connect().await?;
    let autovacuum: String = client.query_one("SHOW autovacuum", &[]).await?.get(0);
    let clean = (
        clean_rate(ctx, Side::Inbox).await?,
        clean_rate(ctx, Side::Raw).await?,
    );
    let offered = ((clean.0 * OFFERED).round(), (clean.1 * OFFERED).round());
    let phases = schedule(ctx);
    let ours = run_side(ctx, Side::Inbox, offered.0, &phases).await?;
    let theirs = run_side(ctx, Side::Raw, offered.1, &phases).await?;
    let push = |rows: &mut Vec<Row>, row: Row| {
        super::report::print_row(&row);
        rows.push(row);
    };
    push(
        &mut rows,
        Row::new(
            12,
            "12. clean rate, closed loop",
            Some(WORKERS),
            (Some(clean.0), Some(clean.1)),
            "jobs/s",
            Target::None,
        )
        .note(format!(
            "offered to each side {OFFERED} of its own: inbox {:.0}, raw {:.0} jobs/s; \
             autovacuum {autovacuum}",
            offered.0, offered.1
        )),
    );
    let of = |windows: &[Window], phase: usize| -> Vec<Window> {
        windows
            .iter()
            .filter(|w| w.phase == phase)
            .copied()
            .collect()
    };
    let clean_median = |windows: &[Window]| median(of(windows, 0).iter().map(|w| w.done).collect());
    let (ours_clean, theirs_clean) = (clean_median(&ours), clean_median(&theirs));
    let clean_size = |windows: &[Window]| of(windows, 0).last().map_or(0.0, |w| w.size_mb);
    push(
        &mut rows,
        Row::new(
            12,
            "12. clean, median of the 10 s windows",
            Some(WORKERS),
            (Some(ours_clean), Some(theirs_clean)),
            "jobs/s",
            Target::None,
        )
        .note(format!(
            "queue size at the end: inbox {:.1} MB, raw {:.1} MB",
            clean_size(&ours),
            clean_size(&theirs)
        )),
    );
    let trail = |windows: &[Window], clean: f64| {
        windows
            .iter()
            .map(|w| {
                format!(
                    "{:.2} ({:.0} ms, {:.0} MB, {} dead)",
                    w.done / clean.max(1.0),
                    w.p99,
                    w.size_mb,
                    w.dead
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    for (i, phase) in phases.iter().enumerate() {
        let Some(holder) = phase.holder else { continue };
        let (o, t) = (of(&ours, i), of(&theirs, i));
        let worst = |w: &[Window], clean: f64| {
            w.iter()
                .map(|w| w.done / clean.max(1.0))
                .fold(f64::INFINITY, f64::min)
        };
        let p99 = |w: &[Window]| w.iter().map(|w| w.p99).fold(0.0, f64::max);
        let held = format!("12. {} {} s", holder.name(), phase.secs);
        push(
            &mut rows,
            Row::new(
                12,
                format!("{held}: worst 10 s / clean"),
                Some(WORKERS),
                (Some(worst(&o, ours_clean)), Some(worst(&t, theirs_clean))),
                "x",
                Target::InboxAtLeast(0.8),
            )
            .note(format!(
                "each 10 s, done / clean (p99, size, dead tuples): inbox {}; raw {}; \
                 enqueued/s inbox {:.0}, raw {:.0} (median)",
                trail(&o, ours_clean),
                trail(&t, theirs_clean),
                median(o.iter().map(|w| w.enqueued).collect()),
                median(t.iter().map(|w| w.enqueued).collect()),
            )),
        );
        push(
            &mut rows,
            Row::new(
                12,
                format!("{held}: worst 10 s p99, enqueue->handler"),
                Some(WORKERS),
                (Some(p99(&o)), Some(p99(&t))),
                "ms",
                Target::InboxBelow(100.0),
            ),
        );
        if let Some(recovery) = phases.get(i + 1) {
            let (o, t) = (of(&ours, i + 1), of(&theirs, i + 1));
            let size = |w: &[Window], clean: f64| w.last().map(|w| w.size_mb / clean.max(0.001));
            let target = if phase.secs >= 600 {
                Target::InboxBelow(2.0)
            } else {
                Target::None
            };
            push(
                &mut rows,
                Row::new(
                    12,
                    format!("{held}: size {} s after / clean size", recovery.secs),
                    Some(WORKERS),
                    (size(&o, clean_size(&ours)), size(&t, clean_size(&theirs))),
                    "x",
                    target,
                )
                .note(format!(
                    "recovery, each 10 s: inbox {}; raw {}",
                    trail(&o, ours_clean),
                    trail(&t, theirs_clean)
                )),
            );
        }
    }
    Ok(rows)
}
