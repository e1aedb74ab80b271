//! The extension's own SQL-level checks (its `#[pg_test]`s) over real connections, so that they
//! hold for whichever build the test database has: the pgrx extension or the SQL-only script.
//! Each keeps its results and SQLSTATEs; what other tests here already check is left to them
//! (`sql_input.rs`: most NULL and out-of-range arguments; `extension_concurrency.rs`: races,
//! privileges of leases). The tests of `schedule.rs` call its Rust functions; `cron_conformance.rs`
//! checks the same cases through SQL.

use inbox_tests::TestDb;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::FromSqlOwned;
use tokio_postgres::Client;

/// A test's schema with the ledger `seen`, the queue `jobs`, and `refund_jobs`, a user's queue
/// with a `bytea` payload, a nullable `locked_until`, `attempt` defaulting to 1 and no optional
/// column.
async fn setup() -> (TestDb, Client) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_ledger('seen'); SELECT inbox_create_queue('jobs'); \
             CREATE TABLE refund_jobs (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 1, \
                                       locked_until timestamptz, payload bytea NOT NULL);",
        )
        .await
        .unwrap_or_else(|e| panic!("setup: {e}"));
    (db, client)
}

/// The SQLSTATE `sql` fails with, or `None` when it succeeds.
async fn sqlstate(client: &Client, sql: &str) -> Option<SqlState> {
    match client.batch_execute(sql).await {
        Ok(()) => None,
        Err(error) => Some(
            error
                .code()
                .cloned()
                .unwrap_or_else(|| panic!("{sql}: no SQLSTATE ({error})")),
        ),
    }
}

async fn assert_sqlstate(client: &Client, sql: &str, expected: SqlState) {
    let code = sqlstate(client, sql).await;
    assert_eq!(code, Some(expected), "{sql}");
}

/// The SQLSTATE and message `sql` fails with.
async fn failure(client: &Client, sql: &str) -> (SqlState, String) {
    let error = client.batch_execute(sql).await.expect_err(sql);
    let db_error = error
        .as_db_error()
        .unwrap_or_else(|| panic!("{sql}: not a server error ({error})"));
    (db_error.code().clone(), db_error.message().to_owned())
}

/// The first column of the only row of `sql`.
async fn one<T: FromSqlOwned>(client: &Client, sql: &str) -> T {
    client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// A count, 0 for NULL.
async fn count(client: &Client, sql: &str) -> i64 {
    one::<Option<i64>>(client, sql).await.unwrap_or(0)
}

async fn run(client: &Client, sql: &str) {
    client
        .batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

// ---- The dedup ledger ----

#[tokio::test]
async fn claim_is_true_once_and_seen_after() {
    let (_db, client) = setup().await;
    assert!(!one::<bool>(&client, "SELECT inbox_seen('seen', 'k')").await);
    assert!(one::<bool>(&client, "SELECT inbox_claim('seen', 'k')").await);
    assert!(!one::<bool>(&client, "SELECT inbox_claim('seen', 'k', now() + '1 day')").await);
    assert!(one::<bool>(&client, "SELECT inbox_seen('seen', 'k')").await);
    assert_eq!(count(&client, "SELECT count(*) FROM seen").await, 1);
}

#[tokio::test]
async fn claim_or_fail_raises_unique_violation_for_a_duplicate() {
    let (_db, client) = setup().await;
    run(&client, "SELECT inbox_claim_or_fail('seen', 'k')").await;
    assert_sqlstate(
        &client,
        "SELECT inbox_claim_or_fail('seen', 'k')",
        SqlState::UNIQUE_VIOLATION,
    )
    .await;
    assert_eq!(count(&client, "SELECT count(*) FROM seen").await, 1);
}

#[tokio::test]
async fn purge_deletes_old_keys_in_batches() {
    let (_db, client) = setup().await;
    run(
        &client,
        "INSERT INTO seen SELECT 'old' || i, now() - '2 days'::interval FROM generate_series(1, 25000) i; \
         INSERT INTO seen VALUES ('new', now())",
    )
    .await;
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_purge('seen', now() - '1 day'::interval)"
        )
        .await,
        25000,
        "more keys than one statement's batch"
    );
    assert_eq!(count(&client, "SELECT count(*) FROM seen").await, 1);
    assert!(one::<bool>(&client, "SELECT inbox_claim('seen', 'old1')").await);
}

// ---- Table names and shapes ----

#[tokio::test]
async fn create_is_idempotent_and_refuses_a_wrong_shape() {
    let (db, client) = setup().await;
    assert_eq!(
        one::<String>(&client, "SELECT inbox_create_queue('jobs')::text").await,
        "jobs"
    );
    assert_eq!(
        one::<String>(&client, "SELECT inbox_create_ledger('seen')::text").await,
        "seen"
    );
    // A schema outside the search_path, so that the created table's name comes back qualified.
    let app = format!("{}_app", db.schema());
    run(
        &client,
        &format!("CREATE SCHEMA {app}; CREATE TABLE {app}.notes (event_key text)"),
    )
    .await;
    let odd = one::<String>(
        &client,
        &format!("SELECT inbox_create_ledger('{app}.\"Odd \"\"Name\"\"\"')::text"),
    )
    .await;
    let refused = [
        sqlstate(
            &client,
            &format!("SELECT inbox_create_ledger('{app}.notes')"),
        )
        .await,
        sqlstate(&client, "SELECT inbox_create_queue('seen')").await,
    ];
    run(&client, &format!("DROP SCHEMA {app} CASCADE")).await;
    assert_eq!(odd, format!("{app}.\"Odd \"\"Name\"\"\""));
    assert_eq!(
        refused,
        [
            Some(SqlState::UNDEFINED_COLUMN),
            Some(SqlState::UNDEFINED_COLUMN)
        ]
    );
}

