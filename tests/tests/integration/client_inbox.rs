//! The `Inbox` ledger of `inbox-client` on a real PostgreSQL with the `inbox` extension. Each test
//! runs in a schema of its own (see `inbox_tests::TestDb`).

use std::sync::Arc;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use inbox_client::{
    Clock, Database, ErrorKind, Inbox, ManualClock, PgDatabase, PgTransaction, Statement,
};
use inbox_tests::{PgBouncer, TestDb};
use tokio::sync::Barrier;

/// The effect of an event: a row in `effects`, which has no unique key, so that an effect
/// applied twice shows up as two rows.
const CREATE_EFFECTS: &str =
    "CREATE TABLE effects (event_key text NOT NULL, amount integer NOT NULL)";

fn effect(event_key: &str, amount: Option<i64>) -> Statement {
    Statement::new("INSERT INTO effects (event_key, amount) VALUES ($1, $2)")
        .bind(event_key)
        .bind(amount)
}

async fn effects(db: &dyn Database, event_key: &str) -> i64 {
    db.query(
        &Statement::new("SELECT count(*) AS n FROM effects WHERE event_key = $1").bind(event_key),
    )
    .await
    .unwrap()
    .one()
    .unwrap()
    .get("n")
    .unwrap()
}

fn start() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap()
}

/// A pool of `size` over a fresh schema holding the ledger `ledger` and the `effects` table.
async fn setup(size: usize) -> (TestDb, PgDatabase, Inbox) {
    let test_db = TestDb::new().await;
    let db = PgDatabase::from_pool(test_db.pool(size));
    let inbox = create(&db).await;
    (test_db, db, inbox)
}

/// As [`setup`], the pool's connections going through a pgbouncer in transaction mode with at
/// most `servers` server connections.
async fn setup_through_pgbouncer(
    size: usize,
    servers: usize,
) -> (TestDb, PgDatabase, Inbox, PgBouncer) {
    let test_db = TestDb::new().await;
    let bouncer = PgBouncer::start(&test_db, servers);
    let db = bouncer.port_polling(size);
    let inbox = create(&db).await;
    (test_db, db, inbox, bouncer)
}

async fn create(db: &PgDatabase) -> Inbox {
    let inbox = Inbox::new("ledger");
    db.execute(&Statement::new(inbox.create_table_sql()))
        .await
        .unwrap();
    db.execute(&Statement::new(CREATE_EFFECTS)).await.unwrap();
    inbox
}

#[tokio::test]
async fn claim_records_a_key_once_and_commits_on_its_own() {
    let (_test_db, db, inbox) = setup(2).await;
    // The migration can run again on an existing ledger.
    db.execute(&Statement::new(inbox.create_table_sql()))
        .await
        .unwrap();
    let clock = ManualClock::new(start());

    assert!(!inbox.seen(&db, "evt-1").await.unwrap());
    assert!(inbox
        .claim(&db, "evt-1", &clock.now_rfc3339())
        .await
        .unwrap());
    clock.advance(TimeDelta::seconds(5));
    assert!(!inbox
        .claim(&db, "evt-1", &clock.now_rfc3339())
        .await
        .unwrap());
    assert!(inbox.seen(&db, "evt-1").await.unwrap());
    assert!(!inbox.seen(&db, "evt-2").await.unwrap());

    // The first claim's seen_at is the one recorded, and it is committed (read from the table).
    let recorded = db
        .query(&Statement::new("SELECT seen_at FROM ledger WHERE event_key = $1").bind("evt-1"))
        .await
        .unwrap();
    assert_eq!(
        recorded
            .one()
            .unwrap()
            .get::<DateTime<Utc>>("seen_at")
            .unwrap(),
        start()
    );
}

