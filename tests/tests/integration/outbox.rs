//! The outbox over real connections and a real NATS server: commit order per key, out-of-order
//! commits, rolled-back publishes, relays racing and taking over, poison messages and the
//! broker's payload limit.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::outbox::{NatsSink, Outbox, Relay};
use inbox_client::{Database, PgDatabase, PgTransaction};
use inbox_tests::nats::read_stream;
use inbox_tests::{NatsServer, TestDb};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

async fn setup(db: &TestDb) -> (PgDatabase, Outbox) {
    let pg = PgDatabase::from_pool_and_config(db.pool(16), db.config());
    let outbox = Outbox::new("events");
    pg.execute(&outbox.create_statement()).await.unwrap();
    (pg, outbox)
}

/// Claims through SQL, as a relay in any language would; returns the ids and the claim's token.
async fn claim(client: &tokio_postgres::Client, relay: &str) -> (Vec<i64>, Option<i64>) {
    let rows = client
        .query(
            "SELECT id, token FROM inbox_relay_claim('events', $1, 100, '1 minute')",
            &[&relay],
        )
        .await
        .unwrap();
    let token = rows.first().map(|row| row.get(1));
    (rows.iter().map(|row| row.get(0)).collect(), token)
}

async fn sent(client: &tokio_postgres::Client, token: i64, ids: &[i64]) -> i64 {
    client
        .query_one("SELECT inbox_relay_sent('events', $1, $2)", &[&token, &ids])
        .await
        .unwrap()
        .get(0)
}

