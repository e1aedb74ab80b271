//! What the extension's rolled-back `#[pg_test]`s cannot show: its functions called over real,
//! concurrent connections that commit, roll back, block each other, wait for leases to expire,
//! `LISTEN`, and switch roles. Plain SQL over tokio-postgres; each test runs in a schema of its
//! own (see `inbox_tests::TestDb`).

use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use inbox_tests::TestDb;
use tokio::sync::{mpsc, Barrier};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout};
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, GenericClient, NoTls, Notification};

use crate::support::{backend_pid, wait_until_waiting_on_lock, PATIENCE};

async fn create_ledger(client: &Client) {
    client
        .batch_execute("SELECT inbox_create_ledger('ledger')")
        .await
        .unwrap();
}

async fn create_queue(client: &Client) {
    client
        .batch_execute("SELECT inbox_create_queue('jobs')")
        .await
        .unwrap();
}

async fn claim(client: &Client, key: &str) -> bool {
    client
        .query_one("SELECT inbox_claim('ledger', $1)", &[&key])
        .await
        .unwrap()
        .get(0)
}

async fn seen(client: &Client, key: &str) -> bool {
    client
        .query_one("SELECT inbox_seen('ledger', $1)", &[&key])
        .await
        .unwrap()
        .get(0)
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn enqueue(client: &Client, payload: &str) -> i64 {
    client
        .query_one("SELECT inbox_enqueue('jobs', $1::text::jsonb)", &[&payload])
        .await
        .unwrap()
        .get(0)
}

/// One delivery returned by `inbox_lease` or `inbox_lock`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Delivery {
    id: i64,
    attempt: i32,
    token: i64,
}

async fn take(client: &impl GenericClient, sql: &str) -> Vec<Delivery> {
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| Delivery {
            id: row.get("id"),
            attempt: row.get("attempt"),
            token: row.get("token"),
        })
        .collect()
}

async fn lease(client: &Client, max: i32, lease: &str) -> Vec<Delivery> {
    take(
        client,
        &format!("SELECT id, attempt, token FROM inbox_lease('jobs', {max}, '{lease}')"),
    )
    .await
}

async fn lock(client: &Client) -> Vec<Delivery> {
    take(client, "SELECT id, attempt, token FROM inbox_lock('jobs')").await
}

/// Runs one settlement (`inbox_ack`, `inbox_retry`, `inbox_extend`, `inbox_dead`, given as the
/// SQL text of the call with `$1` the id and `$2` the token) and returns its result.
async fn settle(client: &Client, call: &str, id: i64, token: i64) -> bool {
    client
        .query_one(&format!("SELECT {call}"), &[&id, &token])
        .await
        .unwrap()
        .get(0)
}

async fn ack(client: &Client, id: i64, token: i64) -> bool {
    settle(client, "inbox_ack('jobs', $1::int8, $2::int8)", id, token).await
}

/// `(ready, delayed, leased, dead)` of the queue, as `client` sees them.
async fn stats(client: &Client) -> (i64, i64, i64, i64) {
    let row = client
        .query_one(
            "SELECT ready, delayed, leased, dead FROM inbox_stats('jobs')",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// 32 claims of one key started together on 32 connections return `true` exactly once, in each
/// of 20 rounds (one key per round).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_one_key_on_separate_connections_return_true_once() {
    const CONNECTIONS: usize = 32;
    const ROUNDS: usize = 20;
    let db = TestDb::new().await;
    let admin = db.client().await;
    create_ledger(&admin).await;
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let client = db.client().await;
        // Warms each backend up (loads the library, prepares the claim) so that the rounds race
        // on the insert itself.
        assert!(claim(&client, &format!("warm-up-{i}")).await);
        clients.push(Arc::new(client));
    }
    let mut pids = HashSet::new();
    for client in &clients {
        pids.insert(backend_pid(client).await);
    }
    assert_eq!(
        pids.len(),
        CONNECTIONS,
        "the claims must use separate backends"
    );

    let barrier = Arc::new(Barrier::new(CONNECTIONS));
    for round in 0..ROUNDS {
        let key = format!("event-{round}");
        let tasks: Vec<_> = clients
            .iter()
            .map(|client| {
                let (client, barrier, key) = (client.clone(), barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    claim(&client, &key).await
                })
            })
            .collect();
        let mut firsts = 0;
        for task in tasks {
            if task.await.unwrap() {
                firsts += 1;
            }
        }
        assert_eq!(
            firsts, 1,
            "round {round}: {firsts} claims of {key} returned true"
        );
    }
    assert_eq!(
        count(&admin, "SELECT count(*) FROM ledger").await,
        (CONNECTIONS + ROUNDS) as i64
    );
    assert_eq!(
        count(
            &admin,
            "SELECT count(DISTINCT event_key) FROM ledger WHERE event_key LIKE 'event-%'"
        )
        .await,
        ROUNDS as i64
    );
}

