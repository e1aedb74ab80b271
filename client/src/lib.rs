//! Async Rust client of the `inbox` PostgreSQL extension.
//!
//! - [`Database`]: the port services write their SQL against, as [`Statement`]s in and [`Rows`]
//!   out, with [`batch_atomic`](Database::batch_atomic) for statements that commit together. It is
//!   implemented over a pool ([`PgDatabase`]) and inside an open transaction
//!   ([`PgTransaction`]), so the same code runs in a handler's delivery transaction.
//! - [`DbError`]: one error type whose [`kind`](DbError::kind) tells what to do about it and
//!   whose [`sqlstate`](DbError::sqlstate) is the server's code.
//! - [`Clock`]: the time port, with [`SystemClock`] and [`ManualClock`].
//! - [`Inbox`]: a dedup ledger whose claims are the extension's functions (`inbox_claim`, ...),
//!   so that an event's effect is applied once however often the event is delivered.
//! - [`Queue`]: enqueue jobs (through any [`Database`], so inside a transaction too), read a
//!   queue's counts, and declare its [`Schedule`]s (periodic jobs, one job per tick).
//! - [`outbox`]: publish events inside a transaction ([`Outbox`](outbox::Outbox)) and relay them
//!   to a broker ([`Relay`](outbox::Relay) into a [`Sink`](outbox::Sink); NATS JetStream with the
//!   `nats` feature), in commit order per key and at most once per message id in the broker.
//! - [`worker`]: workers that lease jobs, run a handler and settle each job; in transactional
//!   mode the handler's writes commit together with the job's settlement, so effects that are
//!   rows in the queue's database happen exactly once. Effects outside it (HTTP calls, e-mail,
//!   other brokers) are at least once and need an idempotency key; a handler's
//!   [`Job::step`](worker::Job::step) records such a call's result once per job, so that a
//!   retry does not make it again.
//!
//! The client holds no SQL of the extension's tables: it calls the extension's functions only.
//!
//! # Connection poolers
//!
//! Through a pooler in transaction mode (pgbouncer's `pool_mode = transaction`), build the port
//! with [`PgDatabase::connect_through_pooler`] or [`PgDatabase::behind_pooler`]: statements are
//! then sent unnamed ([`StatementMode::Unnamed`]: parameters typed explicitly, no named prepared
//! statement, which pgbouncer before 1.21 loses between transactions), and workers wake through a
//! LISTEN connection to the server given directly, or else poll (losing nothing but wake-up
//! latency). The worker sets its timeouts per transaction in every mode, so no session setting
//! leaks to the pooler's next client. With pgbouncer 1.21+ and `max_prepared_statements` set, the
//! default [`StatementMode::Prepared`] works through it too. See `docs/guide.md`.
//!
//! # Example
//!
//! With `DATABASE_URL` pointing at a database where `CREATE EXTENSION inbox` was run:
//!
//! ```no_run
//! use inbox_client::{Clock, Database, Inbox, PgDatabase, Statement, SystemClock};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), inbox_client::DbError> {
//!     let db = PgDatabase::from_env().await?;
//!     let inbox = Inbox::new("billing_inbox");
//!     db.execute(&Statement::new(inbox.create_table_sql())).await?;
//!     db.execute(&Statement::new(
//!         "CREATE TABLE IF NOT EXISTS invoices (order_id bigint, amount_cents integer)",
//!     ))
//!     .await?;
//!
//!     // One delivery of the event "order-42/paid": the claim and its effect commit together.
//!     let effect = [
//!         Statement::new("INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)")
//!             .bind(42_i64)
//!             .bind(1999_i64),
//!     ];
//!     let clock = SystemClock;
//!     let applied = inbox
//!         .claim_with(&db, "order-42/paid", &clock.now_rfc3339(), &effect)
//!         .await?;
//!     println!("first delivery applied the effect: {applied}");
//!
//!     // A redelivery of the same event applies nothing.
//!     let again = inbox
//!         .claim_with(&db, "order-42/paid", &clock.now_rfc3339(), &effect)
//!         .await?;
//!     assert!(!again);
//!     assert!(inbox.seen(&db, "order-42/paid").await?);
//!     Ok(())
//! }
//! ```
#![warn(missing_docs)]

mod clock;
mod database;
mod error;
mod inbox;
mod job_type;
mod listen;
mod mode;
pub mod outbox;
mod pg;
mod queue;
mod rows;
mod schedule;
mod sql;
mod statement;
mod tx;
mod vacuum;
pub mod worker;
mod workflow;

pub use clock::{format_rfc3339, Clock, ManualClock, SystemClock};
pub use database::Database;
pub use error::{DbError, ErrorKind};
pub use inbox::Inbox;
pub use job_type::JobType;
pub use mode::StatementMode;
pub use pg::{default_pool_size, PgDatabase, DATABASE_URL};
pub use queue::{
    BatchOptions, DeadJob, EnqueueOptions, Queue, QueueLimits, QueueStats, RateLimit, UniqueUntil,
};
pub use rows::{FromValue, Row, Rows};
pub use schedule::Schedule;
pub use statement::{Statement, Value};
pub use tx::PgTransaction;
pub use workflow::{
    Batch, BatchCallbacks, BatchMember, BatchStatus, JobRef, JobResult, JobState, ResultWaiter,
};

/// The deadpool-postgres this crate is built on, for [`PgDatabase::from_pool`] and
/// [`PgTransaction::new`].
pub use deadpool_postgres;
/// The tokio-postgres this crate is built on, for [`PgTransaction::from_tokio`].
pub use tokio_postgres;
