//! Wake-ups and upkeep over real connections: an enqueue notifies only a worker asleep on its
//! queue, no wake-up is lost when enqueues race a worker going to sleep, several queues and
//! workers, a worker whose LISTEN connection dies, and the worker vacuuming its own queue.
//!
//! The workers here poll once a minute: a job that is not handled within seconds was not woken
//! for. (Timeouts only bound a failing test; nothing here measures speed.)

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{stream, StreamExt};
use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker, WorkerHandle};
use inbox_client::{Database, PgDatabase, Statement};
use inbox_tests::TestDb;
use tokio::sync::{mpsc, RwLock};
use tokio_postgres::{AsyncMessage, Client};

/// The vacuum horizon test runs alone: the other tests' transactions move the horizon.
static HORIZON: RwLock<()> = RwLock::const_new(());

/// Longer than any test here runs: wake-ups alone deliver the jobs.
const POLL: Duration = Duration::from_secs(60);
/// How long a woken job may take to reach its handler before the test calls it lost.
const LOST: Duration = Duration::from_secs(5);

fn port(db: &TestDb, size: usize) -> PgDatabase {
    PgDatabase::from_pool_and_config(db.pool(size), db.config())
}

async fn create_queue(db: &TestDb, name: &str) {
    db.client()
        .await
        .query_one("SELECT inbox_create_queue($1)::text", &[&name])
        .await
        .unwrap();
}

async fn enqueue(client: &Client, queue: &str, n: i64) {
    client
        .query_one(
            "SELECT inbox_enqueue($1::text::regclass, to_jsonb($2::int8))",
            &[&queue, &n],
        )
        .await
        .unwrap();
}

async fn sleepers(client: &Client, queue: &str) -> Vec<i32> {
    client
        .query(
            "SELECT s FROM inbox_sleepers($1::text::regclass) AS s",
            &[&queue],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Waits until `count` sessions sleep on `queue`; returns their pids.
async fn await_sleepers(client: &Client, queue: &str, count: usize) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + LOST;
    loop {
        let pids = sleepers(client, queue).await;
        if pids.len() == count {
            return pids;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queue}: {} sleepers, not {count}",
            pids.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A connection whose notifications arrive on the receiver.
async fn listener(db: &TestDb) -> (Client, mpsc::UnboundedReceiver<String>) {
    let (client, mut connection) = db.config().connect(tokio_postgres::NoTls).await.unwrap();
    let (send, receive) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                let _ = send.send(n.channel().to_owned());
            }
        }
    });
    (client, receive)
}

async fn channel(client: &Client, queue: &str) -> String {
    client
        .query_one("SELECT inbox_channel($1::text::regclass)", &[&queue])
        .await
        .unwrap()
        .get(0)
}

/// Whether a notification arrives within `wait` (all pending ones are consumed).
async fn notified(receiver: &mut mpsc::UnboundedReceiver<String>, wait: Duration) -> bool {
    let got = tokio::time::timeout(wait, receiver.recv()).await.is_ok();
    while receiver.try_recv().is_ok() {}
    got
}

/// A transactional worker (lease) of `slots` on `queue` that reports each payload it handles.
fn worker(
    pg: &PgDatabase,
    queue: &str,
    slots: usize,
    seen: mpsc::UnboundedSender<i64>,
) -> WorkerHandle {
    let handler = transactional(move |job: Job<i64>, _tx: &dyn Database| {
        let _ = seen.send(job.payload);
        Box::pin(async { Ok(Outcome::ack()) })
    });
    Worker::transactional(pg.clone(), queue, handler)
        .workers(slots)
        .poll_interval(POLL)
        .start()
}