/// Connection A claims `key` in an open transaction; B's claim of the same key blocks until A
/// ends, then returns `!commit`. Uses its own key.
async fn claim_waits_for_an_uncommitted_claim(db: &TestDb, key: &str, commit: bool) {
    let mut a = db.client().await;
    let b = db.client().await;
    let observer = db.client().await;
    let b_pid = backend_pid(&b).await;
    // B's backend prepares its plans before the race, so that it blocks only on A's claim.
    assert!(!seen(&b, key).await);

    let tx = a.transaction().await.unwrap();
    assert!(
        tx.query_one("SELECT inbox_claim('ledger', $1)", &[&key])
            .await
            .unwrap()
            .get::<_, bool>(0),
        "A's claim of {key} is the first"
    );
    let owned_key = key.to_owned();
    let b_claim = tokio::spawn(async move { claim(&b, &owned_key).await });
    sleep(Duration::from_millis(200)).await;
    assert!(
        !b_claim.is_finished(),
        "B's claim of {key} completed while A's claim was uncommitted"
    );
    wait_until_waiting_on_lock(&observer, b_pid).await;
    assert!(!b_claim.is_finished());

    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    let b_result = timeout(PATIENCE, b_claim)
        .await
        .unwrap_or_else(|_| panic!("B's claim of {key} still blocked after A ended"))
        .unwrap();
    assert_eq!(
        b_result,
        !commit,
        "B's claim of {key} after A's claim {}",
        if commit { "committed" } else { "rolled back" }
    );
    assert_eq!(
        observer
            .query_one("SELECT count(*) FROM ledger WHERE event_key = $1", &[&key])
            .await
            .unwrap()
            .get::<_, i64>(0),
        1
    );
}

/// A claimer that meets an uncommitted claim of the same key waits for it, and gets `false` if
/// that claim commits and `true` if it rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_waits_for_an_uncommitted_claim_and_follows_its_outcome() {
    let db = TestDb::new().await;
    create_ledger(&db.client().await).await;
    claim_waits_for_an_uncommitted_claim(&db, "first-commits", true).await;
    claim_waits_for_an_uncommitted_claim(&db, "first-rolls-back", false).await;
}

/// A claim and the effect written in the same transaction commit together: rolled back, neither
/// is there (and the key can be claimed again); committed, both are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_and_effect_in_one_transaction_commit_or_roll_back_together() {
    let db = TestDb::new().await;
    let mut worker = db.client().await;
    let other = db.client().await;
    create_ledger(&other).await;
    other
        .batch_execute("CREATE TABLE effects (event_key text NOT NULL, amount integer NOT NULL)")
        .await
        .unwrap();
    let effects = "SELECT count(*) FROM effects WHERE event_key = 'order-7/paid'";
    let key = "order-7/paid";

    let tx = worker.transaction().await.unwrap();
    assert!(tx
        .query_one("SELECT inbox_claim('ledger', $1)", &[&key])
        .await
        .unwrap()
        .get::<_, bool>(0));
    tx.execute("INSERT INTO effects VALUES ($1, 10)", &[&key])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(!seen(&other, key).await, "a rolled-back claim stayed");
    assert_eq!(count(&other, effects).await, 0);
    assert_eq!(count(&other, "SELECT count(*) FROM ledger").await, 0);

    let tx = worker.transaction().await.unwrap();
    assert!(
        tx.query_one("SELECT inbox_claim('ledger', $1)", &[&key])
            .await
            .unwrap()
            .get::<_, bool>(0),
        "a key whose claim rolled back is claimed again"
    );
    tx.execute("INSERT INTO effects VALUES ($1, 10)", &[&key])
        .await
        .unwrap();
    // Nothing is visible before the commit.
    assert!(!seen(&other, key).await);
    assert_eq!(count(&other, effects).await, 0);
    tx.commit().await.unwrap();
    assert!(seen(&other, key).await);
    assert_eq!(count(&other, effects).await, 1);
    assert!(!claim(&other, key).await, "a committed key is claimed once");
}

