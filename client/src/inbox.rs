//! [`Inbox`]: the dedup ledger, on the extension's `inbox_claim` family.

use chrono::{DateTime, Utc};

use crate::clock::parse_rfc3339;
use crate::database::Database;
use crate::error::DbError;
use crate::sql;
use crate::statement::Statement;

/// A dedup ledger over the [`Database`] port. Construct it with the table the owning module
/// declares (e.g. `"<module>_inbox"`).
///
/// The table is named as in SQL: `billing_inbox`, `app.billing_inbox` or `"Odd Name"` (quoted
/// identifiers keep their quotes); unqualified names resolve through the `search_path`. It is
/// passed to the extension as a value, never formatted into SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    table: String,
}

impl Inbox {
    /// A ledger stored in `table`.
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
        }
    }

    /// The table's name, as given to [`new`](Self::new).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The migration that creates the ledger table: `SELECT inbox_create_ledger('<table>')`, with
    /// the name as a quoted SQL literal. The owning module ships it as a forward-only migration;
    /// running it again on an existing ledger changes nothing.
    pub fn create_table_sql(&self) -> String {
        format!(
            "{}{})",
            sql::LEDGER_CREATE_PREFIX,
            quote_literal(&self.table)
        )
    }

    /// Records `event_key`, returning `true` the first time it is seen (proceed and apply the
    /// effect) and `false` for any later delivery of the same id (a duplicate, replay or
    /// concurrent race: skip).
    ///
    /// The claim is the extension's `inbox_claim`, a single `INSERT ... ON CONFLICT DO NOTHING`:
    /// under concurrent claims of the same key exactly one insert takes, and only that caller gets
    /// `true`. `seen_at` is an RFC 3339 timestamp the caller reads from the
    /// [`Clock`](crate::Clock) port.
    ///
    /// The claim commits on its own (on [`PgDatabase`](crate::PgDatabase); on a
    /// [`PgTransaction`](crate::PgTransaction) it commits with that transaction): if the worker
    /// dies after this returns `true` but before the effect is applied, the redelivery sees the key
    /// and skips, and the event is lost (at-most-once). When the effect is itself database writes,
    /// use [`claim_with`](Self::claim_with), or put [`claim_statement`](Self::claim_statement)
    /// first in the same [`batch_atomic`](Database::batch_atomic) as the effect, so the two commit
    /// together.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a malformed `seen_at`,
    /// before any write; otherwise a [`DbError`] if the write fails.
    pub async fn claim(
        &self,
        db: &dyn Database,
        event_key: &str,
        seen_at: &str,
    ) -> Result<bool, DbError> {
        let seen_at = parse_rfc3339("seen_at", seen_at)?;
        let claim = Statement::new(sql::LEDGER_CLAIM)
            .bind(self.table.as_str())
            .bind(event_key)
            .bind(seen_at);
        db.query(&claim).await?.one()?.get("claimed")
    }

    /// The claim as a statement that fails when the key is already claimed, to run as the first
    /// statement of the same [`batch_atomic`](Database::batch_atomic) that carries the effect's
    /// statements (see [`claim_with`](Self::claim_with) for the ready-made wrapper). It calls the
    /// extension's `inbox_claim_or_fail`.
    ///
    /// Inside the batch the ledger's unique key does the first-writer-wins work: a key that is
    /// already claimed fails the statement with a
    /// [`UniqueViolation`](crate::ErrorKind::UniqueViolation), and the whole batch, effect
    /// included, rolls back, so a duplicate delivery applies nothing a second time. The claim and
    /// the effect commit together or not at all: a worker that dies before the batch commits
    /// leaves the key unclaimed, and the redelivery re-runs both.
    ///
    /// A malformed `seen_at` yields a [`rejected`](Statement::rejected) statement: the batch that
    /// holds it fails with [`InvalidInput`](crate::ErrorKind::InvalidInput) before any write.
    pub fn claim_statement(&self, event_key: &str, seen_at: &str) -> Statement {
        let claim = Statement::new(sql::LEDGER_CLAIM_OR_FAIL)
            .bind(self.table.as_str())
            .bind(event_key);
        match parse_rfc3339("seen_at", seen_at) {
            Ok(at) => claim.bind(at),
            Err(error) => claim.bind(seen_at).rejected(error.message()),
        }
    }

    /// Claims `event_key` and applies `effect` in one atomic batch, returning `true` when this
    /// delivery committed them (the convention of [`claim`](Self::claim)) and `false` when the key
    /// was already claimed (a duplicate, a replay, or a concurrent delivery that won the race), so
    /// the effect did not run again.
    ///
    /// The [`claim_statement`](Self::claim_statement) goes first, then `effect`, all through
    /// [`batch_atomic`](Database::batch_atomic): either everything commits or nothing does, and a
    /// worker that dies mid-batch leaves the key unclaimed for the retry.
    ///
    /// # Errors
    /// [`InvalidInput`](crate::ErrorKind::InvalidInput) for a malformed `seen_at`, before any
    /// write. Otherwise a [`DbError`] when the batch fails and the key is not claimed afterwards:
    /// nothing committed and the effect did not apply, and the caller (or its queue) retries the
    /// whole delivery. A batch that failed because a concurrent delivery claimed the key first is
    /// not an error; it returns `Ok(false)`, told apart by re-reading the key (with
    /// [`seen`](Self::seen)) rather than by parsing the engine's error text. If that re-read fails
    /// too, the batch's error is returned: retrying is safe, since a retry of a delivery that did
    /// commit returns `Ok(false)`. (For the same reason a commit whose acknowledgement was lost
    /// returns `Ok(false)`: the effect then ran exactly once.)
    pub async fn claim_with(
        &self,
        db: &dyn Database,
        event_key: &str,
        seen_at: &str,
        effect: &[Statement],
    ) -> Result<bool, DbError> {
        parse_rfc3339("seen_at", seen_at)?;
        let mut batch = Vec::with_capacity(effect.len() + 1);
        batch.push(self.claim_statement(event_key, seen_at));
        batch.extend_from_slice(effect);
        let Err(error) = db.batch_atomic(&batch).await else {
            return Ok(true);
        };
        match self.seen(db, event_key).await {
            Ok(true) => Ok(false),
            Ok(false) => Err(error),
            Err(reread) => {
                tracing::warn!(%error, %reread, event_key, "cannot re-read a key after a failed claim");
                Err(error)
            }
        }
    }

    /// Whether `event_key` has already been recorded (a read-only check; a handler still uses
    /// [`claim`](Self::claim) or [`claim_with`](Self::claim_with) to act, since only those are
    /// race-free).
    ///
    /// # Errors
    /// A [`DbError`] if the read fails.
    pub async fn seen(&self, db: &dyn Database, event_key: &str) -> Result<bool, DbError> {
        let seen = Statement::new(sql::LEDGER_SEEN)
            .bind(self.table.as_str())
            .bind(event_key);
        db.query(&seen).await?.one()?.get("seen")
    }

    /// Deletes the keys recorded before `older_than` and returns how many it deleted. A purged key
    /// can be claimed again: keep keys longer than any delivery can be replayed.
    ///
    /// # Errors
    /// A [`DbError`] if the delete fails.
    pub async fn purge(
        &self,
        db: &dyn Database,
        older_than: DateTime<Utc>,
    ) -> Result<u64, DbError> {
        let purge = Statement::new(sql::LEDGER_PURGE)
            .bind(self.table.as_str())
            .bind(older_than);
        db.query(&purge).await?.one()?.get("purged")
    }
}

