//! What the cases share: the run's settings, a case's row of the table, the effect table and
//! the checker that classifies every job, and small helpers over real connections.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use inbox_client::PgDatabase;
use inbox_tests::TestDb;
use tokio_postgres::{Client, NoTls};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How many jobs, faults and rounds the cases use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// The CI profile: the full counts where they fit in CI's time, fewer elsewhere.
    Quick,
    /// The full counts everywhere, and more rounds.
    Full,
}

impl Profile {
    pub fn pick<T>(self, quick: T, full: T) -> T {
        match self {
            Profile::Quick => quick,
            Profile::Full => full,
        }
    }

    pub fn name(self) -> &'static str {
        self.pick("quick", "full")
    }
}

/// The run's settings, from the environment.
pub struct Ctx {
    /// A database where `CREATE EXTENSION inbox` was run.
    pub url: String,
    /// The PostgreSQL installation's programs (initdb, pg_ctl) for throwaway clusters.
    pub pg_bin: PathBuf,
    pub profile: Profile,
    /// This program, started again as a child worker.
    pub exe: PathBuf,
}

impl Ctx {
    pub async fn from_env(profile: Profile) -> Result<Self> {
        let url = std::env::var(inbox_tests::URL_VAR).map_err(|_| {
            format!(
                "set {} to a database with the extension",
                inbox_tests::URL_VAR
            )
        })?;
        let pg_bin = match std::env::var("INBOX_PG_CONFIG") {
            Ok(pg_config) => {
                let out = tokio::process::Command::new(&pg_config)
                    .arg("--bindir")
                    .output()
                    .await
                    .map_err(|e| format!("{pg_config} --bindir: {e}"))?;
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
            Err(_) => PathBuf::from("/usr/lib/postgresql/15/bin"),
        };
        Ok(Self {
            url,
            pg_bin,
            profile,
            exe: std::env::current_exe()?,
        })
    }

    /// The URL of database `name` on the same server.
    pub fn url_of(&self, name: &str) -> String {
        let base = self
            .url
            .rsplit_once('/')
            .map_or(self.url.as_str(), |(base, _)| base);
        format!("{base}/{name}")
    }

    /// Creates database `name` (dropping an old one) with the extension; returns its URL.
    pub async fn own_database(&self, name: &str) -> Result<String> {
        let admin = connect(&self.url).await?;
        // One statement per call: CREATE DATABASE cannot run in a (multi-statement) transaction.
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await?;
        let url = self.url_of(name);
        connect(&url)
            .await?
            .batch_execute("CREATE EXTENSION inbox")
            .await?;
        Ok(url)
    }

    pub async fn drop_database(&self, name: &str) {
        if let Ok(admin) = connect(&self.url).await {
            let _ = admin
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await;
        }
    }
}

/// A plain connection to `url`, its connection task on the current runtime.
pub async fn connect(url: &str) -> Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// One case's row of the table.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub case: u8,
    pub name: &'static str,
    pub jobs: u64,
    pub faults: u64,
    pub inputs: u64,
    pub lost: u64,
    pub doubled: u64,
    pub seconds: f64,
    /// What did not hold; empty when the case passed.
    pub failures: Vec<String>,
    /// Figures the case reports beside the table (throughput, sizes, what was injected).
    pub notes: Vec<String>,
}

impl Row {
    pub fn new(case: u8, name: &'static str) -> Self {
        Self {
            case,
            name,
            ..Self::default()
        }
    }

    pub fn failed(case: u8, name: &'static str, why: String) -> Self {
        let mut row = Self::new(case, name);
        row.failures.push(why);
        row
    }

