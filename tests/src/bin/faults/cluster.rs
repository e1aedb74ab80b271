//! A throwaway PostgreSQL cluster of a case's own (stock settings, autovacuum on), on a free
//! port, which the case may stop and start at will; stopped and removed when dropped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

use inbox_tests::TestDb;

use super::common::{connect, Result};

pub struct Cluster {
    dir: PathBuf,
    pg_bin: PathBuf,
    pub port: u16,
}

/// Whether this process runs as root (then PostgreSQL's programs run as user `postgres`).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("Uid:"))
                .map(|line| line.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

fn command(program: &Path) -> Command {
    let mut command = if is_root() {
        let mut sudo = Command::new("sudo");
        sudo.args(["-u", "postgres", "--"]).arg(program);
        sudo
    } else {
        Command::new(program)
    };
    command.current_dir("/").kill_on_drop(true);
    command
}

async fn run(mut command: Command, what: &str) -> Result<()> {
    let out = command.output().await.map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into())
    }
}

impl Cluster {
    /// initdb's a new cluster in a fresh directory under /tmp and starts it.
    pub async fn create(pg_bin: &Path) -> Result<Self> {
        // Under the directory scripts/faults.sh removes when it exits, if it gave one.
        let base = std::env::var("INBOX_FAULTS_TMP").unwrap_or_else(|_| "/tmp".to_owned());
        let out = Command::new("mktemp")
            .arg("-d")
            .arg(format!("{base}/inbox-faults-pg.XXXXXX"))
            .output()
            .await?;
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if is_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:postgres").arg(&dir);
            run(chown, "chown").await?;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let cluster = Self {
            dir,
            pg_bin: pg_bin.to_owned(),
            port,
        };
        let mut initdb = command(&pg_bin.join("initdb"));
        initdb.arg("-D").arg(cluster.data()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        ]);
        run(initdb, "initdb").await?;
        cluster.start().await?;
        Ok(cluster)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A database `faults` in it with the extension created, and a test schema there.
    pub async fn faults_database(&self) -> Result<TestDb> {
        connect(&self.url("postgres"))
            .await?
            .batch_execute("CREATE DATABASE faults")
            .await?;
        connect(&self.url("faults"))
            .await?
            .batch_execute("CREATE EXTENSION inbox")
            .await?;
        Ok(TestDb::at(&self.url("faults")).await)
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub async fn start(&self) -> Result<()> {
        let mut start = command(&self.pg_bin.join("pg_ctl"));
        start
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "120", "-o"])
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1",
                self.port,
                self.dir.display()
            ))
            .arg("start");
        run(start, "pg_ctl start").await
    }

    /// `pg_ctl stop -m MODE` (`immediate`: a crash, recovered from at the next start).
    pub async fn stop(&self, mode: &str) -> Result<()> {
        let mut stop = command(&self.pg_bin.join("pg_ctl"));
        stop.arg("-D")
            .arg(self.data())
            .args(["-m", mode, "-w", "stop"]);
        run(stop, "pg_ctl stop").await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pg_ctl = self.pg_bin.join("pg_ctl");
        let mut stop = if is_root() {
            let mut sudo = std::process::Command::new("sudo");
            sudo.args(["-u", "postgres", "--"]).arg(pg_ctl);
            sudo
        } else {
            std::process::Command::new(pg_ctl)
        };
        let _ = stop
            .current_dir("/")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        std::thread::sleep(Duration::from_millis(100));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