async fn publish(tx: &tokio_postgres::Transaction<'_>, key: Option<&str>, n: i64) -> i64 {
    tx.query_one(
        "SELECT inbox_publish('events', 'events.test', jsonb_build_object('n', $1::int8), $2)",
        &[&n, &key],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_id_that_commits_first_is_relayed_first_and_the_earlier_one_after() {
    let db = TestDb::new().await;
    setup(&db).await;
    let (mut first, mut second, relay) = (db.client().await, db.client().await, db.client().await);
    let early = first.transaction().await.unwrap();
    let early_id = publish(&early, Some("a"), 1).await;
    let late = second.transaction().await.unwrap();
    let late_id = publish(&late, Some("b"), 2).await;
    assert!(late_id > early_id);
    late.commit().await.unwrap();

    // The later id is committed: it goes now, without waiting for the earlier transaction.
    let (ids, token) = claim(&relay, "r").await;
    assert_eq!(ids, vec![late_id]);
    assert_eq!(sent(&relay, token.unwrap(), &ids).await, 1);
    let (ids, _) = claim(&relay, "r").await;
    assert!(ids.is_empty(), "nothing else is committed: {ids:?}");

    // The earlier one is not skipped: it goes once it commits.
    early.commit().await.unwrap();
    let (ids, token) = claim(&relay, "r").await;
    assert_eq!(ids, vec![early_id]);
    assert_eq!(sent(&relay, token.unwrap(), &ids).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishers_of_one_key_draw_their_ids_in_commit_order() {
    let db = TestDb::new().await;
    setup(&db).await;
    let mut first = db.client().await;
    let early = first.transaction().await.unwrap();
    let early_id = publish(&early, Some("k"), 1).await;

    let url_db = db.config();
    let (ready, started) = tokio::sync::oneshot::channel();
    let waiter = tokio::spawn(async move {
        let (mut client, connection) = url_db.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        let tx = client.transaction().await.unwrap();
        ready.send(()).unwrap();
        let id = publish(&tx, Some("k"), 2).await;
        tx.commit().await.unwrap();
        id
    });
    started.await.unwrap();
    // The second publisher waits for the first transaction's key lock.
    let observer = db.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND classid = 'events'::regclass::oid",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second publisher never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!waiter.is_finished());
    let stats = Outbox::new("events")
        .stats(&PgDatabase::from_pool(db.pool(1)))
        .await
        .unwrap();
    assert!(stats.oldest_publisher_age.unwrap() > 0.0);
    early.commit().await.unwrap();
    let late_id = waiter.await.unwrap();
    assert!(
        late_id > early_id,
        "{late_id} drawn after {early_id} committed"
    );

    // A rolled-back holder lets the next one go too, and leaves no message.
    let doomed = first.transaction().await.unwrap();
    publish(&doomed, Some("k"), 3).await;
    doomed.rollback().await.unwrap();
    let relay = db.client().await;
    let (ids, token) = claim(&relay, "r").await;
    assert_eq!(ids, vec![early_id], "one head per key");
    sent(&relay, token.unwrap(), &ids).await;
    let (ids, _) = claim(&relay, "r").await;
    assert_eq!(ids, vec![late_id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_claim_settles_nothing_and_a_second_relay_waits_for_the_lease() {
    let db = TestDb::new().await;
    setup(&db).await;
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_publish('events', 'events.test', '{}', 'k')")
        .await
        .unwrap();
    let (ids, old_token) = claim(&client, "a").await;
    assert_eq!(ids.len(), 1);
    let (ids_b, _) = claim(&client, "b").await;
    assert!(ids_b.is_empty(), "b claimed while a holds the lease");
    // a's lease runs out; b takes the outbox and the message.
    client
        .batch_execute(
            "UPDATE inbox_relays SET leased_until = now() - interval '1 second'; \
                        UPDATE events SET locked_until = now() - interval '1 second'",
        )
        .await
        .unwrap();
    let (ids_b, new_token) = claim(&client, "b").await;
    assert_eq!(ids_b, ids);
    assert_eq!(
        sent(&client, old_token.unwrap(), &ids).await,
        0,
        "the stale claim is fenced"
    );
    let failed: i64 = client
        .query_one(
            "SELECT inbox_relay_failed('events', $1, $2, ARRAY['late'])",
            &[&old_token.unwrap(), &ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(failed, 0);
    assert_eq!(sent(&client, new_token.unwrap(), &ids).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_refused_with_its_sqlstate() {
    let db = TestDb::new().await;
    setup(&db).await;
    let client = db.client().await;
    crate::support::assert_refused(
        &client,
        &[
            ("SELECT inbox_publish('events', NULL, '{}')", "22004"),
            ("SELECT inbox_publish('events', '', '{}')", "22023"),
            ("SELECT inbox_publish('events', 's', NULL)", "22004"),
            (
                "SELECT inbox_publish('events', 's', '{}', headers => '[1]')",
                "22023",
            ),
            (
                "SELECT inbox_publish('events', 's', '{}', headers => '{\"a\": 1}')",
                "22023",
            ),
            ("SELECT inbox_publish('nope', 's', '{}')", "42P01"),
            ("SELECT * FROM inbox_relay_claim('events', 'r', 0)", "22023"),
            (
                "SELECT * FROM inbox_relay_claim('events', 'r', 1, '-1 second')",
                "22023",
            ),
            ("SELECT * FROM inbox_relay_claim('events', '', 1)", "22023"),
            (
                "SELECT inbox_relay_failed('events', 1, ARRAY[1], ARRAY['a', 'b'])",
                "2202E",
            ),
            (
                "SELECT * FROM inbox_outbox_messages('events', 'lost')",
                "22023",
            ),
            ("SELECT inbox_create_outbox('a.b.c')", "42602"),
            ("SELECT inbox_create_outbox(repeat('x', 64))", "42622"),
            (
                "CREATE TABLE plain (id bigint); SELECT inbox_create_outbox('plain')",
                "42703",
            ),
            (
                "CREATE TABLE odd (id int); SELECT inbox_create_outbox('odd')",
                "42804",
            ),
        ],
    )
    .await;
    // Nothing was recorded by the refused calls.
    let count: i64 = client
        .query_one("SELECT count(*) FROM events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 0);
}

fn spawn_relay(
    pg: &PgDatabase,
    sink: NatsSink,
    name: &str,
    lease: Duration,
    max_attempts: i32,
) -> (
    JoinHandle<()>,
    CancellationToken,
    Arc<inbox_client::outbox::RelayCounts>,
) {
    let stop = CancellationToken::new();
    let relay = Relay::new(pg.clone(), "events", sink)
        .name(name)
        .lease(lease)
        .max_attempts(max_attempts);
    let counts = relay.counts();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await.unwrap() }
    });
    (task, stop, counts)
}

async fn drained(pg: &PgDatabase, within: Duration) {
    let outbox = Outbox::new("events");
    let deadline = Instant::now() + within;
    loop {
        let stats = outbox.stats(pg).await.unwrap();
        if stats.pending + stats.sending + stats.retrying == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "not drained: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks the stream against what committed: each message once, none from a rolled-back
/// transaction, and per key in id order (which is commit order per key).
fn check_stream(
    stream: &[(String, String, Vec<u8>)],
    committed: &HashMap<i64, Option<String>>,
    outbox: &str,
) {
    let mut seen = HashSet::new();
    let mut last_of_key: HashMap<String, i64> = HashMap::new();
    for (message_id, _, _) in stream {
        let id: i64 = message_id
            .strip_prefix(&format!("{outbox}:"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected message id {message_id}"));
        assert!(seen.insert(id), "message {id} is in the stream twice");
        let key = committed
            .get(&id)
            .unwrap_or_else(|| panic!("message {id} was not committed"));
        if let Some(key) = key {
            if let Some(previous) = last_of_key.insert(key.clone(), id) {
                assert!(previous < id, "key {key}: {id} after {previous}");
            }
        }
    }
    assert_eq!(
        seen.len(),
        committed.len(),
        "messages missing from the stream"
    );
}

/// 8 producers publish while one relay runs: every committed message reaches the stream once, in
/// order per key, none rolled back; the relay counts them, vacuums the outbox behind it and gives
/// its lease up when stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_delivers_every_committed_message_once_in_order_per_key() {
    let db = TestDb::new().await;
    let (pg, _) = setup(&db).await;
    let nats = NatsServer::start();
    let stream = nats.create_stream("EVENTS", &["events.>"]).await;
    let (relay, stop, counts) = spawn_relay(
        &pg,
        NatsSink::new(nats.jetstream().await),
        "only",
        Duration::from_secs(5),
        10,
    );

    // 8 producers, 50 keys, a fifth of the transactions rolled back, two messages a transaction.
    let committed = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let mut producers = Vec::new();
    for producer in 0..8_i64 {
        let (config, committed) = (db.config(), Arc::clone(&committed));
        producers.push(tokio::spawn(async move {
            let (mut client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(connection);
            for n in 0..150_i64 {
                let tx = client.transaction().await.unwrap();
                let key = format!("key-{}", fastrand::u8(..50));
                let a = publish(&tx, Some(&key), producer * 1000 + n).await;
                let b = publish(&tx, None, producer * 1000 + n).await;
                if n % 5 == 0 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    let mut committed = committed.lock().unwrap();
                    committed.insert(a, Some(key));
                    committed.insert(b, None);
                }
            }
        }));
    }
    for producer in producers {
        producer.await.unwrap();
    }
    drained(&pg, Duration::from_secs(60)).await;
    let committed = committed.lock().unwrap().clone();
    let messages = read_stream(&stream, committed.len() + 10).await;
    check_stream(&messages, &committed, "events");
    // The relay counts a settlement once its commit is answered, a moment after the outbox drains.
    let deadline = Instant::now() + Duration::from_secs(5);
    while counts.sent() < committed.len() as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(counts.sent(), committed.len() as u64);
    // It vacuumed the outbox behind it (every message sent left a dead row; the statistics that
    // tell it so reach the server within a second or two).
    let client = db.client().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let vacuums = loop {
        let vacuums: i64 = client
            .query_one(
                "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'events'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if vacuums > 0 || Instant::now() > deadline {
            break vacuums;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(vacuums > 0, "the relay never vacuumed the outbox");
    stop.cancel();
    relay.await.unwrap();
    // It gave its lease up on the way out.
    let stats = Outbox::new("events").stats(&pg).await.unwrap();
    assert_eq!(stats.sent, committed.len() as i64);
    assert!(stats.relay_lease_until.unwrap() <= chrono::Utc::now());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_race_one_leads_and_the_other_takes_over_when_it_dies() {
    let db = TestDb::new().await;
    let (pg, outbox) = setup(&db).await;
    let nats = NatsServer::start();
    let stream = nats.create_stream("EVENTS", &["events.>"]).await;
    let lease = Duration::from_secs(2);
    let (a, _stop_a, counts_a) =
        spawn_relay(&pg, NatsSink::new(nats.jetstream().await), "a", lease, 10);
    let (b, stop_b, counts_b) =
        spawn_relay(&pg, NatsSink::new(nats.jetstream().await), "b", lease, 10);

    let mut committed = HashMap::new();
    let publish_some = |from: i64| {
        let pg = pg.clone();
        let outbox = outbox.clone();
        async move {
            let mut ids = HashMap::new();
            for n in from..from + 500 {
                let key = format!("key-{}", n % 20);
                let mut client = pg.pool().get().await.unwrap();
                let tx = client.transaction().await.unwrap();
                let id = outbox
                    .publish(&PgTransaction::new(&tx), "events.raced", &n, Some(&key))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                ids.insert(id, Some(key));
            }
            ids
        }
    };
    committed.extend(publish_some(0).await);
    drained(&pg, Duration::from_secs(30)).await;
    assert!(
        counts_a.sent() == 0 || counts_b.sent() == 0,
        "both relays sent while the lease held: a {} b {}",
        counts_a.sent(),
        counts_b.sent()
    );

    // The leader dies without giving its lease up: the other takes over once the lease ends.
    let (leader, survivor, survivor_stop) = if counts_a.sent() > 0 {
        (a, b, stop_b)
    } else {
        (b, a, _stop_a)
    };
    leader.abort();
    let died = Instant::now();
    committed.extend(publish_some(10_000).await);
    drained(&pg, Duration::from_secs(30)).await;
    assert!(died.elapsed() < Duration::from_secs(30));
    let messages = read_stream(&stream, committed.len() + 10).await;
    check_stream(&messages, &committed, "events");
    survivor_stop.cancel();
    survivor.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_message_is_dead_lettered_and_its_key_goes_on() {
    let db = TestDb::new().await;
    let (pg, outbox) = setup(&db).await;
    let nats = NatsServer::start_with_max_payload(Some(64 * 1024));
    let stream = nats.create_stream("EVENTS", &["events.>"]).await;
    let client = db.client().await;
    // No stream takes "nowhere.*"; a payload over the limit cannot be published at all; one just
    // under the limit (with its headers) goes.
    let poison: i64 = client
        .query_one(
            "SELECT inbox_publish('events', 'nowhere.at.all', '{}', 'k')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let after: i64 = client
        .query_one(
            "SELECT inbox_publish('events', 'events.ok', '{}', 'k')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let too_big: i64 = client
        .query_one(
            "SELECT inbox_publish_bytes('events', 'events.big', '\\x00'::bytea || decode(repeat('ab', 64 * 1024), 'hex'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let at_limit: i64 = client
        .query_one(
            "SELECT inbox_publish_bytes('events', 'events.big', decode(repeat('ab', 64 * 1024 - 64), 'hex'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (relay, stop, _) = spawn_relay(
        &pg,
        NatsSink::new(nats.jetstream().await),
        "only",
        Duration::from_secs(2),
        2,
    );
    drained(&pg, Duration::from_secs(30)).await;
    let dead = outbox.messages(&pg, Some("dead"), 10).await.unwrap();
    let dead_ids: Vec<i64> = dead.iter().map(|m| m.id).collect();
    assert_eq!(dead_ids, vec![poison, too_big]);
    assert!(dead
        .iter()
        .all(|m| m.attempt == 2 && m.last_error.is_some()));
    let messages = read_stream(&stream, 2).await;
    // Across keys nothing is ordered: `after` waited behind the poison message's retries.
    let ids: HashSet<String> = messages.iter().map(|m| m.0.clone()).collect();
    let expected = HashSet::from([format!("events:{after}"), format!("events:{at_limit}")]);
    assert_eq!(ids, expected);
    let big = messages.iter().find(|m| m.1 == "events.big").unwrap();
    assert_eq!(big.2.len(), 64 * 1024 - 64);

    // Requeued after the operator added a stream for it, the poison message goes through.
    nats.create_stream("NOWHERE", &["nowhere.>"]).await;
    assert!(outbox.requeue(&pg, poison).await.unwrap());
    drained(&pg, Duration::from_secs(30)).await;
    assert!(outbox.discard(&pg, too_big).await.unwrap());
    assert_eq!(outbox.stats(&pg).await.unwrap().dead, 0);
    stop.cancel();
    relay.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_with_a_long_backlog_holds_back_only_itself() {
    let db = TestDb::new().await;
    setup(&db).await;
    let client = db.client().await;
    // 5,000 messages of one key, then one of each of 50 other keys.
    client
        .batch_execute(
            "SELECT count(inbox_publish('events', 'events.hot', jsonb_build_object('n', g), 'hot')) \
             FROM generate_series(1, 5000) AS g; \
             SELECT count(inbox_publish('events', 'events.cold', '{}', 'cold-' || g)) \
             FROM generate_series(1, 50) AS g",
        )
        .await
        .unwrap();
    // Each claim looks at four times its size: the hot key's head, and the messages behind it
    // set aside, until the claims reach the other keys.
    let mut claimed = Vec::new();
    let mut claims = 0;
    while claimed.len() < 51 {
        let rows = client
            .query(
                "SELECT id, key FROM inbox_relay_claim('events', 'r', 100, '1 minute')",
                &[],
            )
            .await
            .unwrap();
        claims += 1;
        assert!(claims <= 20, "the other keys were not reached: {claimed:?}");
        claimed.extend(
            rows.iter()
                .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1))),
        );
    }
    let hot: Vec<i64> = claimed
        .iter()
        .filter(|(_, key)| key == "hot")
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(
        hot.len(),
        1,
        "one message of the hot key in flight: {hot:?}"
    );
    // Claims whose window holds only the hot key's messages set the rest of them aside.
    let (more, _) = claim(&client, "r").await;
    assert!(more.is_empty(), "{more:?}");
    let set_aside: i64 = client
        .query_one(
            "SELECT count(*) FROM events WHERE locked_until = 'infinity' AND dead_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(set_aside, 4999);
    let stats = Outbox::new("events")
        .stats(&PgDatabase::from_pool(db.pool(1)))
        .await
        .unwrap();
    assert_eq!((stats.pending, stats.sending), (4999, 51));

    // Sending the hot head makes the next one of its key due, and only that one.
    let token: i64 = client
        .query_one("SELECT max(token) FROM events", &[])
        .await
        .unwrap()
        .get(0);
    let rows = client
        .query("SELECT id, token FROM events WHERE token IS NOT NULL", &[])
        .await
        .unwrap();
    for row in rows {
        let (id, token): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(sent(&client, token, &[id]).await, 1);
    }
    let (ids, _) = claim(&client, "r").await;
    assert_eq!(
        ids,
        vec![hot[0] + 1],
        "the hot key's next, alone (token {token})"
    );

    // A head that dies lets its key go on too.
    let (next, token) = (ids[0], claim(&client, "r").await.1);
    assert!(token.is_none(), "nothing else is due");
    let token: i64 = client
        .query_one("SELECT token FROM events WHERE id = $1", &[&next])
        .await
        .unwrap()
        .get(0);
    let recorded: i64 = client
        .query_one(
            "SELECT inbox_relay_failed('events', $1, ARRAY[$2::int8], ARRAY['poison'], 1)",
            &[&token, &next],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 1);
    let (ids, _) = claim(&client, "r").await;
    assert_eq!(ids, vec![next + 1]);
}
