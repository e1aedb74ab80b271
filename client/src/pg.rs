//! [`PgDatabase`]: the [`Database`] port over a deadpool-postgres pool.

use std::fmt;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};

use tokio_postgres::NoTls;

use crate::database::Database;
use crate::error::{DbError, ErrorKind};
use crate::mode::{self, execute_prepared, query_prepared, StatementMode};
use crate::rows::Rows;
use crate::statement::Statement;
use crate::tx::PgTransaction;

/// The environment variable [`PgDatabase::from_env`] reads.
pub const DATABASE_URL: &str = "DATABASE_URL";

/// The size of the pool [`PgDatabase::connect`] builds: four connections per CPU, so that a
/// transactional worker's `workers(8)` runs 7 slots on 2 CPUs (one connection is the
/// heartbeat's). deadpool's own default (two per CPU since its 0.13) would leave it 3.
pub fn default_pool_size() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) * 4
}

/// The [`Database`] port over a connection pool: each call takes a pooled connection, and
/// [`batch_atomic`](Database::batch_atomic) runs its statements in one transaction on one
/// connection. Statements are prepared once per connection and cached, unless the port is
/// [`behind_pooler`](Self::behind_pooler) (or given [`StatementMode::Unnamed`]).
///
/// Cloning is cheap and shares the pool.
///
/// # Connection poolers
/// Behind a pooler in transaction mode (pgbouncer's `pool_mode = transaction`), consecutive
/// transactions of one pooled connection may run on different server connections, so nothing
/// may rely on session state: build the port with [`connect_through_pooler`](Self::connect_through_pooler)
/// or [`behind_pooler`](Self::behind_pooler). Its statements are then sent unnamed (no named
/// prepared statement), and a worker wakes on enqueues through a LISTEN connection opened with
/// the direct connection settings given, or else polls (LISTEN through the pooler would lose
/// notifications). The worker sets its timeouts per transaction in either mode.
#[derive(Clone)]
pub struct PgDatabase {
    pool: Pool,
    /// The connection settings, when known.
    config: Option<tokio_postgres::Config>,
    /// The settings a worker opens its LISTEN connection with; `None`: it polls.
    listen: Option<tokio_postgres::Config>,
    mode: StatementMode,
}

impl PgDatabase {
    /// The port over an existing pool (the way to use TLS, a custom size or timeouts). A worker
    /// on it polls, unless [`with_listen_config`](Self::with_listen_config) is given.
    pub fn from_pool(pool: Pool) -> Self {
        Self {
            pool,
            config: None,
            listen: None,
            mode: StatementMode::Prepared,
        }
    }

    /// The port over an existing pool whose connections use `config`; a worker built on it can
    /// then open its own LISTEN connection and wake on enqueues instead of polling.
    pub fn from_pool_and_config(pool: Pool, config: tokio_postgres::Config) -> Self {
        Self {
            pool,
            listen: Some(config.clone()),
            config: Some(config),
            mode: StatementMode::Prepared,
        }
    }

    /// This port sending its statements (and its workers') as `mode` says.
    #[must_use]
    pub fn with_statement_mode(mut self, mode: StatementMode) -> Self {
        self.mode = mode;
        self
    }

    /// This port with its workers opening their LISTEN connections with `config` (a direct
    /// connection to the server, not through a pooler in transaction mode).
    #[must_use]
    pub fn with_listen_config(mut self, config: tokio_postgres::Config) -> Self {
        self.listen = Some(config);
        self
    }

    /// This port with its workers polling at their poll interval instead of listening.
    #[must_use]
    pub fn without_listen(mut self) -> Self {
        self.listen = None;
        self
    }

    /// This port set up for a pooler in transaction mode: [`StatementMode::Unnamed`], and its
    /// workers LISTEN with `direct` (the server's own address, bypassing the pooler) when given,
    /// else poll. Nothing is lost by polling but the latency of a wake-up (at most the poll
    /// interval).
    #[must_use]
    pub fn behind_pooler(self, direct: Option<tokio_postgres::Config>) -> Self {
        let port = self.with_statement_mode(StatementMode::Unnamed);
        match direct {
            Some(config) => port.with_listen_config(config),
            None => port.without_listen(),
        }
    }