    /// Records a failure unless `holds`.
    pub fn check(&mut self, holds: bool, what: impl FnOnce() -> String) {
        if !holds {
            self.failures.push(what());
        }
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Adds a checker's verdict: its lost and doubled jobs, and a failure for anything not ok.
    pub fn add(&mut self, label: &str, tally: &Tally) {
        self.lost += tally.lost.len() as u64;
        self.doubled += tally.doubled.len() as u64;
        let prefix = if label.is_empty() {
            String::new()
        } else {
            format!("{label}: ")
        };
        self.check(tally.lost.is_empty(), || {
            format!(
                "{prefix}{} jobs lost ({} stuck in the queue, {} gone without their effect), e.g. {:?}",
                tally.lost.len(),
                tally.stuck,
                tally.lost.len() - tally.stuck,
                sample(&tally.lost)
            )
        });
        self.check(tally.doubled.is_empty(), || {
            format!(
                "{prefix}{} jobs doubled, e.g. {:?}",
                tally.doubled.len(),
                sample(&tally.doubled)
            )
        });
        self.check(tally.unexpected.is_empty(), || {
            format!(
                "{prefix}{} unexpected: {:?}",
                tally.unexpected.len(),
                sample(&tally.unexpected)
            )
        });
    }
}

fn sample<T: std::fmt::Debug + Clone>(items: &[T]) -> Vec<T> {
    items.iter().take(5).cloned().collect()
}

/// The printed table and its markdown form.
pub struct Table {
    pub text: String,
    pub markdown: String,
}

/// How many of a case's failures the table's notes show.
pub const SHOWN: usize = 12;

pub fn table(rows: &[Row], profile: Profile, elapsed: Duration) -> Table {
    let head = [
        "case", "jobs", "faults", "inputs", "lost", "doubled", "seconds", "result",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|row| {
            [
                format!("{:>2} {}", row.case, row.name),
                row.jobs.to_string(),
                row.faults.to_string(),
                row.inputs.to_string(),
                row.lost.to_string(),
                row.doubled.to_string(),
                format!("{:.1}", row.seconds),
                if row.passed() { "pass" } else { "FAIL" }.to_owned(),
            ]
        })
        .collect();
    let mut widths = head.map(str::len);
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, width))| {
                if i == 0 {
                    format!("{cell:<width$}")
                } else {
                    format!("{cell:>width$}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let passed = rows.iter().filter(|row| row.passed()).count();
    let closing = format!("{passed} passed, {} failed", rows.len() - passed);
    let mut text = line(&head.map(str::to_owned));
    text.push('\n');
    for row in &cells {
        text.push_str(&line(row));
        text.push('\n');
    }
    let mut markdown = format!("| {} |\n|{}\n", head.join(" | "), "---|".repeat(head.len()));
    for row in &cells {
        let _ = writeln!(markdown, "| {} |", row.join(" | "));
    }
    let mut notes = String::new();
    for row in rows {
        for note in &row.notes {
            let _ = writeln!(notes, "- case {}: {note}", row.case);
        }
        for failure in row.failures.iter().take(SHOWN) {
            let _ = writeln!(notes, "- case {} FAILED: {failure}", row.case);
        }
        if row.failures.len() > SHOWN {
            let _ = writeln!(
                notes,
                "- case {}: {} more failures",
                row.case,
                row.failures.len() - SHOWN
            );
        }
    }
    let summary = format!(
        "profile {}, {:.0} s in all on this machine",
        profile.name(),
        elapsed.as_secs_f64()
    );
    text.push_str(&format!("\n{summary}\n{notes}\n{closing}"));
    markdown.push_str(&format!("\n{summary}.\n\n{notes}\n{closing}\n"));
    Table { text, markdown }
}

/// Silences the panic messages of the panics the cases inject on purpose (their text starts
/// with `injected`); any other panic prints as usual.
pub fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let text = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        if !text.starts_with("injected") {
            default(info);
        }
    }));
}

/// The effect table: one row per committed effect, with no unique constraint, so that a doubled
/// effect shows as two rows.
pub const EFFECTS: &str = "CREATE TABLE effects (n bigint NOT NULL, attempt int NOT NULL, \
     worker text, host_at timestamptz, at timestamptz NOT NULL DEFAULT clock_timestamp())";

