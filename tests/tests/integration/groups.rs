//! Ordered groups over real connections: the jobs of a group run one at a time in enqueue order
//! under concurrent workers with retries; a stuck group blocks only itself and costs other
//! leases nothing; a dead head unblocks its group; enqueues racing the head's settlement (under
//! READ COMMITTED and REPEATABLE READ) never leave a job stuck nor start a second head.

use crate::support::explain;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, Worker};
use inbox_client::{BatchOptions, Database, EnqueueOptions, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;
use serde::{Deserialize, Serialize};
use tokio_postgres::Client;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Step {
    group: u32,
    seq: u32,
}

async fn lease_ids(client: &Client, max: i32) -> Vec<i64> {
    client
        .query("SELECT id FROM inbox_lease('jobs', $1)", &[&max])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn one<T: for<'a> tokio_postgres::types::FromSql<'a>>(client: &Client, sql: &str) -> T {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// 100 groups of 100 jobs, enqueued interleaved, 16 concurrent workers whose handlers retry a
/// fifth of their deliveries at random: within each group the committed effects are in enqueue
/// order, one per job, and no two deliveries of a group ever overlap.
#[tokio::test]
async fn groups_run_in_enqueue_order_one_at_a_time_under_workers_with_retries() {
    run_groups(Claim::Lease, 1, 100, 100).await;
}

/// The same with locked deliveries committed four at a time (each settlement promotes its
/// group's next job inside the shared transaction).
#[tokio::test]
async fn groups_keep_their_order_with_locked_deliveries_committed_together() {
    run_groups(Claim::Lock, 4, 40, 50).await;
}

async fn run_groups(claim: Claim, group_size: usize, groups: u32, per_group: u32) {
    let db = TestDb::new().await;
    // Each of the 16 workers holds a connection while it waits for a job; run_until_idle needs one
    // more to see the queue idle.
    let pg = PgDatabase::from_pool_and_config(db.pool(20), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    pg.execute(&Statement::new(
        "CREATE TABLE effects (ord bigserial, grp int NOT NULL, seq int NOT NULL)",
    ))
    .await
    .unwrap();
    // Round-robin over the groups, in batches of 1,000, so that the groups' jobs interleave.
    let steps: Vec<Step> = (0..per_group)
        .flat_map(|seq| (0..groups).map(move |group| Step { group, seq }))
        .collect();
    for chunk in steps.chunks(1000) {
        let options = BatchOptions {
            group_keys: Some(
                chunk
                    .iter()
                    .map(|step| Some(format!("g{}", step.group)))
                    .collect(),
            ),
            ..BatchOptions::default()
        };
        queue
            .enqueue_batch_with(&pg, chunk, &options)
            .await
            .unwrap();
    }
    let running: Arc<Mutex<HashSet<u32>>> = Arc::default();
    let overlaps = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let running = running.clone();
        let overlaps = overlaps.clone();
        transactional(move |job: Job<Step>, tx: &dyn Database| {
            let running = running.clone();
            let overlaps = overlaps.clone();
            Box::pin(async move {
                let step = job.payload;
                if !running.lock().unwrap().insert(step.group) {
                    overlaps.lock().unwrap().push(step.clone());
                }
                let result = async {
                    tx.execute(
                        &Statement::new("INSERT INTO effects (grp, seq) VALUES ($1, $2)")
                            .bind(step.group as i32)
                            .bind(step.seq as i32),
                    )
                    .await?;
                    if fastrand::u8(0..5) == 0 {
                        Ok(Outcome::retry())
                    } else {
                        Ok(Outcome::ack())
                    }
                }
                .await;
                running.lock().unwrap().remove(&step.group);
                result
            })
        })
    };
    let worker = Worker::transactional(pg.clone(), "jobs", handler)
        .workers(16)
        .claim(claim)
        .group_size(group_size)
        .retry(RetryPolicy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(5),
            max_attempts: None,
            jitter: 0.5,
        });
    let Ok(stats) = tokio::time::timeout(Duration::from_secs(300), worker.run_until_idle()).await
    else {
        let client = db.client().await;
        let rows = client
            .query(
                "SELECT group_key, count(*) FILTER (WHERE locked_until < 'infinity'), count(*), \
                        min(locked_until)::text, max(attempt) \
                   FROM jobs GROUP BY 1 ORDER BY 2, 1 LIMIT 10",
                &[],
            )
            .await
            .unwrap();
        for row in rows {
            println!(
                "{:?} heads {} jobs {} {:?} {}",
                row.get::<_, Option<String>>(0),
                row.get::<_, i64>(1),
                row.get::<_, i64>(2),
                row.get::<_, Option<String>>(3),
                row.get::<_, i32>(4)
            );
        }
        let stats = client
            .query_one(
                "SELECT ready, delayed, leased, dead FROM inbox_stats('jobs')",
                &[],
            )
            .await
            .unwrap();
        println!(
            "stats {} {} {} {}",
            stats.get::<_, i64>(0),
            stats.get::<_, i64>(1),
            stats.get::<_, i64>(2),
            stats.get::<_, i64>(3)
        );
        for row in client
            .query(
                "SELECT state, wait_event_type, wait_event, left(query, 120) FROM pg_stat_activity \
                  WHERE application_name = current_setting('application_name') AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
        {
            println!(
                "{:?} {:?} {:?} {:?}",
                row.get::<_, Option<String>>(0),
                row.get::<_, Option<String>>(1),
                row.get::<_, Option<String>>(2),
                row.get::<_, Option<String>>(3)
            );
        }
        panic!("the workers did not empty the queue in time");
    };
    let stats = stats.unwrap();
    println!("{stats:?}");
    assert!(
        overlaps.lock().unwrap().is_empty(),
        "deliveries of one group overlapped: {:?}",
        overlaps.lock().unwrap()
    );
    let client = db.client().await;
    let mut by_group: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for row in client
        .query("SELECT grp, seq FROM effects ORDER BY ord", &[])
        .await
        .unwrap()
    {
        by_group.entry(row.get(0)).or_default().push(row.get(1));
    }
    assert_eq!(by_group.len(), groups as usize);
    let in_order: Vec<i32> = (0..per_group as i32).collect();
    for (group, seqs) in &by_group {
        assert_eq!(seqs, &in_order, "group {group} ran out of order or twice");
    }
    assert_eq!(one::<i64>(&client, "SELECT count(*) FROM jobs").await, 0);
}

/// A group whose head is held by a worker that never finishes, with 100,000 jobs waiting behind
/// it: every other job is leased (none of the stuck group's), and the lease statement touches as
/// few buffers as on an empty queue, because waiting jobs are not in the lease index.
#[tokio::test]
async fn a_stuck_group_blocks_only_itself_and_costs_other_leases_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', '\"stuck head\"', group_key => 'stuck'); \
             SELECT count(*) FROM inbox_lease('jobs', 1, '1 hour'); \
             SELECT count(*) FROM inbox_enqueue_batch('jobs', \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series(1, 100000) g), \
                 group_keys => ARRAY(SELECT 'stuck' FROM generate_series(1, 100000)));",
        )
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE jobs").await.unwrap();
    let mut session = explain::Explaining::connect(&db).await;
    // Warm the plans, then measure a lease that finds nothing to take.
    session
        .client
        .batch_execute("SELECT * FROM inbox_lease('jobs', 10)")
        .await
        .unwrap();
    let idle = session
        .plans_of("SELECT * FROM inbox_lease('jobs', 10)", explain::TAKE_SCAN)
        .await;
    let idle_buffers = explain::buffers(&idle[0]["Plan"]);
    println!(
        "lease behind a stuck group of 100,001 jobs: {}",
        explain::assert_index_scan(&idle[0], "jobs", "jobs_expr_locked_until_id_idx", 10, 20)
    );
    // Other groups and ungrouped jobs flow.
    client
        .batch_execute(
            "SELECT count(*) FROM inbox_enqueue_batch('jobs', \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series(1, 200) g), \
                 group_keys => ARRAY(SELECT CASE WHEN g % 2 = 0 THEN 'other' || (g % 10) END \
                                       FROM generate_series(1, 200) g))",
        )
        .await
        .unwrap();
    let mut done = 0;
    loop {
        let ids = lease_ids(&client, 50).await;
        if ids.is_empty() {
            break;
        }
        let stuck: i64 = client
            .query_one(
                "SELECT count(*) FROM jobs WHERE id = ANY($1) AND group_key = 'stuck'",
                &[&ids],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(stuck, 0, "a job behind the stuck head was leased");
        let tokens = vec![1i64; ids.len()];
        let acked: i64 = client
            .query_one("SELECT inbox_ack_batch('jobs', $1, $2)", &[&ids, &tokens])
            .await
            .unwrap()
            .get(0);
        assert_eq!(acked, ids.len() as i64);
        done += ids.len();
    }
    assert_eq!(done, 200, "every other job ran");
    let stats = client
        .query_one(
            "SELECT ready, delayed, leased, dead FROM inbox_stats('jobs')",
            &[],
        )
        .await
        .unwrap();
    let stats: (i64, i64, i64, i64) = (stats.get(0), stats.get(1), stats.get(2), stats.get(3));
    assert_eq!(
        stats,
        (0, 100_000, 1, 0),
        "the waiting jobs count as delayed"
    );
    assert!(idle_buffers <= 20);
}

/// A head dead-lettered (by `inbox_retry` past `max_attempts`) hands the group on; requeued, it
/// rejoins its group behind the head then running, ahead of the later jobs.
#[tokio::test]
async fn a_dead_head_unblocks_its_group_and_rejoins_it_when_requeued() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', '1', group_key => 'g'); \
             SELECT inbox_enqueue('jobs', '2', group_key => 'g'); \
             SELECT inbox_enqueue('jobs', '3', group_key => 'g');",
        )
        .await
        .unwrap();
    assert_eq!(lease_ids(&client, 10).await, [1]);
    assert!(
        one::<bool>(&client, "SELECT inbox_retry('jobs', 1, 1, '0', 'boom', 1)").await,
        "dead-lettered"
    );
    assert_eq!(
        lease_ids(&client, 10).await,
        [2],
        "the next job is the head"
    );
    // A retried head keeps its place: nothing else of the group runs meanwhile.
    assert!(one::<bool>(&client, "SELECT inbox_retry('jobs', 2, 1, '0', 'again')").await);
    assert_eq!(lease_ids(&client, 10).await, [2]);
    assert!(one::<bool>(&client, "SELECT inbox_requeue('jobs', 1)").await);
    assert_eq!(
        lease_ids(&client, 10).await,
        Vec::<i64>::new(),
        "2 is still the head"
    );
    assert!(one::<bool>(&client, "SELECT inbox_ack('jobs', 2, 2)").await);
    assert_eq!(
        lease_ids(&client, 10).await,
        [1],
        "the requeued job runs next"
    );
    assert!(one::<bool>(&client, "SELECT inbox_ack('jobs', 1, 1)").await);
    assert_eq!(lease_ids(&client, 10).await, [3]);
    assert!(one::<bool>(&client, "SELECT inbox_ack('jobs', 3, 1)").await);
    assert_eq!(one::<i64>(&client, "SELECT count(*) FROM jobs").await, 0);
}

