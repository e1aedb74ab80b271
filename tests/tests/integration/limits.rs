//! Concurrency and rate limits over real connections: four workers of eight slots each, on
//! connections of their own as four processes would have, never run more jobs at once than the
//! queue's concurrency limit (leased or locked) and never start more in a window than its rate
//! limit; a slot comes back when its job settles or its lease expires, and not before; lowering
//! a limit lets the jobs above it finish first; a limit per key holds for every key, and keys
//! take turns so that none waits behind another's backlog; bad limits are refused with their
//! SQLSTATE.

use std::time::Duration;

use crate::support::{assert_refused, fast_retries};
use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker, WorkerStats};
use inbox_client::{Database, PgDatabase, Queue, RateLimit, Statement};
use inbox_tests::TestDb;

/// The queue `jobs` with `jobs` jobs, and a table in which handlers record each run that
/// commits: its job, and when it started and ended (the server's clock) or when it was leased.
async fn setup(db: &TestDb, jobs: i64) -> (PgDatabase, Queue) {
    let pg = PgDatabase::from_pool_and_config(db.pool(4), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    db.client()
        .await
        .batch_execute(
            "CREATE TABLE runs (job bigint PRIMARY KEY, started timestamptz NOT NULL, \
                                ended timestamptz NOT NULL)",
        )
        .await
        .unwrap();
    let payloads: Vec<i64> = (0..jobs).collect();
    queue.enqueue_batch(&pg, &payloads).await.unwrap();
    (pg, queue)
}

/// Four workers of 8 slots open about 40 connections: the tests that run them take turns, so
/// that they fit a server of 100 beside the other suites.
static WORKERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `processes` workers of 8 slots, each over a pool of its own, until the queue is empty.
async fn run_workers(
    db: &TestDb,
    processes: usize,
    claim: Claim,
    handler_ms: u64,
    record: &'static str,
) -> Vec<WorkerStats> {
    let _turn = WORKERS.lock().await;
    let runs = (0..processes).map(|_| {
        let port = PgDatabase::from_pool_and_config(db.pool(9), db.config());
        // Payloads of any JSON: the handler reads the job's id only.
        let handler = transactional(move |job: Job<serde_json::Value>, tx: &dyn Database| {
            Box::pin(async move {
                let started = tx
                    .query(&Statement::new(record).bind(job.id))
                    .await?
                    .one()?
                    .get::<chrono::DateTime<chrono::Utc>>("started")?;
                tokio::time::sleep(Duration::from_millis(handler_ms + (job.id as u64 % 5))).await;
                tx.execute(
                    &Statement::new(
                        "INSERT INTO runs (job, started, ended) VALUES ($1, $2, clock_timestamp())",
                    )
                    .bind(job.id)
                    .bind(started),
                )
                .await?;
                Ok(Outcome::Ack)
            })
        });
        Worker::transactional(port, "jobs", handler)
            .workers(8)
            .claim(claim)
            .poll_interval(Duration::from_millis(50))
            .retry(fast_retries(10))
            .run_until_idle()
    });
    futures_util::future::join_all(runs)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// The most runs that overlapped at any instant (an end before a start at the same instant).
async fn most_at_once(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT max(n)::int8 FROM ( \
               SELECT sum(d) OVER (ORDER BY at, d) AS n FROM ( \
                 SELECT started AS at, 1 AS d FROM runs UNION ALL SELECT ended, -1 FROM runs) e) s",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The queue `jobs` with `keys` keys of `per_key` jobs each, enqueued one key after another
/// (`{"customer": "c<k>"}`), the `runs` table, and `job_keys`: each job's key.
async fn setup_keys(db: &TestDb, keys: i64, per_key: i64) -> (PgDatabase, Queue) {
    let (pg, queue) = setup(db, 0).await;
    let payloads: Vec<serde_json::Value> = (0..keys)
        .flat_map(|key| {
            (0..per_key).map(move |n| serde_json::json!({"customer": format!("c{key}"), "n": n}))
        })
        .collect();
    for chunk in payloads.chunks(1000) {
        queue.enqueue_batch(&pg, chunk).await.unwrap();
    }
    db.client()
        .await
        .batch_execute(
            "CREATE TABLE job_keys AS SELECT id AS job, payload->>'customer' AS key FROM jobs",
        )
        .await
        .unwrap();
    (pg, queue)
}

/// The most runs of one key that overlapped at any instant.
async fn most_at_once_per_key(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT max(n)::int8 FROM ( \
           SELECT sum(d) OVER (PARTITION BY key ORDER BY at, d) AS n FROM ( \
             SELECT k.key, r.started AS at, 1 AS d FROM runs r JOIN job_keys k ON k.job = r.job \
             UNION ALL \
             SELECT k.key, r.ended, -1 FROM runs r JOIN job_keys k ON k.job = r.job) e) s",
    )
    .await
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client().await.query_one(sql, &[]).await.unwrap().get(0)
}

/// 32 slots in four workers on a queue limited to 3 at once: every job runs once, and no instant
/// has more than 3 running, with leases and with locks; the limit was reached (the test could
/// have seen it exceeded).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_concurrency_limit_holds_across_four_workers() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let jobs = 150;
        let (pg, queue) = setup(&db, jobs).await;
        queue.set_concurrency(&pg, Some(3)).await.unwrap();
        let stats = run_workers(
            &db,
            4,
            claim,
            10,
            "SELECT clock_timestamp() AS started WHERE $1::int8 IS NOT NULL",
        )
        .await;

        let acked: u64 = stats.iter().map(|s| s.acked).sum();
        assert_eq!(acked, jobs as u64, "{claim:?}: {stats:?}");
        assert_eq!(
            count(&db, "SELECT count(*) FROM runs").await,
            jobs,
            "{claim:?}"
        );
        let most = most_at_once(&db).await;
        assert!(
            most <= 3,
            "{claim:?}: {most} jobs ran at once under a limit of 3"
        );
        assert_eq!(most, 3, "{claim:?}: the limit was never reached");
        let limits = queue.limits(&pg).await.unwrap();
        assert_eq!((limits.concurrency, limits.running), (Some(3), Some(0)));
    }
}

