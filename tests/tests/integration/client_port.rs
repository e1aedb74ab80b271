//! The `Database` port of `inbox-client` on a real PostgreSQL: batches, transactions, values and
//! errors. Each test runs in a schema of its own (see `inbox_tests::TestDb`).

use std::time::Duration;

use chrono::{TimeZone, Utc};
use inbox_client::{Database, ErrorKind, PgDatabase, PgTransaction, Statement, Value};
use inbox_tests::TestDb;
use serde_json::json;

const CREATE_ITEMS: &str = "CREATE TABLE items (id integer PRIMARY KEY, note text NOT NULL)";

fn insert(id: i64, note: &str) -> Statement {
    Statement::new("INSERT INTO items (id, note) VALUES ($1, $2)")
        .bind(id)
        .bind(note)
}

async fn count(db: &dyn Database) -> i64 {
    db.query(&Statement::new("SELECT count(*) AS n FROM items"))
        .await
        .unwrap()
        .one()
        .unwrap()
        .get("n")
        .unwrap()
}

/// Five statements whose third fails in the way `third` says.
fn five_with_third(third: Statement) -> Vec<Statement> {
    vec![
        insert(1, "a"),
        insert(2, "b"),
        third,
        insert(4, "d"),
        insert(5, "e"),
    ]
}

/// Batches whose third statement fails on the server, while encoding a parameter, or for a wrong
/// number of parameters: each leaves no row behind, and a good batch then writes all five.
async fn check_batch_atomic(db: &dyn Database) {
    let failing = [
        (
            insert(1, "duplicate of the first"),
            ErrorKind::UniqueViolation,
        ),
        (insert(3, "x").bind("one too many"), ErrorKind::InvalidInput),
        (
            insert(i64::from(i32::MAX) + 1, "out of int4"),
            ErrorKind::InvalidInput,
        ),
        (
            Statement::new("INSERT INTO nowhere VALUES (1)"),
            ErrorKind::UndefinedTable,
        ),
    ];
    let before = count(db).await;
    for (third, kind) in failing {
        let error = db.batch_atomic(&five_with_third(third)).await.unwrap_err();
        assert_eq!(error.kind(), kind, "{error}");
        assert_eq!(
            count(db).await,
            before,
            "a failed batch left rows behind: {error}"
        );
    }
    db.batch_atomic(&five_with_third(insert(3, "c")))
        .await
        .unwrap();
    assert_eq!(count(db).await, before + 5);
    db.batch_atomic(&[]).await.unwrap();
}

#[tokio::test]
async fn pool_batch_atomic_is_all_or_nothing() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();
    check_batch_atomic(&db).await;
}

#[tokio::test]
async fn transaction_batch_atomic_is_all_or_nothing_and_keeps_the_transaction_usable() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();

    let mut client = db.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    port.execute(&insert(100, "before the batches"))
        .await
        .unwrap();
    check_batch_atomic(&port).await;
    // The write made before the failed batches survived them, and nothing is committed yet.
    assert_eq!(count(&port).await, 6);
    assert_eq!(count(&db).await, 0);
    tx.commit().await.unwrap();
    assert_eq!(count(&db).await, 6);

    // A batch that succeeded inside a transaction rolled back is rolled back with it.
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    port.batch_atomic(&[insert(200, "x"), insert(201, "y")])
        .await
        .unwrap();
    assert_eq!(count(&port).await, 8);
    tx.rollback().await.unwrap();
    assert_eq!(count(&db).await, 6);
}

#[tokio::test]
async fn cancelled_transaction_batch_is_rolled_back_at_the_next_call() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(2));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();
    let mut client = db.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    let slow = [
        insert(1, "a"),
        Statement::new("SELECT pg_sleep(2)"),
        insert(2, "b"),
    ];
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), port.batch_atomic(&slow)).await;
    assert!(cancelled.is_err(), "the batch should have timed out");
    // The next call first undoes the cancelled batch's first insert.
    assert_eq!(count(&port).await, 0);
    port.execute(&insert(3, "c")).await.unwrap();
    tx.commit().await.unwrap();
    let ids = db
        .query(&Statement::new("SELECT id FROM items ORDER BY id"))
        .await
        .unwrap();
    let ids: Vec<i32> = ids.iter().map(|r| r.get("id").unwrap()).collect();
    assert_eq!(ids, [3]);
}

