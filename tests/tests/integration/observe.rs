//! The functions operators and exporters read (`inbox_queues`, `inbox_metrics`, `inbox_jobs`)
//! and the bounded `inbox_purge(ledger, older_than, max)`, over real connections: what they
//! list, what they count, what they refuse with which SQLSTATE.

use inbox_tests::TestDb;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

async fn sqlstate(client: &Client, sql: &str) -> SqlState {
    client
        .batch_execute(sql)
        .await
        .expect_err(sql)
        .code()
        .cloned()
        .unwrap_or_else(|| panic!("no SQLSTATE for {sql}"))
}

/// The rows of `inbox_queues()` in this test's schema: (queue, ready, delayed, leased, dead).
async fn our_queues(client: &Client, schema: &str) -> Vec<(String, i64, i64, i64, i64)> {
    client
        .query(
            "SELECT queue::text, ready, delayed, leased, dead FROM inbox_queues() \
              WHERE (SELECT nspname FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid \
                      WHERE c.oid = queue) = $1",
            &[&schema],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4)))
        .collect()
}

#[tokio::test]
async fn inbox_queues_lists_tables_of_queue_shape_the_caller_may_read() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let role = format!("{}_reader", db.schema());
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('visible'); \
             SELECT inbox_create_queue('hidden'); \
             SELECT inbox_enqueue('visible', '{{}}'); \
             SELECT inbox_enqueue('hidden', '{{}}'); \
             CREATE TABLE wrong_key (id bigint PRIMARY KEY, attempt int NOT NULL, \
                 locked_until timestamptz NOT NULL, payload jsonb NOT NULL, key integer); \
             CREATE TABLE parted (id bigint NOT NULL, attempt int NOT NULL, \
                 locked_until timestamptz NOT NULL, payload jsonb NOT NULL) PARTITION BY RANGE (id); \
             CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (1000); \
             INSERT INTO parted VALUES (1, 0, now(), '{{}}'), (2, 0, now() + interval '1 hour', '{{}}'); \
             CREATE ROLE {role}; \
             GRANT USAGE ON SCHEMA {schema} TO {role}; \
             GRANT SELECT ON visible TO {role};",
            schema = db.schema()
        ))
        .await
        .unwrap();

    // A table with a mistyped optional column is not a queue (loading its shape would fail);
    // a partitioned queue is listed once, as its parent.
    let queues = our_queues(&client, db.schema()).await;
    let names: Vec<&str> = queues.iter().map(|q| q.0.as_str()).collect();
    assert_eq!(names, ["hidden", "parted", "visible"]);
    assert_eq!(queues[1], ("parted".to_owned(), 1, 1, 0, 0));

    client
        .batch_execute(&format!("SET ROLE {role}"))
        .await
        .unwrap();
    let queues = our_queues(&client, db.schema()).await;
    let names: Vec<&str> = queues.iter().map(|q| q.0.as_str()).collect();
    assert_eq!(names, ["visible"], "only the tables the role may read");
    client
        .batch_execute(&format!(
            "RESET ROLE; DROP OWNED BY {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
}

#[tokio::test]
async fn inbox_metrics_reports_counts_and_ages_in_seconds() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('m'); \
             INSERT INTO m (payload, locked_until) VALUES ('{}', now() - interval '90 seconds'); \
             SELECT inbox_enqueue('m', '{}'); \
             SELECT inbox_enqueue('m', '{}', now() + interval '1 hour'); \
             CREATE TABLE plain (id int PRIMARY KEY, attempt int NOT NULL, \
                 locked_until timestamptz NOT NULL, payload bytea NOT NULL); \
             INSERT INTO plain VALUES (1, 1, now() + interval '1 minute', '\\x00');",
        )
        .await
        .unwrap();
    client
        .batch_execute("SELECT * FROM inbox_lease('m', 1, '5 minutes')")
        .await
        .unwrap();
    let prefix = format!("{}.", db.schema());
    let rows = client
        .query(
            "SELECT queue, ready, delayed, leased, dead, oldest_ready_age_seconds, \
                    oldest_lease_age_seconds FROM inbox_metrics() WHERE starts_with(queue, $1)",
            &[&prefix],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    let m = &rows[0];
    assert_eq!(m.get::<_, String>(0), format!("{prefix}m"));
    assert_eq!(
        (
            m.get::<_, i64>(1),
            m.get::<_, i64>(2),
            m.get::<_, i64>(3),
            m.get::<_, i64>(4)
        ),
        (1, 1, 1, 0),
        "the overdue job was leased first; one ready, one delayed, one leased"
    );
    let ready_age: f64 = m.get(5);
    assert!((0.0..60.0).contains(&ready_age), "{ready_age}");
    let lease_age: Option<f64> = m.get(6);
    assert!(
        lease_age.is_some_and(|age| (0.0..60.0).contains(&age)),
        "{lease_age:?}"
    );

    // Without `leased_at` the lease's age is unknown: NULL, not 0.
    let plain = &rows[1];
    assert_eq!(plain.get::<_, String>(0), format!("{prefix}plain"));
    assert_eq!(plain.get::<_, i64>(3), 1);
    assert_eq!(plain.get::<_, f64>(5), 0.0, "nothing ready");
    assert_eq!(plain.get::<_, Option<f64>>(6), None);
}