/// 16 connections that take, record and settle one job after another as fast as they can, on a
/// queue limited to one at once: however their takes interleave, no two runs overlap, with leases
/// and with locks. A lease's take can lock the slot just after another take gave it, judging it by
/// a snapshot that does not show the new holder's lease; without the take's check that the slot
/// is the version its snapshot judged, 2 or 3 runs in 400 overlapped here. (A lock's slot is free
/// again once the lock's transaction commits, so locks cannot race that way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takes_racing_for_one_slot_never_both_get_it() {
    let _turn = WORKERS.lock().await;
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let (pg, queue) = setup(&db, 20_000).await;
        queue.set_concurrency(&pg, Some(1)).await.unwrap();
        let (take, in_transaction) = match claim {
            Claim::Lease => ("SELECT id, token FROM inbox_lease('jobs')", false),
            _ => ("SELECT id, token FROM inbox_lock('jobs')", true),
        };
        // Until 400 runs, or 15 seconds on a busy machine; each connection in a task of its own,
        // its statements prepared, so that takes come as fast as the server answers.
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        let mut loops = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let (client, runs) = (db.client().await, runs.clone());
            loops.spawn(async move {
                let take = client.prepare(take).await.unwrap();
                let record = client
                    .prepare(
                        "INSERT INTO runs (job, started, ended) \
                         SELECT $1, clock_timestamp(), clock_timestamp()",
                    )
                    .await
                    .unwrap();
                let end = client
                    .prepare("UPDATE runs SET ended = clock_timestamp() WHERE job = $1")
                    .await
                    .unwrap();
                let ack = client
                    .prepare("SELECT inbox_ack('jobs', $1, $2)")
                    .await
                    .unwrap();
                while runs.load(std::sync::atomic::Ordering::Relaxed) < 400
                    && tokio::time::Instant::now() < deadline
                {
                    if in_transaction {
                        client.batch_execute("BEGIN").await.unwrap();
                    }
                    if let Some(row) = client.query_opt(&take, &[]).await.unwrap() {
                        let (job, token): (i64, i64) = (row.get(0), row.get(1));
                        // Recorded while the job holds the slot: between its take and its ack.
                        client.execute(&record, &[&job]).await.unwrap();
                        client.execute(&end, &[&job]).await.unwrap();
                        let acked: bool = client
                            .query_one(&ack, &[&job, &token])
                            .await
                            .unwrap()
                            .get(0);
                        assert!(acked, "job {job}'s ack was fenced");
                        runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    if in_transaction {
                        client.batch_execute("COMMIT").await.unwrap();
                    }
                }
            });
        }
        while let Some(done) = loops.join_next().await {
            done.unwrap();
        }

        let runs = count(&db, "SELECT count(*) FROM runs").await;
        assert!(runs >= 100, "{claim:?}: only {runs} runs");
        let most = most_at_once(&db).await;
        assert_eq!(
            most, 1,
            "{claim:?}: {most} of {runs} runs at once under a limit of 1"
        );
    }
}

