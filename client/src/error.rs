//! [`DbError`], the one error type of the [`Database`](crate::Database) port, and its [`ErrorKind`].

use std::error::Error as StdError;
use std::fmt;

use deadpool_postgres::PoolError;
use tokio_postgres::types::WrongType;

/// What a caller can do about a [`DbError`]: the classes it branches on.
///
/// New kinds may be added; match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A unique constraint rejected the write (SQLSTATE `23505`), e.g. a key that is already claimed.
    UniqueViolation,
    /// A serialization failure (`40001`) or a deadlock (`40P01`): nothing of the transaction
    /// committed, and running it again may succeed.
    Retryable,
    /// The connection could not be made, or was lost or closed (class `08`, `57P01`..`57P03`, an
    /// I/O error, a closed pool or a pool timeout); whether an in-flight commit took is unknown.
    ConnectionLost,
    /// The table (or its schema) does not exist (`42P01`, `3F000`).
    UndefinedTable,
    /// The role may not read or write the object (`42501`).
    InsufficientPrivilege,
    /// The caller's input was rejected before or by the server: a malformed timestamp, a parameter
    /// of the wrong type or out of range, a bad connection string, an invalid table name
    /// (`42602`, `42622`) or any data exception (class `22`).
    InvalidInput,
    /// Anything else (syntax errors, other constraint violations, ...); see
    /// [`DbError::sqlstate`].
    Other,
}

impl ErrorKind {
    /// The kind of a server error with SQLSTATE `code`.
    pub fn from_sqlstate(code: &str) -> Self {
        match code {
            "23505" => Self::UniqueViolation,
            "40001" | "40P01" => Self::Retryable,
            "42P01" | "3F000" => Self::UndefinedTable,
            "42501" => Self::InsufficientPrivilege,
            "42602" | "42622" => Self::InvalidInput,
            "57P01" | "57P02" | "57P03" => Self::ConnectionLost,
            c if c.starts_with("08") => Self::ConnectionLost,
            c if c.starts_with("22") => Self::InvalidInput,
            _ => Self::Other,
        }
    }
}

/// An error from the [`Database`](crate::Database) port or the ledger.
///
/// Its `Display` gives the server's message and SQLSTATE (or the client-side cause) and never a
/// connection string or password; `Debug` shows the same fields.
#[derive(thiserror::Error)]
#[error("{message}{}", .sqlstate.as_deref().map(|c| format!(" (SQLSTATE {c})")).unwrap_or_default())]
pub struct DbError {
    kind: ErrorKind,
    sqlstate: Option<String>,
    message: String,
    #[source]
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl DbError {
    /// A new error of `kind` with `message` and no SQLSTATE (for client-side failures and for
    /// other implementations of the port).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            sqlstate: None,
            message: message.into(),
            source: None,
        }
    }

    /// A server error: its kind follows from `sqlstate` (see [`ErrorKind::from_sqlstate`]).
    pub fn from_sqlstate(sqlstate: impl Into<String>, message: impl Into<String>) -> Self {
        let sqlstate = sqlstate.into();
        Self {
            kind: ErrorKind::from_sqlstate(&sqlstate),
            sqlstate: Some(sqlstate),
            message: message.into(),
            source: None,
        }
    }

    /// This error with `source` as its [`source()`](std::error::Error::source).
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// What the caller can do about it.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The server's five-character SQLSTATE, or `None` for an error raised before or outside the
    /// server (connection, parameter or input errors).
    pub fn sqlstate(&self) -> Option<&str> {
        self.sqlstate.as_deref()
    }

    /// The message alone, without the SQLSTATE.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether running the same work again may succeed ([`ErrorKind::Retryable`]).
    pub fn is_retryable(&self) -> bool {
        self.kind == ErrorKind::Retryable
    }

    /// Replaces every occurrence of each non-empty `secret` in the message and drops the source,
    /// so that no part of the error can print them.
    pub(crate) fn redacted(mut self, secrets: &[String]) -> Self {
        for secret in secrets.iter().filter(|s| !s.is_empty()) {
            self.message = self.message.replace(secret.as_str(), "********");
        }
        self.source = None;
        self
    }
}

impl fmt::Debug for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbError")
            .field("kind", &self.kind)
            .field("sqlstate", &self.sqlstate)
            .field("message", &self.message)
            .finish()
    }
}

