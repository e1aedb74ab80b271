//! The connection: one session per command, each statement unnamed (see [`crate::sql`]), errors
//! mapped to [`CliError`] without the password.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Config, NoTls, Row};

use crate::error::CliError;
use crate::sql::Sql;

/// What the connection string must never leak into a message: its password.
#[derive(Clone, Debug, Default)]
pub struct Secret(Option<String>);

impl Secret {
    /// Replaces every occurrence of the password in `text`.
    pub fn scrub(&self, text: String) -> String {
        match &self.0 {
            Some(password) if !password.is_empty() => text.replace(password.as_str(), "********"),
            _ => text,
        }
    }

    /// The error of a statement or a connection, mapped to its kind.
    pub fn error(&self, error: tokio_postgres::Error) -> CliError {
        match error.as_db_error() {
            Some(db) => {
                let mut message = db.message().to_owned();
                if let Some(detail) = db.detail() {
                    message.push_str(&format!(" ({detail})"));
                }
                if let Some(hint) = db.hint() {
                    message.push_str(&format!("; hint: {hint}"));
                }
                CliError::Database {
                    sqlstate: db.code().code().to_owned(),
                    message: self.scrub(message),
                }
            }
            // No server error: the connection failed or broke; its causes say why.
            None => {
                let mut message = format!("database connection: {error}");
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    message.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                CliError::Connect(self.scrub(message))
            }
        }
    }
}

/// Parses a connection string (URL or key=value), naming the tool to the server.
pub fn config(url: &str) -> Result<(Config, Secret), CliError> {
    let mut config: Config = url.parse().map_err(|e: tokio_postgres::Error| {
        // The parser's message quotes no part of the string, but a URL is never echoed anyway.
        CliError::Usage(format!(
            "the database URL is not a valid connection string: {e}"
        ))
    })?;
    let secret = Secret(
        config
            .get_password()
            .map(|password| String::from_utf8_lossy(password).into_owned()),
    );
    if config.get_application_name().is_none() {
        config.application_name("inbox-cli");
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    Ok((config, secret))
}

/// A pool of at most `size` sessions of `config`, for the commands that serve (the dashboard,
/// the exporter, the relay); a session is handed out again as it is, unchecked.
pub fn pool(config: Config, size: usize) -> Result<deadpool_postgres::Pool, CliError> {
    let manager = deadpool_postgres::Manager::from_config(
        config,
        NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .build()
        .map_err(|e| CliError::Io(format!("cannot build the connection pool: {e}")))
}

/// One session with the database.
pub struct Db {
    client: Client,
    secret: Secret,
}

impl Db {
    pub async fn connect(url: &str) -> Result<Db, CliError> {
        let (config, secret) = config(url)?;
        let (client, connection) =
            config
                .connect(NoTls)
                .await
                .map_err(|e| match secret.error(e) {
                    // A server that refuses the session (authentication, unknown database) also
                    // means it cannot be used.
                    CliError::Database { sqlstate, message } => {
                        CliError::Connect(format!("{message} (SQLSTATE {sqlstate})"))
                    }
                    other => other,
                })?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Db { client, secret })
    }

    /// Runs `sql` as the unnamed statement: parse, bind and execute in one message, which a
    /// pooler in transaction mode sends to one server connection.
    pub async fn rows(
        &self,
        sql: &Sql,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, CliError> {
        self.client
            .query_typed(sql.text, &typed(sql, params))
            .await
            .map_err(|e| self.secret.error(e))
    }

    /// As [`rows`](Self::rows), for a statement that returns exactly one row.
    pub async fn one(&self, sql: &Sql, params: &[&(dyn ToSql + Sync)]) -> Result<Row, CliError> {
        self.client
            .query_typed_one(sql.text, &typed(sql, params))
            .await
            .map_err(|e| self.secret.error(e))
    }
}

/// Pairs each parameter with the type `sql` declares for it.
pub fn typed<'a>(
    sql: &Sql,
    params: &[&'a (dyn ToSql + Sync)],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(sql.params.len(), params.len(), "{}", sql.text);
    params
        .iter()
        .copied()
        .zip(sql.params.iter().cloned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_of_a_url_or_key_value_string_is_scrubbed() {
        for url in [
            "postgres://app:pa55-word@db.internal:5432/app",
            "host=db.internal user=app password=pa55-word dbname=app",
        ] {
            let (config, secret) = config(url).unwrap();
            assert_eq!(config.get_application_name(), Some("inbox-cli"));
            assert_eq!(
                secret.scrub("auth failed for pa55-word, pa55-word".to_owned()),
                "auth failed for ********, ********"
            );
        }
        let (_, none) = config("postgres://app@db.internal/app").unwrap();
        assert_eq!(none.scrub("nothing to hide".to_owned()), "nothing to hide");
    }

    #[test]
    fn a_malformed_url_is_a_usage_error_that_does_not_echo_it() {
        let Err(CliError::Usage(message)) = config("postgres://app:pa55-word@db:notaport/app")
        else {
            panic!("a bad port is a usage error");
        };
        assert!(!message.contains("pa55-word"), "{message}");
    }
}
