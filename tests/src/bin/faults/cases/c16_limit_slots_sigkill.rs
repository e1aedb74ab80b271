//! Case 16, limits under SIGKILL: in a database of its own, 3 child worker processes (this
//! program's `child` mode, 4 slots each, lease 2 s, `max_attempts` 5) work a queue whose limit
//! they share, their handlers working 0 to 50 ms; at random moments one that is running a
//! delivery is killed with SIGKILL and started again, 6 times per leg (20 with `--full`). Three
//! legs: a concurrency limit of 3 under lease claims and under lock claims (300 jobs each, 1,000
//! with `--full`), and a rate limit of 10 starts per 500 ms under lease claims (120 jobs, 400).
//! The handler logs each delivery outside its transaction, and writes its effect, stamped with
//! when it started and ended (the server's clock), through it.
//!
//! A killed holder's run rolls back, so its row vanishes from the effects; the holders are also
//! sampled every few milliseconds from a connection of the case's own, throughout the run: the
//! jobs holding a live lease and the `running` of `inbox_limits` (leases), the job rows locked by
//! transactions still running (`pgrowlocks` and `pg_locks`, locks). A leased slot of a killed
//! worker comes back when its lease expires, a locked one when the server ends the dead
//! connection's transaction.
//!
//! What must hold: the queue drains after the kills (the killed workers' slots came back), every
//! job done exactly once or dead-lettered, no delivery beyond `max_attempts`; at no instant more
//! committed runs than the limit, and no sample with more holders than the limit, and both reach
//! the limit (the case could have seen it exceeded); no window of 500 ms holds more than 10
//! starts (every lease's `leased_at`, killed ones included, recorded by a trigger on the queue),
//! and some window holds 10; once idle, `inbox_limits` reports the limit and 0 running.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_tests::TestDb;
use tokio_postgres::Client;

use crate::child;
use crate::common::{self, connect, enqueue_range, setup, Ctx, Result, Row, DELIVERIES};

pub const NAME: &str = "SIGKILL holding limit slots";

const PROCESSES: usize = 3;
const CONCURRENCY: i32 = 3;
const RATE: i64 = 10;
const RATE_MS: i64 = 500;
const MAX_ATTEMPTS: i32 = 5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Limit {
    Concurrency,
    Rate,
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(16, NAME);
    let name = format!("inbox_faults_limits_{}", std::process::id());
    // Dropped whatever happens, also when its extension could not be created.
    let result = match ctx.own_database(&name).await {
        Ok(url) => body(ctx, &mut row, &url).await,
        Err(error) => Err(error),
    };
    ctx.drop_database(&name).await;
    result?;
    Ok(row)
}

async fn body(ctx: &Ctx, row: &mut Row, url: &str) -> Result<()> {
    connect(url)
        .await?
        .batch_execute("CREATE EXTENSION pgrowlocks")
        .await?;
    let kills = ctx.profile.pick(6, 20);
    for claim in ["lease", "lock"] {
        let jobs = ctx.profile.pick(300, 1000);
        one(ctx, row, url, Limit::Concurrency, claim, jobs, kills).await?;
    }
    let jobs = ctx.profile.pick(120, 400);
    one(ctx, row, url, Limit::Rate, "lease", jobs, kills).await
}

/// The most holders seen at once by the sampler.
#[derive(Default)]
struct Peaks {
    /// Jobs holding a live lease (leased, `locked_until` ahead of the clock).
    leases: i64,
    /// `inbox_limits`'s `running`.
    running: i64,
    /// Job rows locked by a transaction.
    locks: i64,
    samples: u64,
}

