//! Workflows over real connections: dependants released by their last parent's ack, batches
//! whose callbacks are enqueued exactly once, kept results and waiting for them, under
//! concurrent workers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker};
use inbox_client::{
    Batch, BatchCallbacks, Database, EnqueueOptions, JobRef, JobState, PgDatabase, Queue,
    ResultWaiter, Statement,
};
use inbox_tests::TestDb;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::support::{self, assert_refused, fast_retries};

async fn state(client: &tokio_postgres::Client, queue: &str, id: i64) -> Option<String> {
    client
        .query_opt(
            "SELECT state FROM inbox_result($1::text::regclass, $2)",
            &[&queue, &id],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

async fn one_i64(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Enqueues into `queue` a job that depends on job `parent` of the same queue; `more` adds
/// arguments to the call.
async fn dependant(client: &tokio_postgres::Client, queue: &str, parent: i64, more: &str) -> i64 {
    one_i64(
        client,
        &format!(
            "SELECT inbox_enqueue_after('{queue}', '{{}}', ARRAY[inbox_job('{queue}', {parent})]{more})"
        ),
    )
    .await
}

/// Leases job `id` of `queue` (it must be the only one due) and acks it.
async fn lease_and_ack(client: &tokio_postgres::Client, queue: &str, id: i64) {
    let row = client
        .query_one(
            &format!("SELECT id, token FROM inbox_lease('{queue}', 1)"),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), id, "{queue}");
    let token: i64 = row.get(1);
    let acked: bool = client
        .query_one(&format!("SELECT inbox_ack('{queue}', {id}, {token})"), &[])
        .await
        .unwrap()
        .get(0);
    assert!(acked);
}

/// In SQL: a dependant with parents in two queues is taken by no lease until both parents
/// succeeded; a parent already acked counts as succeeded, an id its queue never drew is refused.
#[tokio::test]
async fn a_dependant_runs_only_after_every_parent_succeeded() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('charges'), inbox_create_queue('stock'), \
                    inbox_create_queue('done')",
        )
        .await
        .unwrap();
    let early = one_i64(&client, "SELECT inbox_enqueue('done', '{}')").await;
    lease_and_ack(&client, "done", early).await;
    let charge = one_i64(&client, "SELECT inbox_enqueue('charges', '{}')").await;
    let stock = one_i64(&client, "SELECT inbox_enqueue('stock', '{}')").await;
    let ship = one_i64(
        &client,
        &format!(
            "SELECT inbox_enqueue_after('stock', '{{\"ship\": true}}', \
             ARRAY[inbox_job('charges', {charge}), inbox_job('stock', {stock}), \
                   inbox_job('done', {early})])"
        ),
    )
    .await;
    assert_eq!(
        state(&client, "stock", ship).await.as_deref(),
        Some("blocked")
    );
    lease_and_ack(&client, "charges", charge).await;
    assert_eq!(
        state(&client, "stock", ship).await.as_deref(),
        Some("blocked")
    );
    // Only the stock job is due: the dependant is not.
    lease_and_ack(&client, "stock", stock).await;
    assert_eq!(
        state(&client, "stock", ship).await.as_deref(),
        Some("ready")
    );
    lease_and_ack(&client, "stock", ship).await;
    assert_eq!(state(&client, "stock", ship).await, None);

    assert_refused(
        &client,
        &[
            (
                "SELECT inbox_enqueue_after('stock', '{}', ARRAY[inbox_job('charges', 999)])",
                "23503",
            ),
            ("SELECT inbox_enqueue_after('stock', '{}', NULL)", "22004"),
            (
                "SELECT inbox_enqueue_after('stock', '{}', ARRAY[inbox_job('charges', NULL)])",
                "22004",
            ),
            (
                "SELECT inbox_enqueue_after('stock', '{}', ARRAY[inbox_job(NULL, 1)])",
                "22004",
            ),
            (
                "SELECT inbox_enqueue_after('stock', '{}', ARRAY[[inbox_job('charges', 1)]])",
                "2202E",
            ),
        ],
    )
    .await;
    // Nothing of the refused enqueues was kept.
    assert_eq!(one_i64(&client, "SELECT count(*) FROM stock").await, 0);
}