#[tokio::test]
async fn claim_statement_first_in_a_batch_fails_a_duplicate_batch_whole() {
    let (_test_db, db, inbox) = setup(2).await;
    let at = ManualClock::new(start()).now_rfc3339();
    let batch = [inbox.claim_statement("evt", &at), effect("evt", Some(10))];
    db.batch_atomic(&batch).await.unwrap();
    let duplicate = db.batch_atomic(&batch).await.unwrap_err();
    assert_eq!(duplicate.kind(), ErrorKind::UniqueViolation, "{duplicate}");
    assert_eq!(duplicate.sqlstate(), Some("23505"));
    assert_eq!(effects(&db, "evt").await, 1);
    // A key claimed by `claim` fails the batch the same way.
    assert!(inbox.claim(&db, "other", &at).await.unwrap());
    let batch = [
        inbox.claim_statement("other", &at),
        effect("other", Some(1)),
    ];
    assert_eq!(
        db.batch_atomic(&batch).await.unwrap_err().kind(),
        ErrorKind::UniqueViolation
    );
    assert_eq!(effects(&db, "other").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claim_with_on_one_key_applies_the_effect_once() {
    let (_test_db, db, inbox) = setup(16).await;
    claim_with_race(db, inbox).await;
}

/// The same race through pgbouncer in transaction mode, 16 clients sharing 4 server connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claim_with_through_pgbouncer_applies_the_effect_once() {
    let (_test_db, db, inbox, _bouncer) = setup_through_pgbouncer(16, 4).await;
    claim_with_race(db, inbox).await;
}

/// 64 tasks claim one key with an effect at once: exactly one applies it.
async fn claim_with_race(db: PgDatabase, inbox: Inbox) {
    const TASKS: usize = 64;
    let db: Arc<dyn Database> = Arc::new(db);
    let inbox = Arc::new(inbox);
    let clock = ManualClock::new(start());
    let barrier = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (db, inbox, clock, barrier) =
                (db.clone(), inbox.clone(), clock.clone(), barrier.clone());
            tokio::spawn(async move {
                let effect = [effect("order-42/paid", Some(i64::try_from(i).unwrap()))];
                barrier.wait().await;
                inbox
                    .claim_with(db.as_ref(), "order-42/paid", &clock.now_rfc3339(), &effect)
                    .await
            })
        })
        .collect();
    let mut applied = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(true) => applied += 1,
            Ok(false) => {}
            Err(error) => panic!("claim_with failed: {error:?}"),
        }
    }
    assert_eq!(applied, 1, "exactly one delivery must apply the effect");
    assert_eq!(effects(db.as_ref(), "order-42/paid").await, 1);
    assert!(inbox.seen(db.as_ref(), "order-42/paid").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_on_one_key_return_true_once() {
    let (_test_db, db, inbox) = setup(16).await;
    claim_race(db, inbox).await;
}

/// The same race through pgbouncer in transaction mode, 16 clients sharing 4 server connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_through_pgbouncer_return_true_once() {
    let (_test_db, db, inbox, _bouncer) = setup_through_pgbouncer(16, 4).await;
    claim_race(db, inbox).await;
}

/// 64 tasks claim one key at once: exactly one claim returns `true`.
async fn claim_race(db: PgDatabase, inbox: Inbox) {
    const TASKS: usize = 64;
    let db = Arc::new(db);
    let inbox = Arc::new(inbox);
    let barrier = Arc::new(Barrier::new(TASKS));
    let at = ManualClock::new(start()).now_rfc3339();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (db, inbox, barrier, at) = (db.clone(), inbox.clone(), barrier.clone(), at.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                inbox.claim(db.as_ref(), "k", &at).await
            })
        })
        .collect();
    let mut firsts = 0;
    for task in tasks {
        if task.await.unwrap().unwrap() {
            firsts += 1;
        }
    }
    assert_eq!(firsts, 1);
}

#[tokio::test]
async fn a_failed_effect_leaves_the_key_unclaimed_and_a_retry_succeeds() {
    let (_test_db, db, inbox) = setup(2).await;
    let clock = ManualClock::new(start());
    // The second effect statement violates NOT NULL: the whole delivery fails.
    let failing = [effect("evt", Some(1)), effect("evt", None)];
    let error = inbox
        .claim_with(&db, "evt", &clock.now_rfc3339(), &failing)
        .await
        .unwrap_err();
    assert_eq!(error.sqlstate(), Some("23502"), "{error}");
    assert!(!inbox.seen(&db, "evt").await.unwrap());
    assert_eq!(effects(&db, "evt").await, 0);

    clock.advance(TimeDelta::seconds(30));
    let fixed = [effect("evt", Some(1)), effect("evt", Some(2))];
    assert!(inbox
        .claim_with(&db, "evt", &clock.now_rfc3339(), &fixed)
        .await
        .unwrap());
    assert!(inbox.seen(&db, "evt").await.unwrap());
    assert_eq!(effects(&db, "evt").await, 2);
    // A redelivery after the success changes nothing.
    assert!(!inbox
        .claim_with(&db, "evt", &clock.now_rfc3339(), &fixed)
        .await
        .unwrap());
    assert_eq!(effects(&db, "evt").await, 2);
}

#[tokio::test]
async fn a_malformed_seen_at_writes_nothing() {
    let (_test_db, db, inbox) = setup(2).await;
    for bad in ["", "now", "2024-05-01", "2024-05-01 12:00:00", "yesterday"] {
        let claim = inbox.claim(&db, "evt", bad).await.unwrap_err();
        assert_eq!(claim.kind(), ErrorKind::InvalidInput, "{claim}");
        let with = inbox
            .claim_with(&db, "evt", bad, &[effect("evt", Some(1))])
            .await
            .unwrap_err();
        assert_eq!(with.kind(), ErrorKind::InvalidInput, "{with}");
        let batch = [effect("evt", Some(1)), inbox.claim_statement("evt", bad)];
        let batched = db.batch_atomic(&batch).await.unwrap_err();
        assert_eq!(batched.kind(), ErrorKind::InvalidInput, "{batched}");
    }
    assert!(!inbox.seen(&db, "evt").await.unwrap());
    assert_eq!(effects(&db, "evt").await, 0);
}

