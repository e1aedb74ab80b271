//! Settings of a run, connections, and the tables every figure works on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use inbox_client::PgDatabase;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T> = std::result::Result<T, Error>;

/// The queue the project's side of a figure works on (made by `inbox_create_queue`).
pub const Q_INBOX: &str = "bench_q_inbox";
/// The queue the raw SQL side works on: the same shape, also made by `inbox_create_queue`.
pub const Q_RAW: &str = "bench_q_raw";
/// Ledgers (made by `inbox_create_ledger`).
pub const L_INBOX: &str = "bench_l_inbox";
pub const L_RAW: &str = "bench_l_raw";
/// The tables the handlers of figures 4, 5 and 7 insert one row into, per job.
pub const DONE_INBOX: &str = "bench_done_inbox";
pub const DONE_RAW: &str = "bench_done_raw";
/// The queues of the bloat figure.
pub const CHURN_INBOX: &str = "bench_churn_inbox";
pub const CHURN_RAW: &str = "bench_churn_raw";

/// Which side of a comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Inbox,
    Raw,
}

impl Side {
    pub fn queue(self) -> &'static str {
        match self {
            Side::Inbox => Q_INBOX,
            Side::Raw => Q_RAW,
        }
    }

    pub fn ledger(self) -> &'static str {
        match self {
            Side::Inbox => L_INBOX,
            Side::Raw => L_RAW,
        }
    }

    pub fn done(self) -> &'static str {
        match self {
            Side::Inbox => DONE_INBOX,
            Side::Raw => DONE_RAW,
        }
    }
}

/// How long and how often to measure.
#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    /// The measured window of each side, each round.
    pub duration: Duration,
    /// Run before the window opens (connections prepared, caches warm); not counted.
    pub warmup: Duration,
    /// Rounds of (inbox, raw) measurements; the median of each side is reported.
    pub rounds: usize,
    /// Concurrent connections of figures 1 to 5.
    pub connections: Vec<usize>,
    /// Figures to run (1 to 19).
    pub figures: Vec<u8>,
    /// Latency samples per side and connection count (figure 5).
    pub latency_samples: usize,
    /// Jobs through the churn queue at the first and the second size measurement (figure 6).
    pub churn: (u64, u64),
    /// How long each child process of figure 7 runs its worker.
    pub child_seconds: u64,
    /// The depth a queue consumed 100 jobs at a time is filled to before a measurement (its
    /// refill, a single connection, cannot keep pace with 16 connections on its own).
    pub batch_depth: u64,
    /// How long each holder of figure 12 holds the horizon, in seconds (each length in turn).
    pub holds: Vec<u64>,
}

impl Opts {
    /// The depth to keep a queue at while `connections` consumers hold `in_flight` jobs each.
    pub fn depth(&self, connections: usize, in_flight: usize) -> u64 {
        if in_flight >= 100 {
            self.batch_depth
        } else {
            5_000 + 4 * (connections * in_flight) as u64
        }
    }
}

impl Opts {
    pub fn full() -> Self {
        Self {
            quick: false,
            duration: Duration::from_millis(1200),
            warmup: Duration::from_millis(250),
            rounds: 3,
            connections: vec![1, 4, 16],
            // Figure 17 needs a Citus cluster: scripts/citus.sh bench runs it.
            figures: (1..=16).chain([18, 19]).collect(),
            latency_samples: 1000,
            churn: (100_000, 1_000_000),
            child_seconds: 8,
            batch_depth: 80_000,
            holds: vec![120, 600],
        }
    }

    pub fn quick() -> Self {
        Self {
            quick: true,
            duration: Duration::from_millis(250),
            warmup: Duration::from_millis(100),
            rounds: 1,
            latency_samples: 100,
            churn: (10_000, 100_000),
            child_seconds: 2,
            batch_depth: 15_000,
            holds: vec![20],
            ..Self::full()
        }
    }
}

/// What every figure needs: the connection settings and the options.
pub struct Ctx {
    pub url: String,
    pub config: tokio_postgres::Config,
    pub opts: Opts,
}

impl Ctx {
    /// Settings from `url`, with `synchronous_commit` set to PostgreSQL's default (`on`) on every
    /// connection whatever the server's configuration says.
    pub fn new(url: &str, opts: Opts) -> Result<Self> {
        let mut config: tokio_postgres::Config = url.parse()?;
        config.options("-c synchronous_commit=on");
        config.application_name("inbox-bench");
        Ok(Self {
            url: url.to_owned(),
            config,
            opts,
        })
    }

