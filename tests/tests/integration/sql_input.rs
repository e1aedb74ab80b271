//! The SQL API as a driver sees it: calls with untyped parameters resolve to one function, and
//! bad input is refused with its SQLSTATE, writing nothing, on a connection that stays usable.

use inbox_tests::TestDb;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

async fn setup() -> (TestDb, Client) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('jobs'); SELECT inbox_create_ledger('seen')")
        .await
        .unwrap();
    (db, client)
}

/// The server infers every parameter's type, as it does for drivers that send them untyped; each
/// call must name exactly one function.
#[tokio::test]
async fn untyped_parameters_resolve_to_one_function() {
    let (_db, client) = setup().await;
    let cases: &[(&str, &[Type])] = &[
        (
            "SELECT inbox_enqueue($1, $2)",
            &[Type::REGCLASS, Type::JSONB],
        ),
        (
            "SELECT inbox_enqueue($1, $2, $3, key => $4)",
            &[Type::REGCLASS, Type::JSONB, Type::TIMESTAMPTZ, Type::TEXT],
        ),
        (
            "SELECT inbox_enqueue($1, $2, $3, $4, $5, $6)",
            &[
                Type::REGCLASS,
                Type::JSONB,
                Type::TIMESTAMPTZ,
                Type::TEXT,
                Type::INT4,
                Type::TEXT,
            ],
        ),
        (
            "SELECT inbox_enqueue_batch($1, $2, $3, $4, $5, $6)",
            &[
                Type::REGCLASS,
                Type::JSONB_ARRAY,
                Type::TIMESTAMPTZ,
                Type::TEXT_ARRAY,
                Type::INT4,
                Type::TEXT_ARRAY,
            ],
        ),
        (
            "SELECT inbox_requeue($1, $2)",
            &[Type::REGCLASS, Type::INT8],
        ),
        (
            "SELECT inbox_requeue_dead($1, $2)",
            &[Type::REGCLASS, Type::INT4],
        ),
        (
            "SELECT * FROM inbox_dead_jobs($1, $2)",
            &[Type::REGCLASS, Type::INT4],
        ),
        (
            "SELECT inbox_enqueue_bytes($1, $2, $3)",
            &[Type::REGCLASS, Type::BYTEA, Type::TIMESTAMPTZ],
        ),
        (
            "SELECT inbox_enqueue_batch($1, $2)",
            &[Type::REGCLASS, Type::JSONB_ARRAY],
        ),
        (
            "SELECT inbox_enqueue_batch_bytes($1, $2, $3, $4)",
            &[
                Type::REGCLASS,
                Type::BYTEA_ARRAY,
                Type::TIMESTAMPTZ,
                Type::TEXT_ARRAY,
            ],
        ),
        (
            "SELECT inbox_ack($1, $2, $3)",
            &[Type::REGCLASS, Type::INT8, Type::INT8],
        ),
        (
            "SELECT inbox_ack_batch($1, $2, $3)",
            &[Type::REGCLASS, Type::INT8_ARRAY, Type::INT8_ARRAY],
        ),
        (
            "SELECT inbox_claim($1, $2, $3)",
            &[Type::REGCLASS, Type::TEXT, Type::TIMESTAMPTZ],
        ),
    ];
    for (sql, expected) in cases {
        let statement = client
            .prepare(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        assert_eq!(statement.params(), *expected, "{sql}");
    }
    // The README's example that was ambiguous, as it stands there.
    let id: Option<i64> = client
        .query_one(
            "SELECT inbox_enqueue('jobs', '{\"to\": \"b@example.com\"}', now() + interval '1 hour', key => 'b-welcome')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(id.is_some());
}

async fn expect_sqlstate(client: &Client, sql: &str, code: &SqlState) {
    let error = client
        .batch_execute(sql)
        .await
        .expect_err(&format!("{sql} should fail"));
    assert_eq!(
        error.code(),
        Some(code),
        "{sql}: {:?}",
        error.as_db_error().map(|e| e.message())
    );
}

/// Non-finite times, NULLs and out-of-range counts, each in its own transaction: refused with
/// the SQLSTATE, nothing committed, and the connection serves the next call.
#[tokio::test]
async fn bad_input_is_refused_and_writes_nothing() {
    let (_db, client) = setup().await;
    let invalid = [
        "SELECT inbox_enqueue('jobs', '{}', 'infinity')",
        "SELECT inbox_enqueue('jobs', '{}', '-infinity')",
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], '-infinity')",
        "SELECT inbox_claim('seen', 'k', 'infinity')",
        "SELECT inbox_purge('seen', '-infinity')",
        "SELECT * FROM inbox_lease('jobs', 0)",
        "SELECT * FROM inbox_lease('jobs', -2147483648)",
        "SELECT * FROM inbox_lease('jobs', 1, '-1 second')",
        "SELECT * FROM inbox_lease('jobs', 1, '0 seconds')",
        "SELECT * FROM inbox_lock('jobs', 0)",
        "SELECT inbox_retry('jobs', 1, 1, '-1 day')",
        "SELECT inbox_retry('jobs', 1, 1, '1 second', 'e', 0)",
        "SELECT inbox_retry('jobs', 1, 1, '1 second', 'e', -5)",
        "SELECT inbox_extend('jobs', 1, 1, '0 seconds')",
    ];
    for sql in invalid {
        expect_sqlstate(&client, sql, &SqlState::INVALID_PARAMETER_VALUE).await;
    }
    let nulls = [
        "SELECT inbox_enqueue('jobs', NULL)",
        "SELECT inbox_enqueue('jobs', '{}', NULL)",
        "SELECT inbox_enqueue(NULL, '{}')",
        "SELECT inbox_enqueue_batch('jobs', NULL)",
        "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], NULL)",
        "SELECT inbox_claim('seen', NULL)",
        "SELECT inbox_claim('seen', 'k', NULL)",
        "SELECT * FROM inbox_lease('jobs', NULL)",
        "SELECT * FROM inbox_lease('jobs', 1, NULL)",
        "SELECT inbox_ack('jobs', NULL, 1)",
        "SELECT inbox_ack_batch('jobs', NULL, ARRAY[1]::int8[])",
        "SELECT inbox_retry('jobs', 1, NULL)",
        "SELECT inbox_extend('jobs', 1, 1, NULL)",
    ];
    for sql in nulls {
        expect_sqlstate(&client, sql, &SqlState::NULL_VALUE_NOT_ALLOWED).await;
    }
    // A huge lease overflows the timestamp: PostgreSQL's own range error, nothing leased.
    client
        .batch_execute("SELECT inbox_enqueue('jobs', '{}')")
        .await
        .unwrap();
    expect_sqlstate(
        &client,
        "SELECT * FROM inbox_lease('jobs', 1, '300000 years')",
        &SqlState::DATETIME_FIELD_OVERFLOW,
    )
    .await;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM jobs WHERE attempt > 0), \
                    (SELECT count(*) FROM seen), (SELECT ready FROM inbox_stats('jobs'))",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>(0),
        1,
        "only the valid enqueue wrote a job"
    );
    assert_eq!(row.get::<_, i64>(1), 0, "no lease counted an attempt");
    assert_eq!(row.get::<_, i64>(2), 0, "no claim was recorded");
    assert_eq!(row.get::<_, i64>(3), 1);
    // A huge max is fine: it takes what there is.
    let taken = client
        .query("SELECT * FROM inbox_lease('jobs', 2147483647)", &[])
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
}
