//! Case 19, durable steps under SIGKILL: a child worker (`child --mode steps`) whose handler
//! makes one durable step per job (a stand-in for a call outside the database, logged in `calls`
//! as it is made) and then writes its effect through the delivery's transaction, is killed with
//! SIGKILL at random moments and started again, with groups of 1 and 10; then a last child
//! finishes the queue. What must hold: every job's effect committed exactly once; no call made
//! by a delivery after its job's step was recorded (a later delivery gets the record instead);
//! one record per job. Calls repeated because a kill fell between a call and its record are
//! counted (the window `Job::step_key` is for), and the case fails if no kill fell between a
//! record and its delivery's commit, where it could have seen a repeat.

use std::time::Duration;

use inbox_tests::TestDb;

use crate::child;
use crate::common::{self, enqueue_range, setup, Ctx, Result, Row, DELIVERIES};

pub const NAME: &str = "durable steps under SIGKILL";

/// The outside calls the steps made: one row per call, committed as it is made.
const CALLS: &str = "CREATE TABLE calls (n bigint NOT NULL, job bigint NOT NULL, \
     attempt int NOT NULL, worker text, at timestamptz NOT NULL DEFAULT clock_timestamp())";

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(19, NAME);
    let kills = ctx.profile.pick(10, 25);
    for group in [1, 10] {
        let jobs = ctx.profile.pick(400, 1500) as i64;
        one(ctx, &mut row, group, jobs, kills).await?;
    }
    Ok(row)
}

async fn one(ctx: &Ctx, row: &mut Row, group: usize, jobs: i64, kills: u64) -> Result<()> {
    let label = format!("group {group}");
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(DELIVERIES).await?;
    admin.batch_execute(CALLS).await?;
    row.jobs += enqueue_range(&admin, "jobs", 1, jobs).await?;
    let args: Vec<String> = [
        ("--mode", "steps".to_owned()),
        ("--url", db.url().to_owned()),
        ("--schema", db.schema().to_owned()),
        ("--group", group.to_string()),
        ("--lease-ms", "1000".to_owned()),
        ("--work-ms", "40".to_owned()),
    ]
    .into_iter()
    .flat_map(|(name, value)| [name.to_owned(), value])
    .collect();
    let mut rng = fastrand::Rng::with_seed(19 + group as u64);
    for _ in 0..kills {
        let mut worker = child::spawn(&ctx.exe, &args, &[])?;
        tokio::time::sleep(Duration::from_millis(rng.u64(300..900))).await;
        worker.start_kill()?;
        worker.wait().await?;
        row.faults += 1;
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
    let tally = common::tally(&admin, "jobs", 1..=jobs, Some(&started)).await?;
    row.add(&label, &tally);
    let repeated = common::repeated_attempts(&admin).await?;
    row.check(repeated == 0, || {
        format!("{label}: {repeated} attempt numbers delivered twice (attempts not counted)")
    });

    // Each call against its job's record: made after the record (a repeat the record should have
    // prevented), or before it by an earlier delivery (a kill between the call and its record).
    let counts = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE c.attempt > s.attempt), \
                    count(*) FILTER (WHERE c.attempt < s.attempt), \
                    count(*) FILTER (WHERE s.attempt IS NULL), \
                    count(*), \
                    (SELECT count(*) FROM inbox_steps r WHERE r.queue = 'jobs'::regclass \
                        AND r.name = 'call') \
               FROM calls c \
               LEFT JOIN inbox_steps s ON s.queue = 'jobs'::regclass AND s.job = c.job \
                                      AND s.name = 'call'",
            &[],
        )
        .await?;
    let (after, lost, unrecorded, calls, records): (i64, i64, i64, i64, i64) = (
        counts.get(0),
        counts.get(1),
        counts.get(2),
        counts.get(3),
        counts.get(4),
    );
    row.check(after == 0, || {
        format!("{label}: {after} calls made after their job's step was recorded")
    });
    row.check(unrecorded == 0 && records == jobs, || {
        format!("{label}: {records} step records for {jobs} jobs, {unrecorded} calls of jobs without one")
    });
    // Deliveries that recorded their step and did not commit: each job's next delivery had a
    // record to find there.
    let reused: i64 = admin
        .query_one(
            "SELECT count(*) FROM inbox_steps s JOIN calls c ON c.job = s.job \
                                                  AND c.attempt = s.attempt \
              WHERE s.queue = 'jobs'::regclass \
                AND NOT EXISTS (SELECT FROM effects e WHERE e.n = c.n AND e.attempt = s.attempt)",
            &[],
        )
        .await?
        .get(0);
    row.check(reused > 0, || {
        format!("{label}: no kill fell between a step's record and its delivery's commit")
    });
    let deliveries: i64 = admin
        .query_one("SELECT count(*) FROM deliveries", &[])
        .await?
        .get(0);
    row.inputs += deliveries as u64;
    row.note(format!(
        "{label}: {deliveries} deliveries for {jobs} jobs; {calls} calls: {reused} jobs found \
         their step recorded by a killed delivery, {lost} calls repeated because a kill fell \
         between the call and its record"
    ));
    drop(admin);
    drop(db);
    Ok(())
}
