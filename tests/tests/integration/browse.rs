//! Browsing a queue as the dashboard does (`inbox_job_page`, `inbox_job_count`,
//! `inbox_job_detail`, `inbox_dead_letter_groups`, `inbox_requeue_dead_with_error`), over real
//! connections: pages agree with `inbox_jobs` and `inbox_stats`, a count beyond its bound is the
//! planner's estimate and says so, bad arguments are refused with their SQLSTATE.

use inbox_tests::TestDb;
use tokio_postgres::Client;

use crate::support::assert_refused;

async fn ids(client: &Client, sql: &str) -> Vec<i64> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn one_i64(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// 100 jobs: priorities 0 and 3, groups g0..g4 on the first 20, keys on all; 10 delayed,
/// 2 leased, 3 dead of "boom" and 2 of "bust", 1 cancelled.
async fn seeded(db: &TestDb) -> Client {
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', jsonb_build_object('n', i), \
                                  priority => CASE WHEN i % 3 = 0 THEN 3 ELSE 0 END, \
                                  key => 'k' || i, \
                                  group_key => CASE WHEN i > 80 THEN 'g' || (i % 5) END) \
               FROM generate_series(1, 90) AS i; \
             SELECT inbox_enqueue('jobs', jsonb_build_object('n', i), now() + interval '1 hour', \
                                  key => 'k' || i) \
               FROM generate_series(91, 100) AS i; \
             SELECT inbox_dead('jobs', id, token, 'boom') FROM inbox_lease('jobs', 3, '1 minute'); \
             SELECT inbox_dead('jobs', id, token, 'bust') FROM inbox_lease('jobs', 2, '1 minute'); \
             SELECT count(*) FROM inbox_lease('jobs', 2, '10 minutes'); \
             SELECT inbox_cancel('jobs', 100);",
        )
        .await
        .unwrap();
    client
}

#[tokio::test]
async fn pages_and_counts_agree_with_the_queues_own_functions() {
    let db = TestDb::new().await;
    let client = seeded(&db).await;
    // Each state: the page holds what inbox_jobs lists, and the exact count is inbox_stats'.
    for state in ["ready", "delayed", "leased", "dead"] {
        let page = ids(
            &client,
            &format!("SELECT id FROM inbox_job_page('jobs', '{state}', max => 1000)"),
        )
        .await;
        let mut listed = ids(
            &client,
            &format!("SELECT id FROM inbox_jobs('jobs', '{state}', 1000)"),
        )
        .await;
        listed.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(page, listed, "{state}");
        let row = client
            .query_one(
                &format!("SELECT jobs, exact FROM inbox_job_count('jobs', '{state}')"),
                &[],
            )
            .await
            .unwrap();
        let stats = one_i64(&client, &format!("SELECT {state} FROM inbox_stats('jobs')")).await;
        assert_eq!(
            (row.get::<_, i64>(0), row.get::<_, bool>(1)),
            (stats, true),
            "{state}"
        );
    }
    assert_eq!(
        ids(
            &client,
            "SELECT id FROM inbox_job_page('jobs', 'cancelled')"
        )
        .await,
        [100]
    );

    // Filters combine, and pages below an id continue without a gap or an overlap.
    let filtered = ids(
        &client,
        "SELECT id FROM jobs WHERE priority = 3 AND group_key IS NULL AND dead_at IS NULL \
           AND locked_until <= now() ORDER BY id DESC",
    )
    .await;
    let mut paged = Vec::new();
    let mut before: Option<i64> = None;
    loop {
        let page: Vec<i64> = client
            .query(
                "SELECT id FROM inbox_job_page('jobs', 'ready', priority => 3, before => $1, max => 7)",
                &[&before],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        let Some(&last) = page.last() else { break };
        paged.extend(page);
        before = Some(last);
    }
    // Grouped jobs behind their head are delayed: the ungrouped ready ones are those above.
    let grouped_ready = ids(
        &client,
        "SELECT id FROM inbox_job_page('jobs', 'ready', priority => 3, max => 1000) \
          WHERE group_key IS NOT NULL",
    )
    .await;
    let mut expected: Vec<i64> = filtered.into_iter().chain(grouped_ready).collect();
    expected.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(paged, expected);
    assert_eq!(
        ids(
            &client,
            "SELECT id FROM inbox_job_page('jobs', key => 'k42')"
        )
        .await,
        [42]
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT jobs FROM inbox_job_count('jobs', group_key => 'g1')"
        )
        .await,
        one_i64(&client, "SELECT count(*) FROM jobs WHERE group_key = 'g1'").await
    );
}

