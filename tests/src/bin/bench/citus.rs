//! Figure 17: the same work on the single server and through a Citus coordinator
//! (`scripts/citus.sh bench` starts a coordinator and two worker nodes on this machine and names
//! the coordinator's database in `INBOX_CITUS_URL`). On one machine every node shares the same
//! two cores and disk, so the ratio is Citus's overhead per job, not what more machines buy.
//!
//! - The default transactional worker (`workers(8)`) burns down jobs whose handler writes one
//!   row: on the single server, and through the coordinator with the queue and the effect table
//!   in one distributed schema (one worker node).
//! - Claims of new keys from 16 connections for the run's duration: on the single server, and
//!   on a ledger hash-distributed by `event_key` over both worker nodes (each claim routed to its
//!   key's shard).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use serde_json::Value;

use super::measure::{median, Row, Target};
use super::setup::{Ctx, Result};

const WORKERS: usize = 8;
const CLAIMERS: usize = 16;
const NOTE: &str = "inbox / raw is Citus / the single server, all nodes on this one machine: \
                    Citus's overhead, not its scale";

/// Creates schema `bench_citus` with a queue of `jobs` jobs and the effect table; on Citus the
/// schema is distributed (the queue and the effects on one worker node).
async fn fill(client: &tokio_postgres::Client, citus: bool, jobs: i64) -> Result<()> {
    client
        .batch_execute(
            "DROP SCHEMA IF EXISTS bench_citus CASCADE; CREATE SCHEMA bench_citus; \
             SELECT inbox_create_queue('bench_citus.jobs'); \
             CREATE TABLE bench_citus.done (n int8 NOT NULL)",
        )
        .await?;
    if citus {
        client
            .batch_execute("SELECT citus_schema_distribute('bench_citus')")
            .await?;
    }
    client
        .execute(
            "SELECT count(*) FROM inbox_enqueue_batch('bench_citus.jobs', \
               ARRAY(SELECT jsonb_build_object('n', g) FROM generate_series(1, $1::int8) AS g))",
            &[&jobs],
        )
        .await?;
    Ok(())
}

/// Jobs per second of the default worker over `db`.
async fn burn_down(db: PgDatabase, jobs: u64) -> Result<f64> {
    let handler = transactional(|job: Job<Value>, tx: &dyn Database| {
        Box::pin(async move {
            let n = job.payload["n"].as_i64().unwrap_or_default();
            tx.execute(&Statement::new("INSERT INTO bench_citus.done VALUES ($1)").bind(n))
                .await?;
            Ok(Outcome::ack())
        })
    });
    let started = Instant::now();
    let stats = Worker::transactional(db, "bench_citus.jobs", handler)
        .workers(WORKERS)
        .run_until_idle()
        .await?;
    let elapsed = started.elapsed().as_secs_f64();
    if stats.acked != jobs {
        return Err(format!("{} acked of {jobs}", stats.acked).into());
    }
    Ok(jobs as f64 / elapsed)
}

/// Claims of new keys per second from [`CLAIMERS`] connections to `url` for `duration`, on
/// ledger `bench_citus_seen` (hash-distributed by its key on Citus).
async fn claims(ctx: &Ctx, url: &str, citus: bool) -> Result<f64> {
    let target = Ctx::new(url, ctx.opts.clone())?;
    let admin = target.connect().await?;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS public.bench_citus_seen; \
             SELECT inbox_create_ledger('public.bench_citus_seen')",
        )
        .await?;
    if citus {
        admin
            .batch_execute(
                "SELECT create_distributed_table('public.bench_citus_seen', 'event_key')",
            )
            .await?;
    }
    let claimed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + ctx.opts.duration;
    let mut claimers = Vec::new();
    for claimer in 0..CLAIMERS {
        let client = target.connect().await?;
        let claimed = claimed.clone();
        claimers.push(tokio::spawn(async move {
            let claim = client
                .prepare("SELECT inbox_claim('public.bench_citus_seen', $1)")
                .await?;
            let mut n = 0u64;
            while Instant::now() < deadline {
                let key = format!("{claimer}-{n}");
                let row = client.query_one(&claim, &[&key]).await?;
                if row.get::<_, bool>(0) {
                    claimed.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    let started = Instant::now();
    for claimer in claimers {
        claimer.await??;
    }
    let rate = claimed.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    admin
        .batch_execute("DROP TABLE public.bench_citus_seen")
        .await?;
    Ok(rate)
}

pub async fn citus(ctx: &Ctx) -> Result<Vec<Row>> {
    let citus_url = std::env::var("INBOX_CITUS_URL")
        .map_err(|_| "figure 17 needs a Citus cluster: run it with scripts/citus.sh bench")?;
    let citus_ctx = Ctx::new(&citus_url, ctx.opts.clone())?;
    let jobs: i64 = if ctx.opts.quick { 2_000 } else { 10_000 };
    let (single_admin, citus_admin) = (ctx.connect().await?, citus_ctx.connect().await?);
    let (mut single, mut through_citus) = (Vec::new(), Vec::new());
    for round in 0..ctx.opts.rounds {
        // Alternating which goes first.
        for citus in [round % 2 == 1, round % 2 == 0] {
            let (admin, target) = if citus {
                (&citus_admin, &citus_ctx)
            } else {
                (&single_admin, ctx)
            };
            fill(admin, citus, jobs).await?;
            let rate = burn_down(target.database(WORKERS + 2)?, jobs as u64).await?;
            if citus {
                through_citus.push(rate);
            } else {
                single.push(rate);
            }
        }
    }
    for admin in [&single_admin, &citus_admin] {
        admin
            .batch_execute("DROP SCHEMA bench_citus CASCADE")
            .await?;
    }
    let (mut single_claims, mut citus_claims) = (Vec::new(), Vec::new());
    for _ in 0..ctx.opts.rounds {
        single_claims.push(claims(ctx, &ctx.url, false).await?);
        citus_claims.push(claims(ctx, &citus_url, true).await?);
    }
    Ok(vec![
        Row::new(
            17,
            "17. Citus: the default worker, a queue and its effects in one distributed schema",
            Some(WORKERS),
            (Some(median(through_citus)), Some(median(single))),
            "jobs/s",
            Target::None,
        )
        .note(NOTE),
        Row::new(
            17,
            "17. Citus: claims of new keys, a ledger hash-distributed by event_key",
            Some(CLAIMERS),
            (Some(median(citus_claims)), Some(median(single_claims))),
            "claims/s",
            Target::None,
        )
        .note(NOTE),
    ])
}
