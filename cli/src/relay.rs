//! `inbox relay`: runs the client's outbox relay ([`inbox_client::outbox::Relay`]) into NATS
//! JetStream ([`NatsSink`]) until Ctrl-C or SIGTERM, then lets the relay settle the round in
//! flight and give its lease up, so that a standby relay takes over at once.
//!
//! On a terminal a progress line (on standard error) shows what it sent, its rate and whether it
//! holds the outbox's lease or stands by; otherwise it logs a plain line when that changed, at
//! most every few seconds. At the end it prints what it did on standard output. The relay's
//! warnings (failed publishes, a lost connection it retries) go to standard error.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::outbox::{NatsSink, Relay, RelayCounts};
use inbox_client::{DbError, PgDatabase};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::db::{self, Db};
use crate::error::CliError;
use crate::output::Output;
use crate::sql;

/// How often the progress line is redrawn.
const TICK: Duration = Duration::from_millis(250);

/// How often, at most, a status line is logged when standard error is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The window the rate is measured over.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// What `inbox relay` was asked to do.
pub struct RelayRequest<'a> {
    pub outbox: &'a str,
    pub nats: &'a str,
    pub name: Option<&'a str>,
    pub batch: i32,
    pub lease: Duration,
    pub max_attempts: i32,
    /// Direct connection settings for the LISTEN session, when `url` is a pooler's.
    pub listen_url: Option<&'a str>,
}

/// Parses a lease: a number and a unit (`500ms`, `30s`, `2m`, `1h`), or seconds alone.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("unknown unit {other:?} (ms, s, m or h)")),
    };
    let duration = Duration::try_from_secs_f64(seconds).map_err(|e| e.to_string())?;
    if duration < Duration::from_secs(1) {
        return Err("the lease must be at least 1s".to_owned());
    }
    Ok(duration)
}

/// A relay name unique enough among an outbox's relays: host, process, and a random part.
fn default_name() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "relay".to_owned());
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!(
        "{host}-{}-{:08x}",
        std::process::id(),
        hasher.finish() as u32
    )
}