/// In SQL: a dependant of one parent keeps no count of parents, and runs once that parent
/// succeeded; one enqueued for later keeps its time and runs then, not at its parent's ack.
#[tokio::test]
async fn a_dependant_of_one_parent_runs_at_its_own_time() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let parent = one_i64(&client, "SELECT inbox_enqueue('jobs', '{}')").await;
    let now = dependant(&client, "jobs", parent, "").await;
    let later = dependant(
        &client,
        "jobs",
        parent,
        ", run_at => now() + interval '1 hour'",
    )
    .await;
    for id in [now, later] {
        assert_eq!(state(&client, "jobs", id).await.as_deref(), Some("blocked"));
    }
    lease_and_ack(&client, "jobs", parent).await;
    assert_eq!(state(&client, "jobs", now).await.as_deref(), Some("ready"));
    assert_eq!(
        state(&client, "jobs", later).await.as_deref(),
        Some("scheduled")
    );
    let due_in: f64 = client
        .query_one(
            &format!(
                "SELECT extract(epoch FROM locked_until - now())::float8 FROM jobs WHERE id = {later}"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(due_in > 3000.0, "due in {due_in} s");
    lease_and_ack(&client, "jobs", now).await;
    assert_eq!(
        one_i64(
            &client,
            "SELECT (SELECT count(*) FROM inbox_blocked WHERE queue = 'jobs'::regclass) \
                  + (SELECT count(*) FROM inbox_dependencies WHERE child_queue = 'jobs'::regclass)"
        )
        .await,
        0
    );
}

/// In SQL: a parent that dies keeps its dependant blocked; requeued and acked, it releases it. A
/// dependant cancelled while blocked stays cancelled when its parent succeeds.
#[tokio::test]
async fn a_dead_parent_keeps_its_dependants_blocked_until_it_is_requeued_and_succeeds() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let parent = one_i64(&client, "SELECT inbox_enqueue('jobs', '{}')").await;
    let kept = dependant(&client, "jobs", parent, "").await;
    let cancelled = dependant(&client, "jobs", parent, "").await;
    let row = client
        .query_one("SELECT id, token FROM inbox_lease('jobs', 10)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), parent, "only the parent is due");
    let token: i64 = row.get(1);
    client
        .batch_execute(&format!(
            "SELECT inbox_dead('jobs', {parent}, {token}, 'boom')"
        ))
        .await
        .unwrap();
    assert_eq!(
        state(&client, "jobs", kept).await.as_deref(),
        Some("blocked")
    );
    assert_eq!(
        state(&client, "jobs", parent).await.as_deref(),
        Some("dead")
    );
    client
        .batch_execute(&format!("SELECT inbox_cancel('jobs', {cancelled})"))
        .await
        .unwrap();
    assert_eq!(
        state(&client, "jobs", cancelled).await.as_deref(),
        Some("cancelled")
    );
    client
        .batch_execute(&format!("SELECT inbox_requeue('jobs', {parent})"))
        .await
        .unwrap();
    lease_and_ack(&client, "jobs", parent).await;
    assert_eq!(state(&client, "jobs", kept).await.as_deref(), Some("ready"));
    assert_eq!(
        state(&client, "jobs", cancelled).await.as_deref(),
        Some("cancelled")
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_blocked WHERE queue = 'jobs'::regclass"
        )
        .await,
        0
    );
}

/// An enqueue of a dependant and its parent's ack, in both orders of their commits: the ack that
/// commits first is seen by the enqueue (the dependant is due), the enqueue that commits first is
/// seen by the ack (which releases it). Never a dependant blocked by a parent that is gone.
#[tokio::test]
async fn a_parent_acked_while_its_dependant_is_enqueued_never_leaves_it_blocked() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
    let enqueuer = db.client().await;
    let acker = Arc::new(db.client().await);
    for enqueue_first in [true, false] {
        let parent = one_i64(&setup, "SELECT inbox_enqueue('jobs', '{}')").await;
        let row = setup
            .query_one("SELECT token FROM inbox_lease('jobs', 1)", &[])
            .await
            .unwrap();
        let token: i64 = row.get(0);
        let enqueue = format!(
            "SELECT inbox_enqueue_after('jobs', '{{}}', ARRAY[inbox_job('jobs', {parent})])"
        );
        let ack = format!("SELECT inbox_ack('jobs', {parent}, {token})");
        let child = if enqueue_first {
            enqueuer.batch_execute("BEGIN").await.unwrap();
            let child = one_i64(&enqueuer, &enqueue).await;
            // The ack waits for the enqueue's lock on the parent.
            let acking = {
                let acker = acker.clone();
                let ack = ack.clone();
                tokio::spawn(
                    async move { acker.query_one(&ack, &[]).await.unwrap().get::<_, bool>(0) },
                )
            };
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!acking.is_finished(), "the ack waits for the enqueue");
            enqueuer.batch_execute("COMMIT").await.unwrap();
            assert!(acking.await.unwrap());
            child
        } else {
            acker.batch_execute("BEGIN").await.unwrap();
            assert!(acker.query_one(&ack, &[]).await.unwrap().get::<_, bool>(0));
            let enqueuing = {
                let enqueuer_sql = enqueue.clone();
                let config = db.config();
                tokio::spawn(async move {
                    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
                    tokio::spawn(connection);
                    one_i64(&client, &enqueuer_sql).await
                })
            };
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!enqueuing.is_finished(), "the enqueue waits for the ack");
            acker.batch_execute("COMMIT").await.unwrap();
            enqueuing.await.unwrap()
        };
        assert_eq!(
            state(&setup, "jobs", child).await.as_deref(),
            Some("ready"),
            "enqueue first: {enqueue_first}"
        );
        lease_and_ack(&setup, "jobs", child).await;
    }
}