/// An error detected while encoding a parameter (a value out of the range of its column type).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ParamError(pub(crate) String);

/// `error` and the chain of its sources, joined by `": "`.
fn chain(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

impl From<tokio_postgres::Error> for DbError {
    fn from(error: tokio_postgres::Error) -> Self {
        if let Some(db) = error.as_db_error() {
            let mut message = db.message().to_owned();
            if let Some(detail) = db.detail() {
                message.push_str(": ");
                message.push_str(detail);
            }
            return Self::from_sqlstate(db.code().code(), message).with_source(error);
        }
        let kind = if error.is_closed() {
            ErrorKind::ConnectionLost
        } else {
            match error.source() {
                Some(cause) if cause.is::<std::io::Error>() => ErrorKind::ConnectionLost,
                Some(cause) if cause.is::<WrongType>() || cause.is::<ParamError>() => {
                    ErrorKind::InvalidInput
                }
                _ => ErrorKind::Other,
            }
        };
        Self::new(kind, chain(&error)).with_source(error)
    }
}

impl From<PoolError> for DbError {
    fn from(error: PoolError) -> Self {
        match error {
            PoolError::Backend(e) => e.into(),
            PoolError::Timeout(_) | PoolError::Closed => {
                Self::new(ErrorKind::ConnectionLost, chain(&error)).with_source(error)
            }
            _ => Self::new(ErrorKind::Other, chain(&error)).with_source(error),
        }
    }
}

/// Waits for one round trip of `answer` for at most `bound` (`None`: as long as it takes). A
/// connection that stops answering without closing (a half-open one: a peer or a middlebox gone
/// silent) never reports an error of its own, so no answer within the bound is reported as
/// [`ErrorKind::ConnectionLost`], and the caller must not use the connection again.
pub(crate) async fn within<T>(
    bound: Option<std::time::Duration>,
    answer: impl std::future::Future<Output = T>,
) -> Result<T, DbError> {
    match bound {
        None => Ok(answer.await),
        Some(bound) => tokio::time::timeout(bound, answer).await.map_err(|_| {
            DbError::new(
                ErrorKind::ConnectionLost,
                format!(
                    "no answer from the server within {bound:?}: the connection is taken as lost"
                ),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_to_the_kinds_callers_act_on() {
        let cases = [
            ("23505", ErrorKind::UniqueViolation),
            ("23502", ErrorKind::Other),
            ("40001", ErrorKind::Retryable),
            ("40P01", ErrorKind::Retryable),
            ("42P01", ErrorKind::UndefinedTable),
            ("3F000", ErrorKind::UndefinedTable),
            ("42501", ErrorKind::InsufficientPrivilege),
            ("08006", ErrorKind::ConnectionLost),
            ("57P01", ErrorKind::ConnectionLost),
            ("22007", ErrorKind::InvalidInput),
            ("22004", ErrorKind::InvalidInput),
            ("42602", ErrorKind::InvalidInput),
            ("42601", ErrorKind::Other),
        ];
        for (code, kind) in cases {
            assert_eq!(ErrorKind::from_sqlstate(code), kind, "{code}");
            let error = DbError::from_sqlstate(code, "boom");
            assert_eq!(error.kind(), kind);
            assert_eq!(error.sqlstate(), Some(code));
        }
    }

    #[test]
    fn display_carries_message_and_sqlstate() {
        let error = DbError::from_sqlstate("23505", "key already claimed");
        assert_eq!(error.to_string(), "key already claimed (SQLSTATE 23505)");
        assert!(!error.is_retryable());
        assert!(DbError::from_sqlstate("40P01", "deadlock").is_retryable());
        let client = DbError::new(ErrorKind::InvalidInput, "bad timestamp");
        assert_eq!(client.to_string(), "bad timestamp");
        assert_eq!(client.sqlstate(), None);
    }

    #[test]
    fn redaction_removes_secrets_from_display_debug_and_source() {
        let error = DbError::new(ErrorKind::Other, "failed for hunter2 at hunter2")
            .with_source(ParamError("hunter2".into()))
            .redacted(&["hunter2".into(), String::new()]);
        assert!(!error.to_string().contains("hunter2"));
        assert!(!format!("{error:?}").contains("hunter2"));
        assert!(error.source().is_none());
        assert_eq!(error.message(), "failed for ******** at ********");
    }
}