    /// As [`connect_with_size`](Self::connect_with_size) to a pooler in transaction mode at
    /// `pooler_url`, [`behind_pooler`](Self::behind_pooler): workers LISTEN through a connection
    /// to `direct_url` (the server itself) when given, else poll.
    ///
    /// # Errors
    /// As [`connect`](Self::connect), for either string.
    pub async fn connect_through_pooler(
        pooler_url: &str,
        direct_url: Option<&str>,
        max_size: Option<usize>,
    ) -> Result<Self, DbError> {
        let direct = match direct_url {
            Some(url) => Some(url.parse::<tokio_postgres::Config>().map_err(|e| {
                DbError::new(ErrorKind::InvalidInput, DbError::from(e).message())
                    .redacted(&secrets_in(url))
            })?),
            None => None,
        };
        Ok(Self::connect_with_size(pooler_url, max_size)
            .await?
            .behind_pooler(direct))
    }

    /// Builds a pool (without TLS, of [`default_pool_size`] connections) for the libpq-style connection
    /// string `url` (`postgres://user:password@host:port/db` or `host=... user=...`) and checks it
    /// by opening one connection.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a malformed string, or the error of the first connection
    /// (usually [`ErrorKind::ConnectionLost`]). The error never contains the password.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::connect_with_size(url, None).await
    }

    /// As [`connect`](Self::connect), with a pool of at most `max_size` connections (`None`:
    /// [`default_pool_size`]). A worker needs one per concurrent delivery, plus one for heartbeats.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_with_size(url: &str, max_size: Option<usize>) -> Result<Self, DbError> {
        let secrets = secrets_in(url);
        Self::connect_unredacted(url, max_size)
            .await
            .map_err(|e| e.redacted(&secrets))
    }

    async fn connect_unredacted(url: &str, max_size: Option<usize>) -> Result<Self, DbError> {
        let config: tokio_postgres::Config = url.parse().map_err(|e: tokio_postgres::Error| {
            DbError::new(ErrorKind::InvalidInput, DbError::from(e).message())
        })?;
        let manager = Manager::from_config(
            config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(max_size.unwrap_or_else(default_pool_size))
            .build()
            .map_err(|e| DbError::new(ErrorKind::Other, format!("cannot build the pool: {e}")))?;
        drop(pool.get().await?);
        Ok(Self::from_pool_and_config(pool, config))
    }

    /// [`connect`](Self::connect)s to the URL in the `DATABASE_URL` environment variable.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when the variable is unset or not Unicode, else as
    /// [`connect`](Self::connect).
    pub async fn from_env() -> Result<Self, DbError> {
        let url = std::env::var(DATABASE_URL).map_err(|e| {
            DbError::new(
                ErrorKind::InvalidInput,
                format!("environment variable {DATABASE_URL}: {e}"),
            )
        })?;
        Self::connect(&url).await
    }

    /// The pool, e.g. to open a transaction for a [`PgTransaction`].
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The connection settings, when the port was built from them (not from a bare pool).
    pub fn config(&self) -> Option<&tokio_postgres::Config> {
        self.config.as_ref()
    }

    /// The settings a worker opens its LISTEN connection with; `None` when it polls.
    pub fn listen_config(&self) -> Option<&tokio_postgres::Config> {
        self.listen.as_ref()
    }

    /// How this port sends statements.
    pub fn statement_mode(&self) -> StatementMode {
        self.mode
    }
}

impl fmt::Debug for PgDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("PgDatabase")
            .field("max_size", &status.max_size)
            .field("size", &status.size)
            .field("available", &status.available)
            .field("mode", &self.mode)
            .field("listens", &self.listen.is_some())
            .finish()
    }
}

#[async_trait]
impl Database for PgDatabase {
    async fn execute(&self, statement: &Statement) -> Result<u64, DbError> {
        statement.check()?;
        let client = self.pool.get().await?;
        if self.mode == StatementMode::Unnamed {
            let ran = mode::run_values(&**client, statement.sql(), statement.params()).await?;
            return Ok(ran.affected);
        }
        let prepared = client.prepare_cached(statement.sql()).await?;
        execute_prepared(&**client, &prepared, statement).await
    }

    async fn query(&self, statement: &Statement) -> Result<Rows, DbError> {
        statement.check()?;
        let client = self.pool.get().await?;
        if self.mode == StatementMode::Unnamed {
            let ran = mode::run_values(&**client, statement.sql(), statement.params()).await?;
            return Ok(Rows::decode_unnamed(&ran.rows));
        }
        let prepared = client.prepare_cached(statement.sql()).await?;
        query_prepared(&**client, &prepared, statement).await
    }