/// In SQL: a batch's callbacks are enqueued when it is sealed and its last member settled, with
/// the counts; on_failure only when a member died; a sealed batch takes no member; a batch whose
/// members settled before its seal finishes in the seal. Bad callbacks are refused.
#[tokio::test]
async fn a_batch_enqueues_its_callbacks_once_its_last_member_settled() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'), inbox_create_queue('callbacks'); \
             SELECT inbox_keep_results('jobs', '1 hour')",
        )
        .await
        .unwrap();
    let batch = one_i64(
        &client,
        "SELECT inbox_batch_open('callbacks', '{\"on\": \"complete\"}', \
                                 'callbacks', '{\"on\": \"failure\"}')",
    )
    .await;
    let first = one_i64(
        &client,
        &format!("SELECT inbox_batch_add({batch}, 'jobs', '{{}}')"),
    )
    .await;
    let second = one_i64(
        &client,
        &format!("SELECT inbox_batch_add({batch}, 'jobs', '{{}}')"),
    )
    .await;
    lease_and_ack(&client, "jobs", first).await;
    let row = client
        .query_one("SELECT id, token FROM inbox_lease('jobs', 1)", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), second);
    let token: i64 = row.get(1);
    client
        .batch_execute(&format!(
            "SELECT inbox_ack_with_result('jobs', {second}, {token}, '{{\"n\": 2}}')"
        ))
        .await
        .unwrap();
    assert_eq!(
        one_i64(&client, "SELECT count(*) FROM callbacks").await,
        0,
        "not sealed yet"
    );
    client
        .batch_execute(&format!("SELECT inbox_batch_seal({batch})"))
        .await
        .unwrap();
    let callbacks: Vec<serde_json::Value> = client
        .query("SELECT payload FROM callbacks ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        callbacks,
        vec![
            json!({"on": "complete", "batch": {"id": batch, "members": 2, "succeeded": 2, "died": 0}})
        ]
    );
    let members: Vec<(i64, String, Option<serde_json::Value>)> = client
        .query(
            &format!("SELECT id, outcome, result FROM inbox_batch_members({batch})"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(
        members,
        vec![
            (first, "succeeded".to_owned(), None),
            (second, "succeeded".to_owned(), Some(json!({"n": 2})))
        ]
    );
    assert!(!client
        .query_one(&format!("SELECT inbox_batch_seal({batch})"), &[])
        .await
        .unwrap()
        .get::<_, bool>(0));

    // A member that dies: both callbacks, after the last member.
    let failing = one_i64(
        &client,
        "SELECT inbox_batch_open('callbacks', '{}', 'callbacks', '{\"failed\": true}')",
    )
    .await;
    let dies = one_i64(
        &client,
        &format!("SELECT inbox_batch_add({failing}, 'jobs', '{{}}')"),
    )
    .await;
    let cancelled = one_i64(&client, &format!("SELECT inbox_batch_add({failing}, 'jobs', '{{}}', run_at => now() + interval '1 hour')")).await;
    client
        .batch_execute(&format!("SELECT inbox_batch_seal({failing})"))
        .await
        .unwrap();
    let token: i64 = client
        .query_one("SELECT token FROM inbox_lease('jobs', 1)", &[])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!(
            "SELECT inbox_dead('jobs', {dies}, {token}, 'boom')"
        ))
        .await
        .unwrap();
    assert_eq!(one_i64(&client, "SELECT count(*) FROM callbacks").await, 1);
    client
        .batch_execute(&format!("SELECT inbox_cancel('jobs', {cancelled})"))
        .await
        .unwrap();
    let counts = json!({"id": failing, "members": 2, "succeeded": 0, "died": 2});
    let callbacks: Vec<serde_json::Value> = client
        .query("SELECT payload FROM callbacks ORDER BY id OFFSET 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        callbacks,
        vec![
            json!({"batch": counts}),
            json!({"failed": true, "batch": counts})
        ]
    );

    client
        .batch_execute("SELECT inbox_create_queue('bytes_jobs'); ALTER TABLE bytes_jobs ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')")
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            (
                &format!("SELECT inbox_batch_add({batch}, 'jobs', '{{}}')"),
                "55000",
            ),
            ("SELECT inbox_batch_add(-1, 'jobs', '{}')", "02000"),
            ("SELECT inbox_batch_seal(-1)", "02000"),
            ("SELECT inbox_batch_open('callbacks', '[1]')", "22023"),
            ("SELECT inbox_batch_open('callbacks', NULL)", "22004"),
            ("SELECT inbox_batch_open('bytes_jobs', '{}')", "42804"),
            ("SELECT inbox_keep_results('jobs', '0 seconds')", "22023"),
            ("SELECT inbox_purge_results(0)", "22023"),
        ],
    )
    .await;
}

