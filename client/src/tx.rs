//! [`PgTransaction`]: the [`Database`] port inside an open transaction.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use tokio::sync::Mutex;

use crate::database::Database;
use crate::error::{within, DbError};
use crate::mode::{self, execute_prepared, query_prepared, Ran, StatementMode};
use crate::rows::Rows;
use crate::sql;
use crate::statement::Statement;

/// The transaction a [`PgTransaction`] runs in.
#[derive(Clone, Copy)]
enum Handle<'a> {
    Pooled(&'a deadpool_postgres::Transaction<'a>),
    Plain(&'a tokio_postgres::Transaction<'a>),
    /// A pooled connection on which the caller began the transaction with its own `BEGIN`.
    Began(&'a deadpool_postgres::Client),
}

impl<'a> Handle<'a> {
    /// Prepares `sql`, through the connection's statement cache when it has one.
    async fn prepare(self, sql: &str) -> Result<tokio_postgres::Statement, DbError> {
        Ok(match self {
            Handle::Pooled(tx) => tx.prepare_cached(sql).await?,
            Handle::Plain(tx) => tx.prepare(sql).await?,
            Handle::Began(client) => client.prepare_cached(sql).await?,
        })
    }

    async fn execute(
        self,
        prepared: &tokio_postgres::Statement,
        statement: &Statement,
    ) -> Result<u64, DbError> {
        match self {
            Handle::Pooled(tx) => execute_prepared(&**tx, prepared, statement).await,
            Handle::Plain(tx) => execute_prepared(tx, prepared, statement).await,
            Handle::Began(client) => execute_prepared(&***client, prepared, statement).await,
        }
    }

    async fn query(
        self,
        prepared: &tokio_postgres::Statement,
        statement: &Statement,
    ) -> Result<Rows, DbError> {
        match self {
            Handle::Pooled(tx) => query_prepared(&**tx, prepared, statement).await,
            Handle::Plain(tx) => query_prepared(tx, prepared, statement).await,
            Handle::Began(client) => query_prepared(&***client, prepared, statement).await,
        }
    }

    /// Runs `statement` as the unnamed statement.
    async fn run_unnamed(self, statement: &Statement) -> Result<Ran, DbError> {
        let (sql, values) = (statement.sql(), statement.params());
        match self {
            Handle::Pooled(tx) => mode::run_values(&**tx, sql, values).await,
            Handle::Plain(tx) => mode::run_values(tx, sql, values).await,
            Handle::Began(client) => mode::run_values(&***client, sql, values).await,
        }
    }

    async fn batch_execute(self, sql: &str) -> Result<(), DbError> {
        match self {
            Handle::Pooled(tx) => tx.batch_execute(sql).await?,
            Handle::Plain(tx) => tx.batch_execute(sql).await?,
            Handle::Began(client) => client.batch_execute(sql).await?,
        }
        Ok(())
    }
}

/// The [`Database`] port over a transaction the caller opened (a handler's delivery transaction,
/// say): [`execute`](Database::execute) and [`query`](Database::query) run in it and see its
/// uncommitted writes, and nothing commits until the caller commits the transaction.
///
/// [`batch_atomic`](Database::batch_atomic) runs inside a savepoint: a failing batch is undone
/// whole and leaves the transaction usable; a succeeding one commits when, and only if, the
/// enclosing transaction commits.
///
/// Calls through one `PgTransaction` run one at a time. If a `batch_atomic` future is dropped
/// before it finishes, its partial work is rolled back at the next call through this
/// `PgTransaction`; a caller that cancels a batch and does not use the port again must roll the
/// enclosing transaction back rather than commit it.
///
/// ```no_run
/// # async fn run(db: &inbox_client::PgDatabase) -> Result<(), inbox_client::DbError> {
/// use inbox_client::{Database, PgTransaction, Statement};
///
/// let mut client = db.pool().get().await?;
/// let tx = client.transaction().await?;
/// let port = PgTransaction::new(&tx);
/// port.execute(&Statement::new("INSERT INTO audit (note) VALUES ($1)").bind("hello")).await?;
/// tx.commit().await?;
/// # Ok(())
/// # }
/// ```
pub struct PgTransaction<'a> {
    handle: Handle<'a>,
    mode: StatementMode,
    /// How long each round trip may wait for the server (see `with_round_trip_bound`).
    round_trip_bound: Option<std::time::Duration>,
    serial: Mutex<()>,
    /// Set when a batch was cancelled inside its savepoint, which must then be rolled back.
    pending_rollback: AtomicBool,
}

impl<'a> PgTransaction<'a> {
    /// The port over a deadpool-postgres transaction (statements are prepared through the
    /// connection's cache).
    pub fn new(tx: &'a deadpool_postgres::Transaction<'a>) -> Self {
        Self::with_handle(Handle::Pooled(tx))
    }

    /// The port over a plain tokio-postgres transaction (statements are prepared on each call).
    pub fn from_tokio(tx: &'a tokio_postgres::Transaction<'a>) -> Self {
        Self::with_handle(Handle::Plain(tx))
    }

    /// The port over a pooled connection on which the caller has begun a transaction with its
    /// own `BEGIN` and will end it (the worker does, to send its statements in fewer round
    /// trips). Statements are prepared through the connection's cache.
    pub fn in_transaction(client: &'a deadpool_postgres::Client) -> Self {
        Self::with_handle(Handle::Began(client))
    }

