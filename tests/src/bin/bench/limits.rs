//! Figure 14: what a queue's limits cost the job path. Figure 3's lease, then ack (one job, each
//! call its own transaction) on the same queue with no limits (the "raw" column, measured in the
//! same run), and with a concurrency limit, a rate limit and a concurrency limit per key, none of
//! them binding: a limited take goes through `inbox__take_limited` (sql/shared/limits.sql), a
//! queue without limits does not. Each limit is measured at the largest size the functions
//! accept and at a size nearer the connections, since a take looks at the limit's slots.

use tokio_postgres::Client;

use super::measure::{median, retrying, Row, Target};
use super::sessions::{run_clients_with, ClientsRun, Step};
use super::setup::*;

/// The limits' sizes: the largest the functions accept, and one a few times the connections.
const SIZES: [i32; 2] = [10_000, 100];

/// The keys of the limit per key, the payloads' field `customer`.
const KEYS: u32 = 100;

/// The payloads of every variant (the same for all): `{"n": g, "customer": "c<g mod 100>"}`.
const PAYLOAD: &str = "jsonb_build_object('n', g, 'customer', 'c' || (g % 100))";

/// A rate limit's window is set so that its starts in it would take this many times the
/// baseline's rate.
const RATE_HEADROOM: f64 = 10.0;

/// The job cycle measured: figure 3's lease of one job, then its ack.
const LEASE_ACK: Step = Step::LeaseAck {
    side: Side::Inbox,
    batch: 1,
};

/// What the queue has while a variant runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Limit {
    None,
    Concurrency(i32),
    /// `n` starts per window of `ms` milliseconds.
    Rate(i32, u64),
    PerKey(i32),
}

impl Limit {
    /// Removes every limit of the queue, then sets this one.
    async fn apply(self, client: &Client) -> Result<()> {
        let q = Q_INBOX;
        let mut sql = format!(
            "SET client_min_messages = warning; \
             SELECT inbox_set_concurrency('{q}', NULL); \
             SELECT inbox_set_rate_limit('{q}', NULL); \
             SELECT inbox_set_concurrency('{q}', NULL, per_key => 'customer');"
        );
        match self {
            Limit::None => {}
            Limit::Concurrency(n) => {
                sql.push_str(&format!("SELECT inbox_set_concurrency('{q}', {n});"));
            }
            Limit::Rate(n, ms) => sql.push_str(&format!(
                "SELECT inbox_set_rate_limit('{q}', {n}, interval '{ms} milliseconds');"
            )),
            Limit::PerKey(n) => sql.push_str(&format!(
                "SELECT inbox_set_concurrency('{q}', {n}, per_key => 'customer');"
            )),
        }
        client.batch_execute(&sql).await?;
        Ok(())
    }

    fn name(self) -> String {
        match self {
            Limit::None => "14. lease+ack, no limits".to_owned(),
            Limit::Concurrency(n) => format!("14. lease+ack, concurrency limit {n}"),
            Limit::Rate(n, _) => format!("14. lease+ack, rate limit {n}/window"),
            Limit::PerKey(n) => format!("14. lease+ack, {n} per key, {KEYS} keys"),
        }
    }
}

/// One variant's measurement: its rate, the takes that found nothing, and for a rate limit the
/// most starts any window of its length held.
struct Measured {
    run: ClientsRun,
    busiest: Option<i64>,
}

/// Runs the variant at `connections`; the queue has no limits afterwards, also when it failed.
async fn measure(ctx: &Ctx, connections: usize, limit: Limit) -> Result<Measured> {
    retrying(|| async {
        let admin = ctx.connect().await?;
        limit.apply(&admin).await?;
        let measured = async {
            let run = run_clients_with(ctx, connections, LEASE_ACK, PAYLOAD).await?;
            let busiest = match limit {
                Limit::Rate(_, ms) => Some(busiest_window(&admin, ms).await?),
                _ => None,
            };
            Result::Ok(Measured { run, busiest })
        }
        .await;
        Limit::None.apply(&admin).await?;
        measured
    })
    .await
}

