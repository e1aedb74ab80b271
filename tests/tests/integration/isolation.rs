//! Delivery transactions at REPEATABLE READ and SERIALIZABLE, and deliveries run again after a
//! serialization failure or a deadlock, over real connections: handlers that really conflict
//! commit each effect once, spend no attempt on a conflict, and after their reruns are spent
//! retry like any error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::support::{count_run, effects, fast_retries, queue_with_effects};
use inbox_client::worker::{transactional, Claim, Isolation, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use inbox_tests::{PgBouncer, TestDb};
use tokio::sync::Barrier;

/// 8 slots whose handlers all update one of two counter rows, at REPEATABLE READ and at
/// SERIALIZABLE, directly and (SERIALIZABLE) through pgbouncer in transaction mode: the
/// conflicts are real (the worker reran deliveries), yet every job's effect is there once,
/// written at attempt 1, and the counters add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conflicting_handlers_commit_each_effect_once_without_spending_an_attempt() {
    for (level, pooled) in [
        (Isolation::RepeatableRead, false),
        (Isolation::Serializable, false),
        (Isolation::Serializable, true),
    ] {
        let db = TestDb::new().await;
        let (pg, queue) = queue_with_effects(
            &db,
            10,
            "CREATE TABLE counters (bucket int PRIMARY KEY, n int NOT NULL); \
             INSERT INTO counters VALUES (0, 0), (1, 0)",
        )
        .await;
        let jobs = 200_i64;
        let payloads: Vec<i64> = (0..jobs).map(|n| n % 2).collect();
        queue.enqueue_batch(&pg, &payloads).await.unwrap();

        let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
            Box::pin(async move {
                // A read of both rows and a write of one: at SERIALIZABLE a write skew as well
                // as a write conflict.
                tx.query(&Statement::new("SELECT sum(n) FROM counters"))
                    .await?;
                tx.execute(
                    &Statement::new("UPDATE counters SET n = n + 1 WHERE bucket = $1")
                        .bind(job.payload as i32),
                )
                .await?;
                tx.execute(
                    &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                        .bind(job.id)
                        .bind(job.attempt),
                )
                .await?;
                Ok(Outcome::Ack)
            })
        });
        let bouncer = pooled.then(|| PgBouncer::start(&db, 10));
        let port = match &bouncer {
            Some(bouncer) => bouncer.port_polling(10),
            None => pg.clone(),
        };
        let stats = Worker::transactional(port, "jobs", handler)
            .workers(8)
            .isolation(level)
            .conflict_reruns(1_000)
            .retry(fast_retries(10))
            .run_until_idle()
            .await
            .unwrap();

        let effects = effects(&db).await;
        assert_eq!(
            effects.len() as i64,
            jobs,
            "{level:?} (pooled: {pooled}): {effects:?}"
        );
        let mut seen: Vec<i64> = effects.iter().map(|(job, _)| *job).collect();
        seen.dedup();
        assert_eq!(
            seen.len() as i64,
            jobs,
            "{level:?} (pooled: {pooled}): an effect twice"
        );
        assert!(
            effects.iter().all(|(_, attempt)| *attempt == 1),
            "{level:?} (pooled: {pooled}): an attempt spent on a conflict: {effects:?}"
        );
        let total: i64 = db
            .client()
            .await
            .query_one("SELECT sum(n)::int8 FROM counters", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(total, jobs, "{level:?} (pooled: {pooled})");
        assert_eq!(
            stats.acked as i64, jobs,
            "{level:?} (pooled: {pooled}): {stats:?}"
        );
        assert_eq!(
            (stats.retried, stats.failed, stats.dead),
            (0, 0, 0),
            "{level:?} (pooled: {pooled}): {stats:?}"
        );
        assert!(
            stats.reran > 0,
            "{level:?} (pooled: {pooled}): the handlers never conflicted, so the test proved nothing: {stats:?}"
        );
    }
}