#[tokio::test]
async fn claim_with_in_a_transaction_commits_with_it() {
    let (test_db, db, inbox) = setup(4).await;
    let at = ManualClock::new(start()).now_rfc3339();
    let pool = test_db.pool(1);

    // Rolled back: the claim and the effect go with the transaction.
    let mut client = pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    assert!(inbox
        .claim_with(&port, "evt", &at, &[effect("evt", Some(1))])
        .await
        .unwrap());
    assert!(inbox.seen(&port, "evt").await.unwrap());
    assert!(!inbox.seen(&db, "evt").await.unwrap());
    tx.rollback().await.unwrap();
    assert!(!inbox.seen(&db, "evt").await.unwrap());
    assert_eq!(effects(&db, "evt").await, 0);

    // Committed: a duplicate inside the same transaction is Ok(false) and leaves it usable.
    let tx = client.transaction().await.unwrap();
    let port = PgTransaction::new(&tx);
    assert!(inbox
        .claim_with(&port, "evt", &at, &[effect("evt", Some(1))])
        .await
        .unwrap());
    assert!(!inbox
        .claim_with(&port, "evt", &at, &[effect("evt", Some(2))])
        .await
        .unwrap());
    assert!(inbox.claim(&port, "evt-2", &at).await.unwrap());
    tx.commit().await.unwrap();
    assert!(inbox.seen(&db, "evt").await.unwrap());
    assert!(inbox.seen(&db, "evt-2").await.unwrap());
    assert_eq!(effects(&db, "evt").await, 1);
}

#[tokio::test]
async fn a_delivery_waiting_on_an_uncommitted_claim_sees_the_winner() {
    let (test_db, db, inbox) = setup(4).await;
    let at = ManualClock::new(start()).now_rfc3339();
    let pool = test_db.pool(1);
    let mut client = pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let winner = PgTransaction::new(&tx);
    assert!(inbox
        .claim_with(&winner, "evt", &at, &[effect("evt", Some(1))])
        .await
        .unwrap());

    // The rival's batch blocks on the winner's uncommitted claim until the winner commits.
    let rival = tokio::spawn({
        let (db, inbox, at) = (db.clone(), inbox.clone(), at.clone());
        async move {
            inbox
                .claim_with(&db, "evt", &at, &[effect("evt", Some(2))])
                .await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !rival.is_finished(),
        "the rival should wait for the winner's transaction"
    );
    tx.commit().await.unwrap();
    assert!(!rival.await.unwrap().unwrap());
    assert_eq!(effects(&db, "evt").await, 1);
}

#[tokio::test]
async fn purge_deletes_old_keys_so_they_can_be_claimed_again() {
    let (_test_db, db, inbox) = setup(2).await;
    let clock = ManualClock::new(start());
    assert!(inbox.claim(&db, "old", &clock.now_rfc3339()).await.unwrap());
    clock.advance(TimeDelta::days(2));
    assert!(inbox.claim(&db, "new", &clock.now_rfc3339()).await.unwrap());

    assert_eq!(
        inbox
            .purge(&db, start() + TimeDelta::days(1))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        inbox
            .purge(&db, start() + TimeDelta::days(1))
            .await
            .unwrap(),
        0
    );
    assert!(!inbox.seen(&db, "old").await.unwrap());
    assert!(inbox.seen(&db, "new").await.unwrap());
    assert!(inbox.claim(&db, "old", &clock.now_rfc3339()).await.unwrap());
    assert!(!inbox.claim(&db, "new", &clock.now_rfc3339()).await.unwrap());
}

#[tokio::test]
async fn table_names_are_passed_as_values() {
    let (test_db, db, _) = setup(2).await;
    let at = ManualClock::new(start()).now_rfc3339();

    // A quoted name with a space and a quote, and a schema-qualified one.
    for name in [
        "\"Odd 'Name\"".to_owned(),
        format!("{}.qualified", test_db.schema()),
    ] {
        let inbox = Inbox::new(name.clone());
        db.execute(&Statement::new(inbox.create_table_sql()))
            .await
            .unwrap();
        assert!(inbox.claim(&db, "k", &at).await.unwrap(), "{name}");
        assert!(
            !inbox.claim_with(&db, "k", &at, &[]).await.unwrap(),
            "{name}"
        );
        assert!(inbox.seen(&db, "k").await.unwrap(), "{name}");
    }

    // A ledger that does not exist.
    let missing = Inbox::new("no_such_ledger");
    let error = missing.claim(&db, "k", &at).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::UndefinedTable, "{error}");
    let error = missing.claim_with(&db, "k", &at, &[]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::UndefinedTable, "{error}");
    // Text that is not a name is data, not SQL.
    let hostile = Inbox::new("x'); DROP TABLE effects; --");
    assert!(hostile.seen(&db, "k").await.is_err());
    assert!(hostile.claim(&db, "k", &at).await.is_err());
    assert_eq!(effects(&db, "k").await, 0);
}