#[tokio::test]
async fn bad_names_change_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let tables = "SELECT count(*) FROM pg_class \
                  WHERE relkind = 'r' AND relnamespace = current_schema()::text::regnamespace";
    let before = count(&client, tables).await;
    for (sql, expected) in [
        (
            "SELECT inbox_create_ledger('x; DROP TABLE y')".to_owned(),
            SqlState::INVALID_NAME,
        ),
        (
            "SELECT inbox_create_queue('a''b')".to_owned(),
            SqlState::INVALID_NAME,
        ),
        (
            "SELECT inbox_create_queue('\"unterminated')".to_owned(),
            SqlState::INVALID_NAME,
        ),
        (
            "SELECT inbox_create_queue('a.b.c')".to_owned(),
            SqlState::INVALID_NAME,
        ),
        (
            format!("SELECT inbox_create_queue('{}')", "q".repeat(64)),
            SqlState::NAME_TOO_LONG,
        ),
        (
            "SELECT inbox_create_queue(NULL)".to_owned(),
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "SELECT inbox_create_queue('nosuchschema.q')".to_owned(),
            SqlState::INVALID_SCHEMA_NAME,
        ),
    ] {
        assert_sqlstate(&client, &sql, expected).await;
    }
    assert_eq!(count(&client, tables).await, before);
    // 63 bytes is the longest name PostgreSQL keeps whole.
    run(
        &client,
        &format!("SELECT inbox_create_queue('{}')", "q".repeat(63)),
    )
    .await;
    assert_eq!(count(&client, tables).await, before + 1);
}

#[tokio::test]
async fn unknown_tables_and_other_relations_are_refused() {
    let (_db, client) = setup().await;
    for (sql, expected) in [
        (
            "SELECT inbox_claim('nosuch', 'k')",
            SqlState::UNDEFINED_TABLE,
        ),
        (
            "SELECT inbox_claim(4000000000::oid::regclass, 'k')",
            SqlState::UNDEFINED_TABLE,
        ),
        (
            "SELECT inbox_ack(4000000000::oid::regclass, 1, 1)",
            SqlState::UNDEFINED_TABLE,
        ),
        (
            "SELECT inbox_claim('pg_class_oid_index', 'k')",
            SqlState::WRONG_OBJECT_TYPE,
        ),
    ] {
        assert_sqlstate(&client, sql, expected).await;
    }
}

#[tokio::test]
async fn wrong_shapes_are_named() {
    let (_db, client) = setup().await;
    run(
        &client,
        "CREATE TABLE no_payload (id bigint, attempt int, locked_until timestamptz); \
         CREATE TABLE text_payload (id bigint, attempt int, locked_until timestamptz, payload text); \
         CREATE TABLE no_unique (event_key text, seen_at timestamptz); \
         CREATE TABLE keys_not_unique (id bigint, attempt int, locked_until timestamptz, \
                                       payload jsonb, key text);",
    )
    .await;
    for (sql, expected) in [
        (
            "SELECT inbox_enqueue('no_payload', '{}')",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT * FROM inbox_lease('no_payload')",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_ack('no_payload', 1, 1)",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_enqueue('text_payload', '{}')",
            SqlState::DATATYPE_MISMATCH,
        ),
        (
            "SELECT inbox_claim('no_unique', 'k')",
            SqlState::INVALID_COLUMN_REFERENCE,
        ),
        (
            "SELECT inbox_claim('jobs', 'k')",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_enqueue('keys_not_unique', '{}')",
            SqlState::INVALID_COLUMN_REFERENCE,
        ),
        (
            "SELECT inbox_enqueue_bytes('jobs', '\\x00'::bytea)",
            SqlState::DATATYPE_MISMATCH,
        ),
        (
            "SELECT inbox_enqueue('refund_jobs', '{}'::jsonb)",
            SqlState::DATATYPE_MISMATCH,
        ),
        (
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x00'::bytea, now(), 'k')",
            SqlState::UNDEFINED_COLUMN,
        ),
    ] {
        assert_sqlstate(&client, sql, expected).await;
    }
}

#[tokio::test]
async fn calls_follow_the_table_through_ddl() {
    let (_db, client) = setup().await;
    assert!(one::<bool>(&client, "SELECT inbox_claim('seen', 'a')").await);
    // After a rename and a new table of the old name, each oid must still reach its own table.
    // Two statements, not one string: Citus cannot run a DDL sent with others in one query.
    run(&client, "ALTER TABLE seen RENAME TO seen_before").await;
    run(&client, "SELECT inbox_create_ledger('seen')").await;
    assert!(one::<bool>(&client, "SELECT inbox_claim('seen', 'a')").await);
    assert!(!one::<bool>(&client, "SELECT inbox_claim('seen_before', 'a')").await);
    run(&client, "ALTER TABLE seen_before DROP COLUMN seen_at").await;
    assert_sqlstate(
        &client,
        "SELECT inbox_claim('seen_before', 'b')",
        SqlState::UNDEFINED_COLUMN,
    )
    .await;
}