/// A rate limit of 10 starts per 400 ms over 60 jobs and 32 slots: no window of 400 ms holds
/// more than 10 leases (the jobs' leased_at, the server's clock), and the run took the five
/// windows it must.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rate_limit_holds_across_four_workers() {
    let db = TestDb::new().await;
    let jobs = 60;
    let (pg, queue) = setup(&db, jobs).await;
    queue
        .set_rate_limit(&pg, Some(RateLimit::new(10, Duration::from_millis(400))))
        .await
        .unwrap();
    run_workers(
        &db,
        4,
        Claim::Lease,
        1,
        "SELECT leased_at AS started FROM jobs WHERE id = $1",
    )
    .await;

    assert_eq!(count(&db, "SELECT count(*) FROM runs").await, jobs);
    let crowded = count(
        &db,
        "SELECT count(*) FROM runs a \
          WHERE (SELECT count(*) FROM runs b \
                  WHERE b.started >= a.started AND b.started < a.started + '400 ms'::interval) > 10",
    )
    .await;
    assert_eq!(crowded, 0, "a window of 400 ms held more than 10 starts");
    let span_ms = count(
        &db,
        "SELECT (extract(epoch FROM max(started) - min(started)) * 1000)::int8 FROM runs",
    )
    .await;
    assert!(
        span_ms >= 5 * 400,
        "60 starts at 10 per 400 ms in {span_ms} ms"
    );
    let limits = queue.limits(&pg).await.unwrap();
    assert_eq!(
        limits.rate,
        Some(RateLimit::new(10, Duration::from_millis(400)))
    );
}

/// 32 slots in four workers on 10 keys limited to 2 at once each: every job runs once, no key
/// ever has more than 2 running, with leases and with locks, and some key reached 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_concurrency_limit_per_key_holds_across_four_workers() {
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let (pg, queue) = setup_keys(&db, 10, 20).await;
        queue
            .set_concurrency_per_key(&pg, "customer", Some(2))
            .await
            .unwrap();
        let stats = run_workers(
            &db,
            4,
            claim,
            10,
            "SELECT clock_timestamp() AS started WHERE $1::int8 IS NOT NULL",
        )
        .await;

        let acked: u64 = stats.iter().map(|s| s.acked).sum();
        assert_eq!(acked, 200, "{claim:?}: {stats:?}");
        assert_eq!(count(&db, "SELECT count(*) FROM runs").await, 200);
        let most = most_at_once_per_key(&db).await;
        assert!(
            most <= 2,
            "{claim:?}: {most} jobs of one key ran at once under a limit of 2"
        );
        assert_eq!(most, 2, "{claim:?}: no key reached its limit");
        // Ten keys of two: the workers ran more than one key's worth at once.
        assert!(most_at_once(&db).await > 2, "{claim:?}");
        let limits = queue.limits(&pg).await.unwrap();
        assert_eq!(
            (
                limits.key_concurrency,
                limits.per_key.as_deref(),
                limits.keys_running,
                limits.most_running_per_key
            ),
            (Some(2), Some("customer"), Some(0), Some(0))
        );
    }
}