#[tokio::test]
async fn a_count_beyond_its_bound_is_the_planners_estimate_and_says_so() {
    let db = TestDb::new().await;
    let client = seeded(&db).await;
    client.batch_execute("ANALYZE jobs").await.unwrap();
    let row = client
        .query_one(
            "SELECT jobs, exact FROM inbox_job_count('jobs', exact_up_to => 10)",
            &[],
        )
        .await
        .unwrap();
    let (jobs, exact): (i64, bool) = (row.get(0), row.get(1));
    assert!(!exact);
    // The planner's figure after ANALYZE, never below what was counted.
    assert!((11..=200).contains(&jobs), "{jobs}");
    let row = client
        .query_one(
            "SELECT jobs, exact FROM inbox_job_count('jobs', exact_up_to => 100)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, bool>(1)), (100, true));
    let row = client
        .query_one(
            "SELECT jobs, exact FROM inbox_job_count('jobs', 'dead', exact_up_to => 0)",
            &[],
        )
        .await
        .unwrap();
    assert!(!row.get::<_, bool>(1));
    assert!(row.get::<_, i64>(0) >= 1);
}

#[tokio::test]
async fn a_job_in_full_and_dead_letters_by_error() {
    let db = TestDb::new().await;
    let client = seeded(&db).await;
    let row = client
        .query_one(
            "SELECT state, job ->> 'key', job -> 'payload' ->> 'n', job ->> 'last_error' \
               FROM inbox_job_detail('jobs', 100)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(3)
        ),
        (
            "dead".to_owned(),
            "k100".to_owned(),
            "100".to_owned(),
            "cancelled".to_owned()
        )
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_job_detail('jobs', 100000)"
        )
        .await,
        0
    );

    let groups: Vec<(String, i64)> = client
        .query(
            "SELECT last_error, jobs FROM inbox_dead_letter_groups('jobs')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(
        groups,
        [
            ("boom".to_owned(), 3),
            ("bust".to_owned(), 2),
            ("cancelled".to_owned(), 1)
        ]
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_requeue_dead_with_error('jobs', 'boom', 2)"
        )
        .await,
        2
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_requeue_dead_with_error('jobs', 'boom')"
        )
        .await,
        1
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_requeue_dead_with_error('jobs', 'no such error')"
        )
        .await,
        0
    );
    assert_eq!(
        one_i64(&client, "SELECT dead FROM inbox_stats('jobs')").await,
        3,
        "bust twice and the cancelled job stay dead"
    );
    // Requeued as inbox_requeue does: due now, the error kept.
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_job_page('jobs', 'ready', max => 1000) \
              WHERE last_error = 'boom'"
        )
        .await,
        3
    );
}