/// A session that used a queue goes on with the table as it is after each change (the SQL-only
/// build keeps its statements per session and must notice): a rename and a new table of the old
/// name, a column dropped and added again (priorities), a column dropped (keys).
#[tokio::test]
async fn a_sessions_queue_calls_follow_the_table_through_ddl() {
    let (_db, client) = setup().await;
    let round = |queue: &'static str| {
        let client = &client;
        async move {
            let id: i64 = one(client, &format!("SELECT inbox_enqueue('{queue}', '{{}}')")).await;
            let (leased, token): (i64, i64) = {
                let row = client
                    .query_one(
                        &format!("SELECT id, token FROM inbox_lease('{queue}')"),
                        &[],
                    )
                    .await
                    .unwrap_or_else(|e| panic!("lease of {queue}: {e}"));
                (row.get(0), row.get(1))
            };
            assert_eq!(leased, id, "{queue}");
            assert!(
                one::<bool>(
                    client,
                    &format!("SELECT inbox_ack('{queue}', {id}, {token})")
                )
                .await
            );
            id
        }
    };
    round("jobs").await;
    run(&client, "ALTER TABLE jobs RENAME TO jobs_before").await;
    run(&client, "SELECT inbox_create_queue('jobs')").await;
    run(
        &client,
        "SELECT inbox_enqueue('jobs_before', '{\"at\": \"before\"}')",
    )
    .await;
    run(&client, "SELECT inbox_enqueue('jobs', '{\"at\": \"new\"}')").await;
    assert_eq!(count(&client, "SELECT count(*) FROM jobs_before").await, 1);
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 1);
    let payload: serde_json::Value = one(&client, "SELECT payload FROM inbox_lease('jobs')").await;
    assert_eq!(payload, serde_json::json!({"at": "new"}));
    let payload: serde_json::Value =
        one(&client, "SELECT payload FROM inbox_lease('jobs_before')").await;
    assert_eq!(payload, serde_json::json!({"at": "before"}));

    // A column dropped (enqueues with a priority are refused from then on), then added again
    // (priorities are taken in their order).
    run(&client, "ALTER TABLE jobs_before DROP COLUMN priority").await;
    round("jobs_before").await;
    assert_sqlstate(
        &client,
        "SELECT inbox_enqueue('jobs_before', '{}', priority => 5)",
        SqlState::UNDEFINED_COLUMN,
    )
    .await;
    run(
        &client,
        "ALTER TABLE jobs_before ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await;
    let low: i64 = one(
        &client,
        "SELECT inbox_enqueue('jobs_before', '{}', priority => 1)",
    )
    .await;
    let high: i64 = one(
        &client,
        "SELECT inbox_enqueue('jobs_before', '{}', priority => 9)",
    )
    .await;
    let first: i64 = one(&client, "SELECT id FROM inbox_lease('jobs_before')").await;
    assert_eq!(first, high, "the higher priority first (then {low})");

    // A column dropped: enqueues without a key go on; one with a key is refused.
    run(&client, "ALTER TABLE jobs DROP COLUMN key").await;
    round("jobs").await;
    assert_sqlstate(
        &client,
        "SELECT inbox_enqueue('jobs', '{}', key => 'k')",
        SqlState::UNDEFINED_COLUMN,
    )
    .await;
}

// ---- Arguments ----

#[tokio::test]
async fn every_function_refuses_nulls() {
    let (_db, client) = setup().await;
    for sql in [
        "SELECT inbox_claim(NULL, 'k')",
        "SELECT inbox_seen('seen', NULL)",
        "SELECT inbox_seen(NULL, 'k')",
        "SELECT inbox_purge('seen', NULL)",
        "SELECT inbox_enqueue('jobs', NULL::jsonb)",
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}', NULL]::jsonb[])",
        "SELECT inbox_enqueue_batch('jobs', NULL::jsonb[])",
        "SELECT inbox_ack('jobs', 1, NULL)",
        "SELECT inbox_retry('jobs', 1, 1, NULL)",
        "SELECT inbox_stats(NULL)",
        // The arguments added since the first release.
        "SELECT inbox_enqueue_bytes('refund_jobs', NULL)",
        "SELECT inbox_enqueue_batch_bytes('refund_jobs', NULL)",
        "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY[NULL]::bytea[])",
        "SELECT inbox_enqueue('jobs', '{}', priority => NULL)",
        "SELECT inbox_ack_batch('jobs', ARRAY[1]::int8[], NULL)",
        "SELECT inbox_dead('jobs', NULL, 1)",
        "SELECT * FROM inbox_lock('jobs', NULL)",
        "SELECT inbox_requeue('jobs', NULL)",
        "SELECT inbox_requeue(NULL, 1)",
        "SELECT inbox_requeue_dead(NULL)",
        "SELECT inbox_discard('jobs', NULL)",
        "SELECT * FROM inbox_dead_jobs('jobs', NULL)",
        "SELECT inbox_channel(NULL)",
    ] {
        assert_sqlstate(&client, sql, SqlState::NULL_VALUE_NOT_ALLOWED).await;
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM refund_jobs").await, 0);
}