    async fn batch_atomic(&self, statements: &[Statement]) -> Result<(), DbError> {
        statements.iter().try_for_each(Statement::check)?;
        if statements.is_empty() {
            return Ok(());
        }
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let result = PgTransaction::new(&tx)
            .with_statement_mode(self.mode)
            .run_all(statements)
            .await;
        match result {
            Ok(()) => Ok(tx.commit().await?),
            Err(error) => {
                if let Err(rollback) = tx.rollback().await {
                    tracing::warn!(%rollback, "rolling back a failed batch failed");
                }
                Err(error)
            }
        }
    }
}

/// The passwords a connection string may carry, as written and percent- or quote-decoded, so that
/// errors about it can be scrubbed of them.
fn secrets_in(conninfo: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    let url_body = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|prefix| conninfo.strip_prefix(prefix));
    if let Some(body) = url_body {
        let credentials = body.split('@').next().filter(|_| body.contains('@'));
        if let Some((_, password)) = credentials.and_then(|c| c.split_once(':')) {
            secrets.push(password.to_owned());
            secrets.push(percent_decode(password));
        }
        // Query parameters may carry it too: `?password=...`.
        if let Some((_, query)) = body.split_once('?') {
            for pair in query.split('&') {
                if let Some(("password", value)) = pair.split_once('=') {
                    secrets.push(value.to_owned());
                    secrets.push(percent_decode(value));
                }
            }
        }
    } else {
        let mut rest = conninfo;
        while let Some(at) = rest.find("password") {
            rest = rest[at + "password".len()..].trim_start();
            let Some(value) = rest.strip_prefix('=') else {
                continue;
            };
            let value = value.trim_start();
            let (raw, decoded) = match value.strip_prefix('\'') {
                Some(quoted) => {
                    let mut decoded = String::new();
                    let mut chars = quoted.char_indices();
                    let mut end = quoted.len();
                    while let Some((i, c)) = chars.next() {
                        match c {
                            '\\' => decoded.extend(chars.next().map(|(_, c)| c)),
                            '\'' => {
                                end = i;
                                break;
                            }
                            c => decoded.push(c),
                        }
                    }
                    (&quoted[..end], decoded)
                }
                None => {
                    let end = value.find(char::is_whitespace).unwrap_or(value.len());
                    (&value[..end], value[..end].to_owned())
                }
            };
            secrets.push(raw.to_owned());
            secrets.push(decoded);
            rest = value;
        }
    }
    secrets.retain(|s| !s.is_empty());
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// `text` with `%XX` escapes decoded (invalid UTF-8 replaced).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_found_in_urls_and_key_value_strings() {
        assert_eq!(
            secrets_in("postgres://app:p%40ss%3Aword@db:5432/x"),
            ["p%40ss%3Aword", "p@ss:word"]
        );
        assert_eq!(
            secrets_in("postgresql://app:pw@db/x?password=other"),
            ["other", "pw"]
        );
        assert!(secrets_in("postgres://app@db/x").is_empty());
        assert!(secrets_in("postgres://db/x").is_empty());
        assert_eq!(
            secrets_in("host=db password = 's3 cr\\'et' user=app"),
            ["s3 cr\\'et", "s3 cr'et"]
        );
        assert_eq!(secrets_in("password=plain host=db"), ["plain"]);
        assert!(secrets_in("host=db user=app").is_empty());
    }

    #[tokio::test]
    async fn connect_errors_never_show_the_password() {
        // Port 1 on the loopback is closed: the first connection is refused.
        let refused = PgDatabase::connect("postgres://app:Sup3rS3cret@127.0.0.1:1/inbox")
            .await
            .unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::ConnectionLost, "{refused}");
        assert!(
            refused.to_string().contains("error connecting"),
            "{refused}"
        );
        for malformed in [
            "postgres://app:Sup3rS3cret@127.0.0.1:notaport/inbox",
            "postgres://app:Sup3rS3cret@127.0.0.1/inbox?Sup3rS3cret=1",
            "host=127.0.0.1 password=Sup3rS3cret Sup3rS3cret=x",
        ] {
            let error = PgDatabase::connect(malformed).await.unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidInput, "{error}");
            assert!(
                error.to_string().contains("invalid connection string"),
                "{error}"
            );
            for shown in [
                error.to_string(),
                format!("{error:?}"),
                format!("{error:#?}"),
            ] {
                assert!(!shown.contains("Sup3rS3cret"), "{shown}");
            }
        }
        for shown in [
            refused.to_string(),
            format!("{refused:?}"),
            format!("{refused:#?}"),
        ] {
            assert!(!shown.contains("Sup3rS3cret"), "{shown}");
        }
    }
}