/// A seal and the last member's ack in two transactions that overlap, in either order: whichever
/// commits second waits for the other's lock on the batch and then sees its write, so the
/// callback is enqueued once (neither saw the other's uncommitted write in its own check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seal_racing_the_last_members_ack_finishes_the_batch_once() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute("SELECT inbox_create_queue('jobs'), inbox_create_queue('callbacks')")
        .await
        .unwrap();
    let sealer = Arc::new(db.client().await);
    let acker = Arc::new(db.client().await);
    for seal_first in [true, false] {
        let batch = one_i64(&setup, "SELECT inbox_batch_open('callbacks', '{}')").await;
        let member = one_i64(
            &setup,
            &format!("SELECT inbox_batch_add({batch}, 'jobs', '{{}}')"),
        )
        .await;
        let token: i64 = setup
            .query_one("SELECT token FROM inbox_lease('jobs', 1)", &[])
            .await
            .unwrap()
            .get(0);
        let seal = format!("BEGIN; SELECT inbox_batch_seal({batch})");
        let ack = format!("BEGIN; SELECT inbox_ack('jobs', {member}, {token})");
        let (first, first_sql, second, second_sql) = if seal_first {
            (&sealer, seal, &acker, ack)
        } else {
            (&acker, ack, &sealer, seal)
        };
        first.batch_execute(&first_sql).await.unwrap();
        let second_pid = support::backend_pid(second).await;
        let blocked = {
            let second = Arc::clone(second);
            tokio::spawn(async move { second.batch_execute(&second_sql).await })
        };
        support::wait_until_waiting_on_lock(&setup, second_pid).await;
        first.batch_execute("COMMIT").await.unwrap();
        tokio::time::timeout(support::PATIENCE, blocked)
            .await
            .expect("the second transaction stayed blocked")
            .unwrap()
            .unwrap();
        second.batch_execute("COMMIT").await.unwrap();
        let row = setup
            .query_one(
                &format!(
                    "SELECT finished_at IS NOT NULL, \
                            (SELECT count(*) FROM callbacks WHERE payload -> 'batch' ->> 'id' = '{batch}') \
                       FROM inbox_batch({batch})"
                ),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            (row.get::<_, bool>(0), row.get::<_, i64>(1)),
            (true, 1),
            "seal first: {seal_first}"
        );
    }
}

/// The last two members of a sealed batch acked by two transactions at once: the first to ack
/// finds the other member still to settle and holds it, so the second's ack waits for the first
/// to commit and then sees the batch finished. Whichever member goes first, the callback is
/// enqueued once, in the second transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_two_members_acked_at_once_finish_the_batch_once() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute("SELECT inbox_create_queue('jobs'), inbox_create_queue('callbacks')")
        .await
        .unwrap();
    let first_acker = db.client().await;
    let second_acker = Arc::new(db.client().await);
    for newest_first in [false, true] {
        let batch = one_i64(&setup, "SELECT inbox_batch_open('callbacks', '{}')").await;
        let mut members = Vec::new();
        for _ in 0..2 {
            members.push(
                one_i64(
                    &setup,
                    &format!("SELECT inbox_batch_add({batch}, 'jobs', '{{}}')"),
                )
                .await,
            );
        }
        setup
            .batch_execute(&format!("SELECT inbox_batch_seal({batch})"))
            .await
            .unwrap();
        let tokens: HashMap<i64, i64> = setup
            .query("SELECT id, token FROM inbox_lease('jobs', 2)", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        if newest_first {
            members.reverse();
        }
        let ack = |member: i64| {
            format!(
                "BEGIN; SELECT inbox_ack('jobs', {member}, {})",
                tokens[&member]
            )
        };
        first_acker.batch_execute(&ack(members[0])).await.unwrap();
        let second_pid = support::backend_pid(&second_acker).await;
        let blocked = {
            let (second_acker, sql) = (Arc::clone(&second_acker), ack(members[1]));
            tokio::spawn(async move { second_acker.batch_execute(&sql).await })
        };
        support::wait_until_waiting_on_lock(&setup, second_pid).await;
        first_acker.batch_execute("COMMIT").await.unwrap();
        tokio::time::timeout(support::PATIENCE, blocked)
            .await
            .expect("the second ack stayed blocked")
            .unwrap()
            .unwrap();
        second_acker.batch_execute("COMMIT").await.unwrap();
        let row = setup
            .query_one(
                &format!(
                    "SELECT finished_at IS NOT NULL, succeeded, \
                            (SELECT count(*) FROM callbacks WHERE payload -> 'batch' ->> 'id' = '{batch}') \
                       FROM inbox_batch({batch})"
                ),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            (
                row.get::<_, bool>(0),
                row.get::<_, i32>(1),
                row.get::<_, i64>(2)
            ),
            (true, 2, 1),
            "newest first: {newest_first}"
        );
    }
}