#[tokio::test]
async fn bad_counts_intervals_and_arrays_are_refused() {
    let (_db, client) = setup().await;
    for sql in [
        "SELECT * FROM inbox_lock('jobs', -1)",
        "SELECT inbox_extend('jobs', 1, 1, '-1 second')",
        "SELECT inbox_retry('jobs', 1, 1, '-1 second')",
        "SELECT inbox_requeue_dead('jobs', 0)",
        "SELECT * FROM inbox_dead_jobs('jobs', -1)",
    ] {
        assert_sqlstate(&client, sql, SqlState::INVALID_PARAMETER_VALUE).await;
    }
    for sql in [
        "SELECT inbox_ack_batch('jobs', ARRAY[1,2]::bigint[], ARRAY[1]::bigint[])",
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], now(), ARRAY['a','b'])",
        "SELECT inbox_enqueue_batch('jobs', ARRAY[['{}']]::jsonb[])",
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], group_keys => ARRAY['a', 'b'])",
    ] {
        assert_sqlstate(&client, sql, SqlState::ARRAY_SUBSCRIPT_ERROR).await;
    }
    for (sql, expected) in [
        (
            "SELECT inbox_enqueue('refund_jobs', '{}', priority => 2)",
            SqlState::DATATYPE_MISMATCH,
        ),
        (
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', priority => 2)",
            SqlState::UNDEFINED_COLUMN,
        ),
        (
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', group_key => 'g')",
            SqlState::UNDEFINED_COLUMN,
        ),
    ] {
        assert_sqlstate(&client, sql, expected).await;
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM refund_jobs").await, 0);
}

#[tokio::test]
async fn untyped_literals_pick_one_function() {
    let (_db, client) = setup().await;
    // Each of these was ambiguous while the bytea forms and the array ack were overloads.
    for sql in [
        "SELECT inbox_enqueue('jobs', '{\"to\": \"a\"}')",
        "SELECT inbox_enqueue('jobs', '{}', now() + interval '1 hour', key => 'k')",
        "SELECT inbox_enqueue('jobs', '{}', '2030-01-01', 'k2')",
        "SELECT inbox_enqueue_batch('jobs', '{\"{}\",\"{}\"}')",
        "SELECT inbox_ack('jobs', '1', '1')",
        "SELECT inbox_ack_batch('jobs', '{1}', '{1}')",
        "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01')",
        "SELECT inbox_enqueue_batch_bytes('refund_jobs', '{\"\\\\x01\"}')",
    ] {
        assert_eq!(sqlstate(&client, sql).await, None, "{sql}");
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 5);
    assert_eq!(count(&client, "SELECT count(*) FROM refund_jobs").await, 2);
}

#[tokio::test]
async fn non_finite_times_are_refused_and_write_nothing() {
    let (_db, client) = setup().await;
    for sql in [
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], 'infinity')",
        "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', '-infinity')",
        "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01']::bytea[], 'infinity')",
        "SELECT inbox_claim_or_fail('seen', 'k', '-infinity')",
        "SELECT inbox_purge('seen', 'infinity')",
    ] {
        assert_sqlstate(&client, sql, SqlState::INVALID_PARAMETER_VALUE).await;
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM refund_jobs").await, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM seen").await, 0);
    assert_eq!(
        count(
            &client,
            "SELECT ready + delayed + leased + dead FROM inbox_stats('jobs')"
        )
        .await,
        0
    );
}

// ---- Enqueue, lease, lock, settle ----

#[tokio::test]
async fn enqueue_dedups_by_key_and_batches_in_order() {
    let (_db, client) = setup().await;
    let first = one::<Option<i64>>(
        &client,
        "SELECT inbox_enqueue('jobs', '{\"n\":1}', key => 'k')",
    )
    .await;
    assert!(first.is_some());
    assert_eq!(
        one::<Option<i64>>(
            &client,
            "SELECT inbox_enqueue('jobs', '{\"n\":2}', key => 'k')"
        )
        .await,
        None
    );
    let ids = client
        .query(
            "SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{\"n\":3}','{\"n\":4}','{\"n\":5}']::jsonb[], \
                                              now(), ARRAY['k', 'x', 'x'])",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        ids.len(),
        1,
        "k is queued and x is repeated within the batch"
    );
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 2);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01', '\\x02']::bytea[])"
        )
        .await,
        2
    );
    let payloads: Vec<Vec<u8>> = client
        .query("SELECT payload FROM refund_jobs ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(payloads, [vec![1], vec![2]], "ids follow the batch's order");
}

#[tokio::test]
async fn lease_takes_due_jobs_in_order_and_counts_attempts() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue('jobs', '{\"n\":2}', now() - '1 minute'::interval); \
         SELECT inbox_enqueue('jobs', '{\"n\":1}', now() - '2 minutes'::interval); \
         SELECT inbox_enqueue('jobs', '{\"n\":3}', now() + '1 hour'::interval);",
    )
    .await;
    let taken: Vec<(i32, i64, String)> = client
        .query(
            "SELECT attempt, token, payload->>'n' FROM inbox_lease('jobs', 10, '1 minute')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(taken, [(1, 1, "1".to_owned()), (1, 1, "2".to_owned())]);
    assert_eq!(
        count(&client, "SELECT count(*) FROM inbox_lease('jobs', 10)").await,
        0,
        "leased and delayed jobs are invisible"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE leased_at IS NOT NULL AND locked_until > now()"
        )
        .await,
        2
    );
    assert_eq!(
        one::<String>(&client, "SELECT s::text FROM inbox_stats('jobs') s").await,
        "(0,1,2,0,,f)"
    );
}