#[tokio::test]
async fn bad_arguments_are_refused_with_their_sqlstate() {
    let db = TestDb::new().await;
    let client = seeded(&db).await;
    client
        .batch_execute(
            "CREATE TABLE bare (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL); \
             CREATE TABLE not_a_queue (id int)",
        )
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT * FROM inbox_job_page(NULL)", "22004"),
            ("SELECT * FROM inbox_job_page('jobs', 'lost')", "22023"),
            ("SELECT * FROM inbox_job_page('jobs', max => 0)", "22023"),
            ("SELECT * FROM inbox_job_page('jobs', max => NULL)", "22004"),
            ("SELECT * FROM inbox_job_page('not_a_queue')", "42703"),
            (
                "SELECT * FROM inbox_job_page('bare', priority => 1)",
                "42703",
            ),
            (
                "SELECT * FROM inbox_job_page('bare', group_key => 'g')",
                "42703",
            ),
            ("SELECT * FROM inbox_job_page('bare', key => 'k')", "42703"),
            ("SELECT * FROM inbox_job_count('jobs', 'lost')", "22023"),
            (
                "SELECT * FROM inbox_job_count('jobs', exact_up_to => -1)",
                "22023",
            ),
            (
                "SELECT * FROM inbox_job_count('jobs', exact_up_to => NULL)",
                "22004",
            ),
            ("SELECT * FROM inbox_job_detail('jobs', NULL)", "22004"),
            ("SELECT * FROM inbox_job_detail(NULL, 1)", "22004"),
            ("SELECT * FROM inbox_dead_letter_groups('jobs', 0)", "22023"),
            (
                "SELECT * FROM inbox_dead_letter_groups('not_a_queue')",
                "42703",
            ),
            (
                "SELECT inbox_requeue_dead_with_error('jobs', 'boom', 0)",
                "22023",
            ),
            (
                "SELECT inbox_requeue_dead_with_error(NULL, 'boom')",
                "22004",
            ),
            (
                "SELECT inbox_requeue_dead_with_error('bare', 'boom')",
                "42703",
            ),
        ],
    )
    .await;
    // A queue without the optional columns still pages, its missing columns NULL.
    client
        .batch_execute("INSERT INTO bare (payload) VALUES ('{}'), ('{}')")
        .await
        .unwrap();
    let row = client
        .query_one(
            "SELECT count(*), count(group_key), sum(priority) FROM inbox_job_page('bare')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (2, 0, 0)
    );
}

#[tokio::test]
async fn activity_counts_the_rows_enqueued_and_settled_partitions_included() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('plain'); \
             SELECT inbox_enqueue('plain', '{}') FROM generate_series(1, 5); \
             SELECT inbox_ack('plain', id, token) FROM inbox_lease('plain', 2, '1 minute'); \
             CREATE TABLE parted (id bigint GENERATED BY DEFAULT AS IDENTITY, attempt int NOT NULL DEFAULT 0, \
                                  locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL, \
                                  PRIMARY KEY (id)) PARTITION BY RANGE (id); \
             CREATE TABLE parted_low PARTITION OF parted FOR VALUES FROM (1) TO (3); \
             CREATE TABLE parted_high PARTITION OF parted FOR VALUES FROM (3) TO (100); \
             SELECT inbox_enqueue('parted', '{}') FROM generate_series(1, 4); \
             SELECT inbox_ack('parted', id, token) FROM inbox_lease('parted', 3, '1 minute'); \
             SELECT pg_stat_force_next_flush();",
        )
        .await
        .unwrap();
    // The counters reach the shared statistics when the session that wrote goes idle (at once,
    // asked to); another session reads them.
    let reader = db.client().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let read = |queue: &'static str| {
            let reader = &reader;
            async move {
                let row = reader
                    .query_one(
                        &format!("SELECT enqueued, settled FROM inbox_queue_activity('{queue}')"),
                        &[],
                    )
                    .await
                    .unwrap();
                (row.get::<_, i64>(0), row.get::<_, i64>(1))
            }
        };
        let (plain, parted) = (read("plain").await, read("parted").await);
        if plain == (5, 2) && parted == (4, 3) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "plain {plain:?}, parted {parted:?}"
        );
        reader
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_refused(
        &reader,
        &[
            ("SELECT * FROM inbox_queue_activity(NULL)", "22004"),
            ("SELECT * FROM inbox_queue_activity('pg_class')", "42703"),
        ],
    )
    .await;
}

