//! The refunds service on Postgres: `./scripts/demo.sh` runs it against a fresh database.
//!
//! Support publishes refunds into `refund_jobs`, some twice. Each delivery writes the refund's
//! record and enqueues a receipt for the mailer on the delivery's transaction, and calls the
//! card processor, which times out on some first calls. The record, the receipt and the job's
//! settlement commit together, so whatever is retried or duplicated, each order ends with one
//! refund and one receipt; the processor, outside the database, is called at least once per
//! order and refunds once because the order is its idempotency key.
//!
//! The delivery also publishes a `RefundIssued` event through the outbox `refund_events`, keyed
//! by the order, on the same transaction: the event exists only if the refund commits. A relay
//! sends the outbox into NATS JetStream (stream `REFUNDS`, subjects `refunds.>`, the message id
//! as `Nats-Msg-Id`), and a notifier reads the stream with a pull consumer: it claims each
//! message id in its ledger `refund_events_seen` on the transaction that records the customer's
//! notification, and acks the message only after that commit. A share of its acks is lost, as
//! when the notifier dies between its commit and its ack: JetStream delivers those messages
//! again, and the ledger skips them. So each refund notifies its customer once.
//!
//! The demo starts its own `nats-server -js` on a free port with a temporary store (killed when
//! the demo ends), or uses the server `NATS_URL` names, where it recreates the stream `REFUNDS`.
//!
//! Options: `--orders N` (default 3000), `--duplicates PERCENT` (10), `--timeouts PERCENT` (15),
//! `--lost-acks PERCENT` (3), `--workers N` (8).

use std::collections::HashMap;
use std::fs;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream, AckKind};
use futures_util::StreamExt;
use inbox_client::outbox::{NatsSink, Outbox, Relay};
use inbox_client::worker::{transactional, Job, Outcome, RetryPolicy, Worker, WorkerStats};
use inbox_client::{
    Clock, Database, DbError, ErrorKind, Inbox, PgDatabase, Queue, Statement, SystemClock,
    DATABASE_URL,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// A refund support asked for.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Refund {
    order: i64,
    amount_cents: i32,
}

/// What the mailer's queue receives.
#[derive(Serialize)]
struct Receipt {
    order: i64,
}

/// The event each committed refund publishes through the outbox.
#[derive(Serialize, Deserialize)]
struct RefundIssued {
    order: i64,
    amount_cents: i32,
}

/// The outbox the refunds service publishes into, and the relay drains.
const OUTBOX: &str = "refund_events";
/// The subject of its events, in the stream [`STREAM`] of `refunds.>`.
const SUBJECT: &str = "refunds.issued";
const STREAM: &str = "REFUNDS";
/// The notifier's durable pull consumer, and its ledger of the message ids it applied.
const CONSUMER: &str = "notifier";
const LEDGER: &str = "refund_events_seen";
/// How long JetStream waits for the notifier's ack before it delivers a message again.
const ACK_WAIT: Duration = Duration::from_secs(2);

/// `notified_customers` has no key of its own: only the ledger keeps an event from notifying
/// twice.
const SCHEMA: &str = "
DROP TABLE IF EXISTS refunds, refund_jobs, receipt_jobs, refund_events, refund_events_seen,
    notified_customers;
CREATE TABLE refunds (order_id bigint PRIMARY KEY, amount_cents integer NOT NULL);
SELECT inbox_create_queue('refund_jobs');
SELECT inbox_create_queue('receipt_jobs');
CREATE TABLE notified_customers (
    order_id bigint NOT NULL,
    amount_cents integer NOT NULL,
    message_id text NOT NULL
);
";

/// The card processor: outside the database, so only its idempotency key makes a repeated call
/// harmless. It times out on the first call for a share of the orders.
#[derive(Default)]
struct CardProcessor {
    timeout_percent: u64,
    calls: Mutex<HashMap<i64, u32>>,
    refunded: Mutex<HashMap<i64, i32>>,
}