/// A job enqueued with a due time in the future into a busy group keeps that due time when it
/// becomes the head.
#[tokio::test]
async fn a_promoted_job_keeps_its_due_time() {
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(2), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    let group = EnqueueOptions::default().group_key("g");
    queue.enqueue_with(&pg, &1, &group).await.unwrap();
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    queue
        .enqueue_with(&pg, &2, &group.clone().run_at(later))
        .await
        .unwrap();
    let client = db.client().await;
    assert_eq!(lease_ids(&client, 10).await, [1]);
    assert!(one::<bool>(&client, "SELECT inbox_ack('jobs', 1, 1)").await);
    assert_eq!(lease_ids(&client, 10).await, Vec::<i64>::new());
    let due: bool = one(
        &client,
        "SELECT locked_until = run_at AND run_at > now() + interval '59 minutes' FROM jobs WHERE id = 2",
    )
    .await;
    assert!(due, "the promoted job is due at its run_at");
}

/// Many rounds of an enqueue into a group racing the ack of its head, on two connections: after
/// both commit, the new job is the group's only head and can be leased.
#[tokio::test]
async fn enqueues_racing_the_heads_ack_never_leave_a_job_stuck() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let acker = db.client().await;
    let enqueuer = db.client().await;
    // The SQL-only build refuses groups outside READ COMMITTED (a_late_snapshot_enqueuer_...).
    let sql_only = db.sql_only().await;
    for round in 0..200 {
        let group = format!("g{round}");
        let head: i64 = setup
            .query_one(
                "SELECT inbox_enqueue('jobs', '0', group_key => $1)",
                &[&group],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(lease_ids(&setup, 10).await, [head]);
        let ack = async {
            acker
                .batch_execute(&format!(
                    "BEGIN; SELECT inbox_ack('jobs', {head}, 1); COMMIT"
                ))
                .await
                .unwrap();
        };
        let isolation = if round % 2 == 0 || sql_only {
            "READ COMMITTED"
        } else {
            "REPEATABLE READ"
        };
        let enqueue = async {
            enqueuer
                .batch_execute(&format!(
                    "BEGIN ISOLATION LEVEL {isolation}; \
                     SELECT inbox_enqueue('jobs', '1', group_key => '{group}'); COMMIT"
                ))
                .await
                .unwrap();
        };
        if round % 3 == 0 {
            tokio::join!(enqueue, ack);
        } else {
            tokio::join!(ack, enqueue);
        }
        let taken = lease_ids(&setup, 10).await;
        assert_eq!(
            taken.len(),
            1,
            "round {round}: one job leasable, got {taken:?}"
        );
        setup
            .batch_execute(&format!("SELECT inbox_ack('jobs', {}, 1)", taken[0]))
            .await
            .unwrap();
    }
    assert_eq!(one::<i64>(&setup, "SELECT count(*) FROM jobs").await, 0);
}