#[tokio::test]
async fn transaction_port_sees_its_own_uncommitted_writes() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();

    // Over a deadpool transaction.
    let mut client = db.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    assert_eq!(port.execute(&insert(1, "mine")).await.unwrap(), 1);
    let rows = port
        .query(&Statement::new("SELECT note FROM items WHERE id = $1").bind(1_i64))
        .await
        .unwrap();
    assert_eq!(rows.one().unwrap().get::<String>("note").unwrap(), "mine");
    assert_eq!(
        count(&db).await,
        0,
        "another connection saw an uncommitted write"
    );
    tx.commit().await.unwrap();
    assert_eq!(count(&db).await, 1);

    // Over a plain tokio-postgres transaction.
    let mut plain = test_db.client().await;
    let tx = plain.transaction().await.unwrap();
    let port = PgTransaction::from_tokio(&tx);
    port.execute(&insert(2, "plain")).await.unwrap();
    assert_eq!(count(&port).await, 2);
    assert_eq!(count(&db).await, 1);
    tx.rollback().await.unwrap();
    assert_eq!(count(&db).await, 1);
}

#[tokio::test]
async fn values_round_trip_through_parameters_and_rows() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(2));
    db.execute(&Statement::new(
        "CREATE TABLE vals (s smallint, i integer, b bigint, r real, d double precision, \
         t text, v varchar(10), f boolean, y bytea, j json, jb jsonb, tz timestamptz, \
         ts timestamp, n integer)",
    ))
    .await
    .unwrap();
    let at = Utc.with_ymd_and_hms(2024, 5, 1, 12, 30, 15).unwrap()
        + chrono::TimeDelta::microseconds(123_456);
    let insert = Statement::new(
        "INSERT INTO vals VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
    )
    .bind(7_i64) // bigint value into smallint
    .bind(-8_i64) // and into integer
    .bind(9_i16) // smallint value into bigint
    .bind(1.5_f64) // double into real
    .bind(2.25_f64)
    .bind("text")
    .bind("varchar")
    .bind(true)
    .bind(vec![0_u8, 1, 255])
    .bind(json!({"a": [1, 2]}))
    .bind(json!({"b": null}))
    .bind(at)
    .bind(at) // timestamptz value into timestamp: stored as UTC
    .bind(None::<i32>);
    assert_eq!(db.execute(&insert).await.unwrap(), 1);

    let rows = db
        .query(&Statement::new("SELECT * FROM vals"))
        .await
        .unwrap();
    let row = rows.one().unwrap();
    assert_eq!(row.get::<i16>("s").unwrap(), 7);
    assert_eq!(row.get::<i64>("s").unwrap(), 7);
    assert_eq!(row.get::<i32>("i").unwrap(), -8);
    assert_eq!(row.get::<i64>("b").unwrap(), 9);
    assert_eq!(row.get::<f64>("r").unwrap(), 1.5);
    assert_eq!(row.get::<f64>("d").unwrap(), 2.25);
    assert_eq!(row.get::<String>("t").unwrap(), "text");
    assert_eq!(row.get::<String>("v").unwrap(), "varchar");
    assert!(row.get::<bool>("f").unwrap());
    assert_eq!(row.get::<Vec<u8>>("y").unwrap(), [0, 1, 255]);
    assert_eq!(
        row.get::<serde_json::Value>("j").unwrap(),
        json!({"a": [1, 2]})
    );
    assert_eq!(
        row.get::<serde_json::Value>("jb").unwrap(),
        json!({"b": null})
    );
    assert_eq!(row.get::<chrono::DateTime<Utc>>("tz").unwrap(), at);
    assert_eq!(row.get::<chrono::DateTime<Utc>>("ts").unwrap(), at);
    assert_eq!(row.get::<Option<i32>>("n").unwrap(), None);
    assert_eq!(row.get::<Value>("n").unwrap(), Value::Null);
    assert_eq!(rows.columns().len(), 14);

    // Reading errors are per column and name it.
    let error = row.get::<i64>("t").unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(error.to_string().contains("`t`"), "{error}");
    assert!(row
        .get::<i64>("n")
        .unwrap_err()
        .to_string()
        .contains("NULL"));
    let odd = db
        .query(&Statement::new("SELECT 1.5::numeric AS n, 2 AS two"))
        .await
        .unwrap();
    let odd = odd.one().unwrap();
    assert_eq!(odd.get::<i32>("two").unwrap(), 2);
    let error = odd.get::<Value>("n").unwrap_err();
    assert!(
        error.to_string().contains("cast it in the query"),
        "{error}"
    );

    // Binding errors are InvalidInput and happen before anything is written.
    let wrong_type = Statement::new("INSERT INTO vals (i) VALUES ($1)").bind("not a number");
    let out_of_range = Statement::new("INSERT INTO vals (s) VALUES ($1)").bind(70_000_i64);
    let too_few = Statement::new("INSERT INTO vals (i, b) VALUES ($1, $2)").bind(1_i64);
    for statement in [wrong_type, out_of_range, too_few] {
        let error = db.execute(&statement).await.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidInput, "{error}");
        assert_eq!(error.sqlstate(), None);
    }
    let total = db
        .query(&Statement::new("SELECT count(*) AS n FROM vals"))
        .await
        .unwrap();
    assert_eq!(total.one().unwrap().get::<i64>("n").unwrap(), 1);
}