impl CardProcessor {
    async fn refund(&self, refund: &Refund) -> bool {
        tokio::time::sleep(Duration::from_micros(200)).await;
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let call = calls.entry(refund.order).or_default();
            *call += 1;
            *call
        };
        if call == 1 && (refund.order as u64 * 2_654_435_761) % 100 < self.timeout_percent {
            return false;
        }
        // The order is the idempotency key: a second successful call refunds nothing more.
        let mut refunded = self.refunded.lock().unwrap_or_else(|e| e.into_inner());
        refunded.entry(refund.order).or_insert(refund.amount_cents);
        true
    }
}

struct Options {
    orders: i64,
    duplicate_percent: i64,
    timeout_percent: u64,
    lost_ack_percent: i64,
    workers: usize,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        orders: 3000,
        duplicate_percent: 10,
        timeout_percent: 15,
        lost_ack_percent: 3,
        workers: 8,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<i64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--orders" => options.orders = number(&value)?.max(1),
            "--duplicates" => options.duplicate_percent = number(&value)?.clamp(0, 100),
            "--timeouts" => options.timeout_percent = number(&value)?.clamp(0, 100) as u64,
            "--lost-acks" => options.lost_ack_percent = number(&value)?.clamp(0, 100),
            "--workers" => options.workers = number(&value)?.max(1) as usize,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(problem) => {
            eprintln!("NOT verified: {problem}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let options = options()?;
    let url = std::env::var(DATABASE_URL).map_err(|_| format!("set {DATABASE_URL}"))?;
    // The workers' transactions, the relay's, the notifier's and the progress line's.
    let db = PgDatabase::connect_with_size(&url, Some(options.workers + 6))
        .await
        .map_err(|e| e.to_string())?;
    let setup = db.pool().get().await.map_err(|e| e.to_string())?;
    setup
        .batch_execute(SCHEMA)
        .await
        .map_err(|e| e.to_string())?;
    drop(setup);
    let outbox = Outbox::new(OUTBOX);
    db.query(&outbox.create_statement())
        .await
        .map_err(|e| e.to_string())?;
    let ledger = Inbox::new(LEDGER);
    db.execute(&Statement::new(ledger.create_table_sql()))
        .await
        .map_err(|e| e.to_string())?;

    // NATS JetStream: the demo's own server unless NATS_URL names one. Dropped at the end of
    // `run`, whatever it returns, which kills the server.
    let (_server, nats_url) = match std::env::var("NATS_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let server = NatsServer::start()?;
            let url = server.url();
            (Some(server), url)
        }
    };
    let nats = async_nats::connect(&nats_url)
        .await
        .map_err(|e| format!("connect to NATS at {nats_url}: {e}"))?;
    let js = jetstream::new(nats);
    let (stream, consumer) = refunds_stream(&js).await?;
    println!("NATS JetStream at {nats_url}: stream {STREAM} (refunds.>), pull consumer {CONSUMER}");

    // Support publishes the refunds; a share of the orders twice.
    let mut published: Vec<Refund> = (1..=options.orders)
        .map(|order| Refund {
            order,
            amount_cents: 500 + (order % 97) as i32 * 25,
        })
        .collect();
    let duplicates: Vec<Refund> = published
        .iter()
        .filter(|refund| refund.order % 100 < options.duplicate_percent)
        .cloned()
        .collect();
    published.extend(duplicates.iter().cloned());
    let refund_jobs = Queue::new("refund_jobs");
    for chunk in published.chunks(500) {
        refund_jobs
            .enqueue_batch(&db, chunk)
            .await
            .map_err(|e| e.to_string())?;
    }
    println!(
        "published {} refunds for {} orders ({} twice); the card processor times out on {}% of first calls",
        published.len(),
        options.orders,
        duplicates.len(),
        options.timeout_percent
    );

    let processor = Arc::new(CardProcessor {
        timeout_percent: options.timeout_percent,
        ..Default::default()
    });
    // Publishes of RefundIssued by deliveries: committed, or rolled back with them (a retry, or
    // a replay of the group the delivery ran in, when a later delivery of the group failed).
    let publishes = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(AtomicU64::new(0));
    let handler = {
        let (processor, dropped, publishes) =
            (processor.clone(), dropped.clone(), publishes.clone());
        transactional(move |job: Job<Refund>, tx: &dyn Database| {
            let (processor, dropped, publishes) =
                (processor.clone(), dropped.clone(), publishes.clone());
            Box::pin(async move {
                let refund = job.payload;
                match record(tx, &refund).await {
                    Ok(()) => {}
                    Err(error) if error.kind() == ErrorKind::UniqueViolation => {
                        // A duplicate publication: this order is refunded already.
                        dropped.fetch_add(1, Ordering::Relaxed);
                        return Ok(Outcome::drop(format!(
                            "order {} already refunded",
                            refund.order
                        )));
                    }
                    Err(error) => return Err(error.into()),
                }
                publishes.fetch_add(1, Ordering::Relaxed);
                if !processor.refund(&refund).await {
                    // The retry rolls the record, the receipt and the event back first.
                    return Ok(Outcome::retry_after(Duration::from_millis(20)));
                }
                Ok(Outcome::ack())
            })
        })
    };
    // The relay and the notifier run alongside the workers.
    let stop = CancellationToken::new();
    let relay = Relay::new(db.clone(), OUTBOX, NatsSink::new(js.clone()));
    let relayed = relay.counts();
    let relay = tokio::spawn(relay.run(stop.clone()));
    let notifier = Arc::new(NotifierCounts::default());
    let notifier_task = tokio::spawn(notify(
        db.clone(),
        consumer,
        options.lost_ack_percent,
        notifier.clone(),
        stop.clone(),
    ));

    let started = Instant::now();
    let worker = Worker::transactional(db.clone(), "refund_jobs", handler)
        .workers(options.workers)
        .retry(RetryPolicy {
            base: Duration::from_millis(20),
            ..RetryPolicy::default()
        })
        .poll_interval(Duration::from_millis(50))
        .start();

    let progress = ProgressBar::new(published.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs settled  {per_sec}  {msg}")
            .map_err(|e| e.to_string())?,
    );
    loop {
        let stats = worker.stats();
        progress.set_position(stats.acked + stats.dead);
        progress.set_message(format!(
            "{} retried, {} events relayed, {} notified",
            stats.retried,
            relayed.sent(),
            notifier.applied.load(Ordering::Relaxed)
        ));
        let queue = refund_jobs.stats(&db).await.map_err(|e| e.to_string())?;
        if queue.ready + queue.delayed + queue.leased == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let stats = worker.shutdown(Duration::from_secs(10)).await;
    progress.set_position(stats.acked + stats.dead);
    progress.finish();

    // The last events: the outbox drained into the stream, and every message of the stream
    // acked by the notifier (the ones whose ack was lost after JetStream delivered them again).
    let mut watched = stream
        .get_consumer::<consumer::pull::Config>(CONSUMER)
        .await
        .map_err(|e| format!("consumer {CONSUMER}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let unsent = outbox.stats(&db).await.map_err(|e| e.to_string())?;
        let info = watched
            .info()
            .await
            .map_err(|e| format!("consumer {CONSUMER}: {e}"))?;
        if unsent.pending + unsent.sending + unsent.retrying == 0
            && info.num_pending == 0
            && info.num_ack_pending == 0
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "events still in flight after 60 s: {} in the outbox, {} not delivered to {CONSUMER}, \
                 {} not acked",
                unsent.pending + unsent.sending + unsent.retrying,
                info.num_pending,
                info.num_ack_pending
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    relay
        .await
        .map_err(|e| format!("relay: {e}"))?
        .map_err(|e| format!("relay: {e}"))?;
    notifier_task
        .await
        .map_err(|e| format!("notifier: {e}"))??;
    let in_stream = stream
        .get_info()
        .await
        .map_err(|e| format!("stream {STREAM}: {e}"))?
        .state
        .messages;

    report(
        &stats,
        dropped.load(Ordering::Relaxed),
        published.len(),
        elapsed,
    );
    let calls: u64 = processor
        .calls
        .lock()
        .map(|calls| calls.values().map(|&n| u64::from(n)).sum())
        .unwrap_or(0);
    let called = processor.calls.lock().map(|c| c.len()).unwrap_or(0);
    println!("processor calls:        {calls} for {called} orders");
    let publishes = publishes.load(Ordering::Relaxed);
    println!(
        "events published:       {publishes} by deliveries, {} rolled back with them (retries, replays)",
        publishes.saturating_sub(relayed.sent())
    );
    println!(
        "relayed to NATS:        {} in {} batches ({} duplicates, {} failed publishes)",
        relayed.sent(),
        relayed.batches(),
        relayed.duplicates(),
        relayed.failed()
    );
    println!(
        "notifier:               {} applied, {} acks lost, {} redeliveries skipped by the ledger",
        notifier.applied.load(Ordering::Relaxed),
        notifier.lost_acks.load(Ordering::Relaxed),
        notifier.skipped.load(Ordering::Relaxed)
    );
    let events = Events {
        outbox: &outbox,
        in_stream,
        lost_acks: notifier.lost_acks.load(Ordering::Relaxed),
        skipped: notifier.skipped.load(Ordering::Relaxed),
    };
    verify(&db, &options, &processor, duplicates.len() as i64, &events).await
}

/// The refund's record, its receipt and its event, written on the delivery's transaction.
async fn record(tx: &dyn Database, refund: &Refund) -> Result<(), DbError> {
    tx.execute(
        &Statement::new("INSERT INTO refunds (order_id, amount_cents) VALUES ($1, $2)")
            .bind(refund.order)
            .bind(refund.amount_cents),
    )
    .await?;
    Queue::new("receipt_jobs")
        .enqueue(
            tx,
            &Receipt {
                order: refund.order,
            },
            None,
            None,
        )
        .await?;
    // Keyed by the order: the events of one order reach the stream in commit order.
    Outbox::new(OUTBOX)
        .publish(
            tx,
            SUBJECT,
            &RefundIssued {
                order: refund.order,
                amount_cents: refund.amount_cents,
            },
            Some(&refund.order.to_string()),
        )
        .await?;
    Ok(())
}

/// The stream `REFUNDS` of `refunds.>`, made anew (a stream left by an earlier run would drop
/// this run's message ids as duplicates of its own), and the notifier's durable pull consumer.
async fn refunds_stream(
    js: &jetstream::Context,
) -> Result<(stream::Stream, consumer::PullConsumer), String> {
    if js.get_stream(STREAM).await.is_ok() {
        js.delete_stream(STREAM)
            .await
            .map_err(|e| format!("delete stream {STREAM}: {e}"))?;
    }
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["refunds.>".to_owned()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("create stream {STREAM}: {e}"))?;
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(CONSUMER.to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("create consumer {CONSUMER}: {e}"))?;
    Ok((stream, consumer))
}

/// What the notifier did.
#[derive(Default)]
struct NotifierCounts {
    /// Messages whose claim and notification committed.
    applied: AtomicU64,
    /// Deliveries of a message id the ledger had: nothing applied again.
    skipped: AtomicU64,
    /// Acks not sent after the commit (the notifier "died" in between).
    lost_acks: AtomicU64,
}

/// The notifier: for each message of the stream, claims its `Nats-Msg-Id` in the ledger and
/// records the notification in one transaction, then acks. A message whose transaction failed is
/// not acked (a nak: JetStream delivers it again); a malformed one is terminated.
async fn notify(
    db: PgDatabase,
    consumer: consumer::PullConsumer,
    lost_ack_percent: i64,
    counts: Arc<NotifierCounts>,
    stop: CancellationToken,
) -> Result<(), String> {
    let ledger = Inbox::new(LEDGER);
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("consume {CONSUMER}: {e}"))?;
    loop {
        let message = tokio::select! {
            next = messages.next() => match next {
                Some(Ok(message)) => message,
                Some(Err(error)) => {
                    tracing::warn!(%error, "reading the stream");
                    continue;
                }
                None => return Ok(()),
            },
            () = stop.cancelled() => return Ok(()),
        };
        let id = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(|id| id.as_str().to_owned());
        let event = serde_json::from_slice::<RefundIssued>(&message.payload);
        let (Some(id), Ok(event)) = (id, event) else {
            tracing::error!(subject = %message.subject, "not a RefundIssued message; terminated");
            let _ = message.ack_with(AckKind::Term).await;
            continue;
        };
        let effect = [Statement::new(
            "INSERT INTO notified_customers (order_id, amount_cents, message_id) VALUES ($1, $2, $3)",
        )
        .bind(event.order)
        .bind(event.amount_cents)
        .bind(id.as_str())];
        match ledger
            .claim_with(&db, &id, &SystemClock.now_rfc3339(), &effect)
            .await
        {
            Ok(true) => {
                counts.applied.fetch_add(1, Ordering::Relaxed);
                let first = message.info().map(|info| info.delivered == 1);
                if first.unwrap_or(false) && loses_ack(event.order, lost_ack_percent) {
                    // Committed, never acked: JetStream delivers it again after ACK_WAIT.
                    counts.lost_acks.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            Ok(false) => {
                counts.skipped.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => {
                tracing::warn!(%error, %id, "notification not recorded; delivered again");
                let _ = message
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(200))))
                    .await;
                continue;
            }
        }
        // Only after the commit: an ack lost here means one more delivery, which the ledger skips.
        if let Err(error) = message.ack().await {
            tracing::warn!(%error, %id, "ack failed; the ledger skips the redelivery");
        }
    }
}

/// Whether the notifier loses its ack of the first delivery of `order`'s event.
fn loses_ack(order: i64, percent: i64) -> bool {
    (order.unsigned_abs().wrapping_mul(40_503) >> 3) % 100 < percent.unsigned_abs()
}

/// A `nats-server -js` of the demo's own, on a free loopback port with its store in a temporary
/// directory; killed, and the directory removed, when dropped.
struct NatsServer {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl NatsServer {
    fn start() -> Result<Self, String> {
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .map(PathBuf::from)
            .chain(
                std::env::var_os("PATH")
                    .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
                    .unwrap_or_default()
                    .into_iter()
                    .map(|dir| dir.join("nats-server")),
            )
            .find(|path| path.is_file())
            .ok_or(
                "nats-server is not installed: `apt-get install -y nats-server` (scripts/lib.sh's \
                 ensure_toolchain does it), or set NATS_URL to a server with JetStream",
            )?;
        let dir = std::env::temp_dir().join(format!("inbox-refunds-nats-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let port = TcpListener::bind(("127.0.0.1", 0))
            .and_then(|listener| listener.local_addr())
            .map_err(|e| format!("find a free port: {e}"))?
            .port();
        let config = dir.join("nats.conf");
        fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{\n  store_dir: \"{}\"\n}}\n",
                dir.join("store").display()
            ),
        )
        .map_err(|e| format!("write {}: {e}", config.display()))?;
        let log = fs::File::create(dir.join("nats.log")).map_err(|e| format!("nats.log: {e}"))?;
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start {}: {e}", binary.display()))?;
        let mut server = Self { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            let exited = server.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let log = fs::read_to_string(server.dir.join("nats.log")).unwrap_or_default();
                return Err(format!("nats-server did not listen on {port}:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// What the events' check needs besides the database.
struct Events<'a> {
    outbox: &'a Outbox,
    in_stream: u64,
    lost_acks: u64,
    skipped: u64,
}

fn report(stats: &WorkerStats, dropped: u64, published: usize, elapsed: Duration) {
    println!("processed:              {}", stats.acked);
    println!("retried:                {}", stats.retried);
    println!("dropped as duplicates:  {dropped}");
    println!(
        "dead-lettered (other):  {}",
        stats.dead.saturating_sub(dropped)
    );
    println!("handler failures:       {}", stats.failed);
    println!(
        "throughput:             {:.0} jobs/s ({published} jobs in {:.2} s)",
        published as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
}

/// Checks the database: one refund and one receipt per order, none twice, and every duplicate
/// dropped; the processor refunded each order once; each refund published one event, which is in
/// the stream once and notified its customer once, and no rolled-back delivery left one.
async fn verify(
    db: &PgDatabase,
    options: &Options,
    processor: &CardProcessor,
    duplicates: i64,
    events: &Events<'_>,
) -> Result<(), String> {
    let count = |sql: &'static str| async move {
        let rows = db
            .query(&Statement::new(sql))
            .await
            .map_err(|e| e.to_string())?;
        rows.one()
            .and_then(|row| row.get::<i64>("n"))
            .map_err(|e| e.to_string())
    };
    let orders = options.orders;
    let refunds = count("SELECT count(*) AS n FROM refunds").await?;
    let distinct_refunds = count("SELECT count(DISTINCT order_id) AS n FROM refunds").await?;
    let receipts = count("SELECT count(*) AS n FROM receipt_jobs").await?;
    let distinct_receipts =
        count("SELECT count(DISTINCT (payload->>'order')) AS n FROM receipt_jobs").await?;
    let dead =
        count("SELECT count(*) AS n FROM refund_jobs WHERE locked_until = 'infinity'").await?;
    let pending =
        count("SELECT count(*) AS n FROM refund_jobs WHERE locked_until <> 'infinity'").await?;
    let refunded = processor
        .refunded
        .lock()
        .map(|r| r.len() as i64)
        .unwrap_or(-1);
    let mut problems = Vec::new();
    if refunds != orders || distinct_refunds != orders {
        problems.push(format!(
            "{refunds} refund rows for {distinct_refunds} of {orders} orders"
        ));
    }
    if receipts != orders || distinct_receipts != orders {
        problems.push(format!(
            "{receipts} receipt jobs for {distinct_receipts} of {orders} orders"
        ));
    }
    if dead != duplicates {
        problems.push(format!(
            "{dead} refund jobs dead-lettered, {duplicates} duplicates published"
        ));
    }
    if pending != 0 {
        problems.push(format!("{pending} refund jobs still queued"));
    }
    if refunded != orders {
        problems.push(format!(
            "the processor refunded {refunded} of {orders} orders"
        ));
    }
    let outbox = events.outbox.stats(db).await.map_err(|e| e.to_string())?;
    let sent = outbox.sent;
    let unsent = outbox.pending + outbox.sending + outbox.retrying + outbox.dead;
    let notified = count("SELECT count(*) AS n FROM notified_customers").await?;
    let distinct_notified =
        count("SELECT count(DISTINCT order_id) AS n FROM notified_customers").await?;
    let claimed = count("SELECT count(*) AS n FROM refund_events_seen").await?;
    // A notification of the refund as committed, under a message id the ledger claimed.
    let matching = count(
        "SELECT count(*) AS n FROM notified_customers n
         JOIN refunds r ON r.order_id = n.order_id AND r.amount_cents = n.amount_cents
         JOIN refund_events_seen s ON s.event_key = n.message_id",
    )
    .await?;
    let in_stream = events.in_stream as i64;
    if sent != orders || unsent != 0 {
        problems.push(format!(
            "the outbox relayed {sent} events for {orders} orders, {unsent} left (dead: {})",
            outbox.dead
        ));
    }
    if in_stream != orders {
        problems.push(format!(
            "{in_stream} events in the stream for {orders} orders"
        ));
    }
    if notified != orders || distinct_notified != orders || matching != orders {
        problems.push(format!(
            "{notified} notifications for {distinct_notified} of {orders} orders ({matching} \
             match a refund and a claimed message id)"
        ));
    }
    if claimed != orders {
        problems.push(format!(
            "the ledger claimed {claimed} message ids for {orders} orders"
        ));
    }
    if events.skipped < events.lost_acks {
        problems.push(format!(
            "{} acks lost but only {} redeliveries seen",
            events.lost_acks, events.skipped
        ));
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    println!(
        "verified: exactly once ({orders} orders, {refunds} refunds, {receipts} receipts; \
         events: {sent} published, {in_stream} in the stream, {notified} consumed exactly once)"
    );
    Ok(())
}