/// A log of deliveries started, written outside the deliveries' transactions.
pub const DELIVERIES: &str = "CREATE TABLE deliveries (n bigint NOT NULL, attempt int NOT NULL, \
     worker text, at timestamptz NOT NULL DEFAULT clock_timestamp())";

/// Creates a queue `queue` and the effect table in the test's schema.
pub async fn setup(client: &Client, queue: &str) -> Result<()> {
    client
        .batch_execute(&format!("SELECT inbox_create_queue('{queue}'); {EFFECTS}"))
        .await?;
    Ok(())
}

/// Enqueues the jobs `from..=to` (payload: the number) in batches; returns how many.
pub async fn enqueue_range(client: &Client, queue: &str, from: i64, to: i64) -> Result<u64> {
    let mut total = 0;
    let mut start = from;
    while start <= to {
        let end = (start + 49_999).min(to);
        let row = client
            .query_one(
                "SELECT count(*) FROM inbox_enqueue_batch($1::text::regclass, \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series($2::int8, $3::int8) g))",
                &[&queue, &start, &end],
            )
            .await?;
        total += row.get::<_, i64>(0) as u64;
        start = end + 1;
    }
    Ok(total)
}

/// Whether the queue has nothing ready, delayed or leased.
pub async fn drained(client: &Client, queue: &str) -> Result<bool> {
    let row = client
        .query_one(
            "SELECT ready + delayed + leased FROM inbox_stats($1::text::regclass)",
            &[&queue],
        )
        .await?;
    Ok(row.get::<_, i64>(0) == 0)
}

/// Attempt numbers delivered more than once (the `deliveries` log): a leased attempt that was not
/// counted, as when a lease is lost to a crash before it committed.
pub async fn repeated_attempts(client: &Client) -> Result<i64> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM (SELECT n, attempt FROM deliveries GROUP BY n, attempt \
             HAVING count(*) > 1) twice",
            &[],
        )
        .await?
        .get(0))
}

/// Waits until the queue is drained; `false` when `limit` passed first.
pub async fn wait_drained(client: &Client, queue: &str, limit: Duration) -> Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        if drained(client, queue).await? {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A pool of at most `size` connections with `config`.
pub fn pool_of(config: tokio_postgres::Config, size: usize) -> Pool {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .build()
        .expect("a pool")
}

/// The test's connection settings, to another port on the loopback (a proxy's).
pub fn config_via(db: &TestDb, port: u16) -> tokio_postgres::Config {
    let base = db.config();
    let mut config = tokio_postgres::Config::new();
    config.host("127.0.0.1").port(port);
    if let Some(user) = base.get_user() {
        config.user(user);
    }
    if let Some(dbname) = base.get_dbname() {
        config.dbname(dbname);
    }
    if let Some(options) = base.get_options() {
        config.options(options);
    }
    if let Some(name) = base.get_application_name() {
        config.application_name(name);
    }
    config
}

/// The port a worker uses: a pool of `size` and the test's settings (for LISTEN).
pub fn worker_db(db: &TestDb, size: usize) -> PgDatabase {
    PgDatabase::from_pool_and_config(db.pool(size), db.config())
}

/// What became of each job, as the checker classifies it.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    /// Acked, its effect committed once.
    pub acked: u64,
    /// Dead-lettered, no effect committed.
    pub dead: u64,
    /// Acked without an effect, or neither acked nor dead-lettered (stuck in the queue).
    pub lost: Vec<i64>,
    /// How many of the lost jobs are still in the queue (ready, delayed or leased).
    pub stuck: usize,
    /// More than one effect committed.
    pub doubled: Vec<i64>,
    /// Anything the history cannot explain: an effect of a job never enqueued, of a dead job, or
    /// of a delivery that never started.
    pub unexpected: Vec<String>,
}

/// A job still in the queue table.
#[derive(Clone, Copy, Debug)]
pub struct Queued {
    pub dead: bool,
    pub attempt: i32,
}