#[tokio::test]
async fn lock_writes_nothing_and_its_settlement_counts_the_attempt() {
    let (_db, client) = setup().await;
    run(&client, "SELECT inbox_enqueue('jobs', '{}')").await;
    // In one transaction, as a worker that locks holds its jobs.
    run(&client, "BEGIN").await;
    assert_eq!(
        one::<String>(
            &client,
            "SELECT format('%s %s', attempt, token) FROM inbox_lock('jobs')"
        )
        .await,
        "1 -1",
        "the first delivery, with a lock's (negative) token"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE attempt = 0 AND leased_at IS NULL"
        )
        .await,
        1
    );
    assert!(
        !one::<bool>(&client, "SELECT inbox_extend('jobs', 1, -1, '1 hour')").await,
        "no lease to extend"
    );
    assert!(
        !one::<bool>(&client, "SELECT inbox_ack('jobs', 1, 1)").await,
        "not a lease's token"
    );
    assert!(
        one::<bool>(
            &client,
            "SELECT inbox_retry('jobs', 1, -1, '0 seconds', 'again', 2)"
        )
        .await
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE attempt = 1 AND last_error = 'again'"
        )
        .await,
        1
    );
    assert!(
        !one::<bool>(&client, "SELECT inbox_retry('jobs', 1, -1)").await,
        "settled once"
    );
    assert_eq!(
        one::<String>(
            &client,
            "SELECT format('%s %s', attempt, token) FROM inbox_lock('jobs')"
        )
        .await,
        "2 -2"
    );
    // The second delivery reaches max_attempts: dead-lettered, its attempt counted.
    assert!(
        one::<bool>(
            &client,
            "SELECT inbox_retry('jobs', 1, -2, '0 seconds', 'last', 2)"
        )
        .await
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE attempt = 2 AND locked_until = 'infinity'"
        )
        .await,
        1
    );
    run(&client, "COMMIT").await;
}

#[tokio::test]
async fn user_tables_with_nullable_locked_until_and_bytea_work() {
    let (_db, client) = setup().await;
    run(
        &client,
        "INSERT INTO refund_jobs (payload) VALUES ('\\x01'); \
         SELECT inbox_enqueue_bytes('refund_jobs', '\\x02'::bytea)",
    )
    .await;
    let taken: Vec<(i32, Option<Vec<u8>>, bool)> = client
        .query(
            "SELECT attempt, payload_bytes, payload IS NULL FROM inbox_lease('refund_jobs', 5)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(
        taken,
        [(2, Some(vec![1]), true), (2, Some(vec![2]), true)],
        "NULL locked_until is due first"
    );
    assert!(one::<bool>(&client, "SELECT inbox_ack('refund_jobs', 1, 2)").await);
    assert!(
        one::<bool>(
            &client,
            "SELECT inbox_retry('refund_jobs', 2, 2, '1 hour', 'ignored: no last_error column')"
        )
        .await
    );
    assert_eq!(
        one::<String>(&client, "SELECT s::text FROM inbox_stats('refund_jobs') s").await,
        "(0,0,1,0,,f)"
    );
}

#[tokio::test]
async fn settlement_is_fenced_by_the_token() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue('jobs', '{}'); SELECT * FROM inbox_lease('jobs')",
    )
    .await;
    // The lease expires and a second delivery takes the job: the first token is stale.
    run(
        &client,
        "UPDATE jobs SET locked_until = now() - '1 second'::interval",
    )
    .await;
    assert_eq!(
        one::<i64>(&client, "SELECT token FROM inbox_lease('jobs')").await,
        2
    );
    for stale in [
        "SELECT inbox_ack('jobs', 1, 1)",
        "SELECT inbox_retry('jobs', 1, 1)",
        "SELECT inbox_dead('jobs', 1, 1, 'x')",
        "SELECT inbox_extend('jobs', 1, 1, '1 hour')",
    ] {
        assert!(!one::<bool>(&client, stale).await, "{stale}");
    }
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_ack_batch('jobs', ARRAY[1]::bigint[], ARRAY[1]::bigint[])"
        )
        .await,
        0
    );
    assert!(one::<bool>(&client, "SELECT inbox_extend('jobs', 1, 2, '1 hour')").await);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE locked_until > now() + '59 minutes'::interval"
        )
        .await,
        1
    );
    assert!(one::<bool>(&client, "SELECT inbox_ack('jobs', 1, 2)").await);
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 0);
}

#[tokio::test]
async fn ack_batch_finishes_only_current_tokens() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}','{}','{}']::jsonb[]); \
         SELECT * FROM inbox_lease('jobs', 3)",
    )
    .await;
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_ack_batch('jobs', ARRAY[1,2,3]::bigint[], ARRAY[1,1,9]::bigint[])"
        )
        .await,
        2
    );
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 1);
}

#[tokio::test]
async fn retry_delays_and_dead_letters_past_max_attempts() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue('jobs', '{}'); SELECT * FROM inbox_lease('jobs')",
    )
    .await;
    assert!(
        one::<bool>(
            &client,
            "SELECT inbox_retry('jobs', 1, 1, '1 hour', 'timeout', 2)"
        )
        .await
    );
    assert!(
        !one::<bool>(&client, "SELECT inbox_extend('jobs', 1, 1, '2 hours')").await,
        "a retried job is no longer leased"
    );
    assert_eq!(
        one::<String>(
            &client,
            "SELECT format('%s|%s|%s', locked_until > now() + '59 minutes', leased_at IS NULL, last_error) FROM jobs"
        )
        .await,
        "t|t|timeout"
    );
    run(
        &client,
        "UPDATE jobs SET locked_until = now() - '1 second'::interval",
    )
    .await;
    assert_eq!(
        one::<i64>(&client, "SELECT token FROM inbox_lease('jobs')").await,
        2
    );
    assert!(
        one::<bool>(
            &client,
            "SELECT inbox_retry('jobs', 1, 2, '1 second', 'again', 2)"
        )
        .await
    );
    assert_eq!(
        one::<String>(&client, "SELECT s::text FROM inbox_stats('jobs') s").await,
        "(0,0,0,1,,f)"
    );
    assert_eq!(
        one::<String>(
            &client,
            "SELECT last_error FROM jobs WHERE locked_until = 'infinity'"
        )
        .await,
        "again"
    );
    assert!(
        !one::<bool>(&client, "SELECT inbox_ack('jobs', 1, 2)").await,
        "dead jobs are settled by no one"
    );
}