    /// A new connection, its driver running on the current runtime.
    pub async fn connect(&self) -> Result<Client> {
        let (client, connection) = self.config.connect(NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// A pool of at most `size` connections.
    pub fn pool(&self, size: usize) -> Result<Pool> {
        let manager = Manager::from_config(
            self.config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Ok(Pool::builder(manager).max_size(size).build()?)
    }

    /// The client crate's port over a pool of `size`, able to LISTEN (as a service builds it).
    pub fn database(&self, size: usize) -> Result<PgDatabase> {
        Ok(PgDatabase::from_pool_and_config(
            self.pool(size)?,
            self.config.clone(),
        ))
    }
}

/// The raw SQL's choice of due jobs, as the extension's: oldest first within the highest
/// priority, in the order of the queue's partial index `((-priority), locked_until, id) WHERE
/// locked_until < 'infinity'`, which a hand-written loop on these tables would use too (any other
/// order sorts the whole queue on every take). Follows `FROM <queue> WHERE`.
pub const DUE_IN_INDEX_ORDER: &str = "locked_until <= now() AND locked_until < 'infinity' \
     ORDER BY (-(priority::int8)), locked_until, id";

/// Creates the benchmark's tables (all through the extension, but the handlers' `done` tables).
pub async fn create_tables(client: &Client) -> Result<()> {
    let mut sql = String::from("SET client_min_messages = warning;");
    for queue in [Q_INBOX, Q_RAW, CHURN_INBOX, CHURN_RAW] {
        sql.push_str(&format!("SELECT inbox_create_queue('{queue}');"));
    }
    for ledger in [L_INBOX, L_RAW] {
        sql.push_str(&format!("SELECT inbox_create_ledger('{ledger}');"));
    }
    for done in [DONE_INBOX, DONE_RAW] {
        sql.push_str(&format!(
            "CREATE TABLE IF NOT EXISTS {done} (n bigint NOT NULL);"
        ));
    }
    client.batch_execute(&sql).await?;
    Ok(())
}

/// Empties `tables` (a fresh file each: no dead rows left by the previous measurement).
pub async fn truncate(client: &Client, tables: &[&str]) -> Result<()> {
    client
        .batch_execute(&format!("TRUNCATE {}", tables.join(", ")))
        .await?;
    Ok(())
}

/// The payload of the jobs [`fill`] inserts, an SQL expression of `g` (1 to n): `{"n": g}`.
pub const PAYLOAD_N: &str = "jsonb_build_object('n', g)";

/// Inserts `n` due jobs `{"n": i}` into `queue` with plain SQL (not part of any measurement).
pub async fn fill(client: &Client, queue: &str, n: u64) -> Result<()> {
    fill_with(client, queue, n, PAYLOAD_N).await
}

/// Inserts `n` due jobs into `queue` whose payloads are `payload`, an SQL expression of `g`
/// (1 to n), as [`PAYLOAD_N`].
pub async fn fill_with(client: &Client, queue: &str, n: u64, payload: &str) -> Result<()> {
    client
        .execute(
            &format!(
                "INSERT INTO {queue} (payload) \
                 SELECT {payload} FROM generate_series(1, $1::int8) AS g"
            ),
            &[&(n as i64)],
        )
        .await?;
    Ok(())
}

/// Keeps a queue at least `depth` jobs deep while a measurement consumes it: fills it first,
/// then tops it up (with plain INSERTs, on a connection of its own) as `consumed` grows.
pub struct Refill {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Result<()>>,
}

impl Refill {
    pub async fn start(
        ctx: &Ctx,
        queue: &'static str,
        depth: u64,
        consumed: Arc<AtomicU64>,
    ) -> Result<Self> {
        Self::start_with(ctx, queue, depth, consumed, PAYLOAD_N).await
    }

    /// The same with payloads `payload` (see [`fill_with`]).
    pub async fn start_with(
        ctx: &Ctx,
        queue: &'static str,
        depth: u64,
        consumed: Arc<AtomicU64>,
        payload: &'static str,
    ) -> Result<Self> {
        let client = ctx.connect().await?;
        fill_with(&client, queue, depth, payload).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut inserted = depth;
            while !flag.load(Ordering::Relaxed) {
                let wanted = consumed.load(Ordering::Relaxed) + depth;
                if inserted < wanted {
                    let chunk = (wanted - inserted).clamp(1_000, 20_000);
                    fill_with(&client, queue, chunk, payload).await?;
                    inserted += chunk;
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            Ok(())
        });
        Ok(Self { stop, task })
    }

    pub async fn stop(self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// Microseconds since the process started: the clock of the latency samples (figure 5).
pub fn micros() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// The process's peak resident set (`VmHWM`), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU seconds used so far by this process and by the server backends of the benchmark's other
/// connections (read from `/proc`, as root or as the server's user).
pub async fn cpu_seconds(client: &Client) -> Result<(f64, f64)> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity \
              WHERE application_name = 'inbox-bench' AND pid <> pg_backend_pid()",
            &[],
        )
        .await?;
    let server = rows
        .iter()
        .filter_map(|row| process_cpu(row.get::<_, i32>(0) as u32))
        .sum();
    Ok((process_cpu(std::process::id()).unwrap_or(0.0), server))
}

/// utime + stime of process `pid`, in seconds.
fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Index entries read so far in the two queues of figures 3 and 4 (PostgreSQL flushes these
/// statistics about once a second: meaningful over long windows only).
pub async fn index_reads(client: &Client) -> Result<i64> {
    let row = client
        .query_one(
            "SELECT coalesce(sum(idx_tup_read), 0)::int8 FROM pg_stat_user_indexes \
              WHERE relname IN ($1, $2)",
            &[&Q_INBOX, &Q_RAW],
        )
        .await?;
    Ok(row.get(0))
}
