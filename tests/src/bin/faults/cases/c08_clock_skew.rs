//! Case 8, the worker host's clock an hour off: two child worker processes run under
//! libfaketime, one an hour ahead and one an hour behind (their monotonic clocks left alone, as
//! an NTP step would). The queue holds 400 jobs due now, 50 due in 30 minutes (by the database's
//! clock) and 4 slow jobs whose first delivery outlives its 2 s lease (no heartbeat). What must
//! hold: the due jobs run exactly once, the delayed ones do not run at all (the worker ahead
//! would think them due), a slow job runs again once its lease ends by the database's clock and
//! only that second delivery's effect commits; and the skew was really there (each child's
//! effects carry its own clock's time).

use std::time::Duration;

use inbox_tests::TestDb;

use crate::child;
use crate::common::{self, enqueue_range, setup, Ctx, Result, Row, DELIVERIES};

pub const NAME: &str = "worker clock an hour off";

const LIBRARIES: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(8, NAME);
    let Some(library) = std::env::var("INBOX_FAKETIME_LIB").ok().or_else(|| {
        LIBRARIES
            .iter()
            .find(|path| std::path::Path::new(path).exists())
            .map(|path| path.to_string())
    }) else {
        row.failures
            .push("libfaketime is not installed (apt-get install faketime)".into());
        return Ok(row);
    };
    let (due, delayed, slow) = (400_i64, 50_i64, 4_i64);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    admin.batch_execute(DELIVERIES).await?;
    enqueue_range(&admin, "jobs", 1, due).await?;
    enqueue_range(&admin, "jobs", 1_000_001, 1_000_000 + slow).await?;
    admin
        .execute(
            "SELECT count(*) FROM inbox_enqueue_batch('jobs', \
             ARRAY(SELECT to_jsonb(g) FROM generate_series(2000001::int8, 2000000 + $1::int8) g), \
             now() + interval '30 minutes')",
            &[&delayed],
        )
        .await?;
    row.jobs = (due + delayed + slow) as u64;
    let mut children = Vec::new();
    for (label, offset) in [("ahead", "+1h"), ("behind", "-1h")] {
        let args: Vec<String> = [
            ("--url", db.url().to_owned()),
            ("--schema", db.schema().to_owned()),
            ("--label", label.to_owned()),
            ("--lease-ms", "2000".to_owned()),
            ("--heartbeat", "off".to_owned()),
            ("--slow-ms", "5000".to_owned()),
            ("--work-ms", "5".to_owned()),
            ("--workers", "3".to_owned()),
        ]
        .into_iter()
        .flat_map(|(name, value)| [name.to_owned(), value])
        .collect();
        let env = [
            ("LD_PRELOAD", library.clone()),
            ("FAKETIME", offset.to_owned()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
            ("FAKETIME_DONT_RESET", "1".to_owned()),
        ];
        children.push(child::spawn(&ctx.exe, &args, &env)?);
        row.faults += 1;
    }
    let expected: Vec<i64> = (1..=due).chain(1_000_001..=1_000_000 + slow).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let done: i64 = admin
            .query_one(
                "SELECT count(DISTINCT n) FROM effects WHERE n < 2000000",
                &[],
            )
            .await?
            .get(0);
        if done as usize >= expected.len() || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Long enough for a worker that thought the delayed jobs due to have taken some.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for mut child in children {
        child.start_kill()?;
        child.wait().await?;
    }
    let started = common::started(&admin).await?;
    let effects = common::effects(&admin).await?;
    let mut queued = common::queued(&admin, "jobs").await?;
    // The delayed jobs must still be queued, untouched.
    let mut untouched = 0;
    for n in 2_000_001..=2_000_000 + delayed {
        if let Some(job) = queued.remove(&n) {
            untouched += u64::from(job.attempt == 0 && !job.dead);
        }
    }
    row.check(untouched == delayed as u64, || {
        format!(
            "{} of {delayed} delayed jobs were delivered early",
            delayed as u64 - untouched
        )
    });
    let tally = common::classify(expected.iter().copied(), &effects, &queued, Some(&started));
    row.add("", &tally);
    let slow_ok: i64 = admin
        .query_one(
            "SELECT count(*) FROM effects e WHERE e.n > 1000000 AND e.n < 2000000 AND e.attempt = 2 \
             AND EXISTS (SELECT FROM deliveries d WHERE d.n = e.n AND d.attempt = 1)",
            &[],
        )
        .await?
        .get(0);
    row.check(slow_ok == slow, || {
        format!("{slow_ok} of {slow} slow jobs ran again after their lease and committed only then")
    });
    let skews = admin
        .query(
            "SELECT worker, avg(extract(epoch FROM host_at - at))::float8, count(*) \
             FROM effects GROUP BY worker ORDER BY worker",
            &[],
        )
        .await?;
    let mut shown = Vec::new();
    for skew in &skews {
        let (worker, seconds, count): (String, f64, i64) = (skew.get(0), skew.get(1), skew.get(2));
        let want = if worker == "ahead" { 3600.0 } else { -3600.0 };
        row.check((seconds - want).abs() < 300.0, || {
            format!("the {worker} worker's clock was {seconds:.0} s off, not {want:.0} s")
        });
        shown.push(format!("{worker}: {count} effects, clock {seconds:+.0} s"));
    }
    row.check(skews.len() == 2, || {
        format!("effects from {} skewed workers, 2 expected", skews.len())
    });
    row.inputs = started.len() as u64;
    row.note(format!(
        "{}; delayed jobs untouched: {untouched}",
        shown.join(", ")
    ));
    drop(admin);
    drop(db);
    Ok(row)
}