#[tokio::test]
async fn server_errors_are_classified_with_their_sqlstate() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();
    db.execute(&insert(1, "a")).await.unwrap();

    let duplicate = db.execute(&insert(1, "again")).await.unwrap_err();
    assert_eq!(duplicate.kind(), ErrorKind::UniqueViolation);
    assert_eq!(duplicate.sqlstate(), Some("23505"));
    assert!(
        duplicate.to_string().contains("(SQLSTATE 23505)"),
        "{duplicate}"
    );

    let missing = db
        .query(&Statement::new("SELECT * FROM missing"))
        .await
        .unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::UndefinedTable);
    assert_eq!(missing.sqlstate(), Some("42P01"));

    let syntax = db.execute(&Statement::new("SELEKT 1")).await.unwrap_err();
    assert_eq!(syntax.kind(), ErrorKind::Other);
    assert_eq!(syntax.sqlstate(), Some("42601"));

    let not_null = db
        .execute(&Statement::new("INSERT INTO items (id) VALUES (2)"))
        .await
        .unwrap_err();
    assert_eq!(not_null.kind(), ErrorKind::Other);
    assert_eq!(not_null.sqlstate(), Some("23502"));

    // A role without rights on the schema.
    let mut client = db.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL ROLE pg_monitor").await.unwrap();
    // (Qualified: the search_path skips a schema the role may not use.)
    let select = format!("SELECT * FROM {}.items", test_db.schema());
    let denied = PgTransaction::new(&tx)
        .query(&Statement::new(select))
        .await
        .unwrap_err();
    assert_eq!(denied.kind(), ErrorKind::InsufficientPrivilege, "{denied}");
    assert_eq!(denied.sqlstate(), Some("42501"));
}