#[tokio::test]
async fn blocked_groups_show_the_head_each_waits_on() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('orders'); \
             SELECT inbox_enqueue('orders', jsonb_build_object('n', i), group_key => 'c' || (i % 3)) \
               FROM generate_series(1, 20) AS i; \
             SELECT count(*) FROM inbox_lease('orders', 1, '1 minute'); \
             SELECT inbox_retry('orders', id, token, '1 hour', 'flaky') FROM inbox_lease('orders', 1, '1 minute');",
        )
        .await
        .unwrap();
    let rows: Vec<(String, i64, i64, String, Option<String>)> = client
        .query(
            "SELECT group_key, waiting, head_id, head_state, head_last_error \
               FROM inbox_blocked_groups('orders')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
        .collect();
    assert_eq!(
        rows,
        [
            ("c1".to_owned(), 6, 1, "leased".to_owned(), None),
            (
                "c2".to_owned(),
                6,
                2,
                "delayed".to_owned(),
                Some("flaky".to_owned())
            ),
            ("c0".to_owned(), 5, 3, "ready".to_owned(), None),
        ]
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_blocked_groups('orders', 1)"
        )
        .await,
        1
    );
    client
        .batch_execute(
            "CREATE TABLE bare (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL)",
        )
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT * FROM inbox_blocked_groups('orders', 0)", "22023"),
            ("SELECT * FROM inbox_blocked_groups(NULL)", "22004"),
            ("SELECT * FROM inbox_blocked_groups('bare')", "42703"),
        ],
    )
    .await;
}

#[tokio::test]
async fn ledgers_are_listed_with_their_estimated_keys_and_size() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_ledger('seen'); \
             SELECT inbox_claim('seen', 'k' || i) FROM generate_series(1, 500) AS i; \
             SELECT inbox_create_queue('jobs'); \
             CREATE TABLE parted_seen (event_key text PRIMARY KEY, seen_at timestamptz NOT NULL) \
               PARTITION BY HASH (event_key); \
             CREATE TABLE parted_seen_0 PARTITION OF parted_seen FOR VALUES WITH (MODULUS 2, REMAINDER 0); \
             CREATE TABLE parted_seen_1 PARTITION OF parted_seen FOR VALUES WITH (MODULUS 2, REMAINDER 1); \
             INSERT INTO parted_seen SELECT 'k' || i, now() FROM generate_series(1, 300) AS i;",
        )
        .await
        .unwrap();
    let schema = db.schema();
    let before = ours(&client, schema).await;
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(
        before
            .iter()
            .all(|(_, keys, bytes)| keys.is_none() && *bytes > 0),
        "{before:?}"
    );
    client
        .batch_execute("ANALYZE seen; ANALYZE parted_seen")
        .await
        .unwrap();
    let after: Vec<(String, Option<i64>)> = ours(&client, schema)
        .await
        .into_iter()
        .map(|(name, keys, _)| (name, keys))
        .collect();
    assert_eq!(
        after,
        [
            ("parted_seen".to_owned(), Some(300)),
            ("seen".to_owned(), Some(500)),
        ]
    );
}

/// The rows of `inbox_ledgers()` in `schema`: name, estimated keys, bytes.
async fn ours(client: &Client, schema: &str) -> Vec<(String, Option<i64>, i64)> {
    client
        .query(
            "SELECT ledger::text, keys_estimate, bytes FROM inbox_ledgers() \
              WHERE (SELECT relnamespace::regnamespace::text FROM pg_class WHERE oid = ledger) = $1",
            &[&schema],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

#[tokio::test]
async fn an_action_on_what_a_filter_matches_takes_the_oldest_max_of_them() {
    let db = TestDb::new().await;
    let client = seeded(&db).await;
    // 5 dead of two errors and 1 cancelled: requeue 4 of the 6, then discard the rest.
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_act_on_matching('jobs', 'requeue', 'dead', max => 4)"
        )
        .await,
        4
    );
    assert_eq!(
        one_i64(&client, "SELECT dead FROM inbox_stats('jobs')").await,
        2
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_act_on_matching('jobs', 'discard', 'dead')"
        )
        .await,
        2
    );
    assert_eq!(
        one_i64(&client, "SELECT dead FROM inbox_stats('jobs')").await,
        0
    );
    // Cancel takes only jobs that are not dead, under the filter.
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_act_on_matching('jobs', 'cancel', priority => 3, max => 5)"
        )
        .await,
        5
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM jobs WHERE priority = 3 AND last_error = 'cancelled'"
        )
        .await,
        5
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT inbox_act_on_matching('jobs', 'requeue', key => 'k50')"
        )
        .await,
        0,
        "a job that is not dead is not requeued"
    );
    assert_refused(
        &client,
        &[
            ("SELECT inbox_act_on_matching('jobs', 'delete')", "22023"),
            ("SELECT inbox_act_on_matching('jobs', NULL)", "22023"),
            (
                "SELECT inbox_act_on_matching('jobs', 'cancel', max => 0)",
                "22023",
            ),
            (
                "SELECT inbox_act_on_matching('jobs', 'cancel', 'lost')",
                "22023",
            ),
            ("SELECT inbox_act_on_matching(NULL, 'cancel')", "22004"),
        ],
    )
    .await;
}

