//! The transactional outbox: publish events from inside a transaction, and relay them to a broker.
//!
//! - [`Outbox`]: records a message with [`publish`](Outbox::publish) through any [`Database`], so
//!   inside a handler's delivery transaction the message exists only if the handler's effects
//!   commit; and the operator's view (stats, dead messages, requeue, discard).
//! - [`Relay`]: drains an outbox into a [`Sink`]. Relays need no leader: any number may run on
//!   one outbox, one holds its lease at a time (`inbox_relay_claim`), and a killed one is replaced
//!   once its lease runs out.
//! - [`Sink`]: where messages go. [`NatsSink`] (feature `nats`) publishes to NATS JetStream; any
//!   other broker is a `Sink` implementation.
//!
//! What is guaranteed: a message is recorded exactly once with its transaction's effects;
//! messages of one key reach the sink in commit order, one at a time; a message is deleted only
//! after the sink confirmed it. The sink sees a message again when a relay dies between the
//! broker's acknowledgement and the deletion, so delivery into the broker is at least once unless
//! the broker drops duplicates by message id ([`Message::message_id`]): JetStream does within its
//! stream's duplicate window. A consumer that claims each message id in its own database's
//! ledger ([`Inbox`](crate::Inbox)) gets each message's effect exactly once end to end.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::statement::Statement;

mod relay;
pub use relay::{Relay, RelayCounts};

#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "nats")]
pub use nats::NatsSink;

pub(crate) mod sql {
    //! The outbox functions the client calls (`sql/shared/outbox.sql`).

    pub const CREATE: &str = "SELECT inbox_create_outbox($1::text)::text AS outbox";
    pub const PUBLISH: &str = "SELECT inbox_publish($1::text::regclass, $2::text, $3::jsonb, \
                               $4::text, $5::jsonb) AS id";
    pub const PUBLISH_BYTES: &str = "SELECT inbox_publish_bytes($1::text::regclass, $2::text, \
                                     $3::bytea, $4::text, $5::jsonb) AS id";
    pub const CLAIM: &str = "SELECT id, token, attempt, subject, key, payload, headers, published_at \
                             FROM inbox_relay_claim($1::text::regclass, $2::text, $3::int4, $4::text::interval)";
    pub const SENT: &str =
        "SELECT inbox_relay_sent($1::text::regclass, $2::int8, $3::int8[], $4::int4)";
    pub const FAILED: &str = "SELECT inbox_relay_failed($1::text::regclass, $2::int8, $3::int8[], \
                              $4::text[], $5::int4)";
    pub const RELEASE: &str = "SELECT inbox_relay_release($1::text::regclass, $2::text)";
    pub const LEASE: &str = "SELECT relay, leased_until FROM inbox_relay_lease($1::text::regclass)";
    pub const STATS: &str = "SELECT pending, sending, retrying, dead, \
                             extract(epoch FROM oldest_unsent_age)::float8 AS oldest_unsent_age, \
                             sent, duplicates, failures, relay, relay_lease_until, \
                             extract(epoch FROM oldest_publisher_age)::float8 AS oldest_publisher_age \
                             FROM inbox_outbox_stats($1::text::regclass)";
    pub const MESSAGES: &str = "SELECT id, state, subject, key, attempt, published_at, due, \
                                last_error, payload, headers \
                                FROM inbox_outbox_messages($1::text::regclass, $2::text, $3::int4)";
    pub const REQUEUE: &str =
        "SELECT inbox_outbox_requeue($1::text::regclass, $2::int8) AS requeued";
    pub const REQUEUE_DEAD: &str =
        "SELECT inbox_outbox_requeue_dead($1::text::regclass, $2::int4) AS requeued";
    pub const DISCARD: &str =
        "SELECT inbox_outbox_discard($1::text::regclass, $2::int8) AS discarded";
}

/// Headers of a message: each name with one value or more (NATS headers, Kafka record headers).
pub type Headers = BTreeMap<String, Vec<String>>;

/// An outbox table of the extension, named as it is in SQL (`"events"`, `"app.events"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outbox {
    table: String,
}

/// A message as the operator functions list it (`inbox_outbox_messages`).
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxMessage {
    /// The message's id: its order within its key.
    pub id: i64,
    /// `pending`, `sending`, `retrying` or `dead`.
    pub state: String,
    /// Where it goes (a NATS subject, a Kafka topic, ...).
    pub subject: String,
    /// Its ordering key.
    pub key: Option<String>,
    /// Claims so far.
    pub attempt: i32,
    /// When its transaction published it.
    pub published_at: DateTime<Utc>,
    /// When it may be claimed next (`None` once dead).
    pub due: Option<DateTime<Utc>>,
    /// The last publish's error.
    pub last_error: Option<String>,
    /// Its bytes.
    pub payload: Vec<u8>,
    /// Its headers.
    pub headers: Headers,
}

