//! Figures 8 to 10: enqueues from many connections while a worker consumes the queue
//! (wake-ups on), the queue's size through 1,000,000 jobs consumed by the worker (which vacuums
//! it), and the worker's throughput before, during and after a snapshot held open.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt};
use inbox_client::worker::{transactional, Job, Outcome, Worker, WorkerHandle};
use inbox_client::Database;
use serde_json::json;
use tokio_postgres::{AsyncMessage, Client};

use super::figures::Payload;
use super::measure::{compare, retrying, Row, Target};
use super::sessions::{run_clients, Step};
use super::setup::*;

fn push(rows: &mut Vec<Row>, row: Row) {
    super::report::print_row(&row);
    rows.push(row);
}

pub const SHUTDOWN: Duration = Duration::from_millis(300);

/// Counts the notifications sent on a queue's channel (a plain LISTEN: it does not sleep on the
/// queue, so it changes nothing about who is notified).
struct NotifyCounter {
    count: Arc<AtomicU64>,
    driver: tokio::task::JoinHandle<()>,
    _client: Client,
}

impl NotifyCounter {
    async fn start(ctx: &Ctx, queue: &str) -> Result<Self> {
        let (client, mut connection) = ctx.config.connect(tokio_postgres::NoTls).await?;
        let count = Arc::new(AtomicU64::new(0));
        let counted = count.clone();
        let driver = tokio::spawn(async move {
            let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(_) = message {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let channel: String = client
            .query_one("SELECT inbox_channel($1::text::regclass)", &[&queue])
            .await?
            .get(0);
        client.batch_execute(&format!("LISTEN {channel}")).await?;
        Ok(Self {
            count,
            driver,
            _client: client,
        })
    }

    fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for NotifyCounter {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The consumer running beside figure 10's producers.
#[derive(Clone, Copy, Debug)]
enum Consumer {
    /// `Worker::transactional` (lease), 4 deliveries: slower than the producers, never idle.
    Transactional,
    /// `Worker::plain`, 100 deliveries, batches of 100: faster than the producers, so it runs
    /// out of work, sleeps and is woken over and over.
    Plain,
}

/// The raw side's worker polls every 5 ms (raw `INSERT`s wake no one), so that both sides'
/// consumers take the jobs as promptly and load the server alike.
fn start_consumer(ctx: &Ctx, side: Side, consumer: Consumer) -> Result<WorkerHandle> {
    let (db, queue) = (ctx.database(12)?, side.queue());
    let poll = match side {
        Side::Inbox => Duration::from_millis(500),
        Side::Raw => Duration::from_millis(5),
    };
    Ok(match consumer {
        Consumer::Transactional => {
            let handler = transactional(|_job: Job<Payload>, _tx: &dyn Database| {
                Box::pin(async { Ok(Outcome::ack()) })
            });
            Worker::transactional(db, queue, handler)
                .workers(4)
                .poll_interval(poll)
                .start()
        }
        Consumer::Plain => {
            Worker::plain(db, queue, |_job: Job<Payload>| async { Ok(Outcome::ack()) })
                .workers(100)
                .batch_size(100)
                .start()
        }
    })
}

/// What one measurement of figure 10 saw besides its rate.
#[derive(Clone, Copy, Default)]
struct Beside {
    enqueued: u64,
    notifications: u64,
    handled: u64,
}

/// One side of figure 10: `connections` producers enqueue one job per call (the inbox side with
/// wake-ups on, as by default) while `consumer` works the same queue.
async fn enqueue_beside(
    ctx: &Ctx,
    side: Side,
    connections: usize,
    consumer: Consumer,
    seen: &Mutex<Vec<Beside>>,
) -> Result<f64> {
    let queue = side.queue();
    let admin = ctx.connect().await?;
    truncate(&admin, &[queue]).await?;
    let counter = NotifyCounter::start(ctx, queue).await?;
    let worker = start_consumer(ctx, side, consumer)?;
    // Let the worker find the queue empty and go to sleep.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let step = Step::Enqueue {
        side,
        batch: 1,
        notify: true,
    };
    let rate = run_clients(ctx, connections, step).await;
    let notifications = counter.count();
    let stats = worker.shutdown(SHUTDOWN).await;
    let rate = rate?;
    let left: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {queue}"), &[])
        .await?
        .get(0);
    if let Ok(mut seen) = seen.lock() {
        seen.push(Beside {
            enqueued: stats.acked + left as u64,
            notifications,
            handled: stats.acked,
        });
    }
    Ok(rate)
}

/// Figure 10: enqueue, one job per call, wake-ups on, while a worker consumes the queue, against
/// plain `INSERT`s into a queue consumed by the same worker (which then only polls).
pub async fn wakeups(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (consumer, name) in [
        (
            Consumer::Transactional,
            "10. enqueue beside a busy worker (tx, 4)",
        ),
        (
            Consumer::Plain,
            "10. enqueue beside an idle-prone worker (plain, 100)",
        ),
    ] {
        for &n in &ctx.opts.connections {
            let (ours_seen, theirs_seen) = (Mutex::new(Vec::new()), Mutex::new(Vec::new()));
            let (ours, theirs) = compare(
                ctx.opts.rounds,
                || enqueue_beside(ctx, Side::Inbox, n, consumer, &ours_seen),
                || enqueue_beside(ctx, Side::Raw, n, consumer, &theirs_seen),
            )
            .await?;
            let sum = |seen: &Mutex<Vec<Beside>>| {
                seen.lock().map_or_else(
                    |_| Beside::default(),
                    |seen| {
                        seen.iter().fold(Beside::default(), |a, b| Beside {
                            enqueued: a.enqueued + b.enqueued,
                            notifications: a.notifications + b.notifications,
                            handled: a.handled + b.handled,
                        })
                    },
                )
            };
            let (o, t) = (sum(&ours_seen), sum(&theirs_seen));
            let note = format!(
                "inbox: {} NOTIFYs for {} enqueues ({:.1} per 1,000), the worker handled {}; \
                 raw (plain INSERT, no NOTIFY, the worker polls every 5 ms): it handled {} of {}",
                o.notifications,
                o.enqueued,
                1000.0 * o.notifications as f64 / o.enqueued.max(1) as f64,
                o.handled,
                t.handled,
                t.enqueued
            );
            push(
                &mut rows,
                Row::new(
                    10,
                    name,
                    Some(n),
                    (Some(ours), Some(theirs)),
                    "jobs/s",
                    Target::RatioAtLeast(0.9),
                )
                .note(note),
            );
        }
    }
    Ok(rows)
}

/// The size of a queue at one point of figure 11.
#[derive(Clone, Copy, Debug, Default)]
struct Point {
    jobs: u64,
    seconds: f64,
    total: i64,
    dead: i64,
    vacuums: i64,
    autovacuums: i64,
}

async fn point(client: &Client, table: &str, jobs: u64, seconds: f64) -> Result<Point> {
    let row = client
        .query_one(
            "SELECT pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0), \
                    coalesce(s.vacuum_count, 0), coalesce(s.autovacuum_count, 0) \
               FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
              WHERE c.oid = $1::text::regclass",
            &[&table],
        )
        .await?;
    Ok(Point {
        jobs,
        seconds,
        total: row.try_get(0)?,
        dead: row.try_get(1)?,
        vacuums: row.try_get(2)?,
        autovacuums: row.try_get(3)?,
    })
}

/// Samples the size of `table` each time `done` passes another `every` jobs, until `total`.
async fn sample(
    ctx: &Ctx,
    table: &str,
    done: &AtomicU64,
    every: u64,
    total: u64,
    label: &str,
) -> Result<Vec<Point>> {
    let client = ctx.connect().await?;
    let started = Instant::now();
    let mut points: Vec<Point> = Vec::new();
    let mut next = every;
    while next <= total {
        let jobs = done.load(Ordering::Relaxed);
        if jobs >= next {
            let p = point(&client, table, jobs, started.elapsed().as_secs_f64()).await?;
            let previous = points.last().copied().unwrap_or_default();
            eprintln!(
                "  11. {label}: {}k jobs, {:.1} MiB, {} dead rows, {} vacuums + {} autovacuums, {:.0} jobs/s since {}k",
                jobs / 1000,
                p.total as f64 / 1048576.0,
                p.dead,
                p.vacuums,
                p.autovacuums,
                (p.jobs - previous.jobs) as f64 / (p.seconds - previous.seconds).max(1e-3),
                previous.jobs / 1000
            );
            points.push(p);
            next += every;
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(points)
}

/// The inbox side of figure 11: a plain worker (100 deliveries, batches of 100) consumes the
/// queue, vacuuming it as it sees fit, while one connection keeps it about 1,000 jobs deep with
/// `inbox_enqueue_batch` (100 per call).
async fn churn_worker(ctx: &Ctx, every: u64, total: u64) -> Result<Vec<Point>> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[CHURN_INBOX]).await?;
    let done = Arc::new(AtomicU64::new(0));
    let counted = done.clone();
    let db = ctx.database(12)?;
    let worker = Worker::plain(db, CHURN_INBOX, move |_job: Job<Payload>| {
        counted.fetch_add(1, Ordering::Relaxed);
        async { Ok(Outcome::ack()) }
    })
    .workers(100)
    .batch_size(100)
    .start();
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (done, stop) = (done.clone(), stop.clone());
        let client = ctx.connect().await?;
        tokio::spawn(async move {
            let enqueue = client
                .prepare(&format!(
                    "SELECT inbox_enqueue_batch('{CHURN_INBOX}'::regclass, $1::jsonb[])"
                ))
                .await?;
            let mut enqueued = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                if enqueued < done.load(Ordering::Relaxed) + 1_000 {
                    let payloads: Vec<serde_json::Value> =
                        (0..100).map(|i| json!({ "n": enqueued + i })).collect();
                    client.query(&enqueue, &[&payloads]).await?;
                    enqueued += 100;
                } else {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
            Result::Ok(())
        })
    };
    let points = sample(ctx, CHURN_INBOX, &done, every, total, "inbox worker").await;
    stop.store(true, Ordering::Relaxed);
    producer.await??;
    worker.shutdown(SHUTDOWN).await;
    points
}

/// The raw side of figure 11: figure 6's raw churn (two connections, each inserting 100, leasing
/// 100 and deleting them, in turn), with nothing but autovacuum to vacuum it.
async fn churn_raw(ctx: &Ctx, every: u64, total: u64) -> Result<Vec<Point>> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[CHURN_RAW]).await?;
    fill(&admin, CHURN_RAW, 1_000).await?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let client = ctx.connect().await?;
        let t = CHURN_RAW;
        let insert = client
            .prepare(&format!(
                "INSERT INTO {t} (payload) SELECT p FROM unnest($1::jsonb[]) AS p"
            ))
            .await?;
        let lease = client
            .prepare(&format!(
                "UPDATE {t} SET attempt = attempt + 1, locked_until = now() + interval '30 seconds', \
                 leased_at = now() WHERE id = ANY (ARRAY (SELECT id FROM {t} \
                 WHERE {DUE_IN_INDEX_ORDER} LIMIT 100 \
                 FOR UPDATE SKIP LOCKED)) RETURNING id, attempt::int8"
            ))
            .await?;
        let ack = client
            .prepare(&format!(
                "DELETE FROM {t} AS q USING unnest($1::int8[], $2::int8[]) AS s(id, token) \
                 WHERE q.id = s.id AND q.attempt = s.token AND q.locked_until <> 'infinity'"
            ))
            .await?;
        let (done, stop) = (done.clone(), stop.clone());
        tasks.spawn(async move {
            let mut n = 0_i64;
            while !stop.load(Ordering::Relaxed) {
                let payloads: Vec<serde_json::Value> = (0..100)
                    .map(|_| {
                        n += 1;
                        json!({ "n": n })
                    })
                    .collect();
                client.query(&insert, &[&payloads]).await?;
                let jobs = client.query(&lease, &[]).await?;
                let ids: Vec<i64> = jobs.iter().map(|r| r.get(0)).collect();
                let tokens: Vec<i64> = jobs.iter().map(|r| r.get(1)).collect();
                client.query(&ack, &[&ids, &tokens]).await?;
                done.fetch_add(ids.len() as u64, Ordering::Relaxed);
            }
            Result::Ok(())
        });
    }
    let points = sample(ctx, CHURN_RAW, &done, every, total, "raw").await;
    stop.store(true, Ordering::Relaxed);
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    points
}

/// Figure 11: the queue's size through 1,000,000 jobs (quick: 100,000) consumed by the worker,
/// sampled every tenth, then figure 6's raw churn on its own queue; both at a steady depth of
/// about 1,000 jobs, on the server's settings as they are (autovacuum included).
pub async fn bloat(ctx: &Ctx) -> Result<Vec<Row>> {
    let (first, total) = ctx.opts.churn;
    let settings = ctx.connect().await?;
    let autovacuum: String = settings
        .query_one(
            "SELECT current_setting('autovacuum') || ', naptime ' || current_setting('autovacuum_naptime')",
            &[],
        )
        .await?
        .get(0);
    // One after the other: run together, the raw queue's autovacuum (of a table grown past 100
    // MiB, at full speed) saturates the disk and slows the worker's vacuums several times over.
    let ours = retrying(|| churn_worker(ctx, first, total)).await?;
    let theirs = retrying(|| churn_raw(ctx, first, total)).await?;
    let mib = |bytes: i64| bytes as f64 / 1048576.0;
    let k = |n: u64| format!("{}k", n / 1000);
    let trail = |points: &[Point]| {
        points
            .iter()
            .map(|p| format!("{:.1}", mib(p.total)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (o_first, o_end) = (ours[0], ours[ours.len() - 1]);
    let (t_first, t_end) = (theirs[0], theirs[theirs.len() - 1]);
    let rate = |a: Point, b: Point| (b.jobs - a.jobs) as f64 / (b.seconds - a.seconds).max(1e-3);
    let rates = |points: &[Point]| {
        points
            .windows(2)
            .map(|w| format!("{:.0}", rate(w[0], w[1])))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut rows = Vec::new();
    push(
        &mut rows,
        Row::new(
            11,
            format!("11. worker's queue size after {}", k(first)),
            Some(2),
            (Some(mib(o_first.total)), Some(mib(t_first.total))),
            "MiB",
            Target::None,
        )
        .note(format!(
            "autovacuum {autovacuum}; size (MiB) every {}: inbox {}; raw {}",
            k(first),
            trail(&ours),
            trail(&theirs)
        )),
    );
    push(
        &mut rows,
        Row::new(
            11,
            format!("11. worker's queue size after {}", k(total)),
            Some(2),
            (Some(mib(o_end.total)), Some(mib(t_end.total))),
            "MiB",
            Target::None,
        )
        .note(format!(
            "inbox: {} vacuums by the worker, {} autovacuums, {} dead rows at the end; raw: {} \
             autovacuums, {} dead rows",
            o_end.vacuums, o_end.autovacuums, o_end.dead, t_end.autovacuums, t_end.dead
        )),
    );
    push(
        &mut rows,
        Row::new(
            11,
            format!("11. worker's queue growth {} -> {}", k(first), k(total)),
            Some(2),
            (
                Some(o_end.total as f64 / o_first.total.max(1) as f64),
                Some(t_end.total as f64 / t_first.total.max(1) as f64),
            ),
            "x",
            Target::InboxBelow(2.0),
        ),
    );
    push(
        &mut rows,
        Row::new(
            11,
            format!("11. jobs/s from {} to {}", k(first), k(total)),
            Some(2),
            (Some(rate(o_first, o_end)), Some(rate(t_first, t_end))),
            "jobs/s",
            Target::None,
        )
        .note(format!(
            "jobs/s in each tenth: inbox {}; raw {} (one after the other)",
            rates(&ours),
            rates(&theirs)
        )),
    );
    Ok(rows)
}