/// The first enqueue after a parent creates the parent queue's triggers, holding that queue
/// against its writers, and then waits for the parent, which a lock-mode delivery holds; that
/// delivery's ack waits for the queue. PostgreSQL cancels the session that checks for a deadlock
/// first: here the enqueue (its check, `deadlock_timeout`, comes once the ack waits, the ack's
/// much later; the other way round the ack fails with 40P01 and its worker retries the delivery).
/// The enqueue gives its locks back, the ack commits, and the enqueue runs again, after a parent
/// that has now succeeded, instead of failing with 40P01.
#[tokio::test]
async fn a_first_enqueue_after_a_locked_parent_survives_the_deadlock_it_meets() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute("SELECT inbox_create_queue('parents'), inbox_create_queue('children')")
        .await
        .unwrap();
    let parent = one_i64(&setup, "SELECT inbox_enqueue('parents', '{}')").await;
    let holder = db.client().await;
    holder
        .batch_execute("SET deadlock_timeout = '1min'; BEGIN")
        .await
        .unwrap();
    let token: i64 = holder
        .query_one("SELECT token FROM inbox_lock('parents', 1)", &[])
        .await
        .unwrap()
        .get(0);
    let enqueuer = Arc::new(db.client().await);
    enqueuer
        .batch_execute("SET deadlock_timeout = '5s'")
        .await
        .unwrap();
    let enqueuer_pid = support::backend_pid(&enqueuer).await;
    let enqueue = {
        let enqueuer = Arc::clone(&enqueuer);
        tokio::spawn(async move {
            enqueuer
                .query_one(
                    &format!(
                        "SELECT inbox_enqueue_after('children', '{{}}',                                                     ARRAY[inbox_job('parents', {parent})])"
                    ),
                    &[],
                )
                .await
                .map(|row| row.get::<_, i64>(0))
        })
    };
    support::wait_until_waiting_on_lock(&setup, enqueuer_pid).await;
    holder
        .query_one(
            &format!("SELECT inbox_ack('parents', {parent}, {token})"),
            &[],
        )
        .await
        .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    let child = tokio::time::timeout(support::PATIENCE, enqueue)
        .await
        .expect("the enqueue stayed blocked")
        .unwrap()
        .expect("the enqueue failed");
    let row = setup
        .query_one(
            &format!(
                "SELECT locked_until < 'infinity', \
                        (SELECT count(*) FROM inbox_blocked WHERE queue = 'children'::regclass), \
                        (SELECT count(*) FROM parents) \
                   FROM children WHERE id = {child}"
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, bool>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (true, 0, 0),
        "the dependant of a parent that succeeded is due"
    );
}

/// What a DAG job carries: its number, and the numbers of its parents.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DagJob {
    n: i32,
    parents: Vec<i32>,
}