/// 100 keys of 30 jobs each, enqueued one key after another, limited to one at a time per key:
/// the keys take turns. Before a key's first lease, and between two of its leases, no other key
/// was leased more than a few times (a key enqueued last does not wait behind the backlogs
/// enqueued before it: a queue that took the oldest job first would lease the first keys' other
/// 29 jobs while it waits). The longest a key waited is printed; it depends on the machine's
/// speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_take_turns_so_that_no_key_waits_behind_the_others() {
    let db = TestDb::new().await;
    let (pg, queue) = setup_keys(&db, 100, 30).await;
    queue
        .set_concurrency_per_key(&pg, "customer", Some(1))
        .await
        .unwrap();
    run_workers(
        &db,
        4,
        Claim::Lease,
        1,
        "SELECT leased_at AS started FROM jobs WHERE id = $1",
    )
    .await;

    assert_eq!(count(&db, "SELECT count(*) FROM runs").await, 3_000);
    assert_eq!(most_at_once_per_key(&db).await, 1);
    // The leases and the ends of the runs, in the order of the server's clock: a key waits from
    // the end of its run (its slot free again) to its next lease.
    let events: Vec<(usize, bool, f64)> = db
        .client()
        .await
        .query(
            "SELECT substr(k.key, 2)::int4, e.lease, extract(epoch FROM e.at)::float8 \
               FROM (SELECT job, true AS lease, started AS at FROM runs \
                     UNION ALL SELECT job, false, ended FROM runs) e \
               JOIN job_keys k ON k.job = e.job ORDER BY e.at, e.lease",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get::<_, i32>(0) as usize, row.get(1), row.get(2)))
        .collect();
    // Each key's leases so far, and each key's copy of them from when it began to wait.
    let mut leased = [0u32; 100];
    let mut since = vec![[0u32; 100]; 100];
    let mut waiting_from = [events[0].2; 100];
    let (mut most_others, mut longest_wait) = (0, 0.0f64);
    for &(key, lease, at) in &events {
        if !lease {
            since[key] = leased;
            waiting_from[key] = at;
            continue;
        }
        let others = (0..100)
            .filter(|other| *other != key)
            .map(|other| leased[other] - since[key][other])
            .max()
            .unwrap_or(0);
        most_others = most_others.max(others);
        longest_wait = longest_wait.max(at - waiting_from[key]);
        leased[key] += 1;
    }
    println!(
        "keys in turn: at most {most_others} leases of another key while one waited; \
         the longest a key waited: {:.0} ms",
        longest_wait * 1000.0
    );
    // A key's slot frees when its ack commits, a moment after `ended`: a loaded machine that
    // pauses that worker lets the other keys run meanwhile, most of all near the end, when few
    // keys have jobs left. A bound of 3 held in every run but one of CI's on a loaded machine
    // (4); the oldest job first would reach 29.
    assert!(
        most_others <= 8,
        "a key waited while another was leased {most_others} times"
    );
}

