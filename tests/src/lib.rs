//! Shared fixtures of the integration tests.
//!
//! [`TestDb::new`] gives each test its own fresh schema in the database named by
//! `INBOX_TEST_DATABASE_URL` (default [`DEFAULT_URL`]), where the `inbox` extension must already be
//! created. Every connection the fixture opens has `search_path` set to `<schema>, public`, so
//! tests create their tables with unqualified names and still find the extension's functions in
//! `public`, and `application_name` set to the schema's name. When the [`TestDb`] is dropped, the
//! connections still open under that name are terminated and the schema is dropped (best effort):
//! drop the `TestDb` last.
//!
//! ```no_run
//! # async fn run() {
//! let db = inbox_tests::TestDb::new().await;
//! let pool = db.pool(4);
//! let client = pool.get().await.unwrap();
//! client.batch_execute("CREATE TABLE t (id int)").await.unwrap(); // in db.schema()
//! # }
//! ```

#![warn(missing_docs)]

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

pub mod nats;
mod pgbouncer;
pub mod results;
pub use nats::NatsServer;
pub use pgbouncer::PgBouncer;

/// The environment variable naming the test database.
pub const URL_VAR: &str = "INBOX_TEST_DATABASE_URL";

/// The test database used when [`URL_VAR`] is unset.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/inbox_test";

/// A fresh schema in the test database, and connections that use it.
#[derive(Debug)]
pub struct TestDb {
    url: String,
    schema: String,
    config: tokio_postgres::Config,
}

impl TestDb {
    /// Creates a uniquely named schema (`t_<pid>_<counter>_<random>`) in the test database.
    ///
    /// # Panics
    /// When the database cannot be reached or the schema cannot be created (the message says
    /// which URL was tried and how to set it up).
    pub async fn new() -> Self {
        let url = std::env::var(URL_VAR).unwrap_or_else(|_| DEFAULT_URL.to_owned());
        Self::at(&url).await
    }

    /// As [`new`](Self::new), in the database at `url` (a server of the test's own, say).
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub async fn at(url: &str) -> Self {
        let url = url.to_owned();
        let schema = unique_schema_name();
        let mut config: tokio_postgres::Config = url
            .parse()
            .unwrap_or_else(|e| panic!("{URL_VAR} is not a connection string: {e}"));
        let admin = connect(&config).await.unwrap_or_else(|e| {
            panic!(
                "cannot connect to the test database ({e}); set {URL_VAR} (default {DEFAULT_URL}) \
                 to a database where `CREATE EXTENSION inbox` was run"
            )
        });
        // On a Citus coordinator the schema is a tenant's, distributed from the start, with one
        // table that the queues and ledgers a test creates join (on one worker node).
        let citus = admin
            .query_one(
                "SELECT pg_catalog.to_regclass('pg_catalog.pg_dist_schema') IS NOT NULL",
                &[],
            )
            .await
            .map(|row| row.get::<_, bool>(0))
            .unwrap_or(false);
        let create = if citus {
            format!(
                "SET citus.enable_schema_based_sharding = on; CREATE SCHEMA {schema}; \
                 RESET citus.enable_schema_based_sharding; \
                 CREATE TABLE {schema}.tenant (since timestamptz NOT NULL DEFAULT now())"
            )
        } else {
            format!("CREATE SCHEMA {schema}")
        };
        admin
            .batch_execute(&create)
            .await
            .unwrap_or_else(|e| panic!("cannot create schema {schema}: {e}"));
        config.options(format!("-c search_path={schema},public"));
        // Lets the cleanup find this test's connections (and a person read pg_stat_activity).
        config.application_name(&schema);
        Self {
            url,
            schema,
            config,
        }
    }

    /// A new pool of at most `size` connections to the test database, each using the schema.
    pub fn pool(&self, size: usize) -> Pool {
        let manager = Manager::from_config(
            self.config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(manager)
            .max_size(size)
            .build()
            .unwrap_or_else(|e| panic!("cannot build a pool: {e}"))
    }

    /// A new plain connection to the test database, using the schema; its connection task runs on
    /// the current tokio runtime.
    ///
    /// # Panics
    /// When the connection fails.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.config)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the test database: {e}"))
    }

    /// The test database's connection string (without the schema's `search_path`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection settings of this test's connections (schema included), e.g. for
    /// `PgDatabase::from_pool_and_config`, whose workers LISTEN with them.
    pub fn config(&self) -> tokio_postgres::Config {
        self.config.clone()
    }

    /// Whether the test database has the SQL-only build (`sql/inbox-sql-only.sql`, see
    /// `docs/sql-only.md`) rather than the extension: the few behaviours that differ are checked
    /// as that build defines them.
    pub async fn sql_only(&self) -> bool {
        self.client()
            .await
            .query_one(
                "SELECT NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'inbox')",
                &[],
            )
            .await
            .unwrap_or_else(|e| panic!("cannot read pg_extension: {e}"))
            .get(0)
    }

    /// The name of this test's schema (a plain lower-case identifier, safe to format into SQL).
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl Drop for TestDb {
    /// Terminates the test's other connections still open (a transaction left open would hold its
    /// locks while this blocks the runtime that would roll it back), then drops the schema on a
    /// connection of its own; failures are ignored.
    fn drop(&mut self) {
        let config = self.config.clone();
        let drop_schema = format!(
            "SET lock_timeout = '10s'; \
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = '{schema}' AND pid <> pg_backend_pid(); \
             DROP SCHEMA IF EXISTS {schema} CASCADE",
            schema = self.schema
        );
        // Drop cannot await, and may run inside a runtime: use a thread with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                if let Ok(client) = connect(&config).await {
                    let _ = client.batch_execute(&drop_schema).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

async fn connect(
    config: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn unique_schema_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(counter);
    let random = hasher.finish() & 0xff_ffff;
    format!("t_{}_{counter}_{random:06x}", std::process::id())
}

/// A loopback port free at the moment of the call (for a server a test starts).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("find a free port")
}