#[tokio::test]
async fn dead_keeps_the_job_with_its_reason() {
    let (_db, client) = setup().await;
    run(&client, "SELECT inbox_enqueue('jobs', '{}')").await;
    run(&client, "BEGIN").await;
    run(&client, "SELECT * FROM inbox_lock('jobs')").await;
    assert!(one::<bool>(&client, "SELECT inbox_dead('jobs', 1, -1, 'undecodable')").await);
    run(&client, "COMMIT").await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM jobs WHERE attempt = 1").await,
        1,
        "the locked delivery counted"
    );
    assert_eq!(
        one::<String>(
            &client,
            "SELECT last_error FROM jobs WHERE locked_until = 'infinity'"
        )
        .await,
        "undecodable"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM inbox_lease('jobs')").await,
        0
    );
}

#[tokio::test]
async fn stats_tells_states_apart() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}','{}','{}','{}']::jsonb[], now() - '1 minute'::interval); \
         SELECT inbox_enqueue('jobs', '{}', now() + '1 hour'::interval); \
         SELECT * FROM inbox_lease('jobs', 2); \
         SELECT inbox_dead('jobs', 2, 1, 'x');",
    )
    .await;
    assert_eq!(
        one::<String>(
            &client,
            "SELECT format('%s %s %s %s %s', ready, delayed, leased, dead, oldest_ready_age >= '1 minute') \
               FROM inbox_stats('jobs')"
        )
        .await,
        "2 1 1 1 t"
    );
}

#[tokio::test]
async fn channel_names_the_queue() {
    let (_db, client) = setup().await;
    let oid: u32 = one(&client, "SELECT 'jobs'::regclass::oid").await;
    assert_eq!(
        one::<String>(&client, "SELECT inbox_channel('jobs')").await,
        format!("inbox_{oid}")
    );
}

// ---- Dead letters and ordered groups ----

#[tokio::test]
async fn dead_letters_of_a_table_without_dead_at() {
    let (_db, client) = setup().await;
    // refund_jobs has no dead_at, last_error or group_key: 'infinity' alone marks the dead.
    run(
        &client,
        "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01', '\\x02']::bytea[]); \
         SELECT count(*) FROM inbox_lease('refund_jobs', 2); \
         SELECT inbox_dead('refund_jobs', 1, 2, 'x'); SELECT inbox_dead('refund_jobs', 2, 2, 'y')",
    )
    .await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_dead_jobs('refund_jobs')"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_dead_jobs('refund_jobs') \
              WHERE payload_bytes IS NOT NULL AND payload IS NULL AND dead_at IS NULL AND last_error IS NULL"
        )
        .await,
        2
    );
    assert!(one::<bool>(&client, "SELECT inbox_requeue('refund_jobs', 1)").await);
    assert!(!one::<bool>(&client, "SELECT inbox_discard('refund_jobs', 1)").await);
    assert!(one::<bool>(&client, "SELECT inbox_discard('refund_jobs', 2)").await);
    assert_eq!(
        one::<i32>(
            &client,
            "SELECT attempt FROM refund_jobs WHERE id = 1 AND locked_until <= clock_timestamp()"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &client,
            "SELECT ready + delayed + leased + dead FROM inbox_stats('refund_jobs')"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn waiting_jobs_count_as_delayed_and_cannot_be_settled() {
    let (_db, client) = setup().await;
    run(
        &client,
        "SELECT inbox_enqueue('jobs', '1', group_key => 'g'); \
         SELECT inbox_enqueue('jobs', '2', group_key => 'g'); \
         SELECT inbox_enqueue('jobs', '3', group_key => 'g')",
    )
    .await;
    assert_eq!(
        count(
            &client,
            "SELECT ready * 100 + delayed * 10 + dead FROM inbox_stats('jobs')"
        )
        .await,
        120
    );
    // A waiting job has never been delivered: no token settles it, it is not dead.
    for sql in [
        "SELECT inbox_ack('jobs', 2, -1)",
        "SELECT inbox_ack('jobs', 2, 0)",
        "SELECT inbox_dead('jobs', 2, -1)",
        "SELECT inbox_requeue('jobs', 2)",
        "SELECT inbox_discard('jobs', 2)",
    ] {
        assert!(!one::<bool>(&client, sql).await, "{sql}");
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 3);
}

// ---- The worker's calls: inbox_ack_all and inbox_fence ----

/// The queue `jobs` with jobs 1, 2 and 3 leased once (token 1), and job 4 dead.
async fn held_jobs() -> (TestDb, Client) {
    let db = TestDb::new().await;
    let client = db.client().await;
    run(
        &client,
        "SELECT inbox_create_queue('jobs'); \
         SELECT inbox_enqueue('jobs', '{}') FROM generate_series(1, 4); \
         SELECT count(*) FROM inbox_lease('jobs', 4, '30 seconds'); \
         SELECT inbox_dead('jobs', 4, 1, 'gone');",
    )
    .await;
    (db, client)
}

#[tokio::test]
async fn ack_all_acks_every_job_held() {
    let (_db, client) = held_jobs().await;
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1, 1]::int8[])"
        )
        .await,
        2
    );
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 2);
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_ack_all('jobs', '{}'::int8[], '{}'::int8[])"
        )
        .await,
        0
    );
}

