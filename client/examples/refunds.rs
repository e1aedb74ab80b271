//! The refunds service on Postgres: `./scripts/demo.sh` runs it against a fresh database.
//!
//! Support publishes refunds into `refund_jobs`, some twice: the order is each job's dedup key,
//! so a second publication while the first is queued adds nothing. The handler is an
//! `AsyncTxHandler` of the typed job `Refund`. Each delivery writes the refund's row through the
//! delivery's transaction with tokio-postgres (`Tx::client`), then makes two calls outside the
//! database as durable steps (`Job::step`): the card processor's refund, which times out on some
//! first calls, and the receipt e-mail, which the mail service refuses on some first calls. A
//! step's result is recorded as soon as it returns, so a delivery retried because the e-mail
//! failed gets the card refund's record and does not refund the card again; each step passes its
//! `Job::step_key` to its service as the idempotency key. The refund's row and the job's
//! settlement commit together, so each order ends with one refund row, one card refund and one
//! receipt e-mail.
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
//! `--mail-failures PERCENT` (10), `--lost-acks PERCENT` (3), `--workers N` (8).

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
use inbox_client::worker::{
    AsyncTxHandler, HandlerResult, Job, Outcome, RetryPolicy, StepError, Tx, Worker, WorkerStats,
};
use inbox_client::{
    BatchOptions, Clock, Database, Inbox, JobType, PgDatabase, Statement, SystemClock, DATABASE_URL,
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

impl JobType for Refund {
    const QUEUE: &'static str = "refund_jobs";
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
DROP TABLE IF EXISTS refunds, refund_jobs, refund_events, refund_events_seen, notified_customers;
CREATE TABLE refunds (
    order_id bigint PRIMARY KEY,
    amount_cents integer NOT NULL,
    -- The card processor's id of the refund.
    refund_id text NOT NULL
);
SELECT inbox_create_queue('refund_jobs');
CREATE TABLE notified_customers (
    order_id bigint NOT NULL,
    amount_cents integer NOT NULL,
    message_id text NOT NULL
);
";

/// How a service outside the database failed a call.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ServiceError(String);

/// Whether `order` is among the `percent` of orders that a service fails on its first call
/// (`salt` picks a different share for each service).
fn fails_first(order: i64, salt: u64, percent: u64) -> bool {
    (order.unsigned_abs().wrapping_mul(2_654_435_761) ^ salt) % 100 < percent
}

/// A service outside the database that deduplicates by an idempotency key, and counts, per order,
/// the calls it got and the ones it carried out.
#[derive(Default)]
struct Service {
    failure_percent: u64,
    calls: Mutex<HashMap<i64, u32>>,
    failed: AtomicU64,
    done: Mutex<HashMap<String, i64>>,
}

impl Service {
    /// One call for `order` with `key`: fails on the first call for a share of the orders (a
    /// timeout after which nothing was done, say); otherwise done, once per key.
    async fn call(&self, order: i64, key: &str, salt: u64) -> Result<(), ServiceError> {
        tokio::time::sleep(Duration::from_micros(200)).await;
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let call = calls.entry(order).or_default();
            *call += 1;
            *call
        };
        if call == 1 && fails_first(order, salt, self.failure_percent) {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return Err(ServiceError(format!("order {order}: timed out")));
        }
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        done.entry(key.to_owned()).or_insert(order);
        Ok(())
    }

    fn calls(&self) -> u64 {
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.values().map(|&n| u64::from(n)).sum()
    }

    fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Calls that did not fail (a repeated key among them does nothing more).
    fn succeeded(&self) -> u64 {
        self.calls() - self.failed()
    }

    /// Orders carried out, and the most keys carried out for one order.
    fn done(&self) -> (i64, usize) {
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let mut per_order: HashMap<i64, usize> = HashMap::new();
        for order in done.values() {
            *per_order.entry(*order).or_default() += 1;
        }
        (
            per_order.len() as i64,
            per_order.values().copied().max().unwrap_or(0),
        )
    }
}

/// The card processor's refund: `ServiceError` on a timeout; the refund's id otherwise.
async fn refund_card(
    processor: &Service,
    refund: &Refund,
    key: &str,
) -> Result<String, ServiceError> {
    processor.call(refund.order, key, 0).await?;
    Ok(format!("re_{}", refund.order))
}

/// The mail service's receipt e-mail.
async fn send_receipt(mailer: &Service, order: i64, key: &str) -> Result<(), ServiceError> {
    mailer.call(order, key, 0x5bd1_e995).await
}

/// The refunds service's handler, with its outside services and what it counted.
struct RefundService {
    processor: Arc<Service>,
    mailer: Arc<Service>,
    /// Events published by deliveries: committed, or rolled back with them.
    publishes: Arc<AtomicU64>,
    /// Deliveries that found their order refunded already (a publication after the first was done).
    dropped: Arc<AtomicU64>,
    /// Deliveries that reached the card step: those that did not call the processor got its record.
    card_steps: Arc<AtomicU64>,
    /// Card refunds made whose record was lost (the database failed recording the step).
    lost_records: Arc<AtomicU64>,
}

impl AsyncTxHandler<Refund> for RefundService {
    async fn handle(&self, job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
        let refund = &job.payload;
        // The refund's row, through tokio-postgres on the delivery's transaction.
        let client = tx.client().await?;
        let fresh = client
            .execute(
                "INSERT INTO refunds (order_id, amount_cents, refund_id) VALUES ($1, $2, '') \
                 ON CONFLICT (order_id) DO NOTHING",
                &[&refund.order, &refund.amount_cents],
            )
            .await?;
        if fresh == 0 {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::drop(format!(
                "order {} already refunded",
                refund.order
            )));
        }
        // The event, on the same transaction through the `Database` port, keyed by the order: the
        // events of one order reach the stream in commit order.
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
        self.publishes.fetch_add(1, Ordering::Relaxed);
        // Outside the database, once per job: a retry after the e-mail failed gets the record.
        self.card_steps.fetch_add(1, Ordering::Relaxed);
        let key = job.step_key("refund-card");
        let refund_id: String = job
            .step("refund-card", || refund_card(&self.processor, refund, &key))
            .await
            .inspect_err(|error| {
                if matches!(error, StepError::Database { .. }) {
                    self.lost_records.fetch_add(1, Ordering::Relaxed);
                }
            })?;
        let key = job.step_key("receipt-email");
        job.step("receipt-email", || {
            send_receipt(&self.mailer, refund.order, &key)
        })
        .await?;
        client
            .execute(
                "UPDATE refunds SET refund_id = $2 WHERE order_id = $1",
                &[&refund.order, &refund_id],
            )
            .await?;
        Ok(Outcome::ack())
    }
}