#[tokio::test]
async fn serialization_failures_and_deadlocks_are_retryable() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();
    db.batch_atomic(&[insert(1, "a"), insert(2, "b")])
        .await
        .unwrap();
    let touch =
        |id: i64| Statement::new("UPDATE items SET note = note || '!' WHERE id = $1").bind(id);

    // 40001: a REPEATABLE READ transaction updates a row changed since its snapshot.
    let mut first = test_db.client().await;
    let tx = first
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    let port = PgTransaction::from_tokio(&tx);
    assert_eq!(count(&port).await, 2);
    db.execute(&touch(1)).await.unwrap();
    let error = port.execute(&touch(1)).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Retryable, "{error}");
    assert_eq!(error.sqlstate(), Some("40001"));
    assert!(error.is_retryable());
    drop(tx);

    // 40P01: two transactions lock the same two rows in opposite orders.
    let mut a = test_db.client().await;
    let mut b = test_db.client().await;
    let tx_a = a.transaction().await.unwrap();
    let tx_b = b.transaction().await.unwrap();
    let (port_a, port_b) = (
        PgTransaction::from_tokio(&tx_a),
        PgTransaction::from_tokio(&tx_b),
    );
    port_a.execute(&touch(1)).await.unwrap();
    port_b.execute(&touch(2)).await.unwrap();
    let (second, first) = (touch(2), touch(1));
    let (ra, rb) = tokio::join!(port_a.execute(&second), port_b.execute(&first));
    let error = match (ra, rb) {
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => e,
        other => panic!("expected exactly one deadlock victim, got {other:?}"),
    };
    assert_eq!(error.kind(), ErrorKind::Retryable, "{error}");
    assert_eq!(error.sqlstate(), Some("40P01"));
}

#[tokio::test]
async fn a_terminated_connection_is_connection_lost() {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(2));
    let mut doomed = test_db.client().await;
    let tx = doomed.transaction().await.unwrap();
    let port = PgTransaction::from_tokio(&tx);
    let pid: i32 = port
        .query(&Statement::new("SELECT pg_backend_pid() AS pid"))
        .await
        .unwrap()
        .one()
        .unwrap()
        .get("pid")
        .unwrap();
    let terminated = db
        .query(&Statement::new("SELECT pg_terminate_backend($1, 5000) AS done").bind(pid))
        .await
        .unwrap();
    assert!(terminated.one().unwrap().get::<bool>("done").unwrap());
    let error = port
        .query(&Statement::new("SELECT 1 AS one"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ConnectionLost, "{error:?}");
}

#[tokio::test]
async fn connect_and_from_env_build_a_working_pool() {
    let test_db = TestDb::new().await;
    let one = Statement::new("SELECT 1 AS one");
    let db = PgDatabase::connect(test_db.url()).await.unwrap();
    // Four connections per CPU, whatever deadpool's own default: room for a transactional
    // worker's workers(4 * CPUs - 1) slots and its heartbeat.
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(db.pool().status().max_size, 4 * cpus);
    assert_eq!(inbox_client::default_pool_size(), 4 * cpus);
    assert_eq!(
        db.query(&one)
            .await
            .unwrap()
            .one()
            .unwrap()
            .get::<i32>("one")
            .unwrap(),
        1
    );

    // This is the only test of the binary that touches DATABASE_URL.
    std::env::remove_var(inbox_client::DATABASE_URL);
    let unset = PgDatabase::from_env().await.unwrap_err();
    assert_eq!(unset.kind(), ErrorKind::InvalidInput);
    assert!(unset.to_string().contains("DATABASE_URL"), "{unset}");
    std::env::set_var(inbox_client::DATABASE_URL, test_db.url());
    let db = PgDatabase::from_env().await.unwrap();
    std::env::remove_var(inbox_client::DATABASE_URL);
    assert_eq!(
        db.query(&one)
            .await
            .unwrap()
            .one()
            .unwrap()
            .get::<i32>("one")
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn the_port_is_usable_as_a_shared_trait_object_across_tasks() {
    let test_db = TestDb::new().await;
    let db: std::sync::Arc<dyn Database> =
        std::sync::Arc::new(PgDatabase::from_pool(test_db.pool(4)));
    db.execute(&Statement::new(CREATE_ITEMS)).await.unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|id| {
            let db = db.clone();
            tokio::spawn(async move { db.execute(&insert(id, "t")).await })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap().unwrap(), 1);
    }
    assert_eq!(count(db.as_ref()).await, 8);
}
