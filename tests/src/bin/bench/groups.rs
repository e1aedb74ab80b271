//! Figure 9: the transactional worker on jobs spread over 100 ordered groups, against the same
//! jobs without groups (the target: at least 0.8 of it). Both sides are the project's; the
//! "raw" column is the ungrouped run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, Statement};
use serde::Deserialize;

use super::measure::{compare, window, Row, Target};
use super::setup::*;

/// Groups of the grouped side; jobs are spread round-robin over them.
const GROUPS: u64 = 100;

#[derive(Deserialize)]
struct Payload {
    n: i64,
}

/// Fills the queue with `count` due jobs, in groups or not, through `inbox_enqueue_batch`
/// (grouped jobs must be enqueued by the extension, which decides who waits).
async fn fill_groups(ctx: &Ctx, count: u64, grouped: bool) -> Result<()> {
    let client = ctx.connect().await?;
    let groups = if grouped {
        format!("ARRAY(SELECT 'g' || (g % {GROUPS}) FROM generate_series($1::int8, $2::int8) g)")
    } else {
        "NULL".to_owned()
    };
    let sql = format!(
        "SELECT count(*) FROM inbox_enqueue_batch('{Q_INBOX}'::regclass, \
         ARRAY(SELECT jsonb_build_object('n', g) FROM generate_series($1::int8, $2::int8) g), \
         group_keys => {groups})"
    );
    let statement = client.prepare(&sql).await?;
    let mut from = 1i64;
    while from <= count as i64 {
        let to = (from + 4_999).min(count as i64);
        client.query(&statement, &[&from, &to]).await?;
        from = to + 1;
    }
    Ok(())
}

async fn run(ctx: &Ctx, connections: usize, grouped: bool) -> Result<f64> {
    let admin = ctx.connect().await?;
    truncate(&admin, &[Q_INBOX, DONE_INBOX]).await?;
    // Enough for the warm-up and the window at several thousand jobs a second.
    fill_groups(ctx, 2 * ctx.opts.depth(connections, 1), grouped).await?;
    let acked = Arc::new(AtomicU64::new(0));
    let counted = acked.clone();
    let handler = transactional(move |job: Job<Payload>, tx: &dyn Database| {
        let counted = counted.clone();
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO bench_done_inbox (n) VALUES ($1)").bind(job.payload.n),
            )
            .await?;
            counted.fetch_add(1, Ordering::Relaxed);
            Ok(Outcome::ack())
        })
    });
    let handle = Worker::transactional(ctx.database(connections + 4)?, Q_INBOX, handler)
        .workers(connections)
        .start();
    let rate = window(ctx, || acked.load(Ordering::Relaxed)).await?;
    handle.shutdown(Duration::from_millis(300)).await;
    Ok(rate)
}

/// Figure 9: throughput with 100 ordered groups, against the same jobs without groups.
pub async fn groups(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in &ctx.opts.connections {
        let (grouped, plain) =
            compare(ctx.opts.rounds, || run(ctx, n, true), || run(ctx, n, false)).await?;
        let row = Row::new(
            9,
            format!("9. worker tx, lease, {GROUPS} ordered groups"),
            Some(n),
            (Some(grouped), Some(plain)),
            "jobs/s",
            Target::RatioAtLeast(0.8),
        )
        .note("the raw column is the same worker on the same jobs without groups");
        super::report::print_row(&row);
        rows.push(row);
    }
    Ok(rows)
}