/// A limit per key of one, lowered from two: the key's jobs running above it finish before the
/// key starts another; other keys go on; removing it lets the key run freely.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lowering_a_limit_per_key_starts_nothing_of_the_key_until_its_jobs_above_it_finish() {
    let db = TestDb::new().await;
    let (pg, queue) = setup_keys(&db, 2, 5).await;
    queue
        .set_concurrency_per_key(&pg, "customer", Some(2))
        .await
        .unwrap();
    let client = db.client().await;
    let running = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    assert_eq!(running.len(), 4, "two keys of two");

    queue
        .set_concurrency_per_key(&pg, "customer", Some(1))
        .await
        .unwrap();
    assert!(lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
        .await
        .is_empty());
    // One of key c0's two finishes: c0 still runs one, at its new limit.
    let c0: Vec<(i64, i64)> = {
        let ids: Vec<i64> = client
            .query("SELECT job FROM job_keys WHERE key = 'c0'", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        running
            .iter()
            .copied()
            .filter(|(id, _)| ids.contains(id))
            .collect()
    };
    assert_eq!(c0.len(), 2);
    assert!(settle(&client, "inbox_ack('jobs', $1, $2)", c0[0]).await);
    assert!(lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
        .await
        .is_empty());
    assert!(settle(&client, "inbox_ack('jobs', $1, $2)", c0[1]).await);
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        1
    );
    assert_eq!(
        queue.limits(&pg).await.unwrap().most_running_per_key,
        Some(2)
    );

    queue
        .set_concurrency_per_key(&pg, "customer", None)
        .await
        .unwrap();
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        5
    );
    assert_eq!(
        queue.limits(&pg).await.unwrap(),
        inbox_client::QueueLimits::default()
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM pg_indexes \
              WHERE schemaname = current_schema() AND tablename = 'jobs' \
                AND indexname LIKE 'inbox_key_%'"
        )
        .await,
        0,
        "the key index outlived its limit"
    );
}

async fn lease_ids(client: &tokio_postgres::Client, call: &str) -> Vec<(i64, i64)> {
    client
        .query(&format!("SELECT id, token FROM {call}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

async fn settle(client: &tokio_postgres::Client, call: &str, (id, token): (i64, i64)) -> bool {
    client
        .query_one(&format!("SELECT {call}"), &[&id, &token])
        .await
        .unwrap()
        .get(0)
}

/// A slot is given back by the settlement of its job or by its lease's expiry, and by nothing
/// else: a lease that has expired cannot be extended, so it cannot take its slot back from the
/// job that has it now; a lock holds its slot until its transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_comes_back_by_settlement_or_expiry() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, 10).await;
    queue.set_concurrency(&pg, Some(2)).await.unwrap();
    let (holder, other) = (db.client().await, db.client().await);

    let first = lease_ids(&holder, "inbox_lease('jobs', 5, '1 hour')").await;
    assert_eq!(first.len(), 2, "a lease of 5 under a limit of 2");
    assert!(lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')")
        .await
        .is_empty());

    // A settlement gives its slot back.
    assert!(settle(&holder, "inbox_ack('jobs', $1, $2)", first[0]).await);
    let second = lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')").await;
    assert_eq!(second.len(), 1);

    // An expiry does: the holder shortens its lease and lets it run out.
    assert!(
        settle(
            &holder,
            "inbox_extend('jobs', $1, $2, '50 milliseconds')",
            first[1]
        )
        .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !settle(&holder, "inbox_extend('jobs', $1, $2, '1 hour')", first[1]).await,
        "an expired lease was extended"
    );
    let third = lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')").await;
    assert_eq!(third.len(), 1, "the expired lease's slot did not come back");
    assert!(lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')")
        .await
        .is_empty());
    assert_eq!(queue.limits(&pg).await.unwrap().running, Some(2));

    // A lock holds its slot until its transaction ends.
    for held in [second[0], third[0]] {
        assert!(settle(&other, "inbox_ack('jobs', $1, $2)", held).await);
    }
    let mut locker = db.client().await;
    let tx = locker.transaction().await.unwrap();
    let locked = tx
        .query("SELECT id FROM inbox_lock('jobs', 5)", &[])
        .await
        .unwrap();
    assert_eq!(locked.len(), 2);
    assert!(lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')")
        .await
        .is_empty());
    tx.rollback().await.unwrap();
    assert_eq!(
        lease_ids(&other, "inbox_lease('jobs', 5, '1 hour')")
            .await
            .len(),
        2
    );
}

/// Lowering a limit lets the jobs running above it finish and starts nothing until they have;
/// removing it lets every due job be taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lowering_a_limit_starts_nothing_until_the_jobs_above_it_finish() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, 10).await;
    queue.set_concurrency(&pg, Some(3)).await.unwrap();
    let client = db.client().await;
    let running = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    assert_eq!(running.len(), 3);

    queue.set_concurrency(&pg, Some(1)).await.unwrap();
    for job in &running[..2] {
        assert!(settle(&client, "inbox_ack('jobs', $1, $2)", *job).await);
        assert!(
            lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
                .await
                .is_empty(),
            "a job started while more than the new limit ran"
        );
    }
    assert!(settle(&client, "inbox_ack('jobs', $1, $2)", running[2]).await);
    let next = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    assert_eq!(next.len(), 1);

    queue.set_concurrency(&pg, None).await.unwrap();
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        6
    );
    assert_eq!(
        queue.limits(&pg).await.unwrap(),
        inbox_client::QueueLimits::default()
    );
}