#[tokio::test]
async fn ack_all_promotes_the_next_job_of_a_group() {
    let db = TestDb::new().await;
    let client = db.client().await;
    run(
        &client,
        "SELECT inbox_create_queue('jobs'); \
         SELECT inbox_enqueue('jobs', '{}', group_key => 'g') FROM generate_series(1, 2);",
    )
    .await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM inbox_lease('jobs', 10)").await,
        1
    );
    assert_eq!(
        one::<i64>(
            &client,
            "SELECT inbox_ack_all('jobs', ARRAY[1]::int8[], ARRAY[1]::int8[])"
        )
        .await,
        1
    );
    assert_eq!(
        count(&client, "SELECT id FROM inbox_lease('jobs', 10)").await,
        2,
        "job 2 became its group's head"
    );
}

#[tokio::test]
async fn ack_all_raises_and_acks_nothing_when_a_job_is_not_held() {
    let (_db, client) = held_jobs().await;
    for (sql, message) in [
        (
            "SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1, 2]::int8[])",
            "1 of 2 jobs are no longer held by their tokens",
        ),
        (
            "SELECT inbox_ack_all('jobs', ARRAY[4]::int8[], ARRAY[1]::int8[])",
            "1 of 1 jobs are no longer held by their tokens",
        ),
    ] {
        assert_eq!(
            failure(&client, sql).await,
            (
                SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
                message.to_owned()
            ),
            "{sql}"
        );
    }
    assert_eq!(
        failure(
            &client,
            "SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1]::int8[])"
        )
        .await,
        (
            SqlState::ARRAY_SUBSCRIPT_ERROR,
            "2 ids given with 1 tokens".to_owned()
        )
    );
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 4);
}

#[tokio::test]
async fn fence_returns_the_jobs_their_tokens_still_hold() {
    let (_db, client) = held_jobs().await;
    // Job 2's token is stale, job 4 is dead, job 9 does not exist.
    assert_eq!(
        one::<Vec<i64>>(
            &client,
            "SELECT array_agg(f ORDER BY f) FROM inbox_fence('jobs', \
             ARRAY[3, 1, 2, 4, 9]::int8[], ARRAY[1, 1, 2, 1, 1]::int8[]) AS f"
        )
        .await,
        [1, 3]
    );
    // A lock's token (minus the attempt it will count) fences a job not yet counted.
    run(&client, "SELECT inbox_enqueue('jobs', '{}')").await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_fence('jobs', ARRAY[5]::int8[], ARRAY[-1]::int8[])"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_fence('jobs', ARRAY[5]::int8[], ARRAY[-2]::int8[])"
        )
        .await,
        0
    );
    assert_eq!(
        failure(
            &client,
            "SELECT inbox_fence('jobs', NULL, ARRAY[1]::int8[])"
        )
        .await,
        (
            SqlState::NULL_VALUE_NOT_ALLOWED,
            "ids must not be NULL".to_owned()
        )
    );
}

// ---- Observing (tests/tests/observe.rs has the rest) ----

#[tokio::test]
async fn observe_errors_carry_the_extensions_messages() {
    let (db, client) = setup().await;
    let schema = db.schema();
    for (sql, code, message) in [
        (
            "SELECT * FROM inbox_jobs(NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
            "queue must not be NULL".to_owned(),
        ),
        (
            "SELECT * FROM inbox_jobs('jobs', 'stuck')",
            SqlState::INVALID_PARAMETER_VALUE,
            "unknown job state \"stuck\": expected ready, delayed, leased or dead".to_owned(),
        ),
        (
            "SELECT * FROM inbox_jobs('jobs', NULL, NULL)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
            "max must not be NULL".to_owned(),
        ),
        (
            "SELECT * FROM inbox_jobs('jobs', NULL, 0)",
            SqlState::INVALID_PARAMETER_VALUE,
            "max must be at least 1".to_owned(),
        ),
        (
            "SELECT * FROM inbox_jobs('seen')",
            SqlState::UNDEFINED_COLUMN,
            format!("queue table {schema}.seen has no column \"id\""),
        ),
        (
            "SELECT inbox_purge('seen', 'infinity', 10)",
            SqlState::INVALID_PARAMETER_VALUE,
            "older_than must be a finite timestamp".to_owned(),
        ),
        (
            "SELECT inbox_purge('seen', '-infinity')",
            SqlState::INVALID_PARAMETER_VALUE,
            "older_than must be a finite time, not -infinity".to_owned(),
        ),
        (
            "SELECT inbox_purge('seen', now(), NULL::bigint)",
            SqlState::NULL_VALUE_NOT_ALLOWED,
            "max must not be NULL".to_owned(),
        ),
        (
            "SELECT inbox_purge('jobs', now(), 1)",
            SqlState::UNDEFINED_COLUMN,
            format!("ledger table {schema}.jobs has no column \"event_key\""),
        ),
    ] {
        assert_eq!(failure(&client, sql).await, (code, message), "{sql}");
    }
}