#[tokio::test]
async fn inbox_jobs_lists_by_state_and_refuses_bad_arguments() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('j'); \
             SELECT inbox_enqueue_batch('j', ARRAY['{\"n\":1}', '{\"n\":2}', '{\"n\":3}']::jsonb[]); \
             SELECT inbox_enqueue('j', '{\"n\":4}', now() + interval '1 day');",
        )
        .await
        .unwrap();
    let row = client
        .query_one("SELECT id, token FROM inbox_lease('j', 1)", &[])
        .await
        .unwrap();
    let (id, token): (i64, i64) = (row.get(0), row.get(1));
    client
        .execute("SELECT inbox_dead('j', $1, $2, 'poison')", &[&id, &token])
        .await
        .unwrap();
    let states = |state: Option<&'static str>, max: i32| {
        let client = &client;
        async move {
            client
                .query(
                    "SELECT state, payload->>'n', last_error FROM inbox_jobs('j', $1, $2)",
                    &[&state, &max],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    (
                        r.get::<_, String>(0),
                        r.get::<_, String>(1),
                        r.get::<_, Option<String>>(2),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let all = states(None, 100).await;
    let summary: Vec<(&str, &str)> = all
        .iter()
        .map(|(s, n, _)| (s.as_str(), n.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            ("ready", "2"),
            ("ready", "3"),
            ("delayed", "4"),
            ("dead", "1")
        ]
    );
    assert_eq!(all[3].2.as_deref(), Some("poison"));
    assert_eq!(states(Some("ready"), 1).await.len(), 1);
    assert_eq!(states(Some("delayed"), 10).await.len(), 1);
    assert_eq!(states(Some("leased"), 10).await.len(), 0);
    assert_eq!(states(Some("dead"), 10).await[0].1, "1");

    assert_eq!(
        sqlstate(&client, "SELECT * FROM inbox_jobs('j', 'stuck')").await,
        SqlState::INVALID_PARAMETER_VALUE
    );
    assert_eq!(
        sqlstate(&client, "SELECT * FROM inbox_jobs('j', NULL, 0)").await,
        SqlState::INVALID_PARAMETER_VALUE
    );
    assert_eq!(
        sqlstate(&client, "SELECT * FROM inbox_jobs(NULL)").await,
        SqlState::NULL_VALUE_NOT_ALLOWED
    );
    client
        .batch_execute("CREATE TABLE notq (id int)")
        .await
        .unwrap();
    assert_eq!(
        sqlstate(&client, "SELECT * FROM inbox_jobs('notq')").await,
        SqlState::UNDEFINED_COLUMN
    );
}

#[tokio::test]
async fn a_bounded_purge_deletes_at_most_max_keys_per_call() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_ledger('l'); \
             INSERT INTO l SELECT 'k' || g, now() - interval '2 days' FROM generate_series(1, 12345) g; \
             INSERT INTO l VALUES ('fresh', now());",
        )
        .await
        .unwrap();
    let purge = |max: i64| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT inbox_purge('l', now() - interval '1 day', $1)",
                    &[&max],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(purge(100).await, 100);
    assert_eq!(
        purge(11_000).await,
        11_000,
        "more than one statement's batch"
    );
    assert_eq!(purge(10_000).await, 1_245);
    assert_eq!(purge(10_000).await, 0);
    let left: i64 = client
        .query_one("SELECT count(*) FROM l", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1);

    for bad in [
        "SELECT inbox_purge('l', now(), 0)",
        "SELECT inbox_purge('l', 'infinity', 10)",
        "SELECT inbox_purge('l', '-infinity', 10)",
    ] {
        assert_eq!(
            sqlstate(&client, bad).await,
            SqlState::INVALID_PARAMETER_VALUE,
            "{bad}"
        );
    }
    assert_eq!(
        sqlstate(&client, "SELECT inbox_purge('l', now(), NULL::bigint)").await,
        SqlState::NULL_VALUE_NOT_ALLOWED
    );
    // The unbounded form keeps its two arguments, so untyped calls stay unambiguous.
    let purged: i64 = client
        .query_one("SELECT inbox_purge('l', now() + interval '1 second')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(purged, 1);
}

#[tokio::test]
async fn a_queue_locked_exclusively_is_left_out_rather_than_waited_for() {
    let db = TestDb::new().await;
    let migration = db.client().await;
    let monitor = db.client().await;
    migration
        .batch_execute("SELECT inbox_create_queue('busy'); SELECT inbox_create_queue('calm')")
        .await
        .unwrap();
    migration
        .batch_execute("BEGIN; LOCK TABLE busy IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    monitor
        .batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    let names = |rows: Vec<(String, i64, i64, i64, i64)>| -> Vec<String> {
        rows.into_iter().map(|row| row.0).collect()
    };
    assert_eq!(names(our_queues(&monitor, db.schema()).await), ["calm"]);
    migration.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        names(our_queues(&monitor, db.schema()).await),
        ["busy", "calm"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_dropped_while_the_metrics_are_read_is_left_out() {
    let db = TestDb::new().await;
    let migration = db.client().await;
    let monitor = db.client().await;
    migration
        .batch_execute("SELECT inbox_create_queue('steady'); SELECT inbox_create_queue('doomed')")
        .await
        .unwrap();
    migration
        .batch_execute("BEGIN; DROP TABLE doomed")
        .await
        .unwrap();
    let prefix = format!("{}.", db.schema());
    let read = tokio::spawn(async move {
        monitor
            .query(
                "SELECT queue FROM inbox_metrics() WHERE starts_with(queue, $1)",
                &[&prefix],
            )
            .await
            .map(|rows| {
                rows.iter()
                    .map(|row| row.get::<_, String>(0))
                    .collect::<Vec<_>>()
            })
    });
    // The drop commits while the metrics may be waiting for it: they must neither wait for it
    // nor fail on the table it removed.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    migration.batch_execute("COMMIT").await.unwrap();
    let queues = read
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("inbox_metrics failed beside a DROP TABLE: {e}"));
    assert_eq!(queues, [format!("{}.steady", db.schema())]);
}

#[tokio::test]
async fn jobs_waiting_behind_their_group_head_are_delayed_not_dead() {
    // A queue with ordered groups keeps the jobs behind a group's head at
    // `locked_until = 'infinity'` with `dead_at` NULL; a dead job has `dead_at` set.
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE g (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                 locked_until timestamptz NOT NULL, leased_at timestamptz, payload jsonb NOT NULL, \
                 group_key text, dead_at timestamptz, last_error text); \
             INSERT INTO g VALUES \
                 (1, 0, now() - interval '1 second', NULL, '{}', 'a', NULL, NULL), \
                 (2, 0, 'infinity', NULL, '{}', 'a', NULL, NULL), \
                 (3, 0, 'infinity', NULL, '{}', 'a', NULL, NULL), \
                 (4, 3, 'infinity', NULL, '{}', 'b', now(), 'poison');",
        )
        .await
        .unwrap();
    let prefix = format!("{}.", db.schema());
    let row = client
        .query_one(
            "SELECT ready, delayed, leased, dead FROM inbox_metrics() WHERE queue = $1",
            &[&format!("{prefix}g")],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
            row.get::<_, i64>(3)
        ),
        (1, 2, 0, 1)
    );
    let states: Vec<(i64, String)> = client
        .query("SELECT id, state FROM inbox_jobs('g')", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        states,
        [
            (1, "ready".to_owned()),
            (2, "delayed".to_owned()),
            (3, "delayed".to_owned()),
            (4, "dead".to_owned())
        ]
    );
    let dead: Vec<i64> = client
        .query("SELECT id FROM inbox_jobs('g', 'dead')", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dead, [4]);
    let delayed: i64 = client
        .query_one("SELECT count(*) FROM inbox_jobs('g', 'delayed')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(delayed, 2);
}

#[tokio::test]
async fn metrics_count_what_inbox_stats_counts_with_ordered_groups() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('grouped'); \
             SELECT inbox_enqueue('grouped', '{}', group_key => 'a'); \
             SELECT inbox_enqueue('grouped', '{}', group_key => 'a'); \
             SELECT inbox_enqueue('grouped', '{}', group_key => 'a'); \
             SELECT inbox_enqueue('grouped', '{}', group_key => 'b'); \
             SELECT inbox_enqueue('grouped', '{}', now() + interval '1 hour');",
        )
        .await
        .unwrap();
    // Dead-letter group b's only job.
    let row = client
        .query_one(
            "SELECT id, token FROM inbox_lease('grouped', 10) AS l \
              JOIN grouped USING (id) WHERE grouped.group_key = 'b'",
            &[],
        )
        .await
        .unwrap();
    let (id, token): (i64, i64) = (row.get(0), row.get(1));
    client
        .execute(
            "SELECT inbox_dead('grouped', $1, $2, 'poison')",
            &[&id, &token],
        )
        .await
        .unwrap();
    let stats = client
        .query_one(
            "SELECT ready, delayed, leased, dead FROM inbox_stats('grouped')",
            &[],
        )
        .await
        .unwrap();
    let metrics = client
        .query_one(
            "SELECT ready, delayed, leased, dead FROM inbox_metrics() WHERE queue = $1",
            &[&format!("{}.grouped", db.schema())],
        )
        .await
        .unwrap();
    let counts = |row: &tokio_postgres::Row| -> Vec<i64> { (0..4).map(|i| row.get(i)).collect() };
    assert_eq!(counts(&metrics), counts(&stats));
    assert_eq!(counts(&metrics)[3], 1, "one dead job");
    let jobs: i64 = client
        .query_one("SELECT count(*) FROM inbox_jobs('grouped', 'delayed')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(jobs, counts(&stats)[1]);
}