/// `text` as a SQL string literal, whatever `standard_conforming_strings` is.
fn quote_literal(text: &str) -> String {
    let quoted = text.replace('\'', "''");
    if text.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::rows::Rows;
    use crate::statement::Value;
    use async_trait::async_trait;
    use chrono::TimeZone;
    use std::collections::HashSet;
    use std::sync::Mutex;

    const AT: &str = "2024-05-01T12:00:00Z";

    /// An in-memory port that plays the extension's ledger functions for the decision logic of
    /// `claim_with`: `batch_atomic` applies the claim and the effects all or nothing.
    #[derive(Default)]
    struct FakeDb {
        claimed: Mutex<HashSet<String>>,
        effects: Mutex<Vec<String>>,
        calls: Mutex<Vec<&'static str>>,
        /// The batch fails with this SQLSTATE after its claim and effects ran (they are undone).
        fail_batch_with: Option<&'static str>,
        /// A concurrent delivery claims the key while this batch fails.
        rival_claims_key: bool,
        /// `inbox_seen` fails.
        fail_seen: bool,
    }

    fn text(statement: &Statement, index: usize) -> String {
        match &statement.params()[index] {
            Value::Text(s) => s.clone(),
            other => panic!("parameter {index} is {other:?}"),
        }
    }

    #[async_trait]
    impl Database for FakeDb {
        async fn execute(&self, _: &Statement) -> Result<u64, DbError> {
            unreachable!("the ledger only queries and batches")
        }

        async fn query(&self, statement: &Statement) -> Result<Rows, DbError> {
            statement.check()?;
            self.calls.lock().unwrap().push("query");
            assert_eq!(statement.sql(), sql::LEDGER_SEEN);
            if self.fail_seen {
                return Err(DbError::new(ErrorKind::ConnectionLost, "gone"));
            }
            let seen = self.claimed.lock().unwrap().contains(&text(statement, 1));
            Rows::new(vec!["seen".into()], vec![vec![Value::Bool(seen)]])
        }

        async fn batch_atomic(&self, statements: &[Statement]) -> Result<(), DbError> {
            statements.iter().try_for_each(Statement::check)?;
            self.calls.lock().unwrap().push("batch");
            let (claim, effect) = statements.split_first().unwrap();
            assert_eq!(claim.sql(), sql::LEDGER_CLAIM_OR_FAIL);
            let key = text(claim, 1);
            let mut claimed = self.claimed.lock().unwrap();
            if self.rival_claims_key {
                claimed.insert(key.clone());
            }
            if claimed.contains(&key) {
                return Err(DbError::from_sqlstate("23505", "already claimed"));
            }
            if let Some(code) = self.fail_batch_with {
                return Err(DbError::from_sqlstate(code, "batch failed"));
            }
            claimed.insert(key);
            let sql = effect.iter().map(|s| s.sql().to_owned());
            self.effects.lock().unwrap().extend(sql);
            Ok(())
        }
    }

    fn effect() -> Vec<Statement> {
        vec![Statement::new("INSERT INTO effects VALUES (1)")]
    }

    #[tokio::test]
    async fn claim_with_applies_once_then_reports_duplicates() {
        let db = FakeDb::default();
        let inbox = Inbox::new("ledger");
        assert!(inbox.claim_with(&db, "k", AT, &effect()).await.unwrap());
        assert!(!inbox.claim_with(&db, "k", AT, &effect()).await.unwrap());
        assert_eq!(db.effects.lock().unwrap().len(), 1);
        assert_eq!(*db.calls.lock().unwrap(), ["batch", "batch", "query"]);
    }

    #[tokio::test]
    async fn claim_with_tells_outcomes_apart_by_rereading_the_key() {
        let inbox = Inbox::new("ledger");
        // A failure that is not a unique violation, while a rival committed the key: not an error.
        let lost_race = FakeDb {
            rival_claims_key: true,
            ..FakeDb::default()
        };
        assert!(!inbox
            .claim_with(&lost_race, "k", AT, &effect())
            .await
            .unwrap());
        // A failed effect and an unclaimed key: the batch's own error, whatever its kind.
        for code in ["23505", "40001", "23502"] {
            let failed = FakeDb {
                fail_batch_with: Some(code),
                ..FakeDb::default()
            };
            let error = inbox
                .claim_with(&failed, "k", AT, &effect())
                .await
                .unwrap_err();
            assert_eq!(error.sqlstate(), Some(code));
            assert!(failed.claimed.lock().unwrap().is_empty());
            assert!(failed.effects.lock().unwrap().is_empty());
        }
        // The re-read fails too: the batch's error, not the re-read's.
        let blind = FakeDb {
            fail_batch_with: Some("40P01"),
            fail_seen: true,
            ..FakeDb::default()
        };
        let error = inbox
            .claim_with(&blind, "k", AT, &effect())
            .await
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Retryable);
    }

    #[tokio::test]
    async fn malformed_seen_at_fails_before_any_call() {
        let db = FakeDb::default();
        let inbox = Inbox::new("ledger");
        for result in [
            inbox.claim(&db, "k", "2024-05-01").await,
            inbox.claim_with(&db, "k", "not a time", &effect()).await,
        ] {
            assert_eq!(result.unwrap_err().kind(), ErrorKind::InvalidInput);
        }
        let batch = [inbox.claim_statement("k", "12:00"), effect().remove(0)];
        assert_eq!(
            db.batch_atomic(&batch).await.unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        assert!(db.calls.lock().unwrap().is_empty());
        assert!(db.claimed.lock().unwrap().is_empty());
    }

    #[test]
    fn create_table_sql_quotes_the_name_as_a_literal() {
        assert_eq!(
            Inbox::new("billing_inbox").create_table_sql(),
            "SELECT inbox_create_ledger('billing_inbox')"
        );
        assert_eq!(
            Inbox::new("app.\"it's\"").create_table_sql(),
            "SELECT inbox_create_ledger('app.\"it''s\"')"
        );
        assert_eq!(
            Inbox::new("a\\b'c").create_table_sql(),
            "SELECT inbox_create_ledger(E'a\\\\b''c')"
        );
    }

    #[test]
    fn claim_statement_binds_table_key_and_parsed_timestamp() {
        let inbox = Inbox::new("app.billing_inbox");
        let statement = inbox.claim_statement("order-1", "2024-05-01T14:00:00+02:00");
        assert!(statement.check().is_ok());
        assert!(statement
            .sql()
            .contains("inbox_claim_or_fail($1::text::regclass"));
        assert_eq!(
            statement.params(),
            &[
                Value::Text("app.billing_inbox".into()),
                Value::Text("order-1".into()),
                Value::Timestamp(Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap()),
            ]
        );
    }

    #[test]
    fn claim_statement_with_a_malformed_seen_at_is_rejected() {
        let statement = Inbox::new("t").claim_statement("k", "yesterday");
        let error = statement.check().unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidInput);
        assert!(error.to_string().contains("\"yesterday\""), "{error}");
    }
}