/// The most starts within `ms` milliseconds of one another, from the rate slots' last starts: a
/// take gives the slot that started longest ago, so the slots hold the latest starts, as many as
/// the limit. Below the limit, the limit never held a take back in that stretch.
async fn busiest_window(client: &Client, ms: u64) -> Result<i64> {
    let row = client
        .query_one(
            &format!(
                "SELECT coalesce(max(w.starts), 0)::int8 FROM ( \
                   SELECT count(*) OVER (ORDER BY s.started_at \
                          RANGE BETWEEN CURRENT ROW AND interval '{ms} milliseconds' FOLLOWING) \
                          AS starts \
                     FROM inbox_queue_slots s \
                    WHERE s.queue = '{Q_INBOX}'::regclass AND s.kind = 'r' \
                      AND s.started_at IS NOT NULL) AS w"
            ),
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// A rate limit's window for `n` starts and a baseline of `rate` jobs/s: `n` starts in it would
/// take `RATE_HEADROOM` times that rate (whole milliseconds, 1 ms to 1 day).
fn rate_window_ms(n: i32, rate: f64) -> u64 {
    let seconds = f64::from(n) / (RATE_HEADROOM * rate.max(1.0));
    ((seconds * 1000.0).floor() as u64).clamp(1, 86_400_000)
}

/// A variant's measurements over the rounds, or the error that ended them.
#[derive(Default)]
struct Runs {
    rates: Vec<f64>,
    dry: u64,
    busiest: i64,
    failed: Option<String>,
}

impl Runs {
    fn add(&mut self, measured: Result<Measured>) {
        match measured {
            Ok(measured) => {
                self.rates.push(measured.run.rate);
                self.dry += measured.run.dry;
                self.busiest = self.busiest.max(measured.busiest.unwrap_or(0));
            }
            Err(error) => {
                let mut message = error.to_string();
                let mut source = error.source();
                while let Some(cause) = source {
                    message.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                eprintln!("  failed: {message}");
                self.failed = Some(message.replace('\n', " "));
            }
        }
    }

    fn median(&self) -> Option<f64> {
        (!self.rates.is_empty()).then(|| median(self.rates.clone()))
    }
}

/// Figure 14: lease, then ack on a queue with a limit that does not bind, against the same queue
/// without limits, at each connection count. A limited variant that fails (its take raised an
/// error) gives a row without a value, its error in the note; the baseline's failure ends the run.
pub async fn limits(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &connections in &ctx.opts.connections {
        // The variants; round 0 measures the baseline first, which sizes the rate windows.
        let mut variants = vec![Limit::None];
        for n in SIZES {
            variants.extend([Limit::Concurrency(n), Limit::Rate(n, 0), Limit::PerKey(n)]);
        }
        let mut runs: Vec<Runs> = variants.iter().map(|_| Runs::default()).collect();
        for round in 0..ctx.opts.rounds.max(1) {
            for i in 0..variants.len() {
                let v = (i + round) % variants.len();
                if runs[v].failed.is_some() {
                    continue;
                }
                if let Limit::Rate(n, 0) = variants[v] {
                    let base = runs[0].rates.first().copied().unwrap_or(1.0);
                    variants[v] = Limit::Rate(n, rate_window_ms(n, base));
                }
                let measured = measure(ctx, connections, variants[v]).await;
                if v == 0 {
                    runs[0].add(Ok(measured?));
                } else {
                    runs[v].add(measured);
                }
            }
        }
        let (base, base_dry) = (runs[0].median(), runs[0].dry);
        for (limit, runs) in variants.iter().zip(&runs).skip(1) {
            let target = match limit {
                Limit::PerKey(_) => Target::None,
                _ => Target::RatioAtLeast(0.9),
            };
            let mut note = match limit {
                Limit::Rate(n, ms) => format!(
                    "{n} starts per {ms} ms ({RATE_HEADROOM}x the first baseline's rate); the \
                     busiest {ms} ms held {} starts{}; ",
                    runs.busiest,
                    if runs.busiest >= i64::from(*n) {
                        " (the limit bound)"
                    } else {
                        ""
                    }
                ),
                Limit::PerKey(_) => {
                    format!("payloads {{\"customer\": \"c<i mod {KEYS}>\"}} (in every variant); ")
                }
                _ => String::new(),
            };
            note.push_str(&format!(
                "takes that found nothing: {} (without limits: {}); the raw column is the same \
                 queue without limits",
                runs.dry, base_dry
            ));
            if let Some(error) = &runs.failed {
                note.push_str(&format!("; failed: {error}"));
            }
            let row = Row::new(
                14,
                limit.name(),
                Some(connections),
                (runs.median(), base),
                "jobs/s",
                target,
            )
            .note(note);
            super::report::print_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}
