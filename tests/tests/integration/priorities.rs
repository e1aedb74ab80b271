//! Priorities: leases and locks take due jobs by priority (higher first), then due time, then
//! id, as an index scan even on a queue of a million jobs.

use crate::support::explain;

use inbox_tests::TestDb;
use tokio_postgres::error::SqlState;

async fn lease_ids(client: &tokio_postgres::Client, sql: &str) -> Vec<i64> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<_, i64>("id"))
        .collect()
}

#[tokio::test]
async fn leases_and_locks_take_higher_priorities_first_then_due_time_then_id() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', '1', now() - interval '1 minute'); \
             SELECT inbox_enqueue('jobs', '2', now() - interval '10 seconds', priority => 5); \
             SELECT inbox_enqueue('jobs', '3', now() - interval '20 seconds', priority => 5); \
             SELECT inbox_enqueue('jobs', '4', now() - interval '1 hour', priority => -1); \
             SELECT inbox_enqueue('jobs', '5', now() + interval '1 hour', priority => 100); \
             SELECT inbox_enqueue_batch('jobs', ARRAY['6', '7']::jsonb[], now() - interval '20 seconds', \
                                        priority => 5)",
        )
        .await
        .unwrap();
    let expected = [3, 6, 7, 2, 1, 4];
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        lease_ids(&client, "SELECT id FROM inbox_lock('jobs', 10)").await,
        expected
    );
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        lease_ids(&client, "SELECT id FROM inbox_lease('jobs', 10)").await,
        expected
    );
    // One at a time, the same order. The leases expire by hand, moving their due times behind
    // where this session's scans start (see `head.rs`: such jobs wait for its next whole scan),
    // so the leases are taken by a new session.
    client
        .batch_execute("UPDATE jobs SET locked_until = now() - interval '1 minute' + id * interval '0 seconds' WHERE id <> 5")
        .await
        .unwrap();
    let client = db.client().await;
    let mut one_by_one = Vec::new();
    for _ in 0..6 {
        one_by_one.extend(lease_ids(&client, "SELECT id FROM inbox_lease('jobs', 1)").await);
    }
    assert_eq!(one_by_one, [2, 3, 6, 7, 1, 4]);
}

#[tokio::test]
async fn a_priority_needs_the_column_and_no_null() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             CREATE TABLE plain (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL); \
             SELECT inbox_enqueue('plain', '{}', priority => 0)",
        )
        .await
        .unwrap();
    for (sql, code) in [
        (
            "SELECT inbox_enqueue('plain', '{}', priority => 1)",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_enqueue_batch('plain', ARRAY['{}']::jsonb[], priority => -3)",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_enqueue('jobs', '{}', priority => NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], priority => NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
    ] {
        let error = client.batch_execute(sql).await.expect_err(sql);
        assert_eq!(error.code(), Some(&code), "{sql}: {error:?}");
    }
    let counts = client
        .query_one(
            "SELECT (SELECT count(*) FROM plain), (SELECT count(*) FROM jobs)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((counts.get::<_, i64>(0), counts.get::<_, i64>(1)), (1, 0));
    // A table without `priority` keeps today's order and statement.
    let taken = lease_ids(&client, "SELECT id FROM inbox_lease('plain', 5)").await;
    assert_eq!(taken, [1]);
}

/// A million jobs of ten priorities: the lease and the lock statements walk the priority index
/// from its start and stop after the jobs they take, touching a few buffers; no sequential scan,
/// no sort of the queue. Jobs that cannot be taken (dead, waiting in a group) are not in the
/// index at all.
#[tokio::test]
async fn a_million_jobs_are_taken_by_an_index_scan() {
    let db = TestDb::new().await;
    let mut session = explain::Explaining::connect(&db).await;
    session
        .client
        .batch_execute(
            "SET client_min_messages = warning; \
             SELECT inbox_create_queue('jobs'); \
             INSERT INTO jobs (payload, priority, locked_until) \
             SELECT pg_catalog.to_jsonb(g), g % 10, now() - (g % 1000) * interval '1 second' \
               FROM generate_series(1, 1000000) AS g; \
             UPDATE jobs SET locked_until = 'infinity', dead_at = now() WHERE id % 100 = 0; \
             RESET client_min_messages",
        )
        .await
        .unwrap();
    session
        .client
        .batch_execute("VACUUM ANALYZE jobs")
        .await
        .unwrap();
    let index = "jobs_expr_locked_until_id_idx";
    // The first calls prepare the statements; the plans checked are those of later calls.
    session
        .client
        .batch_execute("SELECT * FROM inbox_lease('jobs', 10); BEGIN; SELECT * FROM inbox_lock('jobs', 10); ROLLBACK")
        .await
        .unwrap();
    let leases = session
        .plans_of("SELECT * FROM inbox_lease('jobs', 10)", explain::TAKE_SCAN)
        .await;
    assert_eq!(leases.len(), 1, "one lease statement ran");
    println!(
        "lease: {}",
        explain::assert_index_scan(&leases[0], "jobs", index, 10, 400)
    );
    let locks = session
        .plans_of(
            "BEGIN; SELECT * FROM inbox_lock('jobs', 10); ROLLBACK",
            explain::TAKE_SCAN,
        )
        .await;
    assert_eq!(locks.len(), 1, "one lock statement ran");
    println!(
        "lock: {}",
        explain::assert_index_scan(&locks[0], "jobs", index, 10, 200)
    );
    // And the jobs taken are the highest priority's oldest.
    let taken = session
        .client
        .query(
            "SELECT j.priority, j.id FROM inbox_lease('jobs', 5) AS l JOIN jobs AS j USING (id)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(taken.len(), 5);
    assert!(taken.iter().all(|row| row.get::<_, i32>(0) == 9));
}
