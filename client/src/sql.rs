//! Every SQL string the client sends. The work is done by the extension's functions (see
//! `docs/sql-api.md`); these only call them. Table names travel as text parameters cast to
//! `regclass`, never formatted into the SQL.

/// `inbox_claim(ledger, key, seen_at)`: `true` the first time the key is recorded.
pub(crate) const LEDGER_CLAIM: &str =
    "SELECT inbox_claim($1::text::regclass, $2::text, $3::timestamptz) AS claimed";

/// `inbox_claim_or_fail(ledger, key, seen_at)`: claims the key or raises `23505`.
pub(crate) const LEDGER_CLAIM_OR_FAIL: &str =
    "SELECT inbox_claim_or_fail($1::text::regclass, $2::text, $3::timestamptz)";

/// `inbox_seen(ledger, key)`: whether the key is recorded.
pub(crate) const LEDGER_SEEN: &str = "SELECT inbox_seen($1::text::regclass, $2::text) AS seen";

/// `inbox_purge(ledger, older_than)`: deletes older keys and returns how many.
pub(crate) const LEDGER_PURGE: &str =
    "SELECT inbox_purge($1::text::regclass, $2::timestamptz) AS purged";

/// The head of the migration that creates a ledger; the quoted table name and `)` follow.
pub(crate) const LEDGER_CREATE_PREFIX: &str = "SELECT inbox_create_ledger(";

/// Opens the savepoint inside which [`PgTransaction`](crate::PgTransaction) runs a batch.
pub(crate) const BATCH_SAVEPOINT: &str = "SAVEPOINT inbox_client_batch";

/// Keeps the batch's work in the enclosing transaction.
pub(crate) const BATCH_RELEASE: &str = "RELEASE SAVEPOINT inbox_client_batch";

/// Undoes the batch's work and leaves the enclosing transaction usable.
pub(crate) const BATCH_ROLLBACK: &str =
    "ROLLBACK TO SAVEPOINT inbox_client_batch; RELEASE SAVEPOINT inbox_client_batch";