/// Samples the holders of the queue's slots every few milliseconds until `stop`.
fn sample(
    client: Client,
    claim: &'static str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Result<Peaks>> {
    tokio::spawn(async move {
        let mut peaks = Peaks::default();
        while !stop.load(Ordering::Relaxed) {
            if claim == "lock" {
                // pgrowlocks reads the rows one after another, not at one instant: a row counts
                // when the transaction that locked it still runs once the scan is over, when all
                // of those hold their rows at once (a lock is held until its transaction ends).
                let locked = client
                    .query_one(
                        "SELECT coalesce(array_agg(l.locked_row::text), '{}'), \
                                coalesce(array_agg(x::text), '{}') \
                           FROM pgrowlocks('jobs') l, unnest(l.xids) x",
                        &[],
                    )
                    .await?;
                let (rows, xids): (Vec<String>, Vec<String>) = (locked.get(0), locked.get(1));
                let held: i64 = client
                    .query_one(
                        "SELECT count(DISTINCT r.tid) \
                           FROM unnest($1::text[], $2::text[]) r(tid, x) \
                          WHERE EXISTS (SELECT FROM pg_locks k WHERE k.locktype = 'transactionid' \
                                          AND k.transactionid::text = r.x)",
                        &[&rows, &xids],
                    )
                    .await?
                    .get(0);
                peaks.locks = peaks.locks.max(held);
            } else {
                // One snapshot: the leases it shows committed before it, and all were live then.
                let row = client
                    .query_one(
                        "SELECT (SELECT count(*) FROM jobs WHERE leased_at IS NOT NULL \
                                   AND locked_until > clock_timestamp() \
                                   AND locked_until < 'infinity'), \
                                coalesce((SELECT running FROM inbox_limits('jobs')), 0)",
                        &[],
                    )
                    .await?;
                peaks.leases = peaks.leases.max(row.get(0));
                peaks.running = peaks.running.max(row.get(1));
            }
            peaks.samples += 1;
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        Ok(peaks)
    })
}

/// The live leases of the deliveries that worker `name` started (its slots, once it is dead).
async fn leases_of(client: &Client, name: &str) -> Result<i64> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM jobs q \
               JOIN deliveries d ON d.n = (q.payload #>> '{}')::int8 AND d.attempt = q.attempt \
              WHERE d.worker = $1 AND q.leased_at IS NOT NULL \
                AND q.locked_until > clock_timestamp() AND q.locked_until < 'infinity'",
            &[&name],
        )
        .await?
        .get(0))
}

async fn count(client: &Client, sql: &str) -> Result<i64> {
    Ok(client.query_one(sql, &[]).await?.get(0))
}