/// A REPEATABLE READ enqueuer whose snapshot predates the commit that removed the group's head
/// (or that enqueued a new head) decides from the latest committed state: its job becomes the
/// head in the first case and waits in the second.
#[tokio::test]
async fn a_repeatable_read_enqueuer_sees_the_group_as_committed() {
    late_snapshot_enqueuer("REPEATABLE READ").await;
}

/// The same under SERIALIZABLE.
#[tokio::test]
async fn a_serializable_enqueuer_sees_the_group_as_committed() {
    late_snapshot_enqueuer("SERIALIZABLE").await;
}

async fn late_snapshot_enqueuer(isolation: &str) {
    let db = TestDb::new().await;
    let other = db.client().await;
    let late = db.client().await;
    other
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); SELECT inbox_enqueue('jobs', '\"head\"', group_key => 'a')",
        )
        .await
        .unwrap();
    assert_eq!(lease_ids(&other, 10).await, [1]);
    let citus: bool = one(
        &other,
        "SELECT pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL",
    )
    .await;
    if db.sql_only().await || citus {
        // The SQL-only build cannot read the latest committed state from an older snapshot, nor
        // can a queue's node under Citus: ordered groups are refused outside READ COMMITTED, and
        // the transaction changes nothing.
        late.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}"))
            .await
            .unwrap();
        let e = late
            .batch_execute("SELECT inbox_enqueue('jobs', '\"a next\"', group_key => 'a')")
            .await
            .unwrap_err();
        assert_eq!(e.code().map(|c| c.code()), Some("0A000"), "{e:?}");
        late.batch_execute("ROLLBACK").await.unwrap();
        assert_eq!(one::<i64>(&other, "SELECT count(*) FROM jobs").await, 1);
        return;
    }
    // Its snapshot still sees job 1 as the head of group a, and group b as empty.
    late.batch_execute(&format!(
        "BEGIN ISOLATION LEVEL {isolation}; SELECT count(*) FROM jobs"
    ))
    .await
    .unwrap();
    other
        .batch_execute(
            "SELECT inbox_ack('jobs', 1, 1); SELECT inbox_enqueue('jobs', '\"b head\"', group_key => 'b')",
        )
        .await
        .unwrap();
    late.batch_execute(
        "SELECT inbox_enqueue('jobs', '\"a next\"', group_key => 'a'); \
         SELECT inbox_enqueue('jobs', '\"b next\"', group_key => 'b'); COMMIT",
    )
    .await
    .unwrap();
    let mut taken = lease_ids(&other, 10).await;
    taken.sort();
    assert_eq!(
        taken,
        [2, 3],
        "a's new job is its head; b's waits behind b's head"
    );
    assert!(one::<bool>(&other, "SELECT inbox_ack('jobs', 2, 1)").await);
    assert!(one::<bool>(&other, "SELECT inbox_ack('jobs', 3, 1)").await);
    assert_eq!(lease_ids(&other, 10).await, [4]);
}