/// Every failed delivery's error is kept in `errors`, oldest first, with its attempt and time:
/// a lease's retry, a retry without an error, a lock's retry and its death; a requeue keeps them;
/// a queue keeps the last twenty.
#[tokio::test]
async fn every_failed_attempts_error_is_kept_with_its_attempt() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue('jobs', '{\"n\": 1}'); \
             SELECT inbox_retry('jobs', id, token, error => 'first') FROM inbox_lease('jobs'); \
             SELECT inbox_retry('jobs', id, token) FROM inbox_lease('jobs'); \
             BEGIN; \
             SELECT inbox_retry('jobs', id, token, error => 'locked') FROM inbox_lock('jobs'); \
             COMMIT; \
             BEGIN; \
             SELECT inbox_dead('jobs', id, token, 'gave up') FROM inbox_lock('jobs'); \
             COMMIT;",
        )
        .await
        .unwrap();
    let expected = vec![
        (1, Some("first".to_owned()), true),
        (2, None, true),
        (3, Some("locked".to_owned()), true),
        (4, Some("gave up".to_owned()), true),
    ];
    assert_eq!(
        job_errors(&client).await,
        (expected.clone(), Some("gave up".to_owned()), "4".to_owned())
    );
    // Requeued, it starts again from its first attempt with its history.
    client
        .batch_execute(
            "SELECT inbox_requeue('jobs', 1); \
             SELECT inbox_retry('jobs', id, token, error => 'again') FROM inbox_lease('jobs');",
        )
        .await
        .unwrap();
    let (entries, _, _) = job_errors(&client).await;
    assert_eq!(entries[..4], expected[..]);
    assert_eq!(entries[4], (1, Some("again".to_owned()), true));
    // Thirty more failures: the last twenty are kept.
    for n in 0..30 {
        client
            .execute(
                "SELECT inbox_retry('jobs', id, token, error => $1) FROM inbox_lease('jobs')",
                &[&format!("e{n}")],
            )
            .await
            .unwrap();
    }
    let (entries, last_error, _) = job_errors(&client).await;
    let kept: Vec<Option<String>> = entries.into_iter().map(|(_, error, _)| error).collect();
    let expected: Vec<Option<String>> = (10..30).map(|n| Some(format!("e{n}"))).collect();
    assert_eq!(kept, expected);
    assert_eq!(last_error.as_deref(), Some("e29"));
}

/// Job 1's `errors` as (attempt, error, whether it has a time), its last error and attempt.
async fn job_errors(client: &Client) -> (Vec<(i64, Option<String>, bool)>, Option<String>, String) {
    let row = client
        .query_one(
            "SELECT job->'errors', job->>'last_error', job->>'attempt' \
               FROM inbox_job_detail('jobs', 1)",
            &[],
        )
        .await
        .unwrap();
    let errors: serde_json::Value = row.get(0);
    let entries = errors
        .as_array()
        .expect("an array of errors")
        .iter()
        .map(|entry| {
            (
                entry["attempt"].as_i64().expect("an attempt"),
                entry["error"].as_str().map(str::to_owned),
                entry["at"].is_string(),
            )
        })
        .collect();
    (entries, row.get(1), row.get(2))
}
