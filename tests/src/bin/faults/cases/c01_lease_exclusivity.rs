//! Case 1, lease exclusivity: 10,000 jobs, 32 concurrent leasers calling the SQL functions
//! directly. Each leaser takes 1 to 16 jobs, marks each one held in a map shared by all leasers
//! (a job already marked would be held by two leases at once), and then either acks it with its
//! effect in one transaction or, one time in ten, releases it with `inbox_retry`, so that jobs
//! are leased again by someone else. No job is held twice, no deadlock, every job acked once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use inbox_tests::TestDb;

use crate::common::{self, describe, enqueue_range, setup, sqlstate, Ctx, Result, Row};

pub const NAME: &str = "lease exclusivity";

const LEASERS: usize = 32;

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(1, NAME);
    let jobs: i64 = 10_000;
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    let held: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let double_holds = Arc::new(AtomicU64::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let releases = Arc::new(AtomicU64::new(0));
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for leaser in 0..LEASERS {
        let client = db.client().await;
        let (held, double_holds, calls, releases, errors) = (
            held.clone(),
            double_holds.clone(),
            calls.clone(),
            releases.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(leaser as u64);
            loop {
                let max = rng.i32(1..=16);
                calls.fetch_add(1, Ordering::Relaxed);
                let taken = match client
                    .query(
                        "SELECT id, token, (payload #>> '{}')::int8 \
                         FROM inbox_lease('jobs', $1, '10 minutes')",
                        &[&max],
                    )
                    .await
                {
                    Ok(rows) => rows,
                    Err(e) => {
                        errors.lock().unwrap().push(describe(&e));
                        continue;
                    }
                };
                if taken.is_empty() {
                    // Nothing ready: every job left is held by another leaser, or done.
                    return;
                }
                for job in &taken {
                    if held.lock().unwrap().insert(job.get(0), leaser).is_some() {
                        double_holds.fetch_add(1, Ordering::Relaxed);
                    }
                }
                for job in &taken {
                    let (id, token, n): (i64, i64, i64) = (job.get(0), job.get(1), job.get(2));
                    // Unmarked before the settlement commits: until then the lease keeps every
                    // other leaser away, so a mark by another leaser meanwhile is a double hold.
                    held.lock().unwrap().remove(&id);
                    let settle = if rng.u8(0..10) == 0 {
                        releases.fetch_add(1, Ordering::Relaxed);
                        client
                            .query_one("SELECT inbox_retry('jobs', $1, $2)", &[&id, &token])
                            .await
                    } else {
                        client
                            .query_one(
                                "WITH effect AS (INSERT INTO effects (n, attempt) VALUES ($3, $2::int8::int4)) \
                                 SELECT inbox_ack('jobs', $1, $2)",
                                &[&id, &token, &n],
                            )
                            .await
                    };
                    match settle {
                        Ok(settled) if settled.get::<_, bool>(0) => {}
                        Ok(_) => errors
                            .lock()
                            .unwrap()
                            .push(format!("job {id}: its own lease's settlement was refused")),
                        Err(e) => errors.lock().unwrap().push(format!(
                            "job {id}: {} [{}]",
                            describe(&e),
                            sqlstate(&e)
                        )),
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    // A leaser that found nothing while others still held jobs stopped early: finish the rest.
    let leftover = common::drained(&admin, "jobs").await?;
    let tally = common::tally(&admin, "jobs", 1..=jobs, None).await?;
    row.add("", &tally);
    row.inputs = calls.load(Ordering::Relaxed);
    let errors = errors.lock().unwrap().clone();
    row.check(leftover, || "jobs left in the queue".into());
    row.check(double_holds.load(Ordering::Relaxed) == 0, || {
        format!(
            "{} jobs held by two leases at once",
            double_holds.load(Ordering::Relaxed)
        )
    });
    row.check(errors.is_empty(), || {
        format!(
            "{} errors (deadlocks among them would show 40P01): {:?}",
            errors.len(),
            &errors[..errors.len().min(3)]
        )
    });
    row.note(format!(
        "{LEASERS} leasers, {} lease calls, {} jobs released and leased again",
        row.inputs,
        releases.load(Ordering::Relaxed)
    ));
    drop(admin);
    drop(db);
    Ok(row)
}