#[tokio::test]
async fn inbox_jobs_of_a_bytea_queue_with_nullable_locked_until() {
    /// id, state, attempt, no last error, no jsonb payload, the bytea payload.
    type JobRow = (i64, String, i32, bool, bool, Option<Vec<u8>>);
    let (_db, client) = setup().await;
    run(
        &client,
        "INSERT INTO refund_jobs (attempt, locked_until, payload) VALUES \
             (0, now() + interval '1 hour', '\\x03'), (0, now() - interval '1 hour', '\\x02'), \
             (0, NULL, '\\x01'), (1, now() + interval '1 minute', '\\x04'), (2, 'infinity', '\\x05')",
    )
    .await;
    let jobs: Vec<JobRow> = client
        .query(
            "SELECT id, state, attempt, last_error IS NULL, payload IS NULL, payload_bytes \
               FROM inbox_jobs('refund_jobs')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect();
    let job = |id: i64, state: &str, attempt: i32, byte: u8| {
        (id, state.to_owned(), attempt, true, true, Some(vec![byte]))
    };
    // Due first where locked_until is NULL; without leased_at a delivered job counts as leased.
    assert_eq!(
        jobs,
        [
            job(3, "ready", 0, 1),
            job(2, "ready", 0, 2),
            job(4, "leased", 1, 4),
            job(1, "delayed", 0, 3),
            job(5, "dead", 2, 5),
        ]
    );
    let ids = |state: &'static str| {
        let client = &client;
        async move {
            client
                .query("SELECT id FROM inbox_jobs('refund_jobs', $1, 1)", &[&state])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, i64>(0))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(ids("ready").await, [3]);
    assert_eq!(ids("leased").await, [4]);
    assert_eq!(ids("delayed").await, [1]);
    assert_eq!(ids("dead").await, [5]);
}

// ---- Privileges ----

#[tokio::test]
async fn a_role_without_privilege_gets_insufficient_privilege() {
    let (db, client) = setup().await;
    let role = format!("{}_nobody", db.schema());
    run(
        &client,
        &format!(
            "CREATE ROLE {role}; GRANT USAGE ON SCHEMA {schema} TO {role}; SET ROLE {role}",
            schema = db.schema()
        ),
    )
    .await;
    let refused = [
        sqlstate(&client, "SELECT inbox_claim('seen', 'k')").await,
        sqlstate(&client, "SELECT * FROM inbox_lease('jobs')").await,
        sqlstate(&client, "SELECT inbox_enqueue('jobs', '{}')").await,
    ];
    run(
        &client,
        &format!("RESET ROLE; DROP OWNED BY {role}; DROP ROLE {role}"),
    )
    .await;
    assert_eq!(
        refused,
        [(); 3].map(|()| Some(SqlState::INSUFFICIENT_PRIVILEGE))
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM jobs").await
            + count(&client, "SELECT count(*) FROM seen").await,
        0
    );
}

/// A session whose prepared statements are dropped (`DEALLOCATE ALL`, `DISCARD ALL`: what a
/// pooler's reset query does) keeps working: each call plans its statements again, and none
/// fails. The SQL-only build keeps its statements as the session's prepared statements, so this
/// is where it could break.
#[tokio::test]
async fn calls_go_on_after_the_sessions_prepared_statements_are_dropped() {
    let (_db, client) = setup().await;
    let round = |reset: &'static str| {
        let client = &client;
        async move {
            let key = format!("key {reset}");
            assert!(
                one::<bool>(client, &format!("SELECT inbox_claim('seen', '{key}')")).await,
                "{reset}"
            );
            client
                .batch_execute("SELECT inbox_enqueue('jobs', '{}'::jsonb)")
                .await
                .unwrap_or_else(|e| panic!("enqueue after {reset}: {e}"));
            let acked = count(
                client,
                "SELECT count(*) FILTER (WHERE inbox_ack('jobs', id, token)) \
                   FROM inbox_lease('jobs', 10, '30 seconds')",
            )
            .await;
            assert_eq!(acked, 1, "after {reset}");
        }
    };
    round("nothing").await;
    for reset in ["DEALLOCATE ALL", "DISCARD ALL"] {
        client.batch_execute(reset).await.unwrap();
        round(reset).await;
        // Twice: the statements prepared again are found again.
        client
            .batch_execute("SELECT inbox_enqueue('jobs', '{}'::jsonb)")
            .await
            .unwrap();
        assert_eq!(
            count(
                &client,
                "SELECT count(*) FILTER (WHERE inbox_ack('jobs', id, token)) \
                   FROM inbox_lease('jobs', 10, '30 seconds')"
            )
            .await,
            1,
            "{reset}, again"
        );
    }
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 0);
}

/// `inbox.notify` takes PostgreSQL's boolean spellings on both builds, and a misspelt value is
/// refused with `22023`, where the pgrx build checks it (`SET`) or where the SQL-only build reads
/// it (the enqueue, which then writes nothing).
#[tokio::test]
async fn a_misspelt_notify_setting_is_refused() {
    let (db, client) = setup().await;
    for spelling in ["off", "of", "false", "0", "no", "on", "yes", "1", "tru"] {
        client
            .batch_execute(&format!(
                "SET inbox.notify = '{spelling}'; SELECT inbox_enqueue('jobs', '{{}}'::jsonb)"
            ))
            .await
            .unwrap_or_else(|e| panic!("inbox.notify = {spelling}: {e}"));
    }
    let misspelt = if db.sql_only().await {
        client
            .batch_execute("SET inbox.notify = 'offf'")
            .await
            .unwrap();
        "SELECT inbox_enqueue('jobs', '{}'::jsonb)"
    } else {
        "SET inbox.notify = 'offf'"
    };
    let (code, message) = failure(&client, misspelt).await;
    assert_eq!(code, SqlState::INVALID_PARAMETER_VALUE, "{message}");
    assert!(message.contains("inbox.notify"), "{message}");
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 9);
}
