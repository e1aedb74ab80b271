//! [`Relay`]: claims an outbox's messages, hands them to a [`Sink`] and settles what the sink
//! answered, holding the outbox's lease while it works.
//!
//! One round: `inbox_relay_claim` (which renews the lease) takes each key's head, up to a batch;
//! the sink publishes the batch; `inbox_relay_sent` deletes what the broker acknowledged and
//! `inbox_relay_failed` schedules the rest for a retry, in one transaction with the next round's
//! claim (one commit a round, not two). Every statement is unnamed with its
//! parameter types, so a relay works through a pooler in transaction mode too.
//!
//! Idle, the holder sleeps on the outbox as workers sleep on a queue (`inbox_sleep`, on a LISTEN
//! connection of its own: publishes notify only while a relay sleeps), waking at least every
//! third of its lease to renew it; without direct connection settings it polls every 250 ms. A relay that
//! finds the lease held by another sleeps until that lease ends, then tries to take it: a killed
//! holder is replaced within one lease period.
//!
//! Every message relayed leaves a dead row, which a relay clears as a worker clears its queue's:
//! it vacuums the outbox when `inbox_vacuum_due` says so (see `crate::vacuum`), on a connection
//! of its own when its port has connection settings.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use super::{headers_from_json, sql, Delivery, Message, Sink};
use crate::error::DbError;
use crate::listen::ListenSession;
use crate::pg::PgDatabase;

/// How often an idle relay that cannot LISTEN (behind a pooler) looks for messages.
const POLL: Duration = Duration::from_millis(250);

/// The first wait of an idle relay whose outbox has due messages it cannot claim yet.
const BLOCKED: Duration = Duration::from_millis(50);

/// What a relay has done so far (for a progress line or metrics); shared with its clones.
#[derive(Debug, Default)]
pub struct RelayCounts {
    sent: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    batches: AtomicU64,
    leading: std::sync::atomic::AtomicBool,
}

impl RelayCounts {
    /// Messages the broker acknowledged and the relay deleted.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Of those, acknowledgements flagged as duplicates.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Publishes that failed (each is retried, or dead-lettered after the last attempt).
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Claims that returned messages.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Whether this relay held the outbox's lease at its last claim.
    pub fn leading(&self) -> bool {
        self.leading.load(Ordering::Relaxed)
    }
}

/// Drains an outbox into a [`Sink`]; see the [module](super) for what it guarantees.
///
/// ```no_run
/// # #[cfg(feature = "nats")]
/// # async fn run(db: inbox_client::PgDatabase) -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_client::outbox::{NatsSink, Relay};
///
/// let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let sink = NatsSink::new(async_nats::jetstream::new(nats));
/// let stop = tokio_util::sync::CancellationToken::new();
/// Relay::new(db, "events", sink).run(stop).await?;
/// # Ok(())
/// # }
/// ```
pub struct Relay<S> {
    db: PgDatabase,
    outbox: String,
    sink: S,
    name: String,
    batch: i32,
    lease: Duration,
    max_attempts: i32,
    vacuum: bool,
    counts: Arc<RelayCounts>,
}