/// `url` without the password of its user info (`nats://user:secret@host` → `nats://user@host`),
/// for messages.
fn without_password(url: &str) -> String {
    url.split(',')
        .map(|part| {
            let Some((scheme, rest)) = part.split_once("://") else {
                return part.to_owned();
            };
            match rest.rsplit_once('@') {
                Some((user_info, host)) => {
                    let user = user_info.split(':').next().unwrap_or_default();
                    format!("{scheme}://{user}@{host}")
                }
                None => part.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn db_error(error: DbError, secret: &db::Secret) -> CliError {
    let message = secret.scrub(error.message().to_owned());
    match error.sqlstate() {
        Some(sqlstate) => CliError::Database {
            sqlstate: sqlstate.to_owned(),
            message,
        },
        None => CliError::Connect(format!("database connection: {message}")),
    }
}

/// Writes the relay's log lines above the progress line, not through it.
#[derive(Clone)]
struct LogWriter(ProgressBar);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Messages sent per second over the last [`RATE_WINDOW`].
#[derive(Default)]
struct Rate {
    samples: VecDeque<(Instant, u64)>,
}

impl Rate {
    fn update(&mut self, now: Instant, sent: u64) -> f64 {
        self.samples.push_back((now, sent));
        while self.samples.len() > 2 && now.duration_since(self.samples[0].0) > RATE_WINDOW {
            self.samples.pop_front();
        }
        let (then, sent_then) = self.samples[0];
        let elapsed = now.duration_since(then).as_secs_f64();
        if elapsed > 0.0 {
            sent.saturating_sub(sent_then) as f64 / elapsed
        } else {
            0.0
        }
    }
}

/// How long after its start a relay has surely made its first claim, and knows whether it leads.
const SETTLED: Duration = Duration::from_secs(2);

/// One status: what the counts say, for the progress line and the log.
fn status(outbox: &str, counts: &RelayCounts, rate: f64, started: bool) -> String {
    let role = if counts.leading() {
        "leading"
    } else if started {
        "standing by"
    } else {
        "starting"
    };
    format!(
        "{outbox}: {role}, {} sent ({rate:.0}/s), {} duplicates, {} failed",
        counts.sent(),
        counts.duplicates(),
        counts.failed()
    )
}

/// Cancels `stop` at the first Ctrl-C or SIGTERM; a second one ends the process at once.
fn stop_on_signals(stop: CancellationToken) -> Result<(), CliError> {
    #[cfg(unix)]
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| CliError::Io(format!("cannot handle SIGTERM: {e}")))?;
    tokio::spawn(async move {
        for signal in 0.. {
            #[cfg(unix)]
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
            if signal == 0 {
                stop.cancel();
            } else {
                let _ = writeln!(
                    std::io::stderr(),
                    "inbox relay: interrupted again; exiting without releasing the lease"
                );
                std::process::exit(130);
            }
        }
    });
    Ok(())
}

pub async fn run(url: &str, out: &Output, request: RelayRequest<'_>) -> Result<(), CliError> {
    let stop = CancellationToken::new();
    stop_on_signals(stop.clone())?;

    // The relay names its messages after the outbox as given (`events:42`, the client's rule):
    // every relay of an outbox, in this tool or in a service, must be given the same name for it.
    // The schema-qualified name is for the progress lines; reading it checks at once that the
    // database can be reached and the table exists.
    let given = request.outbox;
    let outbox: String = {
        let db = Db::connect(url).await?;
        db.one(&sql::TABLE_NAME, &[&request.outbox]).await?.get(0)
    };
    let (config, secret) = db::config(url)?;
    let pool = db::pool(config.clone(), 2)?;
    // The relay sleeps on a LISTEN session of its own: on a direct connection to the server,
    // which the database URL is unless --listen-url names one (then the URL is a pooler's).
    let database = PgDatabase::from_pool_and_config(pool, config);
    let database = match request.listen_url {
        Some(listen_url) => {
            let (direct, _) = db::config(listen_url)?;
            database.behind_pooler(Some(direct))
        }
        None => database,
    };

    let nats = async_nats::ConnectOptions::new()
        .name("inbox-relay")
        .connect(request.nats)
        .await
        .map_err(|e| {
            CliError::Connect(format!(
                "cannot connect to NATS at {}: {e}",
                without_password(request.nats)
            ))
        })?;
    let sink = NatsSink::new(async_nats::jetstream::new(nats));

    let name = request.name.map_or_else(default_name, str::to_owned);
    let relay = Relay::new(database, given, sink)
        .name(name.clone())
        .batch(request.batch)
        .lease(request.lease)
        .max_attempts(request.max_attempts);
    let counts = relay.counts();

    let terminal = std::io::stderr().is_terminal();
    let progress = if terminal {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    // Another subscriber may exist only in tests of this crate; then the relay logs through it.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_target(false)
        .with_ansi(terminal)
        .with_writer(LogWriter(progress.clone()))
        .try_init();
    let _ = writeln!(
        std::io::stderr(),
        "inbox relay: relaying {outbox} (message ids {given}:<id>) to NATS at {} as {name}",
        without_password(request.nats)
    );

    let reporter = tokio::spawn(report(
        outbox.clone(),
        Arc::clone(&counts),
        progress.clone(),
        terminal,
        stop.clone(),
    ));
    let result = relay.run(stop.clone()).await;
    stop.cancel();
    let _ = reporter.await;
    progress.finish_and_clear();
    result.map_err(|e| db_error(e, &secret))?;

    let (sent, duplicates, failed) = (counts.sent(), counts.duplicates(), counts.failed());
    out.emit(
        json!({
            "outbox": outbox, "relay": name, "sent": sent, "duplicates": duplicates,
            "failed": failed,
        }),
        || {
            format!(
                "relayed {sent} message(s) of {outbox} ({duplicates} duplicate(s), {failed} \
                 failed publish(es)); lease released"
            )
        },
    );
    Ok(())
}

/// Redraws the progress line (or logs a status line when it changed) until `stop`.
async fn report(
    outbox: String,
    counts: Arc<RelayCounts>,
    progress: ProgressBar,
    terminal: bool,
    stop: CancellationToken,
) {
    let begun = Instant::now();
    let mut rate = Rate::default();
    let mut ticker = tokio::time::interval(TICK);
    let mut logged: Option<(Instant, (u64, u64, u64, bool))> = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = stop.cancelled() => return,
        }
        let now = Instant::now();
        let per_second = rate.update(now, counts.sent());
        let started = counts.batches() > 0 || now.duration_since(begun) >= SETTLED;
        let line = status(&outbox, &counts, per_second, started);
        if terminal {
            progress.set_message(line);
            progress.tick();
            continue;
        }
        let state = (
            counts.sent(),
            counts.duplicates(),
            counts.failed(),
            counts.leading(),
        );
        let due = match logged {
            None => started,
            Some((at, last)) => last != state && now.duration_since(at) >= LOG_EVERY,
        };
        if due {
            let _ = writeln!(std::io::stderr(), "inbox relay: {line}");
            logged = Some((now, state));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_read_with_their_unit() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("500ms").is_err(), "under a second");
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("3d").is_err());
    }

    #[test]
    fn nats_passwords_stay_out_of_messages() {
        assert_eq!(
            without_password("nats://relay:s3cret@nats.internal:4222"),
            "nats://relay@nats.internal:4222"
        );
        assert_eq!(
            without_password("nats://a:x@h1:4222,nats://h2:4222"),
            "nats://a@h1:4222,nats://h2:4222"
        );
        assert_eq!(without_password("127.0.0.1:4222"), "127.0.0.1:4222");
    }

    #[test]
    fn the_rate_is_measured_over_the_last_seconds() {
        let mut rate = Rate::default();
        let start = Instant::now();
        assert_eq!(rate.update(start, 0), 0.0);
        let per_second = rate.update(start + Duration::from_secs(2), 200);
        assert!((per_second - 100.0).abs() < 1e-9, "{per_second}");
        // Old samples leave the window: only the last seconds count.
        rate.update(start + Duration::from_secs(8), 200);
        let per_second = rate.update(start + Duration::from_secs(10), 200);
        assert!(per_second.abs() < 1e-9, "{per_second}");
    }
}