/// An outbox's counts (`inbox_outbox_stats`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutboxStats {
    /// Due, or waiting behind an earlier message of their key.
    pub pending: i64,
    /// Claimed by a relay, not yet settled.
    pub sending: i64,
    /// Waiting for a retry after a failed publish.
    pub retrying: i64,
    /// Dead-lettered after their last attempt.
    pub dead: i64,
    /// Seconds since the oldest message not sent nor dead was published.
    pub oldest_unsent_age: Option<f64>,
    /// Messages the relays sent.
    pub sent: i64,
    /// Of those, the ones the broker reported as duplicates.
    pub duplicates: i64,
    /// Failed publishes recorded.
    pub failures: i64,
    /// The relay holding (or last holding) the outbox's lease.
    pub relay: Option<String>,
    /// Until when it holds it.
    pub relay_lease_until: Option<DateTime<Utc>>,
    /// Seconds since the oldest open transaction holding one of the outbox's keys began: later
    /// publishers of that key wait for it.
    pub oldest_publisher_age: Option<f64>,
}

impl Outbox {
    /// The outbox stored in `table`.
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
        }
    }

    /// The table's name as given.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The statement that creates the outbox table unless it exists (`inbox_create_outbox`).
    pub fn create_statement(&self) -> Statement {
        Statement::new(sql::CREATE).bind(self.table.as_str())
    }

    /// Records `payload` (as JSON) for `subject` through `db`, ordered by `key`; returns its id.
    /// Through a transaction ([`PgTransaction`](crate::PgTransaction), a handler's delivery) the
    /// message exists only if the transaction commits. Messages of one key are relayed in commit
    /// order: the transaction holds the key until it ends, and a concurrent publisher of the same
    /// key waits for it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `payload` does not serialize to JSON, or the database's
    /// error.
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        db: &dyn Database,
        subject: &str,
        payload: &T,
        key: Option<&str>,
    ) -> Result<i64, DbError> {
        let json = serde_json::to_value(payload)
            .map_err(|e| DbError::new(ErrorKind::InvalidInput, format!("payload: {e}")))?;
        let statement = self.publish_statement(sql::PUBLISH, subject, json, key, None);
        db.query(&statement).await?.one()?.get("id")
    }

    /// As [`publish`](Self::publish), for bytes, with `headers`.
    ///
    /// # Errors
    /// The database's error.
    pub async fn publish_bytes(
        &self,
        db: &dyn Database,
        subject: &str,
        payload: &[u8],
        key: Option<&str>,
        headers: &Headers,
    ) -> Result<i64, DbError> {
        let headers = (!headers.is_empty()).then(|| serde_json::json!(headers));
        let statement = self.publish_statement(sql::PUBLISH_BYTES, subject, payload, key, headers);
        db.query(&statement).await?.one()?.get("id")
    }

    fn publish_statement(
        &self,
        sql: &'static str,
        subject: &str,
        payload: impl Into<crate::Value>,
        key: Option<&str>,
        headers: Option<serde_json::Value>,
    ) -> Statement {
        Statement::new(sql)
            .bind(self.table.as_str())
            .bind(subject)
            .bind(payload)
            .bind(key)
            .bind(headers)
    }

    /// The outbox's counts.
    ///
    /// # Errors
    /// The database's error.
    pub async fn stats(&self, db: &dyn Database) -> Result<OutboxStats, DbError> {
        let rows = db
            .query(&Statement::new(sql::STATS).bind(self.table.as_str()))
            .await?;
        let row = rows.one()?;
        Ok(OutboxStats {
            pending: row.get("pending")?,
            sending: row.get("sending")?,
            retrying: row.get("retrying")?,
            dead: row.get("dead")?,
            oldest_unsent_age: row.get("oldest_unsent_age")?,
            sent: row.get("sent")?,
            duplicates: row.get("duplicates")?,
            failures: row.get("failures")?,
            relay: row.get("relay")?,
            relay_lease_until: row.get("relay_lease_until")?,
            oldest_publisher_age: row.get("oldest_publisher_age")?,
        })
    }

    /// At most `max` messages in id order: all, or those in `state` (`pending`, `sending`,
    /// `retrying`, `dead`).
    ///
    /// # Errors
    /// The database's error (`22023` for an unknown state or a `max` below 1).
    pub async fn messages(
        &self,
        db: &dyn Database,
        state: Option<&str>,
        max: i32,
    ) -> Result<Vec<OutboxMessage>, DbError> {
        let statement = Statement::new(sql::MESSAGES)
            .bind(self.table.as_str())
            .bind(state)
            .bind(max);
        db.query(&statement)
            .await?
            .iter()
            .map(|row| {
                Ok(OutboxMessage {
                    id: row.get("id")?,
                    state: row.get("state")?,
                    subject: row.get("subject")?,
                    key: row.get("key")?,
                    attempt: row.get("attempt")?,
                    published_at: row.get("published_at")?,
                    due: row.get("due")?,
                    last_error: row.get("last_error")?,
                    payload: row.get("payload")?,
                    headers: headers_from_json(row.get("headers")?),
                })
            })
            .collect()
    }

    /// Sends dead message `id` again (attempts counted from zero); `false` when it is not dead.
    ///
    /// # Errors
    /// The database's error.
    pub async fn requeue(&self, db: &dyn Database, id: i64) -> Result<bool, DbError> {
        let statement = Statement::new(sql::REQUEUE)
            .bind(self.table.as_str())
            .bind(id);
        db.query(&statement).await?.one()?.get("requeued")
    }

    /// Sends the dead messages again, oldest first: all, or at most `max`; returns how many.
    ///
    /// # Errors
    /// The database's error (`22023` for a `max` below 1).
    pub async fn requeue_dead(&self, db: &dyn Database, max: Option<i32>) -> Result<i64, DbError> {
        let statement = Statement::new(sql::REQUEUE_DEAD)
            .bind(self.table.as_str())
            .bind(max);
        db.query(&statement).await?.one()?.get("requeued")
    }

    /// Deletes dead message `id`; `false` when it is not dead.
    ///
    /// # Errors
    /// The database's error.
    pub async fn discard(&self, db: &dyn Database, id: i64) -> Result<bool, DbError> {
        let statement = Statement::new(sql::DISCARD)
            .bind(self.table.as_str())
            .bind(id);
        db.query(&statement).await?.one()?.get("discarded")
    }
}