async fn next(seen: &mut mpsc::UnboundedReceiver<i64>, what: &str) -> i64 {
    tokio::time::timeout(LOST, seen.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: not handled within {LOST:?}: a wake-up was lost"))
        .expect("the worker stopped")
}

// ------------------------------------------------------------------------------------------------
// The protocol in SQL
// ------------------------------------------------------------------------------------------------

/// Enqueues notify only while a session sleeps on the queue, and only that queue's.
#[tokio::test]
async fn enqueues_notify_only_sleepers() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "a").await;
    create_queue(&db, "b").await;
    let producer = db.client().await;
    let (sleeper, mut notes) = listener(&db).await;
    let (channel_a, channel_b) = (channel(&sleeper, "a").await, channel(&sleeper, "b").await);
    sleeper
        .batch_execute(&format!("LISTEN {channel_a}; LISTEN {channel_b}"))
        .await
        .unwrap();

    enqueue(&producer, "a", 1).await;
    assert!(
        !notified(&mut notes, Duration::from_millis(300)).await,
        "no one sleeps: no NOTIFY"
    );
    // A job is due: inbox_sleep registers nothing and says so.
    let slept: bool = sleeper
        .query_one("SELECT inbox_sleep('a')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!slept);
    assert!(sleepers(&producer, "a").await.is_empty());
    producer.batch_execute("DELETE FROM a").await.unwrap();

    let slept: bool = sleeper
        .query_one("SELECT inbox_sleep('a')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(slept);
    let pid: i32 = sleeper
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(sleepers(&producer, "a").await, vec![pid]);
    assert!(sleepers(&producer, "b").await.is_empty());
    // Sleeping twice is one registration, undone by one stop.
    let slept: bool = sleeper
        .query_one("SELECT inbox_sleep('a')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(slept);

    enqueue(&producer, "b", 2).await;
    assert!(
        !notified(&mut notes, Duration::from_millis(300)).await,
        "b has no sleeper"
    );
    enqueue(&producer, "a", 3).await;
    let got = tokio::time::timeout(LOST, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, channel_a);
    // The batch form notifies too.
    producer
        .query(
            "SELECT inbox_enqueue_batch('a', ARRAY['4'::jsonb, '5'])",
            &[],
        )
        .await
        .unwrap();
    assert!(
        notified(&mut notes, LOST).await,
        "the batch notified the sleeper"
    );
    // With inbox.notify off, nothing is sent even to a sleeper.
    producer
        .batch_execute("SET inbox.notify = off")
        .await
        .unwrap();
    enqueue(&producer, "a", 6).await;
    assert!(
        !notified(&mut notes, Duration::from_millis(300)).await,
        "inbox.notify = off"
    );
    producer.batch_execute("RESET inbox.notify").await.unwrap();

    let stopped: bool = sleeper
        .query_one("SELECT inbox_stop_sleeping('a')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(stopped);
    assert!(sleepers(&producer, "a").await.is_empty());
    let again: bool = sleeper
        .query_one("SELECT inbox_stop_sleeping('a')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!again, "it was not asleep any more");
    enqueue(&producer, "a", 7).await;
    assert!(
        !notified(&mut notes, Duration::from_millis(300)).await,
        "awake: no NOTIFY"
    );
}

/// The ordering the design rests on: a session that asks to sleep while an enqueue is in flight
/// waits for it to end, then sees its job (and does not sleep); an enqueue that starts while a
/// session sleeps notifies it at commit.
#[tokio::test]
async fn sleeping_waits_for_enqueues_in_flight() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "q").await;
    let producer = db.client().await;
    producer.batch_execute("BEGIN").await.unwrap();
    enqueue(&producer, "q", 1).await;
    let (sleeper, mut notes) = listener(&db).await;
    let ch = channel(&sleeper, "q").await;
    sleeper
        .batch_execute(&format!("LISTEN {ch}"))
        .await
        .unwrap();
    let sleeper = Arc::new(sleeper);
    let asking = sleeper.clone();
    let slept = tokio::spawn(async move {
        asking
            .query_one("SELECT inbox_sleep('q')", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !slept.is_finished(),
        "inbox_sleep waits for the enqueue in flight"
    );
    producer.batch_execute("COMMIT").await.unwrap();
    assert!(
        !slept.await.unwrap(),
        "the enqueue committed first: a job is due, no sleep"
    );
    assert!(!notified(&mut notes, Duration::from_millis(200)).await);

    producer.batch_execute("DELETE FROM q").await.unwrap();
    let registered: bool = sleeper
        .query_one("SELECT inbox_sleep('q')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(registered);
    producer.batch_execute("BEGIN").await.unwrap();
    enqueue(&producer, "q", 2).await;
    assert!(
        !notified(&mut notes, Duration::from_millis(200)).await,
        "nothing before the commit"
    );
    producer.batch_execute("COMMIT").await.unwrap();
    assert!(notified(&mut notes, LOST).await, "notified at commit");
}

/// Bad calls raise the documented errors and register nothing.
#[tokio::test]
async fn bad_calls_are_refused() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "q").await;
    let client = db.client().await;
    let code = |e: tokio_postgres::Error| e.code().map(|c| c.code().to_owned());
    let e = client
        .query_one("SELECT inbox_sleep(NULL)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(e).as_deref(), Some("22004"));
    let e = client
        .query_one("SELECT inbox_sleep('nope')", &[])
        .await
        .unwrap_err();
    assert_eq!(code(e).as_deref(), Some("42P01"));
    client
        .batch_execute("CREATE TABLE not_a_queue (x int)")
        .await
        .unwrap();
    let e = client
        .query_one("SELECT inbox_sleep('not_a_queue')", &[])
        .await
        .unwrap_err();
    assert!(code(e).is_some());
    // The SQL-only build cannot tell a transaction block from a statement's own transaction,
    // and does not refuse it (docs/sql-only.md).
    if !db.sql_only().await {
        client.batch_execute("BEGIN").await.unwrap();
        let e = client
            .query_one("SELECT inbox_sleep('q')", &[])
            .await
            .unwrap_err();
        assert_eq!(code(e).as_deref(), Some("25001"));
        client.batch_execute("ROLLBACK").await.unwrap();
    }
    let e = client
        .query_one("SELECT inbox_stop_sleeping(NULL)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(e).as_deref(), Some("22004"));
    let e = client
        .query_one("SELECT inbox_vacuum_due(NULL)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(e).as_deref(), Some("22004"));
    assert!(sleepers(&client, "q").await.is_empty());
}

// ------------------------------------------------------------------------------------------------
// The worker
// ------------------------------------------------------------------------------------------------

/// Many rounds of a job enqueued just as the worker runs out of work and goes to sleep, at
/// varying moments around it, by one and then by several producers at once: every job reaches
/// the handler on a wake-up (the worker polls once a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_wakeup_lost_when_enqueues_race_sleep() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "jobs").await;
    let pg = port(&db, 8);
    let (seen, mut handled) = mpsc::unbounded_channel();
    let handle = worker(&pg, "jobs", 2, seen);
    let producers: Vec<Client> = futures_util::future::join_all((0..4).map(|_| db.client())).await;
    let mut rng = fastrand::Rng::with_seed(11);
    let mut n = 0;
    for round in 0..300 {
        // Right after a job was handled the worker is on its way to sleep: enqueue 0 to 3 ms
        // later, sometimes from several connections at once.
        let pause = rng.u64(0..3_000);
        tokio::time::sleep(Duration::from_micros(pause)).await;
        let at_once = if round % 3 == 0 { 4 } else { 1 };
        futures_util::future::join_all(
            producers
                .iter()
                .take(at_once)
                .enumerate()
                .map(|(i, client)| enqueue(client, "jobs", n + i as i64)),
        )
        .await;
        let mut got: Vec<i64> = Vec::new();
        for _ in 0..at_once {
            got.push(next(&mut handled, &format!("round {round}")).await);
        }
        got.sort_unstable();
        assert_eq!(got, (n..n + at_once as i64).collect::<Vec<_>>());
        n += at_once as i64;
    }
    handle.shutdown(Duration::from_secs(5)).await;
}

/// Three queues with two worker processes each: every job is handled by a worker of its own
/// queue, each worker's LISTEN session sleeps on its queue only, and sleeping workers are woken
/// whichever of them is asleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_queues_and_workers() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    let queues = ["qa", "qb", "qc"];
    let mut handled = HashMap::new();
    let mut handles = Vec::new();
    for queue in queues {
        create_queue(&db, queue).await;
        let (seen, receive) = mpsc::unbounded_channel();
        for _ in 0..2 {
            handles.push(worker(&port(&db, 6), queue, 2, seen.clone()));
        }
        handled.insert(queue, receive);
    }
    let client = db.client().await;
    for queue in queues {
        await_sleepers(&client, queue, 2).await;
    }
    let mut rng = fastrand::Rng::with_seed(7);
    for n in 0..150 {
        let queue = queues[rng.usize(..queues.len())];
        enqueue(&client, queue, n).await;
        let got = next(handled.get_mut(queue).unwrap(), queue).await;
        assert_eq!(got, n, "{queue}");
        for (other, receive) in handled.iter_mut() {
            if *other != queue {
                assert!(
                    receive.try_recv().is_err(),
                    "{other} handled a job of {queue}"
                );
            }
        }
        if n % 10 == 0 {
            // The workers run out of work again and sleep.
            for queue in queues {
                await_sleepers(&client, queue, 2).await;
            }
        }
    }
    for handle in handles {
        handle.shutdown(Duration::from_secs(5)).await;
    }
}

/// A worker whose LISTEN connection is killed: its registration goes with the session (no
/// enqueue keeps notifying a dead sleeper), the worker connects again, finds what was enqueued
/// meanwhile, sleeps again, and is woken as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listen_connection_dies() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "jobs").await;
    let pg = port(&db, 6);
    let (seen, mut handled) = mpsc::unbounded_channel();
    let handle = worker(&pg, "jobs", 2, seen);
    let client = db.client().await;
    let (probe, mut notes) = listener(&db).await;
    enqueue(&client, "jobs", 0).await;
    assert_eq!(next(&mut handled, "before").await, 0);

    for round in 1..=3 {
        let pid = await_sleepers(&client, "jobs", 1).await[0];
        let killed: bool = client
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(killed);
        // The registration died with the session: an enqueue now notifies no one.
        let deadline = tokio::time::Instant::now() + LOST;
        while sleepers(&client, "jobs").await.contains(&pid) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the dead session still sleeps"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ch = channel(&probe, "jobs").await;
        probe.batch_execute(&format!("LISTEN {ch}")).await.unwrap();
        enqueue(&client, "jobs", round * 10).await;
        // Found by the reconnected worker, without a poll.
        assert_eq!(next(&mut handled, "after the kill").await, round * 10);
        let new_pid = await_sleepers(&client, "jobs", 1).await[0];
        assert_ne!(new_pid, pid);
        enqueue(&client, "jobs", round * 10 + 1).await;
        assert_eq!(next(&mut handled, "woken again").await, round * 10 + 1);
        probe
            .batch_execute(&format!("UNLISTEN {ch}"))
            .await
            .unwrap();
        while notes.try_recv().is_ok() {}
    }
    handle.shutdown(Duration::from_secs(5)).await;
    // A stopped worker leaves no sleeper behind.
    let deadline = tokio::time::Instant::now() + LOST;
    while !sleepers(&client, "jobs").await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a stopped worker still sleeps"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every claim form wakes on an enqueue after going idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_claim_form_sleeps_and_wakes() {
    let _shared = HORIZON.read().await;
    for form in ["lease", "lock", "plain"] {
        let db = TestDb::new().await;
        create_queue(&db, "jobs").await;
        let pg = port(&db, 6);
        let (seen, mut handled) = mpsc::unbounded_channel();
        let handle = match form {
            "plain" => Worker::plain(pg.clone(), "jobs", move |job: Job<i64>| {
                let _ = seen.send(job.payload);
                async { Ok(Outcome::ack()) }
            }),
            _ => {
                let claim = if form == "lock" {
                    Claim::Lock
                } else {
                    Claim::Lease
                };
                let handler = transactional(move |job: Job<i64>, tx: &dyn Database| {
                    let _ = seen.send(job.payload);
                    Box::pin(async move {
                        tx.execute(&Statement::new("SELECT 1")).await?;
                        Ok(Outcome::ack())
                    })
                });
                Worker::transactional(pg.clone(), "jobs", handler).claim(claim)
            }
        }
        .workers(2)
        .poll_interval(POLL)
        .start();
        let client = db.client().await;
        for n in 0..20 {
            await_sleepers(&client, "jobs", 1).await;
            enqueue(&client, "jobs", n).await;
            assert_eq!(next(&mut handled, form).await, n, "{form}");
        }
        handle.shutdown(Duration::from_secs(5)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// Upkeep: the worker vacuums its queue
// ------------------------------------------------------------------------------------------------

async fn vacuum_due(client: &Client, queue: &str) -> Option<String> {
    client
        .query_one("SELECT inbox_vacuum_due($1::text::regclass)", &[&queue])
        .await
        .unwrap()
        .get(0)
}

/// `inbox_vacuum_due` answers yes once dead rows pile up, and not again while the oldest
/// snapshot stands still (a vacuum could remove nothing more); after it moves, yes again.
#[tokio::test]
async fn vacuum_is_due_after_dead_rows_and_a_moving_horizon() {
    let _alone = HORIZON.write().await;
    let db = TestDb::new().await;
    create_queue(&db, "q").await;
    let client = db.client().await;
    assert_eq!(vacuum_due(&client, "q").await, None, "a fresh queue");
    let churn = "SELECT count(*) FROM inbox_enqueue_batch('q', \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series(1, 3000) g)); \
                 DELETE FROM q; SELECT pg_stat_force_next_flush()";
    // A snapshot held open from before the churn: nothing it deletes can be removed.
    let holder = db.client().await;
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM q")
        .await
        .unwrap();
    client.batch_execute(churn).await.unwrap();
    let name = format!("{}.q", db.schema());
    assert_eq!(
        vacuum_due(&client, "q").await,
        Some(name.clone()),
        "3,000 dead rows"
    );
    client.batch_execute(churn).await.unwrap();
    // The horizon may still climb up to the held snapshot (as older transactions of other
    // sessions end); there it stops, and so do the yeses.
    let mut tries = 0;
    while vacuum_due(&client, "q").await.is_some() {
        tries += 1;
        assert!(tries < 50, "vacuum stays due behind a held snapshot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..3 {
        assert_eq!(
            vacuum_due(&client, "q").await,
            None,
            "the oldest snapshot did not move: a vacuum would remove nothing"
        );
    }
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        vacuum_due(&client, "q").await,
        Some(name.clone()),
        "it moved"
    );
    client
        .batch_execute(&format!("VACUUM {name}"))
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    assert_eq!(vacuum_due(&client, "q").await, None, "vacuumed");
}

/// A worker churning through jobs vacuums its queue by itself (counted as manual vacuums in
/// `pg_stat_user_tables`, apart from autovacuum's), and none with `vacuum(false)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_vacuums_its_queue() {
    let _shared = HORIZON.read().await;
    for on in [true, false] {
        let db = TestDb::new().await;
        create_queue(&db, "jobs").await;
        let pg = port(&db, 6);
        let handle = Worker::plain(pg.clone(), "jobs", |_job: Job<i64>| async {
            Ok(Outcome::ack())
        })
        .workers(100)
        .vacuum(on)
        .start();
        let client = db.client().await;
        let started = tokio::time::Instant::now();
        let mut vacuums = 0;
        while started.elapsed() < Duration::from_secs(6) {
            pg.execute(&Statement::new(
                "SELECT count(*) FROM inbox_enqueue_batch('jobs', \
                 ARRAY(SELECT to_jsonb(g) FROM generate_series(1, 500) g))",
            ))
            .await
            .unwrap();
            client
                .batch_execute("SELECT pg_stat_force_next_flush()")
                .await
                .unwrap();
            vacuums = client
                .query_one(
                    "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'jobs'::regclass",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0);
            if on && vacuums > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        handle.shutdown(Duration::from_secs(5)).await;
        if on {
            assert!(vacuums > 0, "the worker never vacuumed its queue");
        } else {
            assert_eq!(vacuums, 0, "vacuum(false) vacuumed");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Where a lease's scan starts
// ------------------------------------------------------------------------------------------------

async fn lease_one(client: &Client) -> Vec<String> {
    client
        .query("SELECT payload::text FROM inbox_lease('q', 1)", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<_, String>(0))
        .collect()
}

/// A job that becomes takeable below where the session's scans start (its lock was rolled back,
/// or it was enqueued with an older due time) is still taken: as soon as nothing is left above,
/// in the same call.
#[tokio::test]
async fn jobs_below_the_scan_floor_are_taken() {
    let _shared = HORIZON.read().await;
    let db = TestDb::new().await;
    create_queue(&db, "q").await;
    let taker = db.client().await;
    let other = db.client().await;
    for n in 1..=3 {
        enqueue(&taker, "q", n).await;
    }
    other.batch_execute("BEGIN").await.unwrap();
    let locked: String = other
        .query_one("SELECT payload::text FROM inbox_lock('q', 1)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(locked, "1");
    assert_eq!(lease_one(&taker).await, vec!["2"], "1 is locked: skipped");
    other.batch_execute("ROLLBACK").await.unwrap();
    // 1 is takeable again, below where the taker's scans now start.
    taker
        .query_one(
            "SELECT inbox_enqueue('q', '4', now() - interval '1 hour')",
            &[],
        )
        .await
        .unwrap();
    let mut rest = Vec::new();
    for _ in 0..3 {
        rest.extend(lease_one(&taker).await);
    }
    rest.sort();
    assert_eq!(rest, vec!["1", "3", "4"]);
    assert!(lease_one(&taker).await.is_empty());
}