/// Two jobs that lock two rows in opposite orders, at READ COMMITTED, held together by a
/// barrier so that they deadlock: the one the server aborts (`40P01`) runs again at once (its
/// reruns here ample), in a locked group inside its savepoint and in a leased group by a replay;
/// both effects commit once, at attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlocked_delivery_runs_again_without_spending_an_attempt() {
    for claim in [Claim::Lock, Claim::Lease] {
        let db = TestDb::new().await;
        let (pg, queue) = queue_with_effects(
            &db,
            4,
            "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL); \
             INSERT INTO accounts VALUES (1, 0), (2, 0)",
        )
        .await;
        // Job 1 moves from account 1 to 2, job 2 from 2 to 1.
        queue.enqueue_batch(&pg, &[[1, 2], [2, 1]]).await.unwrap();

        let barrier = Arc::new(Barrier::new(2));
        let first_runs = Arc::new(Mutex::new(HashMap::<i64, u32>::new()));
        let handler = {
            let (barrier, first_runs) = (barrier.clone(), first_runs.clone());
            transactional(move |job: Job<[i32; 2]>, tx: &dyn Database| {
                let (barrier, first_runs) = (barrier.clone(), first_runs.clone());
                Box::pin(async move {
                    let [from, to] = job.payload;
                    tx.execute(
                        &Statement::new("UPDATE accounts SET balance = balance - 1 WHERE id = $1")
                            .bind(from),
                    )
                    .await?;
                    if count_run(&first_runs, job.id) == 1 {
                        // Both hold their first row before either asks for its second.
                        barrier.wait().await;
                    }
                    tx.execute(
                        &Statement::new("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                            .bind(to),
                    )
                    .await?;
                    tx.execute(
                        &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                            .bind(job.id)
                            .bind(job.attempt),
                    )
                    .await?;
                    Ok(Outcome::Ack)
                })
            })
        };
        let stats = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(2)
            .group_size(1)
            .claim(claim)
            .conflict_reruns(100)
            .retry(fast_retries(10))
            .run_until_idle()
            .await
            .unwrap();

        let effects = effects(&db).await;
        let ids: Vec<i64> = effects.iter().map(|(job, _)| *job).collect();
        assert_eq!(ids.len(), 2, "{claim:?}: {effects:?}");
        assert_ne!(ids[0], ids[1], "{claim:?}: {effects:?}");
        assert!(
            effects.iter().all(|(_, attempt)| *attempt == 1),
            "{claim:?}: {effects:?}"
        );
        let balances: Vec<i32> = db
            .client()
            .await
            .query("SELECT balance FROM accounts ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(balances, vec![0, 0], "{claim:?}");
        // The victim's rerun may take its first row again before the survivor is woken, and
        // deadlock once more: at least one rerun.
        assert_eq!(
            (stats.acked, stats.retried, stats.failed),
            (2, 0, 0),
            "{claim:?}: {stats:?}"
        );
        assert!(stats.reran >= 1, "{claim:?}: no deadlock: {stats:?}");
    }
}

/// A delivery runs again at most `conflict_reruns` times: a job whose handler raises `40001`
/// twice is acked at attempt 1 after two reruns; one that raises it three times (one more than
/// its reruns) is retried like any failure and acked at attempt 2. A third job's handler returns
/// the conflict wrapped in an error of its own, which is recognised by its source.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reruns_are_bounded_then_the_conflict_is_a_retry() {
    let db = TestDb::new().await;
    let (pg, queue) = queue_with_effects(&db, 4, "").await;
    let conflicts = [2_u32, 3, 1];
    let ids = queue.enqueue_batch(&pg, &conflicts).await.unwrap();
    let runs = Arc::new(Mutex::new(HashMap::<i64, u32>::new()));
    let handler = {
        let runs = runs.clone();
        transactional(move |job: Job<u32>, tx: &dyn Database| {
            let runs = runs.clone();
            Box::pin(async move {
                let run = count_run(&runs, job.id);
                tx.execute(
                    &Statement::new("INSERT INTO effects VALUES ($1, $2)")
                        .bind(job.id)
                        .bind(job.attempt),
                )
                .await?;
                if run <= job.payload {
                    let raised = tx
                        .execute(&Statement::new(
                            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001', \
                             MESSAGE = 'a conflict, raised'; END $$",
                        ))
                        .await;
                    if job.payload == 1 {
                        raised.map_err(Wrapped)?;
                    } else {
                        raised?;
                    }
                }
                Ok(Outcome::Ack)
            })
        })
    };
    let stats = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(1)
        .group_size(1)
        .conflict_reruns(2)
        .retry(fast_retries(10))
        .run_until_idle()
        .await
        .unwrap();

    // The effects of the runs that conflicted were rolled back.
    assert_eq!(
        effects(&db).await,
        vec![(ids[0], 1), (ids[1], 2), (ids[2], 1)]
    );
    assert_eq!(runs.lock().unwrap().values().sum::<u32>(), 3 + 4 + 2);
    assert_eq!(
        (stats.acked, stats.reran, stats.retried, stats.failed),
        (3, 5, 1, 1),
        "{stats:?}"
    );
    let left: i64 = db
        .client()
        .await
        .query_one("SELECT count(*)::int8 FROM jobs", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

/// A handler's own error type around a database error, as error-handling crates make them.
#[derive(Debug)]
struct Wrapped(inbox_client::DbError);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("charging the card")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// A locked delivery cannot run above READ COMMITTED: the worker refuses to start.
#[tokio::test]
#[should_panic(expected = "Claim::Lock runs at READ COMMITTED only")]
async fn a_locking_worker_above_read_committed_is_refused() {
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(2), db.config());
    let handler =
        transactional(|_job: Job<i64>, _tx: &dyn Database| Box::pin(async { Ok(Outcome::Ack) }));
    let _ = Worker::transactional(pg, "jobs", handler)
        .claim(Claim::Lock)
        .isolation(Isolation::Serializable)
        .start();
}