struct Options {
    orders: i64,
    duplicate_percent: i64,
    timeout_percent: u64,
    mail_failure_percent: u64,
    lost_ack_percent: i64,
    workers: usize,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        orders: 3000,
        duplicate_percent: 10,
        timeout_percent: 15,
        mail_failure_percent: 10,
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
            "--mail-failures" => {
                options.mail_failure_percent = number(&value)?.clamp(0, 100) as u64;
            }
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

    // Support publishes the refunds; a share of the orders twice. The order is the job's dedup
    // key: a publication while its order's job is queued adds nothing.
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
    let mut jobs = 0;
    for chunk in published.chunks(500) {
        let keys = chunk.iter().map(|r| Some(r.order.to_string())).collect();
        jobs += Refund::queue()
            .enqueue_batch_with(
                &db,
                chunk,
                &BatchOptions {
                    keys: Some(keys),
                    ..BatchOptions::default()
                },
            )
            .await
            .map_err(|e| e.to_string())?
            .len();
    }
    println!(
        "published {} refunds for {} orders ({} twice, {} jobs); the card processor times out on \
         {}% of first calls, the mail service on {}%",
        published.len(),
        options.orders,
        duplicates.len(),
        jobs,
        options.timeout_percent,
        options.mail_failure_percent
    );

    let service = RefundService {
        processor: Arc::new(Service {
            failure_percent: options.timeout_percent,
            ..Service::default()
        }),
        mailer: Arc::new(Service {
            failure_percent: options.mail_failure_percent,
            ..Service::default()
        }),
        publishes: Arc::default(),
        dropped: Arc::default(),
        card_steps: Arc::default(),
        lost_records: Arc::default(),
    };
    let (processor, mailer) = (service.processor.clone(), service.mailer.clone());
    let (publishes, dropped) = (service.publishes.clone(), service.dropped.clone());
    let (card_steps, lost_records) = (service.card_steps.clone(), service.lost_records.clone());
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
    let worker = Worker::transactional_for(db.clone(), service)
        .workers(options.workers)
        .retry(RetryPolicy {
            base: Duration::from_millis(20),
            ..RetryPolicy::default()
        })
        .poll_interval(Duration::from_millis(50))
        .start();