/// A limit set while jobs of the queue are running counts them: with one job leased before the
/// limit, a limit of 3 lets 2 more start, not 3; a limit of 2 set while 5 run starts nothing
/// until they are down to fewer than 2; a limit of 1 per key set while one job of key `a` runs
/// starts no second `a` (and one `b`) until that job settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_set_while_jobs_run_counts_them() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, 10).await;
    let client = db.client().await;
    let early = lease_ids(&client, "inbox_lease('jobs', 1, '1 hour')").await;
    assert_eq!(early.len(), 1);

    queue.set_concurrency(&pg, Some(3)).await.unwrap();
    assert_eq!(queue.limits(&pg).await.unwrap().running, Some(1));
    let more = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    assert_eq!(
        more.len(),
        2,
        "a job leased before the limit was not counted"
    );
    assert!(settle(&client, "inbox_ack('jobs', $1, $2)", early[0]).await);
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        1,
        "the early job's settlement gave back its slot"
    );

    // Five running (3 under the limit, 2 leased after it was removed), then a limit of 2: the
    // 3 over it must finish before anything starts.
    queue.set_concurrency(&pg, None).await.unwrap();
    let extra = lease_ids(&client, "inbox_lease('jobs', 2, '1 hour')").await;
    assert_eq!(extra.len(), 2);
    assert!(more.iter().all(|job| !extra.contains(job)));
    queue.set_concurrency(&pg, Some(2)).await.unwrap();
    assert_eq!(queue.limits(&pg).await.unwrap().running, Some(5));
    // As they settle, one by one, nothing starts while 2 or more run (the slots above the
    // limit retire once free, as when a limit is lowered); once all have, 2 run.
    // The jobs running, with the tokens of their leases.
    let held = lease_ids(
        &client,
        "(SELECT id, attempt::int8 AS token FROM jobs WHERE leased_at IS NOT NULL \
            AND locked_until > now() AND locked_until < 'infinity') AS held ORDER BY id",
    )
    .await;
    let running_now = "SELECT count(*) FROM jobs WHERE leased_at IS NOT NULL \
                         AND locked_until > now() AND locked_until < 'infinity'";
    assert_eq!(held.len(), 5);
    for job in &held {
        let before = count(&db, running_now).await;
        let started = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
        assert!(
            started.is_empty() || before + (started.len() as i64) <= 2,
            "{} started while {before} ran under a limit of 2",
            started.len()
        );
        assert!(settle(&client, "inbox_ack('jobs', $1, $2)", *job).await);
    }
    lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    assert_eq!(count(&db, running_now).await, 2);

    // Per key: one `a` running before a limit of 1 per customer.
    let db = TestDb::new().await;
    let (pg, queue) = setup_keys(&db, 0, 0).await;
    let payloads: Vec<serde_json::Value> = ["a", "a", "b"]
        .iter()
        .map(|customer| serde_json::json!({ "customer": customer }))
        .collect();
    queue.enqueue_batch(&pg, &payloads).await.unwrap();
    let client = db.client().await;
    let first_a = lease_ids(&client, "inbox_lease('jobs', 1, '1 hour')").await;
    assert_eq!(first_a.len(), 1);
    queue
        .set_concurrency_per_key(&pg, "customer", Some(1))
        .await
        .unwrap();
    let limits = queue.limits(&pg).await.unwrap();
    assert_eq!(limits.keys_running, Some(1));
    let next = lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')").await;
    let customers: Vec<String> = client
        .query(
            "SELECT payload->>'customer' FROM jobs WHERE id = ANY($1) ORDER BY 1",
            &[&next.iter().map(|(id, _)| *id).collect::<Vec<i64>>()],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(customers, ["b"], "a second `a` started beside the first");
    assert!(settle(&client, "inbox_ack('jobs', $1, $2)", first_a[0]).await);
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        1,
        "the second `a` starts once the first has settled"
    );
}