/// Enqueues with groups need the columns that keep them.
#[tokio::test]
async fn a_group_needs_its_columns() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE plain (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL, \
                                 group_key text)",
        )
        .await
        .unwrap();
    for sql in [
        "SELECT inbox_enqueue('plain', '{}', group_key => 'g')",
        "SELECT inbox_enqueue_batch('plain', ARRAY['{}']::jsonb[], group_keys => ARRAY['g'])",
    ] {
        let error = client.batch_execute(sql).await.expect_err(sql);
        assert_eq!(
            error.code(),
            Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN),
            "{sql}"
        );
        assert!(error.as_db_error().unwrap().message().contains("dead_at"));
    }
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let error = client
        .batch_execute(
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}', '{}']::jsonb[], group_keys => ARRAY['g'])",
        )
        .await
        .expect_err("unequal lengths");
    assert_eq!(
        error.code(),
        Some(&tokio_postgres::error::SqlState::ARRAY_SUBSCRIPT_ERROR)
    );
    assert_eq!(one::<i64>(&client, "SELECT count(*) FROM jobs").await, 0);
}

/// A batch into 100,000 groups locks the queue rather than each group: 100,000 advisory locks
/// do not fit PostgreSQL's lock table (`53200 out of shared memory` with the default
/// `max_locks_per_transaction`). Each group gets its head; the second job of a group waits.
#[tokio::test]
async fn a_batch_into_many_groups_fits_the_lock_table() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT count(*) FROM inbox_enqueue_batch('jobs', \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series(0, 100999) g), \
                 group_keys => ARRAY(SELECT 'g' || (g % 100000) FROM generate_series(0, 100999) g))",
        )
        .await
        .unwrap();
    let stats = client
        .query_one("SELECT ready, delayed FROM inbox_stats('jobs')", &[])
        .await
        .unwrap();
    assert_eq!(
        (stats.get::<_, i64>(0), stats.get::<_, i64>(1)),
        (100_000, 1_000)
    );
    let heads: i64 = one(
        &client,
        "SELECT count(*) FROM jobs WHERE locked_until < 'infinity' AND id <= 100000",
    )
    .await;
    assert_eq!(heads, 100_000, "each group's first job is its head");
}