/// Random DAGs over three queues, run by transactional workers (a lease and a lock) with random
/// failures, while the jobs are being enqueued: every job runs once it may and exactly once in
/// effect, never before a parent's effect committed, and every batch's callback runs exactly once,
/// after all its members.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_dags_run_every_job_once_and_after_its_parents() {
    const JOBS: i32 = 300;
    const QUEUES: [&str; 3] = ["dag_a", "dag_b", "dag_c"];
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(16), db.config());
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE dag_effects (n int NOT NULL); \
             CREATE TABLE dag_violations (n int NOT NULL, missing int NOT NULL); \
             CREATE TABLE batch_effects (batch bigint NOT NULL, members int NOT NULL, \
                                         succeeded int NOT NULL, done int NOT NULL); \
             SELECT inbox_create_queue('dag_a'), inbox_create_queue('dag_b'), \
                    inbox_create_queue('dag_c'), inbox_create_queue('dag_callbacks')",
        )
        .await
        .unwrap();
    let handler = transactional(|job: Job<DagJob>, tx: &dyn Database| {
        Box::pin(async move {
            // Fails a third of the first deliveries, after writing: the write must roll back.
            tx.execute(&Statement::new("INSERT INTO dag_effects VALUES ($1)").bind(job.payload.n))
                .await?;
            let seen: i64 = tx
                .query(
                    &Statement::new(
                        "SELECT count(DISTINCT n) AS seen FROM dag_effects \
                          WHERE n = ANY (ARRAY(SELECT jsonb_array_elements_text($1::jsonb)::int))",
                    )
                    .bind(json!(job.payload.parents)),
                )
                .await?
                .one()?
                .get("seen")?;
            if seen != job.payload.parents.len() as i64 {
                tx.execute(
                    &Statement::new("INSERT INTO dag_violations VALUES ($1, $2)")
                        .bind(job.payload.n)
                        .bind(job.payload.parents.len() as i32 - seen as i32),
                )
                .await?;
            }
            if job.attempt == 1 && job.payload.n % 3 == 0 {
                return Ok(Outcome::retry_after(Duration::from_millis(5)));
            }
            Ok(Outcome::ack())
        })
    });
    let callback = transactional(|job: Job<serde_json::Value>, tx: &dyn Database| {
        Box::pin(async move {
            let counts = &job.payload["batch"];
            let done: i64 = tx
                .query(
                    &Statement::new(
                        "SELECT count(*) AS done FROM dag_effects \
                          WHERE n = ANY (ARRAY(SELECT jsonb_array_elements_text($1::jsonb)::int))",
                    )
                    .bind(job.payload["members"].clone()),
                )
                .await?
                .one()?
                .get("done")?;
            tx.execute(
                &Statement::new("INSERT INTO batch_effects VALUES ($1, $2, $3, $4)")
                    .bind(counts["id"].as_i64().unwrap_or(-1))
                    .bind(counts["members"].as_i64().unwrap_or(-1) as i32)
                    .bind(counts["succeeded"].as_i64().unwrap_or(-1) as i32)
                    .bind(done as i32),
            )
            .await?;
            Ok(Outcome::ack())
        })
    });
    let mut workers = Vec::new();
    for (i, queue) in QUEUES.iter().enumerate() {
        let claim = if i == 1 { Claim::Lock } else { Claim::Lease };
        workers.push(
            Worker::transactional(pg.clone(), *queue, handler)
                .workers(2)
                .claim(claim)
                .retry(fast_retries(10))
                .poll_interval(Duration::from_millis(50))
                .start(),
        );
    }
    workers.push(
        Worker::transactional(pg.clone(), "dag_callbacks", callback)
            .workers(1)
            .poll_interval(Duration::from_millis(50))
            .start(),
    );

    let mut rng = fastrand::Rng::with_seed(21);
    let mut jobs: Vec<JobRef> = Vec::new();
    let mut batches: Vec<(Batch, Vec<i32>)> = Vec::new();
    let mut open: Option<(Batch, Vec<i32>)> = None;
    for n in 0..JOBS {
        let queue = Queue::new(QUEUES[rng.usize(0..QUEUES.len())]);
        let mut parents: Vec<i32> = if n == 0 {
            Vec::new()
        } else {
            (0..rng.usize(0..4)).map(|_| rng.i32(0..n)).collect()
        };
        parents.sort_unstable();
        parents.dedup();
        let refs: Vec<JobRef> = parents.iter().map(|&p| jobs[p as usize].clone()).collect();
        let payload = DagJob { n, parents };
        let options = EnqueueOptions::default();
        // Every fifth job joins the open batch, five members to a batch.
        let id = if n % 5 == 0 {
            let (batch, members) = match open.as_mut() {
                Some(open) => open,
                None => {
                    // Its members: this job and the next four that join a batch.
                    let members: Vec<i32> = (0..5).map(|k| n + 5 * k).collect();
                    let batch = Batch::open(
                        &pg,
                        &BatchCallbacks::default()
                            .on_complete(&Queue::new("dag_callbacks"), json!({"members": members})),
                    )
                    .await
                    .unwrap();
                    open.insert((batch, Vec::new()))
                }
            };
            members.push(n);
            batch
                .add(&pg, &queue, &payload, &refs, &options)
                .await
                .unwrap()
                .unwrap()
        } else {
            queue
                .enqueue_after(&pg, &payload, &refs, &options)
                .await
                .unwrap()
                .unwrap()
        };
        jobs.push(queue.job(id));
        if open.as_ref().is_some_and(|(_, members)| members.len() == 5) {
            let (batch, members) = open.take().unwrap();
            batches.push((batch, members));
        }
    }
    assert!(open.is_none());
    for (batch, _) in &batches {
        assert!(batch.seal(&pg).await.unwrap());
    }

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = one_i64(&client, "SELECT count(DISTINCT n) FROM dag_effects").await;
        let callbacks = one_i64(&client, "SELECT count(*) FROM batch_effects").await;
        if done == JOBS as i64 && callbacks == batches.len() as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{done} of {JOBS} jobs, {callbacks} callbacks"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let any duplicate show itself.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for worker in workers {
        worker.shutdown(Duration::from_secs(10)).await;
    }

    let twice = one_i64(
        &client,
        "SELECT count(*) FROM (SELECT n FROM dag_effects GROUP BY n HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(twice, 0, "a job's effect committed twice");
    let violations: Vec<(i32, i32)> = client
        .query("SELECT n, missing FROM dag_violations", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert!(
        violations.is_empty(),
        "jobs ran before their parents: {violations:?}"
    );
    let fired: HashMap<i64, (i32, i32, i32)> = client
        .query(
            "SELECT batch, members, succeeded, done FROM batch_effects",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2), row.get(3))))
        .collect();
    assert_eq!(fired.len(), batches.len(), "a callback ran twice");
    for (batch, members) in &batches {
        let n = members.len() as i32;
        assert_eq!(
            fired.get(&batch.id()),
            Some(&(n, n, n)),
            "batch {}",
            batch.id()
        );
    }
    for queue in QUEUES {
        assert_eq!(
            one_i64(&client, &format!("SELECT count(*) FROM {queue}")).await,
            0
        );
    }
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_blocked WHERE queue::text LIKE 'dag_%'"
        )
        .await,
        0
    );
}