/// Locks `mutex`, ignoring poison: a worker that failed an assertion while holding it must not
/// hide its message behind other workers' `PoisonError`s.
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Eight connections leasing 10,000 jobs in batches of 10 never hold one job at the same time,
/// deliver every job once and ack each exactly once, and leave the queue empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_connections_lease_ten_thousand_jobs_without_overlap() {
    const JOBS: i32 = 10_000;
    const CHUNK: i32 = 1_000;
    const WORKERS: usize = 8;
    let db = TestDb::new().await;
    let admin = db.client().await;
    create_queue(&admin).await;

    let mut enqueued = HashSet::new();
    for start in (1..=JOBS).step_by(CHUNK as usize) {
        let rows = admin
            .query(
                "SELECT inbox_enqueue_batch('jobs', ARRAY( \
                     SELECT jsonb_build_object('n', n) FROM generate_series($1::int4, $2::int4) AS n))",
                &[&start, &(start + CHUNK - 1)],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), CHUNK as usize);
        enqueued.extend(rows.iter().map(|row| row.get::<_, i64>(0)));
    }
    assert_eq!(enqueued.len(), JOBS as usize);
    assert_eq!(stats(&admin).await, (i64::from(JOBS), 0, 0, 0));

    let held = Arc::new(Mutex::new(HashSet::<i64>::new()));
    let acks = Arc::new(Mutex::new(HashMap::<i64, u32>::new()));
    let mut workers = JoinSet::new();
    for worker in 0..WORKERS {
        let client = db.client().await;
        // Ten thousand single-row commits: durability is not what this test is about.
        client
            .batch_execute("SET synchronous_commit = off")
            .await
            .unwrap();
        let (held, acks) = (held.clone(), acks.clone());
        workers.spawn(async move {
            let mut deliveries = 0_usize;
            loop {
                let jobs = lease(&client, 10, "30 seconds").await;
                if jobs.is_empty() {
                    let (ready, _, leased, _) = stats(&client).await;
                    if ready == 0 && leased == 0 {
                        return deliveries;
                    }
                    sleep(Duration::from_millis(2)).await;
                    continue;
                }
                deliveries += jobs.len();
                {
                    let mut held = locked(&held);
                    for job in &jobs {
                        assert!(
                            held.insert(job.id),
                            "worker {worker} leased job {} while another worker held it",
                            job.id
                        );
                    }
                }
                for job in jobs {
                    assert_eq!(
                        (job.attempt, job.token),
                        (1, 1),
                        "job {} delivered again",
                        job.id
                    );
                    match job.id % 16 {
                        0 => sleep(Duration::from_millis(1)).await,
                        1..=4 => tokio::task::yield_now().await,
                        _ => {}
                    }
                    assert!(
                        ack(&client, job.id, job.token).await,
                        "worker {worker}'s ack of job {} was refused",
                        job.id
                    );
                    *locked(&acks).entry(job.id).or_default() += 1;
                    assert!(locked(&held).remove(&job.id));
                }
            }
        });
    }
    let all_done = async {
        let mut deliveries = 0;
        while let Some(worker) = workers.join_next().await {
            deliveries += worker.unwrap();
        }
        deliveries
    };
    let deliveries = timeout(Duration::from_secs(120), all_done)
        .await
        .expect("the workers did not finish the queue");

    assert_eq!(deliveries, JOBS as usize, "jobs delivered more than once");
    let acks = std::mem::take(&mut *locked(&acks));
    assert_eq!(acks.len(), JOBS as usize);
    let acked: HashSet<i64> = acks.keys().copied().collect();
    assert_eq!(acked, enqueued);
    let twice: Vec<_> = acks.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "jobs acked more than once: {twice:?}");
    assert!(locked(&held).is_empty());
    assert_eq!(count(&admin, "SELECT count(*) FROM jobs").await, 0);
    assert_eq!(stats(&admin).await, (0, 0, 0, 0));
}

