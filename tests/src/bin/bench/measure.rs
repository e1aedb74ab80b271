//! The measurement every figure shares: both sides run for the same window, interleaved over a
//! few rounds, and the median of each side is reported with their ratio.

use std::future::Future;
use std::time::Instant;

use serde::Serialize;

use super::setup::{cpu_seconds, index_reads, Ctx, Result};

/// What a figure's row must reach.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Target {
    /// None: printed for reference.
    None,
    /// The ratio inbox / raw must be at least this.
    RatioAtLeast(f64),
    /// The project's value itself must be below this (in the row's unit).
    InboxBelow(f64),
    /// The project's value itself must be at least this (in the row's unit).
    InboxAtLeast(f64),
}

impl Target {
    /// As the tables show it (`>= 0.9x`, `< 10`, `-`): `inbox_tests::results` reads it from the
    /// JSON the same way.
    pub fn describe(self) -> String {
        inbox_tests::results::target(&serde_json::json!(self))
    }
}

/// One line of the results: a figure at one connection count.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The figure's number.
    pub figure: u8,
    pub name: String,
    /// Concurrent connections (or deliveries), where it applies.
    pub connections: Option<usize>,
    /// The project's value.
    pub inbox: Option<f64>,
    /// The raw SQL value measured in the same run (null where there is none).
    pub raw: Option<f64>,
    /// inbox / raw.
    pub ratio: Option<f64>,
    pub unit: &'static str,
    pub target: Target,
    /// Whether the target is met (null when there is none).
    pub met: Option<bool>,
    /// What the numbers mean, where the name does not say it all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Row {
    pub fn new(
        figure: u8,
        name: impl Into<String>,
        connections: Option<usize>,
        (inbox, raw): (Option<f64>, Option<f64>),
        unit: &'static str,
        target: Target,
    ) -> Self {
        let ratio = match (inbox, raw) {
            (Some(inbox), Some(raw)) if raw > 0.0 => Some(inbox / raw),
            _ => None,
        };
        let met = match target {
            Target::None => None,
            Target::RatioAtLeast(min) => ratio.map(|r| r >= min),
            Target::InboxBelow(max) => inbox.map(|v| v < max),
            Target::InboxAtLeast(min) => inbox.map(|v| v >= min),
        };
        Self {
            figure,
            name: name.into(),
            connections,
            inbox,
            raw,
            ratio,
            unit,
            target,
            met,
            note: None,
        }
    }

    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

/// The rate of `count` over a window that opens after the warmup and lasts the run's duration.
/// With `INBOX_BENCH_TRACE` set, also tells the CPU time spent per unit by this process (the
/// client) and by its server backends (where the time goes).
pub async fn window(ctx: &Ctx, count: impl Fn() -> u64) -> Result<f64> {
    let trace = std::env::var_os("INBOX_BENCH_TRACE").is_some();
    let probe = if trace {
        Some(ctx.connect().await?)
    } else {
        None
    };
    tokio::time::sleep(ctx.opts.warmup).await;
    let cpu = match &probe {
        Some(client) => Some((cpu_seconds(client).await?, index_reads(client).await?)),
        None => None,
    };
    let (start, at) = (count(), Instant::now());
    tokio::time::sleep(ctx.opts.duration).await;
    let (end, elapsed) = (count(), at.elapsed());
    let units = end.saturating_sub(start);
    if let (Some(client), Some(((client_before, server_before), reads_before))) = (&probe, cpu) {
        let (client_after, server_after) = cpu_seconds(client).await?;
        let reads_after = index_reads(client).await?;
        let per_unit = |seconds: f64| seconds * 1e6 / units.max(1) as f64;
        eprintln!(
            "    CPU per unit: client {:.0} us, server {:.0} us; queue index entries read per unit: {:.1}",
            per_unit(client_after - client_before),
            per_unit(server_after - server_before),
            (reads_after - reads_before) as f64 / units.max(1) as f64
        );
    }
    Ok(units as f64 / elapsed.as_secs_f64())
}

/// Measures both sides `rounds` times, alternating which goes first, and returns the median of
/// each: (inbox, raw).
pub async fn compare<I, R, FI, FR>(rounds: usize, mut inbox: I, mut raw: R) -> Result<(f64, f64)>
where
    I: FnMut() -> FI,
    R: FnMut() -> FR,
    FI: Future<Output = Result<f64>>,
    FR: Future<Output = Result<f64>>,
{
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds.max(1) {
        if round % 2 == 0 {
            ours.push(traced("inbox", &mut inbox).await?);
            theirs.push(traced("raw", &mut raw).await?);
        } else {
            theirs.push(traced("raw", &mut raw).await?);
            ours.push(traced("inbox", &mut inbox).await?);
        }
    }
    Ok((median(ours), median(theirs)))
}

/// Measures one side alone `rounds` times (a reference figure); returns the median.
pub async fn reference<R, FR>(rounds: usize, mut raw: R) -> Result<f64>
where
    R: FnMut() -> FR,
    FR: Future<Output = Result<f64>>,
{
    let mut values = Vec::new();
    for _ in 0..rounds.max(1) {
        values.push(traced("raw", &mut raw).await?);
    }
    Ok(median(values))
}

/// Runs a measurement again (up to 6 times, 10 s apart) when it failed because the server could
/// not load the extension's library: on a shared machine another `cargo pgrx install` may be
/// replacing it at that moment.
pub async fn retrying<T, F, Fut>(mut run: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut tries = 0;
    loop {
        match run().await {
            Err(error) if tries < 6 && library_missing(&*error) => {
                tries += 1;
                eprintln!("  the extension's library is being replaced; measuring again in 10 s");
                tokio::time::sleep(std::time::Duration::from_secs(10)).await;
            }
            result => return result,
        }
    }
}

fn library_missing(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error
            .to_string()
            .contains("could not access file \"$libdir/inbox\"")
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// Runs one side's measurement, telling how long it took when `INBOX_BENCH_TRACE` is set.
async fn traced<F, Fut>(side: &str, run: F) -> Result<f64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<f64>>,
{
    let started = Instant::now();
    let rate = retrying(run).await?;
    if std::env::var_os("INBOX_BENCH_TRACE").is_some() {
        eprintln!(
            "  {side}: {rate:.1}/s, took {:.2} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(rate)
}

pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The `p`-th percentile (0 to 100) of `sorted`, by nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