impl<S: Sink> Relay<S> {
    /// A relay of `outbox` (its SQL name) into `sink`, named after this host and process, claiming
    /// up to 1,000 messages a round with a 30 s lease, dead-lettering after 10 attempts.
    pub fn new(db: PgDatabase, outbox: impl Into<String>, sink: S) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "relay".to_owned());
        Self {
            db,
            outbox: outbox.into(),
            sink,
            name: format!("{host}-{}-{:08x}", std::process::id(), fastrand::u32(..)),
            batch: 1000,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            vacuum: true,
            counts: Arc::default(),
        }
    }

    /// This relay known as `name` in `inbox_outbox_stats` (unique among the outbox's relays).
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// At most `batch` messages a round (at least 1).
    #[must_use]
    pub fn batch(mut self, batch: i32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The lease: how long a claim holds the outbox and its messages (at least 1 s). A relay that
    /// dies is replaced this long after its last claim at most.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// Attempts before a message is dead-lettered (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, max_attempts: i32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Whether the relay vacuums the outbox when dead rows pile up (default on), as a worker
    /// vacuums its queue (`docs/operating.md`), on a connection of its own: a relay whose port
    /// was built from a bare pool (no connection settings) leaves the outbox to autovacuum.
    /// Turn it off only where something else vacuums the outbox every few seconds.
    #[must_use]
    pub fn vacuum(mut self, on: bool) -> Self {
        self.vacuum = on;
        self
    }

    /// The counts of what it has done, updated as it runs.
    pub fn counts(&self) -> Arc<RelayCounts> {
        Arc::clone(&self.counts)
    }

    /// Relays until `stop` is cancelled, then settles the round in flight and gives up the lease.
    /// Database errors (a lost connection, a failover) are logged and retried; they do not end it.
    ///
    /// # Errors
    /// Only an error that retrying cannot cure: the outbox does not exist or is not an outbox,
    /// or the role may not use it.
    pub async fn run(self, stop: CancellationToken) -> Result<(), DbError> {
        // Ends with the relay, however it returns.
        let upkeep = stop.child_token();
        let _upkeep_ends = upkeep.clone().drop_guard();
        // On a connection of its own only: a pooled one would be held from the relay's rounds.
        if self.vacuum && self.db.config().is_some() {
            tokio::spawn(crate::vacuum::run(crate::vacuum::Upkeep {
                db: self.db.clone(),
                table: self.outbox.clone(),
                purge_results: false,
                stop: upkeep,
            }));
        }
        let mut listener = Listener::new(&self.db, &self.outbox);
        let mut backoff = Duration::from_millis(100);
        let mut pending = None;
        while !stop.is_cancelled() {
            match self.round(&mut pending).await {
                Ok(Round::Worked) => {
                    backoff = Duration::from_millis(100);
                    listener.worked();
                }
                Ok(Round::Empty) => {
                    self.counts.leading.store(true, Ordering::Relaxed);
                    listener.idle(self.lease / 3, &stop).await;
                }
                Ok(Round::Standby(until)) => {
                    self.counts.leading.store(false, Ordering::Relaxed);
                    let wait = (until - Utc::now())
                        .to_std()
                        .unwrap_or_default()
                        .min(self.lease)
                        + Duration::from_millis(fastrand::u64(1..50));
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = stop.cancelled() => {}
                    }
                }
                Err(error) if fatal(&error) => return Err(error),
                Err(error) => {
                    tracing::warn!(outbox = %self.outbox, %error, "relay round failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = stop.cancelled() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        self.settle_alone(&mut pending).await?;
        let client = self.db.pool().get().await?;
        query(
            &client,
            sql::RELEASE,
            &[(&self.outbox, Type::TEXT), (&self.name, Type::TEXT)],
        )
        .await?;
        Ok(())
    }

    /// One round: the previous round's settlement and the next claim in one transaction (one
    /// commit for both), then the claim's publishes, whose outcomes `pending` keeps for the next
    /// round. A settlement that did not commit is kept and tried again: it acts only on messages
    /// still the claim's.
    async fn round(&self, pending: &mut Option<Settlement>) -> Result<Round, DbError> {
        let mut client = self.db.pool().get().await?;
        let lease = format!("{} milliseconds", self.lease.as_millis());
        let tx = client.transaction().await?;
        let settled = match pending.as_ref() {
            Some(settlement) => Some(self.settle(&tx, settlement).await?),
            None => None,
        };
        let rows = tx
            .query_typed(
                sql::CLAIM,
                &[
                    (&self.outbox, Type::TEXT),
                    (&self.name, Type::TEXT),
                    (&self.batch, Type::INT4),
                    (&lease, Type::TEXT),
                ],
            )
            .await?;
        tx.commit().await?;
        if let (Some(settlement), Some(deleted)) = (pending.take(), settled) {
            self.count(&settlement, deleted);
        }
        if rows.is_empty() {
            return self.holder(&client).await;
        }
        let claimed_at = tokio::time::Instant::now();
        let token: i64 = rows[0].try_get("token")?;
        let batch = rows
            .iter()
            .map(|row| self.message(row))
            .collect::<Result<Vec<_>, DbError>>()?;
        // Not past the lease: once it ends another relay may claim these messages.
        let bound = (self.lease / 2).saturating_sub(claimed_at.elapsed());
        let deliveries = match tokio::time::timeout(bound, self.sink.publish(&batch)).await {
            Ok(deliveries) if deliveries.len() == batch.len() => deliveries,
            Ok(deliveries) => {
                let error = format!(
                    "the sink answered {} outcomes for {} messages",
                    deliveries.len(),
                    batch.len()
                );
                vec![Delivery::Failed(error); batch.len()]
            }
            Err(_) => {
                vec![Delivery::Failed(format!("publish timed out after {bound:?}")); batch.len()]
            }
        };
        let mut settlement = Settlement {
            token,
            ..Settlement::default()
        };
        for (message, delivery) in batch.iter().zip(deliveries) {
            match delivery {
                Delivery::Sent { duplicate } => {
                    settlement.sent.push(message.id);
                    settlement.duplicates += i32::from(duplicate);
                }
                Delivery::Failed(error) => {
                    settlement.failed.push(message.id);
                    settlement.errors.push(error);
                }
            }
        }
        if let Some(error) = settlement.errors.first() {
            tracing::warn!(outbox = %self.outbox, failed = settlement.failed.len(), first_error = %error, "publishes failed");
        }
        *pending = Some(settlement);
        self.counts.batches.fetch_add(1, Ordering::Relaxed);
        self.counts.leading.store(true, Ordering::Relaxed);
        Ok(Round::Worked)
    }

    /// Records a round's outcomes in `tx`: deletes what the broker has, schedules the rest for a
    /// retry (or the dead letters). Returns how many messages it deleted.
    async fn settle(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        settlement: &Settlement,
    ) -> Result<i64, DbError> {
        let mut deleted = 0;
        if !settlement.sent.is_empty() {
            let rows = tx
                .query_typed(
                    sql::SENT,
                    &[
                        (&self.outbox, Type::TEXT),
                        (&settlement.token, Type::INT8),
                        (&settlement.sent, Type::INT8_ARRAY),
                        (&settlement.duplicates, Type::INT4),
                    ],
                )
                .await?;
            deleted = rows[0].try_get(0)?;
        }
        if !settlement.failed.is_empty() {
            tx.query_typed(
                sql::FAILED,
                &[
                    (&self.outbox, Type::TEXT),
                    (&settlement.token, Type::INT8),
                    (&settlement.failed, Type::INT8_ARRAY),
                    (&settlement.errors, Type::TEXT_ARRAY),
                    (&self.max_attempts, Type::INT4),
                ],
            )
            .await?;
        }
        Ok(deleted)
    }

    /// Settles `pending` in a transaction of its own (at shutdown).
    async fn settle_alone(&self, pending: &mut Option<Settlement>) -> Result<(), DbError> {
        let Some(settlement) = pending.as_ref() else {
            return Ok(());
        };
        let mut client = self.db.pool().get().await?;
        let tx = client.transaction().await?;
        let deleted = self.settle(&tx, settlement).await?;
        tx.commit().await?;
        if let Some(settlement) = pending.take() {
            self.count(&settlement, deleted);
        }
        Ok(())
    }

    fn count(&self, settlement: &Settlement, deleted: i64) {
        self.counts
            .sent
            .fetch_add(deleted.max(0) as u64, Ordering::Relaxed);
        self.counts
            .duplicates
            .fetch_add(settlement.duplicates.max(0) as u64, Ordering::Relaxed);
        self.counts
            .failed
            .fetch_add(settlement.failed.len() as u64, Ordering::Relaxed);
    }

    /// After an empty claim: whether this relay holds the lease, or until when another does.
    async fn holder(&self, client: &tokio_postgres::Client) -> Result<Round, DbError> {
        let rows = query(client, sql::LEASE, &[(&self.outbox, Type::TEXT)]).await?;
        let Some(row) = rows.first() else {
            return Ok(Round::Empty);
        };
        let relay: String = row.try_get("relay")?;
        let until: DateTime<Utc> = row.try_get("leased_until")?;
        if relay != self.name && until > Utc::now() {
            Ok(Round::Standby(until))
        } else {
            Ok(Round::Empty)
        }
    }

    fn message(&self, row: &tokio_postgres::Row) -> Result<Message, DbError> {
        let id: i64 = row.try_get("id")?;
        let payload: Vec<u8> = row.try_get("payload")?;
        Ok(Message {
            id,
            attempt: row.try_get("attempt")?,
            subject: row.try_get("subject")?,
            key: row.try_get("key")?,
            payload: payload.into(),
            headers: headers_from_json(row.try_get("headers")?),
            published_at: row.try_get("published_at")?,
            message_id: format!("{}:{id}", self.outbox),
        })
    }
}

/// What became of a round's messages, recorded in the next round's transaction.
#[derive(Default)]
struct Settlement {
    token: i64,
    sent: Vec<i64>,
    duplicates: i32,
    failed: Vec<i64>,
    errors: Vec<String>,
}

enum Round {
    Worked,
    Empty,
    /// Another relay holds the lease until then.
    Standby(DateTime<Utc>),
}

/// Errors a retry cannot cure: no such table, not an outbox, no privilege.
fn fatal(error: &DbError) -> bool {
    matches!(
        error.sqlstate(),
        Some("42P01" | "42703" | "42804" | "42809" | "42501" | "22023" | "22004")
    )
}

async fn query(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<tokio_postgres::Row>, DbError> {
    Ok(client.query_typed(sql, params).await?)
}

/// The relay's LISTEN session: registers as asleep on the outbox when a claim came back empty, so
/// that publishes notify it, and wakes on the notification or after a timeout.
struct Listener {
    config: Option<tokio_postgres::Config>,
    outbox: String,
    session: Option<ListenSession>,
    /// How long to wait while due messages cannot be claimed (50 ms, doubling up to 1 s).
    blocked: Duration,
}

impl Listener {
    fn new(db: &PgDatabase, outbox: &str) -> Self {
        Self {
            config: db.listen_config().cloned(),
            outbox: outbox.to_owned(),
            session: None,
            blocked: BLOCKED,
        }
    }

    /// A claim found work: the next wait for unclaimable messages starts short again.
    fn worked(&mut self) {
        self.blocked = BLOCKED;
    }

    /// Waits for a publish, at most `timeout` (polls when it cannot LISTEN).
    async fn idle(&mut self, timeout: Duration, stop: &CancellationToken) {
        let asleep = match self.sleep().await {
            Ok(asleep) => asleep,
            Err(error) => {
                tracing::warn!(outbox = %self.outbox, %error, "LISTEN connection failed; polling");
                self.session = None;
                false
            }
        };
        let Some(session) = self.session.as_mut() else {
            tokio::select! {
                () = tokio::time::sleep(timeout.min(POLL)) => {}
                () = stop.cancelled() => {}
            }
            return;
        };
        if asleep {
            tokio::select! {
                _ = session.notifications.recv() => {}
                () = tokio::time::sleep(timeout) => {}
                () = stop.cancelled() => {}
            }
            while session.notifications.try_recv().is_ok() {}
            if let Err(error) = session.stop_sleeping(&self.outbox).await {
                tracing::warn!(outbox = %self.outbox, %error, "LISTEN connection lost");
                self.session = None;
            }
        } else {
            // Something is due that the claim could not take (a key waiting behind a message
            // that is retrying, or a claim of another relay in flight): look again shortly, less
            // often while it lasts.
            tokio::select! {
                () = tokio::time::sleep(self.blocked) => {}
                () = stop.cancelled() => {}
            }
            self.blocked = (self.blocked * 2).min(Duration::from_secs(1));
        }
    }

    /// Registers the session as asleep (`inbox_sleep`); `false` when a message is due (or
    /// publishes in flight kept the registration waiting: the relay looks at the outbox).
    async fn sleep(&mut self) -> Result<bool, DbError> {
        if self.session.is_none() {
            let Some(config) = &self.config else {
                return Ok(false);
            };
            self.session = Some(ListenSession::open(config, &self.outbox).await?);
        }
        let session = self.session.as_ref().expect("connected above");
        session.sleep(&self.outbox).await
    }
}