/// Results: a handler acks with a result, which the transactional worker records in the
/// delivery's transaction; 16 callers each enqueue and wait for their own jobs, woken by the
/// result channel; a polling waiter gets the same. A job retried once is seen only with the
/// result of the delivery that acked it (attempt 2); a wait that times out returns where the job
/// stands, a dead job is final with its error, a job never enqueued is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_wait_for_their_own_results() {
    const CALLERS: i64 = 16;
    const EACH: i64 = 25;
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(24), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    queue
        .keep_results(&pg, Some(Duration::from_secs(3600)))
        .await
        .unwrap();
    let worker = Worker::transactional(
        pg.clone(),
        "jobs",
        transactional(|job: Job<i64>, _tx: &dyn Database| {
            Box::pin(async move {
                if job.attempt == 1 && job.payload % 7 == 0 {
                    return Ok(Outcome::retry_after(Duration::from_millis(2)));
                }
                Ok(Outcome::ack_with(
                    json!({"double": job.payload * 2, "attempt": job.attempt}),
                ))
            })
        }),
    )
    .workers(4)
    .retry(fast_retries(5))
    .claim(Claim::Lease)
    .start();
    let waiter = Arc::new(ResultWaiter::new(&pg));
    let mut callers = Vec::new();
    for caller in 0..CALLERS {
        let (pg, queue, waiter) = (pg.clone(), queue.clone(), waiter.clone());
        callers.push(tokio::spawn(async move {
            for k in 0..EACH {
                let n = caller * 1000 + k;
                let id = queue.enqueue(&pg, &n, None, None).await.unwrap().unwrap();
                let done = waiter
                    .wait(&queue, id, Duration::from_secs(30))
                    .await
                    .unwrap();
                assert_eq!(done.state, JobState::Succeeded, "job {id}: {done:?}");
                let attempt = if n % 7 == 0 { 2 } else { 1 };
                assert_eq!(
                    done.result,
                    Some(json!({"double": n * 2, "attempt": attempt}))
                );
                assert_eq!(done.attempt, Some(attempt));
            }
        }));
    }
    for caller in callers {
        caller.await.unwrap();
    }
    let polling = ResultWaiter::polling(&pg, Duration::from_millis(20));
    let id = queue.enqueue(&pg, &5, None, None).await.unwrap().unwrap();
    let done = polling
        .wait(&queue, id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(done.result, Some(json!({"double": 10, "attempt": 1})));
    worker.shutdown(Duration::from_secs(10)).await;

    // Not final within the time: where it stands then.
    let id = queue.enqueue(&pg, &1, None, None).await.unwrap().unwrap();
    let waited = waiter
        .wait(&queue, id, Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(waited.state, JobState::Ready);
    // A dead job is final, with its error; a job never enqueued is gone.
    let client = db.client().await;
    let token: i64 = client
        .query_one("SELECT token FROM inbox_lease('jobs', 1)", &[])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!("SELECT inbox_dead('jobs', {id}, {token}, 'boom')"))
        .await
        .unwrap();
    let dead = waiter
        .wait(&queue, id, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        (dead.state, dead.last_error.as_deref()),
        (JobState::Dead, Some("boom"))
    );
    assert_eq!(
        queue.result(&pg, 1 << 40).await.unwrap().state,
        JobState::Gone
    );
}

/// A plain worker's ack with a result keeps it on a queue that keeps none, for a day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_workers_ack_with_a_result_keeps_it() {
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(4), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    let ids: HashSet<i64> = [
        queue.enqueue(&pg, &1, None, None).await.unwrap().unwrap(),
        queue.enqueue(&pg, &2, None, None).await.unwrap().unwrap(),
    ]
    .into();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stats = Worker::plain(pg.clone(), "jobs", {
        let seen = seen.clone();
        move |job: Job<i64>| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(job.id);
                Ok(Outcome::ack_with(json!(job.payload + 100)))
            }
        }
    })
    .run_until_idle()
    .await
    .unwrap();
    assert_eq!(stats.acked, 2);
    for id in ids {
        let result = queue.result(&pg, id).await.unwrap();
        assert_eq!(result.state, JobState::Succeeded);
        assert!(matches!(result.result, Some(serde_json::Value::Number(_))));
    }
    let expires_in: f64 = db
        .client()
        .await
        .query_one(
            "SELECT extract(epoch FROM min(expires_at) - now())::float8 FROM inbox_results \
              WHERE queue = 'jobs'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!((86_000.0..=86_400.0).contains(&expires_in), "{expires_in}");
}

