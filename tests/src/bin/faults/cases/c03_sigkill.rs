//! Case 3, SIGKILL: a child worker process (this program's `child` mode) is killed with SIGKILL
//! at a random moment, mid-handler, and started again, many times; in lease and lock claims,
//! with groups of 1, 10 and 50, and `max_attempts` 5. Its handler logs each delivery outside
//! the delivery's transaction and writes the effect through it. Then a last child finishes the
//! queue. What must hold: no effect from a delivery that did not commit, every job done exactly
//! once or dead-lettered, a leased delivery's attempt counted (no attempt number delivered
//! twice), and no delivery beyond `max_attempts`.

use std::time::Duration;

use inbox_tests::TestDb;

use crate::child;
use crate::common::{self, enqueue_range, setup, Ctx, Result, Row, DELIVERIES};

pub const NAME: &str = "SIGKILL mid-handler";

const MAX_ATTEMPTS: i32 = 5;

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(3, NAME);
    let kills = ctx.profile.pick(8, 25);
    for claim in ["lease", "lock"] {
        for group in [1, 10, 50] {
            let jobs = ctx.profile.pick(400, 1500) as i64;
            one(ctx, &mut row, claim, group, jobs, kills).await?;
        }
    }
    Ok(row)
}

async fn one(
    ctx: &Ctx,
    row: &mut Row,
    claim: &str,
    group: usize,
    jobs: i64,
    kills: u64,
) -> Result<()> {
    let label = format!("{claim}, group {group}");
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(DELIVERIES).await?;
    // Job 0 has already been leased max_attempts times by workers that died (leases of 1 ms):
    // its next delivery would be one too many, so it must be dead-lettered, not run.
    let exhausted = claim == "lease";
    if exhausted {
        enqueue_range(&admin, "jobs", 0, 0).await?;
        for _ in 0..MAX_ATTEMPTS {
            admin
                .batch_execute("SELECT * FROM inbox_lease('jobs', 1, '1 millisecond')")
                .await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        row.jobs += 1;
    }
    row.jobs += enqueue_range(&admin, "jobs", 1, jobs).await?;
    let args: Vec<String> = [
        ("--url", db.url().to_owned()),
        ("--schema", db.schema().to_owned()),
        ("--claim", claim.to_owned()),
        ("--group", group.to_string()),
        ("--max-attempts", MAX_ATTEMPTS.to_string()),
        ("--lease-ms", "1000".to_owned()),
        ("--work-ms", "15".to_owned()),
    ]
    .into_iter()
    .flat_map(|(name, value)| [name.to_owned(), value])
    .collect();
    let mut rng = fastrand::Rng::with_seed(group as u64);
    let mut mid_handler = 0;
    for _ in 0..kills {
        let mut worker = child::spawn(&ctx.exe, &args, &[])?;
        tokio::time::sleep(Duration::from_millis(rng.u64(300..900))).await;
        // A kill counts as mid-handler when a delivery it started has not committed.
        let running: i64 = admin
            .query_one(
                "SELECT count(*) FROM deliveries d WHERE NOT EXISTS \
                 (SELECT FROM effects e WHERE e.n = d.n AND e.attempt = d.attempt)",
                &[],
            )
            .await?
            .get(0);
        worker.start_kill()?;
        worker.wait().await?;
        row.faults += 1;
        mid_handler += u64::from(running > 0);
        if common::drained(&admin, "jobs").await? {
            break;
        }
    }
    let mut last = child::spawn(&ctx.exe, &args, &[])?;
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(180)).await?;
    last.start_kill()?;
    last.wait().await?;
    row.check(finished, || format!("{label}: the queue did not drain"));
    let started = common::started(&admin).await?;
    let first = if exhausted { 0 } else { 1 };
    let tally = common::tally(&admin, "jobs", first..=jobs, Some(&started)).await?;
    if exhausted {
        let runs: i64 = admin
            .query_one("SELECT count(*) FROM deliveries WHERE n = 0", &[])
            .await?
            .get(0);
        row.check(runs == 0, || {
            format!(
                "{label}: a job leased {MAX_ATTEMPTS} times already (max_attempts {MAX_ATTEMPTS}) \
                 was delivered {runs} more times instead of being dead-lettered"
            )
        });
    }
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
    if claim == "lease" {
        let repeated = common::repeated_attempts(&admin).await?;
        row.check(repeated == 0, || {
            format!("{label}: {repeated} attempt numbers delivered twice (attempts not counted)")
        });
    }
    let deliveries: i64 = admin
        .query_one("SELECT count(*) FROM deliveries", &[])
        .await?
        .get(0);
    row.inputs += deliveries as u64;
    row.note(format!(
        "{label}: {mid_handler} kills mid-handler, {deliveries} deliveries for {jobs} jobs, {} dead-lettered",
        tally.dead
    ));
    drop(admin);
    drop(db);
    Ok(())
}