    let progress = ProgressBar::new(jobs as u64).with_style(
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
        let queue = Refund::queue()
            .stats(&db)
            .await
            .map_err(|e| e.to_string())?;
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

    report(&stats, dropped.load(Ordering::Relaxed), jobs, elapsed);
    let card_calls = processor.calls();
    let (refunded, _) = processor.done();
    let card_steps = card_steps.load(Ordering::Relaxed);
    let lost_records = lost_records.load(Ordering::Relaxed);
    println!(
        "card processor:         {card_calls} calls for {refunded} orders: {:.2} refund calls per \
         order; {} timed out and were retried; {lost_records} made again because their record was \
         lost",
        processor.succeeded() as f64 / refunded.max(1) as f64,
        processor.failed(),
    );
    println!(
        "card steps:             {card_steps} deliveries reached the card refund; {} got it from \
         its record instead of calling the processor (retried after the e-mail failed, or replayed)",
        card_steps.saturating_sub(card_calls)
    );
    println!(
        "receipt e-mails:        {} calls, {} refused and retried",
        mailer.calls(),
        mailer.failed()
    );
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
    let services = Services {
        processor: &processor,
        mailer: &mailer,
        lost_records,
    };
    verify(&db, &options, &services, &events).await
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

fn report(stats: &WorkerStats, dropped: u64, jobs: usize, elapsed: Duration) {
    println!("processed:              {}", stats.acked);
    println!("retried:                {}", stats.retried);
    println!("dropped, already done:  {dropped}");
    println!(
        "dead-lettered (other):  {}",
        stats.dead.saturating_sub(dropped)
    );
    println!("handler failures:       {}", stats.failed);
    println!(
        "throughput:             {:.0} jobs/s ({jobs} jobs in {:.2} s)",
        jobs as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
}

/// The services outside the database, and the card refunds whose record was lost.
struct Services<'a> {
    processor: &'a Service,
    mailer: &'a Service,
    lost_records: u64,
}

/// Checks the database and the services: one refund row per order, with the processor's refund
/// id; no job left or dead-lettered; the processor refunded each order once and was called to
/// refund once per order (but for the calls whose record was lost), however many of its jobs'
/// deliveries failed on the e-mail after it; the mail service sent each receipt once; each
/// refund published one event, which is in the stream once and notified its customer once, and
/// no rolled-back delivery left one.
async fn verify(
    db: &PgDatabase,
    options: &Options,
    services: &Services<'_>,
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
    let distinct_refunds = count(
        "SELECT count(DISTINCT order_id) AS n FROM refunds WHERE refund_id = 're_' || order_id",
    )
    .await?;
    let left = count("SELECT count(*) AS n FROM refund_jobs").await?;
    let mut problems = Vec::new();
    if refunds != orders || distinct_refunds != orders {
        problems.push(format!(
            "{refunds} refund rows, {distinct_refunds} of {orders} orders with their refund's id"
        ));
    }
    if left != 0 {
        problems.push(format!(
            "{left} refund jobs left in the queue (dead or queued)"
        ));
    }
    let (refunded, most_refunds) = services.processor.done();
    if refunded != orders || most_refunds != 1 {
        problems.push(format!(
            "the processor refunded {refunded} of {orders} orders, one of them {most_refunds} times"
        ));
    }
    let refund_calls = services.processor.succeeded();
    if refund_calls != orders as u64 + services.lost_records {
        problems.push(format!(
            "{refund_calls} refund calls for {orders} orders and {} lost records: a recorded \
             step was run again",
            services.lost_records
        ));
    }
    let (mailed, most_mails) = services.mailer.done();
    if mailed != orders || most_mails != 1 {
        problems.push(format!(
            "the mail service sent {mailed} of {orders} receipts, one of them {most_mails} times"
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
        "verified: exactly once ({orders} orders, {refunds} refunds, {refund_calls} card refund \
         calls, {mailed} receipts; events: {sent} published, {in_stream} in the stream, \
         {notified} consumed exactly once)"
    );
    Ok(())
}