    /// This port sending its statements as `mode` says ([`StatementMode::Unnamed`] behind a
    /// pooler in transaction mode: no statement is prepared under a name).
    #[must_use]
    pub fn with_statement_mode(mut self, mode: StatementMode) -> Self {
        self.mode = mode;
        self
    }

    /// Bounds each call's wait for the server: no answer within `bound` fails the call with
    /// [`ErrorKind::ConnectionLost`](crate::ErrorKind::ConnectionLost) (the worker sets it a
    /// little above its statement timeout, so a connection that went silent cannot hang a
    /// handler).
    pub fn with_round_trip_bound(mut self, bound: Option<std::time::Duration>) -> Self {
        self.round_trip_bound = bound;
        self
    }

    fn with_handle(handle: Handle<'a>) -> Self {
        Self {
            handle,
            mode: StatementMode::Prepared,
            round_trip_bound: None,
            serial: Mutex::new(()),
            pending_rollback: AtomicBool::new(false),
        }
    }

    /// Rolls back the savepoint of a cancelled batch, if there is one.
    async fn restore(&self) -> Result<(), DbError> {
        if self.pending_rollback.swap(false, Ordering::SeqCst) {
            self.batch_execute(sql::BATCH_ROLLBACK).await?;
        }
        Ok(())
    }

    /// Rolls back what a cancelled [`batch_atomic`](Database::batch_atomic) left behind, before
    /// the transaction is used other than through this port (which does it at its next call).
    pub(crate) async fn settle_cancelled_batch(&self) -> Result<(), DbError> {
        let _serial = self.serial.lock().await;
        self.restore().await
    }

    /// Runs `statements` in order in the transaction, stopping at the first failure, with no
    /// savepoint of its own.
    pub(crate) async fn run_all(&self, statements: &[Statement]) -> Result<(), DbError> {
        for statement in statements {
            self.execute_one(statement).await?;
        }
        Ok(())
    }

    async fn execute_one(&self, statement: &Statement) -> Result<u64, DbError> {
        within(self.round_trip_bound, self.execute_unbounded(statement)).await?
    }

    async fn query_one(&self, statement: &Statement) -> Result<Rows, DbError> {
        within(self.round_trip_bound, self.query_unbounded(statement)).await?
    }

    /// Runs one of the transaction's own statements (savepoints), within the round-trip bound.
    async fn batch_execute(&self, sql: &str) -> Result<(), DbError> {
        within(self.round_trip_bound, self.handle.batch_execute(sql)).await?
    }

    async fn execute_unbounded(&self, statement: &Statement) -> Result<u64, DbError> {
        if self.mode == StatementMode::Unnamed {
            return Ok(self.handle.run_unnamed(statement).await?.affected);
        }
        let prepared = self.handle.prepare(statement.sql()).await?;
        self.handle.execute(&prepared, statement).await
    }

    async fn query_unbounded(&self, statement: &Statement) -> Result<Rows, DbError> {
        if self.mode == StatementMode::Unnamed {
            let ran = self.handle.run_unnamed(statement).await?;
            return Ok(Rows::decode_unnamed(&ran.rows));
        }
        let prepared = self.handle.prepare(statement.sql()).await?;
        self.handle.query(&prepared, statement).await
    }
}

impl<'a> From<&'a deadpool_postgres::Transaction<'a>> for PgTransaction<'a> {
    fn from(tx: &'a deadpool_postgres::Transaction<'a>) -> Self {
        Self::new(tx)
    }
}

impl<'a> From<&'a tokio_postgres::Transaction<'a>> for PgTransaction<'a> {
    fn from(tx: &'a tokio_postgres::Transaction<'a>) -> Self {
        Self::from_tokio(tx)
    }
}

impl fmt::Debug for PgTransaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.handle {
            Handle::Pooled(_) => "deadpool",
            Handle::Plain(_) => "tokio-postgres",
            Handle::Began(_) => "deadpool, begun by the caller",
        };
        f.debug_struct("PgTransaction")
            .field("transaction", &kind)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Marks the batch's savepoint for rollback if dropped before [`disarm`](Self::disarm).
struct Armed<'a>(Option<&'a AtomicBool>);

impl Armed<'_> {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.0 {
            flag.store(true, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Database for PgTransaction<'_> {
    async fn execute(&self, statement: &Statement) -> Result<u64, DbError> {
        statement.check()?;
        let _serial = self.serial.lock().await;
        self.restore().await?;
        self.execute_one(statement).await
    }

    async fn query(&self, statement: &Statement) -> Result<Rows, DbError> {
        statement.check()?;
        let _serial = self.serial.lock().await;
        self.restore().await?;
        self.query_one(statement).await
    }

    async fn batch_atomic(&self, statements: &[Statement]) -> Result<(), DbError> {
        statements.iter().try_for_each(Statement::check)?;
        if statements.is_empty() {
            return Ok(());
        }
        let _serial = self.serial.lock().await;
        self.restore().await?;
        let tx = self;
        tx.batch_execute(sql::BATCH_SAVEPOINT).await?;
        let mut armed = Armed(Some(&self.pending_rollback));
        match self.run_all(statements).await {
            Ok(()) => {
                // From here a cancelled call leaves at worst a savepoint holding the whole batch.
                armed.disarm();
                tx.batch_execute(sql::BATCH_RELEASE).await?;
                Ok(())
            }
            Err(error) => {
                if let Err(rollback) = tx.batch_execute(sql::BATCH_ROLLBACK).await {
                    tracing::warn!(%rollback, "rolling back a failed batch to its savepoint failed");
                }
                armed.disarm();
                Err(error)
            }
        }
    }
}