/// A claimed message, as a [`Sink`] publishes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// Its id in the outbox.
    pub id: i64,
    /// Claims so far, this one included.
    pub attempt: i32,
    /// Where it goes.
    pub subject: String,
    /// Its ordering key.
    pub key: Option<String>,
    /// Its bytes.
    pub payload: bytes::Bytes,
    /// Its headers.
    pub headers: Headers,
    /// When its transaction published it.
    pub published_at: DateTime<Utc>,
    message_id: String,
}

impl Message {
    /// The identity a broker dedups it by (`<outbox>:<id>`, the outbox named as the relay was
    /// given it, e.g. `events:42`: give every relay of an outbox the same name for it), the same
    /// on every attempt: JetStream's `Nats-Msg-Id`, a Kafka record key for a compacting consumer,
    /// the key a consumer claims in its ledger.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }
}

/// What became of one message handed to a [`Sink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The broker has it (stored and acknowledged). `duplicate`: it already had it (a publish
    /// repeated after a relay died before deleting the message), which is success too.
    Sent {
        /// Whether the broker reported it as a duplicate of one it had.
        duplicate: bool,
    },
    /// The broker did not confirm it: it is retried after a backoff, and dead-lettered after the
    /// relay's `max_attempts`.
    Failed(String),
}

/// Where a [`Relay`] publishes messages: a broker's client.
///
/// `publish` gets a batch of messages and returns one [`Delivery`] per message, in the batch's
/// order. A batch holds at most one message per key (the relay claims each key's head only),
/// so a sink may publish the whole batch at once, concurrently; it must answer
/// [`Delivery::Sent`] only once the broker has stored the message (a publish acknowledgement,
/// not a socket write), and should bound its own waits: the relay gives it half the lease.
///
/// A Kafka sink, for instance, produces every message with the message's key and
/// [`Message::message_id`] as a header, awaits each delivery report, and maps the report's
/// error to [`Delivery::Failed`]; an idempotent producer then drops the repeats of a restarted
/// relay within its session, and the consumer's ledger the rest.
#[async_trait::async_trait]
pub trait Sink: Send + Sync {
    /// Publishes `batch`; one outcome per message, in order.
    async fn publish(&self, batch: &[Message]) -> Vec<Delivery>;
}

/// Headers as `inbox_publish` stores them: `{"name": "value"}` or `{"name": ["a", "b"]}`.
fn headers_from_json(value: Option<serde_json::Value>) -> Headers {
    let mut headers = Headers::new();
    if let Some(serde_json::Value::Object(map)) = value {
        for (name, value) in map {
            let values = match value {
                serde_json::Value::String(one) => vec![one],
                serde_json::Value::Array(many) => many
                    .into_iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect(),
                _ => Vec::new(),
            };
            headers.insert(name, values);
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_one_value_or_many() {
        let headers = headers_from_json(Some(serde_json::json!({"a": "1", "b": ["2", "3"]})));
        assert_eq!(headers["a"], vec!["1"]);
        assert_eq!(headers["b"], vec!["2", "3"]);
        assert!(headers_from_json(None).is_empty());
    }
}