async fn one(
    ctx: &Ctx,
    row: &mut Row,
    url: &str,
    limit: Limit,
    claim: &'static str,
    jobs: i64,
    kills: u64,
) -> Result<()> {
    let label = match limit {
        Limit::Concurrency => format!("{claim}, concurrency {CONCURRENCY}"),
        Limit::Rate => format!("{claim}, rate {RATE} per {RATE_MS} ms"),
    };
    let db = TestDb::at(url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(DELIVERIES).await?;
    admin
        .batch_execute("ALTER TABLE effects ADD COLUMN ended timestamptz")
        .await?;
    match limit {
        Limit::Concurrency => {
            admin
                .execute("SELECT inbox_set_concurrency('jobs', $1)", &[&CONCURRENCY])
                .await?;
        }
        Limit::Rate => {
            // Every lease's start, killed ones included: a lease sets leased_at, in the take's
            // own transaction.
            admin
                .batch_execute(&format!(
                    "CREATE TABLE starts (id bigint NOT NULL, attempt int NOT NULL, \
                                          at timestamptz NOT NULL); \
                     CREATE FUNCTION record_start() RETURNS trigger LANGUAGE plpgsql \
                       SET search_path = pg_catalog AS $$ BEGIN \
                         INSERT INTO {schema}.starts VALUES (NEW.id, NEW.attempt, NEW.leased_at); \
                         RETURN NULL; END $$; \
                     CREATE TRIGGER record_start AFTER UPDATE ON jobs FOR EACH ROW \
                       WHEN (NEW.leased_at IS NOT NULL \
                             AND NEW.leased_at IS DISTINCT FROM OLD.leased_at) \
                       EXECUTE FUNCTION record_start(); \
                     SELECT inbox_set_rate_limit('jobs', {RATE}, '{RATE_MS} milliseconds')",
                    schema = db.schema()
                ))
                .await?;
        }
    }
    row.jobs += enqueue_range(&admin, "jobs", 1, jobs).await?;

    let args = |name: &str| -> Vec<String> {
        [
            ("--url", db.url().to_owned()),
            ("--schema", db.schema().to_owned()),
            ("--label", name.to_owned()),
            ("--claim", claim.to_owned()),
            ("--workers", "4".to_owned()),
            ("--max-attempts", MAX_ATTEMPTS.to_string()),
            ("--lease-ms", "2000".to_owned()),
            ("--work-ms", "50".to_owned()),
            ("--ends", "on".to_owned()),
        ]
        .into_iter()
        .flat_map(|(name, value)| [name.to_owned(), value])
        .collect()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample(db.client().await, claim, stop.clone());
    let started = Instant::now();
    // Each child's label names its process and generation, so that a killed one's deliveries
    // are told from those of the one started in its place.
    let mut children = Vec::new();
    for process in 0..PROCESSES {
        let name = format!("{process}.0");
        children.push((name.clone(), child::spawn(&ctx.exe, &args(&name), &[])?));
    }
    let mut rng =
        fastrand::Rng::with_seed(u64::from(limit == Limit::Rate) * 2 + u64::from(claim == "lock"));
    let (mut killed, mut mid_handler, mut held) = (0, 0, 0);
    for generation in 1..=kills {
        tokio::time::sleep(Duration::from_millis(rng.u64(200..700))).await;
        // The victim: a child running a delivery (logged, its job still queued, no effect
        // committed), waited for up to 3 s; any child if none is.
        let live: Vec<String> = children.iter().map(|(name, _)| name.clone()).collect();
        let deadline = Instant::now() + Duration::from_secs(3);
        let busy = loop {
            let busy: Vec<String> = admin
                .query(
                    "SELECT DISTINCT d.worker FROM deliveries d \
                       JOIN jobs q ON (q.payload #>> '{}')::int8 = d.n \
                      WHERE d.worker = ANY($1) AND q.locked_until < 'infinity' \
                        AND NOT EXISTS (SELECT FROM effects e WHERE e.n = d.n \
                                          AND e.attempt = d.attempt AND e.worker = d.worker)",
                    &[&live],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            if !busy.is_empty() || Instant::now() > deadline {
                break busy;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let victim = match busy.get(rng.usize(..busy.len().max(1))) {
            Some(name) => live.iter().position(|n| n == name).unwrap_or(0),
            None => rng.usize(..PROCESSES),
        };
        let (name, mut worker) = children.remove(victim);
        worker.start_kill()?;
        worker.wait().await?;
        row.faults += 1;
        killed += 1;
        // Killed mid-handler: a delivery it started did not commit; the leases it held live on.
        let unfinished: i64 = admin
            .query_one(
                "SELECT count(*) FROM deliveries d WHERE d.worker = $1 AND NOT EXISTS \
                 (SELECT FROM effects e WHERE e.n = d.n AND e.attempt = d.attempt \
                    AND e.worker = d.worker)",
                &[&name],
            )
            .await?
            .get(0);
        mid_handler += u64::from(unfinished > 0);
        if claim == "lease" {
            held += leases_of(&admin, &name).await?;
        }
        let name = format!("{victim}.{generation}");
        children.insert(
            victim,
            (name.clone(), child::spawn(&ctx.exe, &args(&name), &[])?),
        );
        if common::drained(&admin, "jobs").await? {
            break;
        }
    }
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(120)).await?;
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let peaks = sampler.await??;
    for (_, mut worker) in children {
        worker.start_kill()?;
        worker.wait().await?;
    }
    row.check(finished, || {
        format!("{label}: the queue did not drain after the kills (slots not given back?)")
    });

    let started_deliveries = common::started(&admin).await?;
    let tally = common::tally(&admin, "jobs", 1..=jobs, Some(&started_deliveries)).await?;
    row.add(&label, &tally);
    let over: i64 = admin
        .query_one(
            "SELECT count(*) FROM deliveries WHERE attempt > $1",
            &[&MAX_ATTEMPTS],
        )
        .await?
        .get(0);
    row.check(over == 0, || {
        format!("{label}: {over} deliveries beyond max_attempts {MAX_ATTEMPTS}")
    });
    let unstamped = count(&admin, "SELECT count(*) FROM effects WHERE ended IS NULL").await?;
    row.check(unstamped == 0, || {
        format!("{label}: {unstamped} effects without their end")
    });
    // The most committed runs at once (an end before a start at the same instant).
    let most = count(
        &admin,
        "SELECT coalesce(max(n), 0)::int8 FROM ( \
           SELECT sum(d) OVER (ORDER BY at, d) AS n FROM ( \
             SELECT at, 1 AS d FROM effects UNION ALL SELECT ended, -1 FROM effects) e) s",
    )
    .await?;
    let limits = admin
        .query_one(
            "SELECT concurrency, running, rate_limit, recent_starts FROM inbox_limits('jobs')",
            &[],
        )
        .await?;
    let (concurrency, running): (Option<i32>, Option<i64>) = (limits.get(0), limits.get(1));
    let rate_limit: Option<i32> = limits.get(2);
    row.check(peaks.samples >= 100, || {
        format!("{label}: only {} samples of the holders", peaks.samples)
    });
    let mut seen = format!("{most} committed runs at once");
    match limit {
        Limit::Concurrency => {
            let cap = i64::from(CONCURRENCY);
            let holders = if claim == "lock" {
                peaks.locks
            } else {
                peaks.leases
            };
            row.check(most <= cap, || {
                format!("{label}: {most} committed runs at once under a limit of {cap}")
            });
            row.check(holders <= cap, || {
                format!(
                    "{label}: {holders} jobs held at once ({}) under a limit of {cap}",
                    if claim == "lock" {
                        "locked rows"
                    } else {
                        "live leases"
                    }
                )
            });
            row.check(peaks.running <= cap, || {
                format!(
                    "{label}: inbox_limits reported {} running under a limit of {cap}",
                    peaks.running
                )
            });
            // Reached (more than that fails above).
            row.check(most >= cap && holders >= cap, || {
                format!(
                    "{label}: the limit was never reached ({most} committed runs, {holders} \
                     holders at most)"
                )
            });
            let idle = concurrency == Some(CONCURRENCY) && running == Some(0);
            row.check(idle, || {
                format!(
                    "{label}: idle, inbox_limits reports concurrency {concurrency:?} and \
                     {running:?} running, not {CONCURRENCY} and 0"
                )
            });
            seen = if claim == "lock" {
                format!("{seen}, {} rows locked at once", peaks.locks)
            } else {
                format!(
                    "{seen}, {} live leases at once (inbox_limits: {} running)",
                    peaks.leases, peaks.running
                )
            };
        }
        Limit::Rate => {
            let window = format!("'{RATE_MS} milliseconds'::interval");
            let crowded = count(
                &admin,
                &format!(
                    "SELECT count(*) FROM starts a WHERE (SELECT count(*) FROM starts b \
                      WHERE b.at >= a.at AND b.at < a.at + {window}) > {RATE}"
                ),
            )
            .await?;
            let fullest = count(
                &admin,
                &format!(
                    "SELECT coalesce(max((SELECT count(*) FROM starts b \
                      WHERE b.at >= a.at AND b.at < a.at + {window})), 0) FROM starts a"
                ),
            )
            .await?;
            let starts = count(&admin, "SELECT count(*) FROM starts").await?;
            row.check(crowded == 0, || {
                format!(
                    "{label}: {crowded} windows of {RATE_MS} ms hold more than {RATE} starts \
                     (at most {fullest})"
                )
            });
            row.check(fullest >= RATE, || {
                format!(
                    "{label}: the limit was never reached (at most {fullest} starts in a window)"
                )
            });
            row.check(rate_limit == Some(RATE as i32), || {
                format!("{label}: idle, inbox_limits reports rate limit {rate_limit:?}")
            });
            seen =
                format!("{seen}, {starts} leases, at most {fullest} in a window of {RATE_MS} ms");
        }
    }
    let deliveries = count(&admin, "SELECT count(*) FROM deliveries").await?;
    // Under locks a killed worker's slots come back with its connection's end, not a lease.
    let held = if claim == "lease" {
        format!(", {held} leases held by the killed ran out")
    } else {
        String::new()
    };
    row.inputs += deliveries as u64;
    row.note(format!(
        "{label}: {killed} kills ({mid_handler} mid-handler{held}), \
         drained in {seconds:.1} s; {seen} over {} samples; {deliveries} deliveries for {jobs} \
         jobs, {} dead-lettered",
        peaks.samples, tally.dead
    ));
    drop(admin);
    drop(db);
    Ok(())
}