/// The checker: classifies every expected job from the committed effects (job → the attempts
/// whose effect committed), the jobs still queued, and, when known, the deliveries started.
pub fn classify(
    expected: impl IntoIterator<Item = i64>,
    effects: &BTreeMap<i64, Vec<i32>>,
    queued: &HashMap<i64, Queued>,
    started: Option<&HashSet<(i64, i32)>>,
) -> Tally {
    let mut tally = Tally::default();
    let expected: HashSet<i64> = expected.into_iter().collect();
    for (&n, attempts) in effects {
        if !expected.contains(&n) {
            tally
                .unexpected
                .push(format!("effect of job {n}, never enqueued"));
        }
        if let Some(started) = started {
            for &attempt in attempts {
                if !started.contains(&(n, attempt)) {
                    tally.unexpected.push(format!(
                        "effect of job {n} attempt {attempt}, a delivery never started"
                    ));
                }
            }
        }
    }
    let mut sorted: Vec<i64> = expected.into_iter().collect();
    sorted.sort_unstable();
    for n in sorted {
        let count = effects.get(&n).map_or(0, Vec::len);
        match (count, queued.get(&n)) {
            (0, Some(job)) if job.dead => tally.dead += 1,
            (0, Some(_)) => {
                tally.stuck += 1;
                tally.lost.push(n);
            }
            (0, None) => tally.lost.push(n),
            (1, None) => tally.acked += 1,
            (1, Some(job)) if job.dead => tally
                .unexpected
                .push(format!("job {n} is dead-lettered but its effect committed")),
            (1, Some(_)) => tally
                .unexpected
                .push(format!("job {n} is still queued but its effect committed")),
            _ => tally.doubled.push(n),
        }
    }
    tally
}

/// The committed effects, job → attempts.
pub async fn effects(client: &Client) -> Result<BTreeMap<i64, Vec<i32>>> {
    let mut effects: BTreeMap<i64, Vec<i32>> = BTreeMap::new();
    for row in client.query("SELECT n, attempt FROM effects", &[]).await? {
        effects.entry(row.get(0)).or_default().push(row.get(1));
    }
    Ok(effects)
}

/// The jobs still in queue `queue` (a jsonb queue whose payloads are numbers), by payload.
pub async fn queued(client: &Client, queue: &str) -> Result<HashMap<i64, Queued>> {
    let rows = client
        .query(
            &format!(
                "SELECT (payload #>> '{{}}')::int8, locked_until = 'infinity', attempt FROM {queue}"
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                Queued {
                    dead: row.get(1),
                    attempt: row.get(2),
                },
            )
        })
        .collect())
}

/// The deliveries started, from the delivery log.
pub async fn started(client: &Client) -> Result<HashSet<(i64, i32)>> {
    Ok(client
        .query("SELECT n, attempt FROM deliveries", &[])
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect())
}

/// The checker over the database's final state.
pub async fn tally(
    client: &Client,
    queue: &str,
    expected: impl IntoIterator<Item = i64>,
    started: Option<&HashSet<(i64, i32)>>,
) -> Result<Tally> {
    let effects = effects(client).await?;
    let queued = queued(client, queue).await?;
    Ok(classify(expected, &effects, &queued, started))
}

/// How many connections of application `name` are in a transaction (other than the caller's).
pub async fn in_transaction(client: &Client, name: &str) -> Result<i64> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'",
            &[&name],
        )
        .await?
        .get(0))
}

/// An error's text; a database error's with its message, detail and SQLSTATE.
pub fn explain(error: &Error) -> String {
    match error.downcast_ref::<tokio_postgres::Error>() {
        Some(pg) => describe(pg),
        None => error.to_string(),
    }
}

/// The text of a tokio-postgres error with its SQLSTATE, when it has one.
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!(
            "{}{} ({})",
            db.message(),
            db.detail().map(|d| format!(": {d}")).unwrap_or_default(),
            db.code().code()
        ),
        None => error.to_string(),
    }
}

/// The SQLSTATE of an error, or `-` for a client-side one.
pub fn sqlstate(error: &tokio_postgres::Error) -> String {
    error
        .code()
        .map_or_else(|| "-".to_owned(), |code| code.code().to_owned())
}
