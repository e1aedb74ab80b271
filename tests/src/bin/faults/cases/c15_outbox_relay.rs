//! Case 15, the outbox relay under kills: on a throwaway cluster of the case's own and a NATS
//! server of its own, 8 producer connections publish over 1,000 keys (a fifth of their
//! transactions rolled back, one transaction held open for 10 s in the middle), while the relay
//! process is SIGKILLed and started again 10 times, the NATS server is restarted once and
//! PostgreSQL is crashed once (`pg_ctl -m immediate`). Each producer records the message it
//! published in a table of the same transaction, so what committed is known exactly. What must
//! hold, read back from the stream: every committed message exactly once (by `Nats-Msg-Id`), none
//! of a rolled-back transaction, and per key the stream's order is the ids' order, which is
//! commit order per key.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_tests::nats::read_stream;
use inbox_tests::NatsServer;

use crate::cluster::Cluster;
use crate::common::{Ctx, Result, Row};
use crate::relay_child;

pub const NAME: &str = "outbox relay: kills, broker restart, server crash";

const PRODUCERS: i64 = 8;
const KEYS: u32 = 1000;

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(15, NAME);
    let messages: i64 = ctx.profile.pick(30_000, 100_000);
    let kills = 10;
    let cluster = Cluster::create(&ctx.pg_bin).await?;
    let db = cluster.faults_database().await?;
    db.client()
        .await
        .batch_execute(
            "SELECT inbox_create_outbox('events'); \
             CREATE TABLE committed (id bigint NOT NULL, key text NOT NULL)",
        )
        .await?;
    let mut nats = NatsServer::start();
    // The window covers the whole run: a repeat is dropped however late the relay repeats it.
    let stream = nats
        .create_stream_with_window("EVENTS", &["events.>"], Duration::from_secs(1800))
        .await;

    let relay_args: Vec<String> = [
        "--url",
        &cluster.url("faults"),
        "--schema",
        db.schema(),
        "--nats",
        &nats.url(),
        "--lease-ms",
        "2000",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();

    let published = Arc::new(AtomicU64::new(0));
    let rolled_back = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut producers = Vec::new();
    for producer in 0..PRODUCERS {
        let (config, published, rolled_back, errors) = (
            db.config(),
            published.clone(),
            rolled_back.clone(),
            errors.clone(),
        );
        let share = messages / PRODUCERS;
        producers.push(tokio::spawn(async move {
            let mut n = 0;
            while n < share {
                // A lost connection (the crash) is opened again; its transaction's fate is read
                // back from the table of what committed.
                let Ok((mut client, connection)) = config.connect(tokio_postgres::NoTls).await
                else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                tokio::spawn(connection);
                while n < share {
                    let key = format!("key-{}", fastrand::u32(..KEYS));
                    let rollback = fastrand::u8(..5) == 0;
                    let outcome = async {
                        let tx = client.transaction().await?;
                        let id: i64 = tx
                            .query_one(
                                "SELECT inbox_publish('events', 'events.faults', \
                                 jsonb_build_object('producer', $1::int8, 'n', $2::int8), $3)",
                                &[&producer, &n, &key],
                            )
                            .await?
                            .get(0);
                        tx.execute(
                            "INSERT INTO committed (id, key) VALUES ($1, $2)",
                            &[&id, &key],
                        )
                        .await?;
                        if rollback {
                            tx.rollback().await
                        } else {
                            tx.commit().await
                        }
                    }
                    .await;
                    n += 1;
                    match outcome {
                        Ok(()) if rollback => _ = rolled_back.fetch_add(1, Ordering::Relaxed),
                        Ok(()) => _ = published.fetch_add(1, Ordering::Relaxed),
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                }
            }
        }));
    }
    // The long transaction: it holds one key for 10 s while everything else goes on.
    let held = {
        let config = db.config();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            let tx = client.transaction().await?;
            let id: i64 = tx
                .query_one(
                    "SELECT inbox_publish('events', 'events.faults', '{\"held\": true}', 'key-held')",
                    &[],
                )
                .await?
                .get(0);
            tx.execute(
                "INSERT INTO committed (id, key) VALUES ($1, 'key-held')",
                &[&id],
            )
            .await?;
            tokio::time::sleep(Duration::from_secs(10)).await;
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(())
        })
    };

    // The faults: relay kills throughout, the broker restarted after the third, the server
    // crashed after the sixth, once the long transaction has committed.
    let started = Instant::now();
    let mut held = Some(held);
    let mut held_committed = false;
    for kill in 1..=kills {
        let mut relay = relay_child::spawn(&ctx.exe, &relay_args)?;
        tokio::time::sleep(Duration::from_millis(fastrand::u64(500..1500))).await;
        relay.start_kill()?;
        relay.wait().await?;
        row.faults += 1;
        if kill == 3 {
            nats.restart_gracefully();
            row.faults += 1;
        }
        if kill == 6 {
            if let Some(held) = held.take() {
                held_committed = matches!(held.await?, Ok(()));
            }
            cluster.stop("immediate").await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            cluster.start().await?;
            row.faults += 1;
        }
    }
    let mut relay = relay_child::spawn(&ctx.exe, &relay_args)?;
    for producer in producers {
        producer.await?;
    }

    // Drained: every committed message sent (the last relay is never killed).
    let admin = db.client().await;
    let deadline = Instant::now() + Duration::from_secs(300);
    let drained = loop {
        let left: i64 = admin
            .query_one("SELECT count(*) FROM events WHERE dead_at IS NULL", &[])
            .await?
            .get(0);
        if left == 0 {
            break true;
        }
        if Instant::now() > deadline {
            row.failures
                .push(format!("{left} messages still unsent after 300 s"));
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let took = started.elapsed();
    drop(relay.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), relay.wait()).await;

    let committed: HashMap<i64, String> = admin
        .query("SELECT id, key FROM committed", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let dead: i64 = admin
        .query_one("SELECT count(*) FROM events WHERE dead_at IS NOT NULL", &[])
        .await?
        .get(0);
    row.check(dead == 0, || format!("{dead} messages were dead-lettered"));
    row.jobs = committed.len() as u64;
    row.inputs = published.load(Ordering::Relaxed) + rolled_back.load(Ordering::Relaxed);
    let read = read_stream(&stream, committed.len() + 1000).await;
    let mut seen = HashSet::new();
    let mut last_of_key: HashMap<&str, i64> = HashMap::new();
    let (mut doubled, mut foreign, mut reordered) = (0, 0, 0);
    for (message_id, _, _) in &read {
        let Some(id) = message_id
            .rsplit_once(':')
            .and_then(|(_, n)| n.parse::<i64>().ok())
        else {
            foreign += 1;
            continue;
        };
        if !seen.insert(id) {
            doubled += 1;
            continue;
        }
        let Some(key) = committed.get(&id) else {
            foreign += 1;
            continue;
        };
        if let Some(previous) = last_of_key.insert(key.as_str(), id) {
            if previous > id {
                reordered += 1;
            }
        }
    }
    let lost = committed.keys().filter(|id| !seen.contains(id)).count();
    row.lost = lost as u64;
    row.doubled = doubled;
    row.check(drained, || "the outbox did not drain".into());
    row.check(lost == 0, || {
        format!("{lost} committed messages are not in the stream")
    });
    row.check(doubled == 0, || {
        format!("{doubled} messages are in the stream twice")
    });
    row.check(foreign == 0, || {
        format!("{foreign} messages in the stream were never committed (rolled back)")
    });
    row.check(reordered == 0, || {
        format!("{reordered} messages reached the stream before an earlier one of their key")
    });
    row.check(held_committed, || "the long transaction failed".into());
    row.note(format!(
        "{} committed messages ({} transactions rolled back, {} lost to the crash) over {KEYS} keys \
         from {PRODUCERS} producers; {kills} relay kills, 1 broker restart, 1 server crash; \
         {} messages in the stream, drained {:.1} s after the first kill",
        committed.len(),
        rolled_back.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        read.len(),
        took.as_secs_f64()
    ));
    drop(admin);
    drop(db);
    drop(cluster);
    Ok(row)
}