/// Limits out of range and tables that cannot have them are refused with their SQLSTATE, and
/// change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_limits_are_refused() {
    let db = TestDb::new().await;
    let (pg, queue) = setup(&db, 1).await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE bare (id bigint, attempt int, locked_until timestamptz, payload jsonb); \
             CREATE TABLE bytes (id bigint, attempt int, locked_until timestamptz, \
                                 leased_at timestamptz, payload bytea)",
        )
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT inbox_set_concurrency('jobs', 0)", "22023"),
            ("SELECT inbox_set_concurrency('jobs', 10001)", "22023"),
            ("SELECT inbox_set_concurrency(NULL, 1)", "22004"),
            ("SELECT inbox_set_concurrency('bare', 1)", "42703"),
            ("SELECT inbox_set_concurrency('runs', 1)", "42703"),
            (
                "SELECT inbox_set_rate_limit('jobs', 0, '1 second')",
                "22023",
            ),
            (
                "SELECT inbox_set_rate_limit('jobs', 5, '0 seconds')",
                "22023",
            ),
            ("SELECT inbox_set_rate_limit('jobs', 5, '2 days')", "22023"),
            ("SELECT inbox_set_rate_limit('jobs', 5, NULL)", "22023"),
            (
                "SELECT inbox_set_rate_limit('bare', 5, '1 second')",
                "42703",
            ),
            (
                "SELECT inbox_set_concurrency('jobs', 0, per_key => 'customer')",
                "22023",
            ),
            (
                "SELECT inbox_set_concurrency('jobs', 1, per_key => '')",
                "22023",
            ),
            (
                "SELECT inbox_set_concurrency('bytes', 1, per_key => 'customer')",
                "42804",
            ),
            (
                "SELECT inbox_set_concurrency('bare', 1, per_key => 'customer')",
                "42703",
            ),
        ],
    )
    .await;
    assert_eq!(
        queue.limits(&pg).await.unwrap(),
        inbox_client::QueueLimits::default()
    );
    assert_eq!(
        lease_ids(&client, "inbox_lease('jobs', 10, '1 hour')")
            .await
            .len(),
        1
    );
}

/// The limits' extremes are taken from: the largest rate over the shortest window (10,000 starts
/// a microsecond, whose turns since 1970 a bigint cannot count) and the largest concurrency
/// limit lease every job, with leases and with locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_extreme_limits_are_taken_from() {
    let db = TestDb::new().await;
    let (_pg, _queue) = setup(&db, 6).await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_set_rate_limit('jobs', 10000, interval '1 microsecond'); \
             SELECT inbox_set_concurrency('jobs', 10000)",
        )
        .await
        .unwrap();
    assert_eq!(lease_ids(&client, "inbox_lease('jobs', 3)").await.len(), 3);
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(lease_ids(&client, "inbox_lock('jobs', 3)").await.len(), 3);
    client.batch_execute("COMMIT").await.unwrap();
}

