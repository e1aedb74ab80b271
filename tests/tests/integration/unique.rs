//! Unique keys over real connections: each rule of `inbox_set_unique` frees a key in the state
//! it names and not before, concurrent enqueues of one key insert it once, and a rule that jobs
//! already queued would break is refused without a change.

use std::sync::Arc;

use crate::support::assert_refused;
use inbox_client::{PgDatabase, Queue, UniqueUntil};
use inbox_tests::TestDb;
use tokio::sync::Barrier;

/// Enqueues `{}` with `key`; the id, or `None` when a job holds the key.
async fn enqueue(client: &tokio_postgres::Client, key: &str) -> Option<i64> {
    client
        .query_one("SELECT inbox_enqueue('jobs', '{}', key => $1)", &[&key])
        .await
        .unwrap()
        .get(0)
}

async fn lease(client: &tokio_postgres::Client) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT id, token FROM inbox_lease('jobs', 1, '1 minute')",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

async fn forget(client: &tokio_postgres::Client, id: i64) {
    client
        .execute("DELETE FROM jobs WHERE id = $1", &[&id])
        .await
        .unwrap();
}

/// Under each rule a key is held while its job waits; then, as the job is leased, retried,
/// dead-lettered and acked, a second enqueue of the key inserts exactly when the rule frees it.
/// Batches follow the same rule. The rule is set and read through the client.
#[tokio::test]
async fn each_rule_frees_a_key_in_the_state_it_names() {
    for rule in [
        UniqueUntil::Acked,
        UniqueUntil::Finished,
        UniqueUntil::Started,
    ] {
        let db = TestDb::new().await;
        let pg = PgDatabase::from_pool_and_config(db.pool(2), db.config());
        let client = db.client().await;
        client
            .batch_execute("SELECT inbox_create_queue('jobs')")
            .await
            .unwrap();
        let queue = Queue::new("jobs");
        assert_eq!(queue.unique_until(&pg).await.unwrap(), UniqueUntil::Acked);
        queue.set_unique(&pg, rule).await.unwrap();
        assert_eq!(queue.unique_until(&pg).await.unwrap(), rule);

        let first = enqueue(&client, "k")
            .await
            .expect("the first enqueue inserts");
        assert_eq!(enqueue(&client, "k").await, None, "{rule:?}: waiting");
        let batch: Vec<Option<i64>> = client
            .query(
                "SELECT inbox_enqueue_batch('jobs', ARRAY['{}', '{}']::jsonb[], keys => ARRAY['k', 'b'])",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(
            batch.len(),
            1,
            "{rule:?}: only 'b' of the batch is inserted"
        );
        forget(&client, batch[0].unwrap()).await;

        // Running.
        let (id, token) = lease(&client).await;
        assert_eq!(id, first);
        let again = enqueue(&client, "k").await;
        assert_eq!(
            again.is_some(),
            rule == UniqueUntil::Started,
            "{rule:?}: running"
        );
        if let Some(again) = again {
            forget(&client, again).await;
        }
        // Waiting for its retry.
        let retried: bool = client
            .query_one(
                "SELECT inbox_retry('jobs', $1, $2, '1 hour')",
                &[&id, &token],
            )
            .await
            .unwrap()
            .get(0);
        assert!(retried);
        let again = enqueue(&client, "k").await;
        assert_eq!(
            again.is_some(),
            rule == UniqueUntil::Started,
            "{rule:?}: retrying"
        );
        if let Some(again) = again {
            forget(&client, again).await;
        }
        // Dead.
        client
            .execute("UPDATE jobs SET locked_until = now() WHERE id = $1", &[&id])
            .await
            .unwrap();
        let (id, token) = lease(&client).await;
        let dead: bool = client
            .query_one("SELECT inbox_dead('jobs', $1, $2, 'no')", &[&id, &token])
            .await
            .unwrap()
            .get(0);
        assert!(dead);
        let again = enqueue(&client, "k").await;
        assert_eq!(
            again.is_some(),
            rule != UniqueUntil::Acked,
            "{rule:?}: dead"
        );
        if let Some(again) = again {
            // The dead job cannot come back while another holds its key.
            let requeue = format!("SELECT inbox_requeue('jobs', {id})");
            assert_refused(&client, &[(&requeue, "23505")]).await;
            forget(&client, again).await;
        }
        // Acked: every rule frees the key.
        forget(&client, id).await;
        enqueue(&client, "a").await.unwrap();
        let (id, token) = lease(&client).await;
        let acked: bool = client
            .query_one("SELECT inbox_ack('jobs', $1, $2)", &[&id, &token])
            .await
            .unwrap()
            .get(0);
        assert!(acked);
        assert!(enqueue(&client, "a").await.is_some(), "{rule:?}: acked");
    }
}

/// 16 connections enqueue the same key at once, 20 times over, under each rule: each key is
/// inserted once, and every other enqueue returns NULL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_enqueues_of_one_key_insert_it_once() {
    const CONNECTIONS: usize = 16;
    const ROUNDS: usize = 20;
    for rule in ["acked", "finished", "started"] {
        let db = TestDb::new().await;
        let admin = db.client().await;
        admin
            .batch_execute(&format!(
                "SELECT inbox_create_queue('jobs'); SELECT inbox_set_unique('jobs', '{rule}')"
            ))
            .await
            .unwrap();
        let barrier = Arc::new(Barrier::new(CONNECTIONS));
        let mut tasks = Vec::new();
        for _ in 0..CONNECTIONS {
            let client = db.client().await;
            let barrier = barrier.clone();
            tasks.push(tokio::spawn(async move {
                let mut inserted = 0;
                for round in 0..ROUNDS {
                    barrier.wait().await;
                    inserted += usize::from(enqueue(&client, &format!("r{round}")).await.is_some());
                }
                inserted
            }));
        }
        let mut inserted = 0;
        for task in tasks {
            inserted += task.await.unwrap();
        }
        assert_eq!(inserted, ROUNDS, "{rule}");
        let most: i64 = admin
            .query_one(
                "SELECT max(n) FROM (SELECT count(*) AS n FROM jobs GROUP BY key) AS k",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(most, 1, "{rule}");
    }
}

/// Bad input is refused with its SQLSTATE; a rule that queued jobs would break is refused with
/// 23505 and the queue keeps its rule and its index.
#[tokio::test]
async fn inbox_set_unique_refuses_bad_input_and_changes_nothing_on_a_duplicate() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             CREATE TABLE keyless (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                   locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL); \
             CREATE TABLE undying (LIKE keyless INCLUDING ALL, key text); \
             CREATE UNIQUE INDEX ON undying (key) WHERE key IS NOT NULL",
        )
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT inbox_set_unique('jobs', 'never')", "22023"),
            ("SELECT inbox_set_unique('jobs', NULL)", "22004"),
            ("SELECT inbox_set_unique(NULL, 'acked')", "22004"),
            ("SELECT inbox_set_unique('keyless', 'acked')", "42703"),
            ("SELECT inbox_set_unique('undying', 'finished')", "42703"),
        ],
    )
    .await;
    // 'undying' may keep keys until acked (no dead_at needed); its enqueues still dedup.
    client
        .batch_execute("SELECT inbox_set_unique('undying', 'acked')")
        .await
        .unwrap();
    let ids: Vec<Option<i64>> = client
        .query(
            "SELECT inbox_enqueue('undying', '{}', key => 'u') UNION ALL \
             SELECT inbox_enqueue('undying', '{}', key => 'u')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(ids.iter().filter(|id| id.is_some()).count(), 1);

    // Two jobs of key k, one of them started: allowed under 'started' only.
    client
        .batch_execute("SELECT inbox_set_unique('jobs', 'started')")
        .await
        .unwrap();
    enqueue(&client, "k").await.unwrap();
    lease(&client).await;
    enqueue(&client, "k").await.unwrap();
    assert_refused(
        &client,
        &[("SELECT inbox_set_unique('jobs', 'acked')", "23505")],
    )
    .await;
    let until: String = client
        .query_one("SELECT inbox_unique_until('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(until, "started");
    assert_eq!(
        enqueue(&client, "k").await,
        None,
        "the waiting k still holds its key"
    );
}
