//! inbox on a running Citus cluster (docs/scaling.md, "On Citus"): one coordinator and two worker
//! nodes that `scripts/citus.sh test` starts for these tests, and names in `INBOX_CITUS_URL` (the
//! coordinator's database) and `INBOX_CITUS_DIR` (the nodes' data directories, for the crashes).
//! Every call goes through the coordinator. The tests are ignored by a plain `cargo test`, which
//! has no cluster; the script runs them with `--ignored`, one at a time.

mod exactly_once;
mod placement;
mod wakeups;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime};

use tokio_postgres::{Client, Config, NoTls};

/// The nodes in the order of `scripts/citus.sh`'s ports file.
pub const NODES: [&str; 3] = ["coordinator", "worker1", "worker2"];

/// The cluster `scripts/citus.sh test` started.
pub struct Cluster {
    /// The coordinator's database.
    pub url: String,
    dir: PathBuf,
    pg_bin: PathBuf,
}

impl Cluster {
    pub fn from_env() -> Self {
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| {
                panic!("{name} is unset: run these tests with scripts/citus.sh test")
            })
        };
        Self {
            url: var("INBOX_CITUS_URL"),
            dir: PathBuf::from(var("INBOX_CITUS_DIR")),
            pg_bin: PathBuf::from(var("INBOX_PG_BIN")),
        }
    }

    /// A new connection to the coordinator.
    pub async fn connect(&self) -> Client {
        self.connect_to("coordinator").await
    }

    /// A new connection to `node`'s database (a worker node's too: Citus runs queries on
    /// distributed tables from any node).
    pub async fn connect_to(&self, node: &str) -> Client {
        let (client, connection) = self
            .config(node)
            .connect(NoTls)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {node}: {e}"));
        tokio::spawn(connection);
        client
    }

    /// How to connect to `node`: the coordinator's URL with the node's port, from the ports
    /// file `scripts/citus.sh` wrote.
    pub fn config(&self, node: &str) -> Config {
        let ports = std::fs::read_to_string(self.dir.join("ports")).expect("the cluster's ports");
        let index = NODES
            .iter()
            .position(|n| *n == node)
            .expect("a node's name");
        let port: u16 = ports
            .split_whitespace()
            .nth(index)
            .unwrap()
            .parse()
            .unwrap();
        // A Config holds a list of ports: a new one, with the URL's host, user and database.
        let url: Config = self.url.parse().unwrap();
        let mut config = Config::new();
        for host in url.get_hosts() {
            if let tokio_postgres::config::Host::Tcp(host) = host {
                config.host(host);
            }
        }
        config.port(port);
        if let Some(user) = url.get_user() {
            config.user(user);
        }
        if let Some(dbname) = url.get_dbname() {
            config.dbname(dbname);
        }
        config
    }

    /// Crashes node `node` (`coordinator`, `worker1` or `worker2`) with `pg_ctl -m immediate`,
    /// waits `down`, and starts it again; returns when it went down.
    pub async fn crash(&self, node: &str, down: Duration) -> SystemTime {
        self.pg_ctl(node, &["-m", "immediate", "-w", "stop"]);
        let stopped = SystemTime::now();
        tokio::time::sleep(down).await;
        let log = self.dir.join(format!("{node}.log"));
        self.pg_ctl(
            node,
            &["-l", &log.display().to_string(), "-w", "-t", "120", "start"],
        );
        stopped
    }

    fn pg_ctl(&self, node: &str, args: &[&str]) {
        let data = self.dir.join(node);
        let status = Command::new("sudo")
            .args(["-u", "postgres", "--"])
            .arg(self.pg_bin.join("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .args(args)
            .current_dir("/")
            .stdout(std::process::Stdio::null())
            .status()
            .expect("pg_ctl runs");
        assert!(status.success(), "pg_ctl {args:?} on {}", data.display());
    }
}

/// The SQLSTATE of `sql`'s failure; panics when it succeeds.
pub async fn sqlstate(client: &Client, sql: &str) -> String {
    let error = client
        .batch_execute(sql)
        .await
        .expect_err(&format!("{sql} succeeded"));
    error
        .code()
        .map(|code| code.code().to_owned())
        .unwrap_or_else(|| panic!("{sql}: no SQLSTATE: {error}"))
}