/// A lease that expired is taken by the next lease with the attempt counted and a new token,
/// and every settlement by the stale token (ack, retry, extend, dead) returns `false` and
/// changes nothing, while the new token's ack finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_lease_is_leased_again_and_the_stale_token_is_fenced() {
    let db = TestDb::new().await;
    let first = db.client().await;
    let second = db.client().await;
    create_queue(&first).await;
    let id = enqueue(&first, r#"{"n": 1}"#).await;

    // A long lease, so that a loaded machine cannot let it end before the second lease looks;
    // the holder then shortens it, and the clock ends it.
    let old = lease(&first, 1, "30 seconds").await;
    assert_eq!(old.len(), 1);
    let old = old[0];
    assert_eq!((old.id, old.attempt), (id, 1));
    assert!(
        lease(&second, 1, "30 seconds").await.is_empty(),
        "a leased job was leased again before its lease ended"
    );
    assert!(
        settle(
            &first,
            "inbox_extend('jobs', $1::int8, $2::int8, '100 milliseconds')",
            id,
            old.token
        )
        .await,
        "the holder could not shorten its lease"
    );

    sleep(Duration::from_millis(300)).await;
    let new = lease(&second, 1, "30 seconds").await;
    assert_eq!(new.len(), 1, "the expired job was not leased again");
    let new = new[0];
    assert_eq!((new.id, new.attempt), (id, 2));
    assert_ne!(new.token, old.token);

    let stale = [
        "inbox_ack('jobs', $1::int8, $2::int8)",
        "inbox_retry('jobs', $1::int8, $2::int8, '0 seconds', 'stale retry')",
        "inbox_extend('jobs', $1::int8, $2::int8, '1 hour')",
        "inbox_dead('jobs', $1::int8, $2::int8, 'stale dead')",
    ];
    for call in stale {
        assert!(
            !settle(&first, call, id, old.token).await,
            "{call} with the stale token returned true"
        );
    }
    // The job is still the second delivery's: leased for about 30 seconds, no error recorded.
    let row = first
        .query_one(
            "SELECT attempt, last_error, leased_at IS NOT NULL, \
                    locked_until > now() + interval '20 seconds', \
                    locked_until < now() + interval '40 seconds' \
               FROM jobs WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 2);
    assert_eq!(row.get::<_, Option<String>>(1), None);
    assert!(row.get::<_, bool>(2));
    assert!(
        row.get::<_, bool>(3) && row.get::<_, bool>(4),
        "a stale token moved the lease"
    );
    assert_eq!(stats(&first).await, (0, 0, 1, 0));

    assert!(ack(&second, id, new.token).await);
    assert!(!ack(&second, id, new.token).await, "a job is acked once");
    assert_eq!(count(&first, "SELECT count(*) FROM jobs").await, 0);
}

/// `inbox_lock` holds a job only by its transaction's row lock: other connections' leases and
/// locks skip it without waiting; a rollback releases it with the attempt uncounted; an ack in
/// that transaction finishes it when the transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_holds_a_job_for_its_transaction_only() {
    let db = TestDb::new().await;
    let mut a = db.client().await;
    let b = db.client().await;
    create_queue(&b).await;

    // Rolled back: the job is back, its attempt not counted.
    let id = enqueue(&b, r#"{"n": 1}"#).await;
    let tx = a.transaction().await.unwrap();
    let locked = take(&tx, "SELECT id, attempt, token FROM inbox_lock('jobs')").await;
    // A lock's token is negative: its settlement, not the lock, counts the attempt.
    assert_eq!(
        locked,
        [Delivery {
            id,
            attempt: 1,
            token: -1
        }]
    );
    let skipped = timeout(PATIENCE, async {
        (lease(&b, 10, "30 seconds").await, lock(&b).await)
    })
    .await
    .expect("B waited for A's row lock instead of skipping the job");
    assert_eq!(skipped, (vec![], vec![]), "B took a job A holds");
    tx.rollback().await.unwrap();
    assert_eq!(
        count(&b, "SELECT attempt::int8 FROM jobs").await,
        0,
        "a rolled-back lock counted the attempt"
    );
    let leased = lease(&b, 10, "30 seconds").await;
    assert_eq!(
        leased,
        [Delivery {
            id,
            attempt: 1,
            token: 1
        }]
    );
    assert!(ack(&b, id, 1).await);

    // Acked and committed: the job is gone.
    let id = enqueue(&b, r#"{"n": 2}"#).await;
    let tx = a.transaction().await.unwrap();
    let locked = take(&tx, "SELECT id, attempt, token FROM inbox_lock('jobs')").await;
    assert_eq!(
        locked,
        [Delivery {
            id,
            attempt: 1,
            token: -1
        }]
    );
    assert!(lease(&b, 10, "30 seconds").await.is_empty());
    assert!(tx
        .query_one(
            "SELECT inbox_ack('jobs', $1::int8, $2::int8)",
            &[&id, &-1_i64]
        )
        .await
        .unwrap()
        .get::<_, bool>(0));
    // Uncommitted, the job is still there for B (locked, so skipped).
    assert_eq!(count(&b, "SELECT count(*) FROM jobs").await, 1);
    assert!(lock(&b).await.is_empty());
    tx.commit().await.unwrap();
    assert!(lease(&b, 10, "30 seconds").await.is_empty());
    assert!(lock(&b).await.is_empty());
    assert_eq!(count(&b, "SELECT count(*) FROM jobs").await, 0);
}

/// A connection of the test (so that `TestDb` cleans it up) whose notifications arrive on the
/// returned channel.
async fn listener(db: &TestDb) -> (Client, mpsc::UnboundedReceiver<Notification>) {
    let mut config: tokio_postgres::Config = db.url().parse().unwrap();
    config.options(format!("-c search_path={},public", db.schema()));
    config.application_name(db.schema());
    let (client, mut connection) = config.connect(NoTls).await.unwrap();
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = poll_fn(|cx| connection.poll_message(cx)).await {
            match message {
                Ok(AsyncMessage::Notification(notification)) => {
                    if sender.send(notification).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    (client, receiver)
}

async fn next_notification(
    notifications: &mut mpsc::UnboundedReceiver<Notification>,
    waiting_for: &str,
) -> Notification {
    timeout(PATIENCE, notifications.recv())
        .await
        .unwrap_or_else(|_| panic!("no notification arrived: {waiting_for}"))
        .expect("the listener's connection closed")
}

/// Sends `NOTIFY channel, payload` from `prober` and checks that the next notification the
/// listener gets is that one: so no other notification was delivered before it.
async fn expect_probe_next(
    prober: &Client,
    channel: &str,
    payload: &str,
    notifications: &mut mpsc::UnboundedReceiver<Notification>,
    why: &str,
) {
    prober
        .batch_execute(&format!("NOTIFY \"{channel}\", '{payload}'"))
        .await
        .unwrap();
    let next = next_notification(notifications, why).await;
    assert_eq!(
        (next.process_id(), next.payload()),
        (backend_pid(prober).await, payload),
        "{why}: got {next:?}"
    );
}

/// Enqueues notify the queue's channel (a session asleep on it) when they commit, not before,
/// and not at all with `inbox.notify` off (set before or after the library is loaded).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enqueue_notifies_listeners_on_commit_unless_notify_is_off() {
    let db = TestDb::new().await;
    let mut producer = db.client().await;
    let prober = db.client().await;
    create_queue(&prober).await;
    let channel: String = prober
        .query_one("SELECT inbox_channel('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    let oid: i64 = prober
        .query_one("SELECT 'jobs'::regclass::oid::int8", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(channel, format!("inbox_{oid}"));
    let (listening, mut notifications) = listener(&db).await;
    listening
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .unwrap();
    // Enqueues notify only sessions asleep on the queue (tests/tests/wakeups.rs has the rest).
    let asleep: bool = listening
        .query_one("SELECT inbox_sleep('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(asleep);
    let producer_pid = backend_pid(&producer).await;

    // Uncommitted: nothing; committed: one notification from the producer.
    let tx = producer.transaction().await.unwrap();
    tx.query_one("SELECT inbox_enqueue('jobs', '{\"n\": 1}')", &[])
        .await
        .unwrap();
    assert!(
        timeout(Duration::from_millis(200), notifications.recv())
            .await
            .is_err(),
        "a notification arrived before the enqueue committed"
    );
    expect_probe_next(
        &prober,
        &channel,
        "probe-1",
        &mut notifications,
        "the uncommitted enqueue must not notify",
    )
    .await;
    tx.commit().await.unwrap();
    let notification = next_notification(&mut notifications, "the committed enqueue").await;
    assert_eq!(notification.channel(), channel);
    assert_eq!(notification.process_id(), producer_pid);

    // A rolled-back enqueue never notifies.
    let tx = producer.transaction().await.unwrap();
    tx.query_one("SELECT inbox_enqueue('jobs', '{\"n\": 2}')", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    expect_probe_next(
        &prober,
        &channel,
        "probe-2",
        &mut notifications,
        "a rolled-back enqueue must not notify",
    )
    .await;

    // A batch notifies too.
    producer
        .batch_execute(
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{\"n\": 3}', '{\"n\": 4}']::jsonb[])",
        )
        .await
        .unwrap();
    let notification = next_notification(&mut notifications, "the committed batch").await;
    assert_eq!(
        (notification.channel(), notification.process_id()),
        (channel.as_str(), producer_pid)
    );

    // Off, set on a connection that has already loaded the library...
    producer
        .batch_execute(
            "SET inbox.notify = off; \
             SELECT inbox_enqueue('jobs', '{\"n\": 5}'); \
             SELECT inbox_enqueue_batch('jobs', ARRAY['{\"n\": 6}']::jsonb[])",
        )
        .await
        .unwrap();
    // ...and on a fresh one, before the library is loaded.
    let quiet = db.client().await;
    quiet
        .batch_execute(
            "SET inbox.notify = off; \
             SELECT inbox_enqueue('jobs', '{\"n\": 7}'); \
             SELECT inbox_enqueue_batch('jobs', ARRAY['{\"n\": 8}']::jsonb[])",
        )
        .await
        .unwrap();
    expect_probe_next(
        &prober,
        &channel,
        "probe-3",
        &mut notifications,
        "enqueues with inbox.notify off must not notify",
    )
    .await;
    assert!(
        timeout(Duration::from_millis(200), notifications.recv())
            .await
            .is_err(),
        "a notification arrived with inbox.notify off"
    );

    // Back on.
    producer
        .batch_execute("RESET inbox.notify; SELECT inbox_enqueue('jobs', '{\"n\": 9}')")
        .await
        .unwrap();
    let notification = next_notification(&mut notifications, "enqueue after RESET").await;
    assert_eq!(notification.process_id(), producer_pid);
    assert_eq!(count(&prober, "SELECT count(*) FROM jobs").await, 8);
}

/// Roles created for one test, dropped (best effort) when it ends even if it panics.
struct Roles {
    url: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        let url = self.url.clone();
        let names = self.names.join(", ");
        let sql = format!("DROP OWNED BY {names}; DROP ROLE {names}");
        // As TestDb: Drop cannot await, so a thread with a runtime of its own does the work.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                if let Ok((client, connection)) = tokio_postgres::connect(&url, NoTls).await {
                    tokio::spawn(connection);
                    let _ = client.batch_execute(&sql).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// The functions run with the caller's rights: a role sees only the rows a row-level security
/// policy exposes to it (even on a backend whose plans were prepared by a superuser), and a role
/// without privileges on the queue gets `42501`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_applies_the_callers_privileges_and_row_level_security() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let tenant = format!("inbox_rls_{schema}");
    let nobody = format!("inbox_rls_{schema}_none");
    let admin = db.client().await;
    create_queue(&admin).await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {tenant} NOLOGIN; CREATE ROLE {nobody} NOLOGIN"
        ))
        .await
        .unwrap();
    let roles = Roles {
        url: db.url().to_owned(),
        names: vec![tenant.clone(), nobody.clone()],
    };
    admin
        .batch_execute(&format!(
            "ALTER TABLE jobs ENABLE ROW LEVEL SECURITY; \
             CREATE POLICY tenant_a ON jobs USING (payload->>'tenant' = 'a'); \
             GRANT USAGE ON SCHEMA {schema}, public TO {tenant}, {nobody}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON jobs TO {tenant}"
        ))
        .await
        .unwrap();
    // Tenant b's jobs come first, so a lease that ignored the policy would take them.
    let mut by_tenant: HashMap<&str, Vec<i64>> = HashMap::new();
    for (n, tenant) in ["b", "a", "b", "a", "b", "a"].into_iter().enumerate() {
        let id = enqueue(&admin, &format!(r#"{{"tenant": "{tenant}", "n": {n}}}"#)).await;
        by_tenant.entry(tenant).or_default().push(id);
    }

    let mut worker = db.client().await;
    // The superuser's lease on this backend sees every job (and prepares the plan)...
    let tx = worker.transaction().await.unwrap();
    assert_eq!(
        take(
            &tx,
            "SELECT id, attempt, token FROM inbox_lease('jobs', 10)"
        )
        .await
        .len(),
        6
    );
    tx.rollback().await.unwrap();
    assert_eq!(stats(&worker).await, (6, 0, 0, 0));

    // ...the tenant's sees only tenant a's.
    worker
        .batch_execute(&format!("SET ROLE {tenant}"))
        .await
        .unwrap();
    let rows = worker
        .query(
            "SELECT id, payload->>'tenant' FROM inbox_lease('jobs', 10, '30 seconds')",
            &[],
        )
        .await
        .unwrap();
    let leased: Vec<(i64, String)> = rows.iter().map(|row| (row.get(0), row.get(1))).collect();
    assert_eq!(
        leased.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        by_tenant["a"],
        "the tenant leased {leased:?}"
    );
    assert!(leased.iter().all(|(_, tenant)| tenant == "a"));
    assert_eq!(stats(&worker).await, (0, 0, 3, 0), "the tenant's stats");
    assert!(lock(&worker).await.is_empty());
    // Tenant b's first job is unleased (attempt 0), so its token would be 0: still invisible.
    let hidden = by_tenant["b"][0];
    assert!(
        !ack(&worker, hidden, 0).await,
        "the tenant acked a hidden job"
    );
    for id in &by_tenant["a"] {
        assert!(ack(&worker, *id, 1).await);
    }
    worker.batch_execute("RESET ROLE").await.unwrap();
    assert_eq!(stats(&admin).await, (3, 0, 0, 0));
    assert_eq!(
        count(
            &admin,
            "SELECT count(*) FROM jobs WHERE payload->>'tenant' = 'b' AND attempt = 0"
        )
        .await,
        3
    );

    // Without privileges: 42501, on a backend with plans prepared and on a fresh one.
    let fresh = db.client().await;
    for client in [&worker, &fresh] {
        client
            .batch_execute(&format!("SET ROLE {nobody}"))
            .await
            .unwrap();
        let error = client
            .query("SELECT * FROM inbox_lease('jobs')", &[])
            .await
            .expect_err("a role without privileges leased");
        assert_eq!(
            error.code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE),
            "{error:?}"
        );
        client.batch_execute("RESET ROLE").await.unwrap();
    }
    assert_eq!(stats(&admin).await, (3, 0, 0, 0));

    drop((worker, fresh));
    drop(roles);
    let left = admin
        .query_one(
            "SELECT count(*) FROM pg_roles WHERE rolname IN ($1, $2)",
            &[&tenant, &nobody],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(left, 0, "the test's roles were not dropped");
}
