//! [`Tx`]: a delivery's transaction, as its transactional handler sees it.

use std::fmt;

use async_trait::async_trait;

use crate::database::Database;
use crate::error::DbError;
use crate::rows::Rows;
use crate::statement::Statement;
use crate::tx::PgTransaction;

/// The transaction of one delivery, lent to a transactional handler
/// ([`AsyncTxHandler`](super::AsyncTxHandler)): whatever the handler writes in it commits together
/// with the job's settlement on [`Outcome::Ack`](super::Outcome::Ack), and not at all otherwise (an
/// error, a panic, a retry, a lost lease, a cancel).
///
/// It reaches the transaction two ways, which can be mixed:
///
/// - as the [`Database`] port: `Tx` implements it, so code written against `&dyn Database`
///   (a [`Queue`](crate::Queue), an [`Inbox`](crate::Inbox), an
///   [`Outbox`](crate::outbox::Outbox), a [`JobType`](crate::JobType)'s enqueue) takes `tx` as it
///   is;
/// - as the driver's connection, with [`client`](Tx::client): any tokio-postgres code, with typed
///   `ToSql`/`FromSql` parameters and prepared statements of its own.
///
/// The worker owns the transaction: a handler borrows it and cannot commit or roll it back (it
/// must not send `COMMIT`, `ROLLBACK` or savepoint commands as SQL either).
///
/// ```no_run
/// use inbox_client::worker::{AsyncTxHandler, HandlerResult, Job, Outcome, Tx};
/// use inbox_client::{Database, Statement};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Refund { order_id: i64, cents: i32 }
///
/// struct Refunds;
///
/// impl AsyncTxHandler<Refund> for Refunds {
///     async fn handle(&self, job: Job<Refund>, tx: &Tx<'_>) -> HandlerResult {
///         // Through the driver: typed parameters, a statement prepared on the connection.
///         let client = tx.client().await?;
///         let insert = client
///             .prepare_cached("INSERT INTO refunds (order_id, cents) VALUES ($1, $2)")
///             .await?;
///         client.execute(&insert, &[&job.payload.order_id, &job.payload.cents]).await?;
///         // Through the port, in the same transaction.
///         tx.execute(&Statement::new("UPDATE orders SET refunded = true WHERE id = $1")
///             .bind(job.payload.order_id))
///             .await?;
///         Ok(Outcome::ack())
///     }
/// }
/// ```
pub struct Tx<'a> {
    port: PgTransaction<'a>,
    client: &'a deadpool_postgres::Client,
}

impl<'a> Tx<'a> {
    /// The delivery's transaction on `client` (begun by the worker), with `port` over it.
    pub(crate) fn new(client: &'a deadpool_postgres::Client, port: PgTransaction<'a>) -> Self {
        Self { port, client }
    }

    /// The transaction as the [`Database`] port (what `&tx` gives too, `Tx` being one).
    pub fn database(&self) -> &dyn Database {
        &self.port
    }

    /// The delivery's connection, inside its transaction: run any tokio-postgres code on it
    /// (`query`, `execute`, `prepare`, `copy_in`, ...; it dereferences to
    /// [`tokio_postgres::Client`], and [`prepare_cached`] uses the connection's statement cache).
    /// Its statements run in the delivery's transaction and inside the delivery's savepoint when
    /// it has one, exactly as the port's do, so they commit with the settlement or not at all.
    ///
    /// It is lent, not given: it cannot begin a transaction of its own (that needs `&mut`), and
    /// the worker ends the transaction. Its calls are bounded by the worker's
    /// [`statement_timeout`](super::Worker::statement_timeout) on the server, but not by a
    /// round-trip bound as the port's are: bound a handler with
    /// [`handler_timeout`](super::Worker::handler_timeout) where a silent connection must not
    /// hang it. Behind a pooler in transaction mode use `prepare`, not `prepare_cached` (a
    /// statement prepared in one transaction is gone in the next).
    ///
    /// Code written for any tokio-postgres client or transaction takes `&**client`:
    ///
    /// ```no_run
    /// use inbox_client::tokio_postgres::{Error, GenericClient};
    /// use inbox_client::worker::{HandlerResult, Job, Outcome, Tx};
    ///
    /// async fn open_orders(client: &impl GenericClient, customer: i64) -> Result<i64, Error> {
    ///     let row = client
    ///         .query_one("SELECT count(*) FROM orders WHERE customer = $1", &[&customer])
    ///         .await?;
    ///     Ok(row.get(0))
    /// }
    ///
    /// async fn handle(job: Job<i64>, tx: &Tx<'_>) -> HandlerResult {
    ///     let client = tx.client().await?;
    ///     let open = open_orders(&**client, job.payload).await?;
    ///     Ok(if open == 0 { Outcome::ack() } else { Outcome::retry() })
    /// }
    /// ```
    ///
    /// # Errors
    /// The database's error when a batch of the port that was cancelled midway (see
    /// [`PgTransaction`]) cannot be rolled back first.
    ///
    /// [`prepare_cached`]: deadpool_postgres::ClientWrapper::prepare_cached
    pub async fn client(&self) -> Result<&deadpool_postgres::ClientWrapper, DbError> {
        // The delivery's savepoint needs nothing here: the worker sends it before the handler
        // first runs, so every statement on the connection follows it.
        self.port.settle_cancelled_batch().await?;
        Ok(self.client)
    }
}

impl fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Database for Tx<'_> {
    async fn execute(&self, statement: &Statement) -> Result<u64, DbError> {
        self.port.execute(statement).await
    }

    async fn query(&self, statement: &Statement) -> Result<Rows, DbError> {
        self.port.query(statement).await
    }

    async fn batch_atomic(&self, statements: &[Statement]) -> Result<(), DbError> {
        self.port.batch_atomic(statements).await
    }
}
