//! Case 18, crashes while the horizon is held: on a throwaway cluster of the case's own, a
//! session idle in a transaction that has an xid holds the MVCC horizon for the whole run (so
//! nothing the queue leaves behind can be vacuumed), while two child worker processes (leases
//! of 1 s, groups of 10) work through the queue and more jobs are enqueued round by round. Each
//! round SIGKILLs the children at a random moment and starts them again; every third round
//! also crashes the server with `pg_ctl -m immediate` and starts it again, and the holder takes
//! the horizon again at once. Then the hold ends and a last child finishes the queue. What
//! must hold: every job's effect committed exactly once, no attempt number delivered twice (a
//! lease's attempt survives the crash that follows it), and nothing left ready, delayed or
//! leased.

use std::time::Duration;

use tokio_postgres::Client;

use crate::child;
use crate::cluster::Cluster;
use crate::common::{self, connect, enqueue_range, setup, Ctx, Result, Row, DELIVERIES};

pub const NAME: &str = "SIGKILL and server crash, horizon held";

/// A session idle in a transaction that has an xid: the horizon stays where it began.
async fn hold(url: &str) -> Result<Client> {
    let holder = connect(url).await?;
    holder.batch_execute("BEGIN; SELECT txid_current()").await?;
    Ok(holder)
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(18, NAME);
    let jobs: i64 = ctx.profile.pick(3_000, 12_000);
    let rounds: i64 = ctx.profile.pick(6, 15);
    let cluster = Cluster::create(&ctx.pg_bin).await?;
    let db = cluster.faults_database().await?;
    let mut admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(DELIVERIES).await?;
    // Half at first, the rest over the rounds: enqueues too run under the held horizon.
    let first_half = jobs / 2;
    row.jobs = enqueue_range(&admin, "jobs", 1, first_half).await?;
    let mut next = first_half + 1;
    let per_round = (jobs - first_half + rounds - 1) / rounds;
    let args: Vec<String> = [
        ("--url", db.url().to_owned()),
        ("--schema", db.schema().to_owned()),
        ("--claim", "lease".to_owned()),
        ("--group", "10".to_owned()),
        ("--lease-ms", "1000".to_owned()),
        ("--work-ms", "5".to_owned()),
    ]
    .into_iter()
    .flat_map(|(name, value)| [name.to_owned(), value])
    .collect();
    let mut holder = hold(&cluster.url("faults")).await?;
    let mut rng = fastrand::Rng::with_seed(18);
    let (mut kills, mut crashes) = (0, 0);
    for round in 0..rounds {
        let mut children = Vec::new();
        for _ in 0..2 {
            children.push(child::spawn(&ctx.exe, &args, &[])?);
        }
        if next <= jobs {
            let to = (next + per_round - 1).min(jobs);
            row.jobs += enqueue_range(&admin, "jobs", next, to).await?;
            next = to + 1;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(400..1500))).await;
        if round % 3 == 2 {
            cluster.stop("immediate").await?;
            crashes += 1;
            row.faults += 1;
            tokio::time::sleep(Duration::from_millis(500)).await;
            cluster.start().await?;
            holder = hold(&cluster.url("faults")).await?;
            admin = db.client().await;
        }
        for mut child in children {
            child.start_kill()?;
            child.wait().await?;
            kills += 1;
            row.faults += 1;
        }
    }
    // How far the hold held the horizon back: the transactions begun since the holder's own
    // (the statistics' dead tuples would not tell: a crash resets them).
    let held_back: i32 = holder
        .query_one(
            "SELECT age(backend_xid) FROM pg_stat_activity WHERE pid = pg_backend_pid()",
            &[],
        )
        .await?
        .get(0);
    holder.batch_execute("COMMIT").await?;
    let mut last = child::spawn(&ctx.exe, &args, &[])?;
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(180)).await?;
    last.start_kill()?;
    last.wait().await?;
    row.check(finished, || {
        "the queue did not drain after the hold ended (a job left ready, delayed or leased)".into()
    });
    let started = common::started(&admin).await?;
    let tally = common::tally(&admin, "jobs", 1..=jobs, Some(&started)).await?;
    row.add("", &tally);
    let repeated = common::repeated_attempts(&admin).await?;
    row.check(repeated == 0, || {
        format!("{repeated} attempt numbers delivered twice (an attempt lost in a crash)")
    });
    let deliveries: i64 = admin
        .query_one("SELECT count(*) FROM deliveries", &[])
        .await?
        .get(0);
    row.inputs = deliveries as u64;
    row.note(format!(
        "{kills} worker processes SIGKILLed and {crashes} server crashes while an xid held the \
         horizon; {deliveries} deliveries for {jobs} jobs; the last hold (since the last \
         crash) held the horizon {held_back} transactions back"
    ));
    drop(admin);
    drop(db);
    drop(cluster);
    Ok(row)
}