/// A dependant's queue or a batch's callback queue dropped: the parent's ack and the last
/// member's ack still commit (the callback is skipped with a warning).
#[tokio::test]
async fn a_dropped_queue_never_fails_a_settlement() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('parents'), inbox_create_queue('children'), \
                    inbox_create_queue('callbacks')",
        )
        .await
        .unwrap();
    let parent = one_i64(&client, "SELECT inbox_enqueue('parents', '{}')").await;
    one_i64(
        &client,
        &format!(
            "SELECT inbox_enqueue_after('children', '{{}}', ARRAY[inbox_job('parents', {parent})])"
        ),
    )
    .await;
    let batch = one_i64(&client, "SELECT inbox_batch_open('callbacks', '{}')").await;
    let member = one_i64(
        &client,
        &format!("SELECT inbox_batch_add({batch}, 'parents', '{{}}')"),
    )
    .await;
    client
        .batch_execute(&format!(
            "SELECT inbox_batch_seal({batch}); DROP TABLE children; DROP TABLE callbacks"
        ))
        .await
        .unwrap();
    lease_and_ack(&client, "parents", parent).await;
    lease_and_ack(&client, "parents", member).await;
    let finished: bool = client
        .query_one(
            &format!("SELECT finished_at IS NOT NULL FROM inbox_batch({batch})"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(finished);
}

/// Progress: a running handler's notes reach the job's row with its heartbeat, where
/// `inbox_jobs` and `inbox_result` show them; in SQL, only a live lease records progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_handlers_progress_is_seen_while_it_runs() {
    let db = TestDb::new().await;
    let pg = PgDatabase::from_pool_and_config(db.pool(4), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    let id = queue.enqueue(&pg, &3, None, None).await.unwrap().unwrap();
    let worker = Worker::plain(pg.clone(), "jobs", |job: Job<i64>| async move {
        for step in 1..=job.payload {
            job.set_progress(json!({"step": step, "of": job.payload}));
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        Ok(Outcome::ack())
    })
    .lease(Duration::from_millis(600))
    .start();
    let client = db.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let row = client
            .query_opt(
                "SELECT progress FROM inbox_jobs('jobs') WHERE progress IS NOT NULL",
                &[],
            )
            .await
            .unwrap();
        if let Some(row) = row {
            break row.get::<_, serde_json::Value>(0);
        }
        assert!(Instant::now() < deadline, "no progress recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(seen["of"], json!(3), "{seen}");
    let result: Option<serde_json::Value> = client
        .query_one("SELECT progress FROM inbox_result('jobs', $1)", &[&id])
        .await
        .unwrap()
        .get(0);
    assert!(result.is_some());
    assert!(queue.result(&pg, id).await.unwrap().progress.is_some());
    worker.shutdown(Duration::from_secs(10)).await;
    assert_eq!(queue.result(&pg, id).await.unwrap().state, JobState::Gone);

    // In SQL: a lease's token records it, until a later delivery's fences it; a lock's cannot.
    let id = one_i64(&client, "SELECT inbox_enqueue('jobs', '1')").await;
    let token: i64 = client
        .query_one("SELECT token FROM inbox_lease('jobs', 1, '1 minute')", &[])
        .await
        .unwrap()
        .get(0);
    let record = format!("SELECT inbox_set_progress('jobs', {id}, {token}, '{{\"n\": 1}}')");
    assert!(client
        .query_one(&record, &[])
        .await
        .unwrap()
        .get::<_, bool>(0));
    // The lease runs out (made due at once rather than waited for, so that no timing decides),
    // and a new delivery takes the job.
    client
        .execute("UPDATE jobs SET locked_until = now() WHERE id = $1", &[&id])
        .await
        .unwrap();
    client
        .query_one("SELECT token FROM inbox_lease('jobs', 1)", &[])
        .await
        .unwrap();
    assert!(!client
        .query_one(&record, &[])
        .await
        .unwrap()
        .get::<_, bool>(0));
    assert_refused(
        &client,
        &[
            (
                &format!("SELECT inbox_set_progress('jobs', {id}, -1, '1')"),
                "0A000",
            ),
            (
                &format!(
                    "SELECT inbox_set_progress('jobs', {id}, {token}, to_jsonb(repeat('x', 9000)))"
                ),
                "54000",
            ),
            (
                &format!("SELECT inbox_set_progress('jobs', {id}, NULL, '1')"),
                "22004",
            ),
        ],
    )
    .await;
}

/// A producer naming as parents a job held by a lock-mode delivery and a dependant of that job
/// waits for the delivery, whose ack releases the dependant: no deadlock, and the new job waits
/// for the dependant only.
#[tokio::test]
async fn an_enqueue_after_a_locked_parent_and_its_dependant_does_not_deadlock() {
    let db = TestDb::new().await;
    let setup = db.client().await;
    setup
        .batch_execute(
            "SELECT inbox_create_queue('a'), inbox_create_queue('b'), inbox_create_queue('c'); \
             SELECT inbox_enable_workflows('a'), inbox_enable_workflows('b')",
        )
        .await
        .unwrap();
    let x = one_i64(&setup, "SELECT inbox_enqueue('b', '{}')").await;
    let p = one_i64(
        &setup,
        &format!("SELECT inbox_enqueue_after('a', '{{}}', ARRAY[inbox_job('b', {x})])"),
    )
    .await;
    let worker = db.client().await;
    worker.batch_execute("BEGIN").await.unwrap();
    let token: i64 = worker
        .query_one("SELECT token FROM inbox_lock('b', 1)", &[])
        .await
        .unwrap()
        .get(0);
    let producing = {
        let config = db.config();
        tokio::spawn(async move {
            let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(connection);
            client
                .query_one(
                    &format!(
                        "SELECT inbox_enqueue_after('c', '{{}}', \
                         ARRAY[inbox_job('a', {p}), inbox_job('b', {x})])"
                    ),
                    &[],
                )
                .await
                .map(|row| row.get::<_, i64>(0))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !producing.is_finished(),
        "the enqueue waits for the locked parent"
    );
    worker
        .batch_execute(&format!("SELECT inbox_ack('b', {x}, {token}); COMMIT"))
        .await
        .unwrap();
    let child = producing.await.unwrap().expect("no deadlock");
    assert_eq!(state(&setup, "a", p).await.as_deref(), Some("ready"));
    assert_eq!(state(&setup, "c", child).await.as_deref(), Some("blocked"));
    lease_and_ack(&setup, "a", p).await;
    assert_eq!(state(&setup, "c", child).await.as_deref(), Some("ready"));
}
