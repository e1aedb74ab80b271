//! The [`Database`] port.

use async_trait::async_trait;

use crate::error::DbError;
use crate::rows::Rows;
use crate::statement::Statement;

/// The port through which services and the ledger reach the database; object safe, so code takes
/// a `&dyn Database` and runs unchanged on a pool ([`PgDatabase`](crate::PgDatabase)) or inside
/// an open transaction ([`PgTransaction`](crate::PgTransaction)).
///
/// Every implementation fails a [`rejected`](Statement::rejected) statement (see
/// [`Statement::check`]) before running anything.
///
/// Implement it with [`async_trait`](https://docs.rs/async-trait): `#[async_trait::async_trait]`
/// on the `impl` block.
#[async_trait]
pub trait Database: Send + Sync {
    /// Runs one statement and returns the number of rows it affected.
    async fn execute(&self, statement: &Statement) -> Result<u64, DbError>;

    /// Runs one statement and returns the rows it produced.
    async fn query(&self, statement: &Statement) -> Result<Rows, DbError>;

    /// Runs `statements` in order so that they all commit together or none does: the first
    /// failure undoes the ones before it and skips the rest. An empty slice does nothing.
    async fn batch_atomic(&self, statements: &[Statement]) -> Result<(), DbError>;
}