/// The idle key slots' cleanup, which about one lease in fifty runs, made to run by the session's
/// random seed: it deletes the free slots last given more than 10 minutes ago, and keeps a busy
/// one however old, the recent ones, and those of the key the lease serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_now_and_then_deletes_the_key_slots_idle_for_ten_minutes() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_set_concurrency('jobs', 1, per_key => 'customer')",
        )
        .await
        .unwrap();
    let enqueue = |key: &'static str| {
        let client = &client;
        async move {
            client
                .execute(
                    "SELECT inbox_enqueue('jobs', jsonb_build_object('customer', $1::text))",
                    &[&key],
                )
                .await
                .unwrap();
        }
    };
    let lease = "inbox_lease('jobs', 1, '10 minutes')";
    // Keys old and recent run and finish; key busy stays leased.
    for key in ["old", "recent", "busy"] {
        enqueue(key).await;
        let taken = lease_ids(&client, lease).await;
        assert_eq!(taken.len(), 1, "{key}");
        if key != "busy" {
            assert!(settle(&client, "inbox_ack('jobs', $1, $2)", taken[0]).await);
        }
    }
    client
        .execute(
            "UPDATE inbox_queue_slots SET started_at = started_at - interval '11 minutes' \
              WHERE queue = 'jobs'::regclass AND kind = 'k' AND key IN ('old', 'busy')",
            &[],
        )
        .await
        .unwrap();
    // A seed whose first random() runs the cleanup (random() < 0.02).
    let mut seed = None;
    for n in 0..2000 {
        let s = f64::from(n) / 2000.0;
        let first: f64 = client
            .query_one("SELECT setseed($1), random()", &[&s])
            .await
            .unwrap()
            .get(1);
        if first < 0.02 {
            seed = Some(s);
            break;
        }
    }
    let seed = seed.expect("a seed among 2000");
    enqueue("new").await;
    client
        .execute("SELECT setseed($1)", &[&seed])
        .await
        .unwrap();
    assert_eq!(
        lease_ids(&client, lease).await.len(),
        1,
        "key new is served"
    );
    let left: Vec<String> = client
        .query(
            "SELECT key FROM inbox_queue_slots WHERE queue = 'jobs'::regclass AND kind = 'k' \
              ORDER BY key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(left, ["busy", "new", "recent"]);
}

/// A limited lease prepares its statements for the session (`inbox__prepared`): after a
/// pooler's reset (`DEALLOCATE ALL`, `DISCARD ALL`) it prepares them again and goes on, under a
/// concurrency limit and a limit per key alike, and never hands out more than the limit.
#[tokio::test]
async fn a_limited_lease_goes_on_after_the_sessions_prepared_statements_are_dropped() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('capped'), inbox_create_queue('keyed'); \
             SELECT inbox_set_concurrency('capped', 1); \
             SELECT inbox_set_concurrency('keyed', 1, per_key => 'customer')",
        )
        .await
        .unwrap();
    for reset in ["nothing", "DEALLOCATE ALL", "DISCARD ALL"] {
        if reset != "nothing" {
            client.batch_execute(reset).await.unwrap();
        }
        for queue in ["capped", "keyed"] {
            client
                .batch_execute(&format!(
                    "SELECT inbox_enqueue('{queue}', '{{\"customer\": \"a\"}}'), \
                            inbox_enqueue('{queue}', '{{\"customer\": \"a\"}}')"
                ))
                .await
                .unwrap();
            for round in 0..2 {
                let leased = client
                    .query(
                        &format!("SELECT id, token FROM inbox_lease('{queue}', 10, '30 seconds')"),
                        &[],
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{queue} after {reset}: {e}"));
                assert_eq!(
                    leased.len(),
                    1,
                    "{queue} after {reset}, round {round}: the limit of 1"
                );
                let (id, token): (i64, i64) = (leased[0].get(0), leased[0].get(1));
                client
                    .batch_execute(&format!("SELECT inbox_ack('{queue}', {id}, {token})"))
                    .await
                    .unwrap();
            }
        }
    }
    // The statements were prepared again after the last reset.
    let prepared: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'inbox\\_%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        prepared > 0,
        "no statement of the limited leases is prepared"
    );
}
