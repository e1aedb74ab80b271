//! Figure 13: the outbox. A relay draining a backlog into NATS JetStream (a server of the run's
//! own) against the raw loop a service would write (take a batch in id order, publish it with the
//! same client, delete it), the commit-to-stream latency with wake-ups and with polling, and
//! what `inbox_publish` costs the producers' transactions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, message::PublishMessage};
use futures_util::StreamExt;
use inbox_client::outbox::{NatsSink, Relay};
use inbox_client::PgDatabase;
use inbox_tests::NatsServer;
use tokio_util::sync::CancellationToken;

use super::measure::{compare, median, percentile, Row, Target};
use super::setup::{Ctx, Result};

const OUTBOX: &str = "bench_outbox";
const RAW: &str = "bench_outbox_raw";
const REFUNDS: &str = "bench_refunds";
const KEYS: i64 = 1000;

pub async fn outbox(ctx: &Ctx) -> Result<Vec<Row>> {
    let nats = NatsServer::start();
    let admin = ctx.connect().await?;
    admin
        .batch_execute(&format!(
            "SET client_min_messages = warning; DROP TABLE IF EXISTS {OUTBOX}, {RAW}, {REFUNDS}; \
             SELECT inbox_create_outbox('{OUTBOX}'); \
             CREATE TABLE {RAW} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 subject text NOT NULL, ordering_key text, payload bytea NOT NULL); \
             CREATE TABLE {REFUNDS} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 n bigint NOT NULL, amount numeric NOT NULL)"
        ))
        .await?;
    let backlog: i64 = if ctx.opts.quick { 20_000 } else { 100_000 };
    let mut rows = Vec::new();

    let js = nats.jetstream().await;
    let (ours, theirs) = compare(
        ctx.opts.rounds,
        || async {
            fresh_stream(&js).await?;
            fill(ctx, true, backlog).await?;
            drain_with_relay(ctx, &nats, backlog).await
        },
        || async {
            fresh_stream(&js).await?;
            fill(ctx, false, backlog).await?;
            drain_raw(ctx, &js, backlog).await
        },
    )
    .await?;
    let note = format!("{backlog} messages over {KEYS} keys, batches of 1,000, one relay");
    rows.push(
        Row::new(
            13,
            "13. relay, msg/s",
            None,
            (Some(ours), Some(theirs)),
            "msg/s",
            Target::RatioAtLeast(0.8),
        )
        .note(note.clone()),
    );
    rows.push(
        Row::new(
            13,
            "13. relay, msg/s (absolute)",
            None,
            (Some(ours), None),
            "msg/s",
            Target::InboxAtLeast(20_000.0),
        )
        .note(note),
    );
    super::report::print_row(&rows[0]);
    super::report::print_row(&rows[1]);

    for (listen, target, name) in [
        (true, 0.1, "13. commit to stream, wake-ups"),
        (false, 1.0, "13. commit to stream, polling"),
    ] {
        fresh_stream(&js).await?;
        let (p50, p99) = latency(ctx, &nats, listen).await?;
        for (label, value, target) in [("p50", p50, None), ("p99", p99, Some(target))] {
            let row = Row::new(
                13,
                format!("{name}, {label}"),
                Some(4),
                (Some(value), None),
                "s",
                target.map_or(Target::None, Target::InboxBelow),
            )
            .note("4 producers, 250 transactions/s each, each publishing one message");
            super::report::print_row(&row);
            rows.push(row);
        }
    }

    let (with, without) = compare(
        ctx.opts.rounds,
        || producers(ctx, true),
        || producers(ctx, false),
    )
    .await?;
    let row = Row::new(
        13,
        "13. producer transactions with inbox_publish",
        Some(8),
        (Some(with), Some(without)),
        "tx/s",
        Target::RatioAtLeast(0.9),
    )
    .note(
        "each transaction inserts a refund; the inbox side also publishes its event (with a key)",
    );
    super::report::print_row(&row);
    rows.push(row);
    fresh_stream(&js).await?;
    rows.extend(steady_size(ctx, &nats).await?);
    fresh_stream(&js).await?;
    rows.extend(held_relay(ctx, &nats).await?);
    admin
        .batch_execute(&format!("DROP TABLE {OUTBOX}, {RAW}, {REFUNDS}"))
        .await?;
    Ok(rows)
}

/// The outbox's size (table and indexes) while 4 producers publish as fast as they can and a
/// relay keeps up, with nothing but the server's autovacuum to reclaim the deleted rows: sampled
/// every tenth of the run, the first sample after a tenth.
async fn steady_size(ctx: &Ctx, nats: &NatsServer) -> Result<Vec<Row>> {
    let admin = fresh_outbox(ctx).await?;
    let autovacuum: String = admin
        .query_one(
            "SELECT current_setting('autovacuum') || ', naptime ' || current_setting('autovacuum_naptime')",
            &[],
        )
        .await?
        .get(0);
    let run = if ctx.opts.quick {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(180)
    };
    let stop = CancellationToken::new();
    let relay = Relay::new(
        ctx.database(4)?,
        OUTBOX,
        NatsSink::new(nats.jetstream().await),
    );
    let counts = relay.counts();
    let running = tokio::spawn(relay.run(stop.clone()));
    let published = Arc::new(AtomicU64::new(0));
    let mut producers = Vec::new();
    for producer in 0..4_i64 {
        let client = ctx.connect().await?;
        let (published, stop) = (published.clone(), stop.clone());
        producers.push(tokio::spawn(async move {
            let mut n = 0_i64;
            while !stop.is_cancelled() {
                client
                    .query_one(
                        &format!(
                            "SELECT inbox_publish_bytes('{OUTBOX}', 'bench.size', \
                             decode(repeat('ab', 100), 'hex'), $1)"
                        ),
                        &[&format!("key-{}", (producer * 7919 + n) % KEYS)],
                    )
                    .await?;
                published.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    let size = format!(
        "SELECT pg_total_relation_size('{OUTBOX}'), \
         (SELECT coalesce(autovacuum_count, 0) FROM pg_stat_user_tables WHERE relid = '{OUTBOX}'::regclass)"
    );
    let mut samples = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(run / 10).await;
        let row = admin.query_one(&size, &[]).await?;
        samples.push((row.get::<_, i64>(0), row.get::<_, i64>(1)));
    }
    stop.cancel();
    for producer in producers {
        producer.await??;
    }
    running.await??;
    let mib = |bytes: i64| bytes as f64 / 1048576.0;
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    let peak = samples.iter().map(|s| s.0).max().unwrap_or(0);
    let trail: Vec<String> = samples.iter().map(|s| format!("{:.1}", mib(s.0))).collect();
    let note = format!(
        "autovacuum {autovacuum}; {} messages published and {} relayed in {} s; size (MiB) every {} s: {}; \
         peak {:.1} MiB; {} autovacuums",
        published.load(Ordering::Relaxed),
        counts.sent(),
        run.as_secs(),
        run.as_secs() / 10,
        trail.join(" "),
        mib(peak),
        last.1
    );
    let row = Row::new(
        13,
        "13. outbox size, last sample / first",
        Some(4),
        (Some(mib(last.0)), Some(mib(first.0))),
        "MiB",
        Target::None,
    )
    .note(note);
    super::report::print_row(&row);
    Ok(vec![row])
}

/// The relay on a backlog kept deep (a connection of its own tops it up in transactions of
/// 1,000) while a session idle in a transaction with an xid holds the horizon: its messages a
/// second in 10 s windows, clean, held, and after.
async fn held_relay(ctx: &Ctx, nats: &NatsServer) -> Result<Vec<Row>> {
    const WINDOW: Duration = Duration::from_secs(10);
    const DEPTH: u64 = 50_000;
    let admin = fresh_outbox(ctx).await?;
    let autovacuum: String = admin.query_one("SHOW autovacuum", &[]).await?.get(0);
    let (clean, held, after) = if ctx.opts.quick {
        (2, 2, 2)
    } else {
        (3, 12, 3)
    };
    let stop = CancellationToken::new();
    let relay = Relay::new(
        ctx.database(4)?,
        OUTBOX,
        NatsSink::new(nats.jetstream().await),
    )
    .batch(1000);
    let counts = relay.counts();
    let topped = {
        let client = ctx.connect().await?;
        let (counts, stop) = (counts.clone(), stop.clone());
        let sql = format!(
            "SELECT count(inbox_publish_bytes('{OUTBOX}', 'bench.held', \
             decode(repeat('ab', 100), 'hex'), 'key-' || (g % {KEYS}))) \
             FROM generate_series(1, 1000) AS g"
        );
        tokio::spawn(async move {
            let mut published = 0_u64;
            while !stop.is_cancelled() {
                if published < counts.sent() + DEPTH {
                    client.query_one(&sql, &[]).await?;
                    published += 1000;
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            Ok::<_, tokio_postgres::Error>(())
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let running = tokio::spawn(relay.run(stop.clone()));
    let holder = ctx.connect().await?;
    let mut windows = Vec::new();
    let mut last = counts.sent();
    for window in 0..clean + held + after {
        if window == clean {
            holder.batch_execute("BEGIN; SELECT txid_current()").await?;
        }
        if window == clean + held {
            holder.batch_execute("COMMIT").await?;
        }
        tokio::time::sleep(WINDOW).await;
        let sent = counts.sent();
        windows.push((sent - last) as f64 / WINDOW.as_secs_f64());
        last = sent;
    }
    stop.cancel();
    topped.await??;
    running.await??;
    let clean_rate = median(windows[..clean].to_vec());
    let worst = windows[clean..clean + held]
        .iter()
        .fold(f64::INFINITY, |a, &b| a.min(b));
    let trail: Vec<String> = windows.iter().map(|w| format!("{w:.0}")).collect();
    let row = Row::new(
        13,
        format!("13. relay, worst 10 s of {} s held / clean", held * 10),
        None,
        (Some(worst / clean_rate.max(1.0)), None),
        "x",
        Target::InboxAtLeast(0.8),
    )
    .note(format!(
        "an idle transaction with an xid held from {} s to {} s; msg/s each 10 s: {}; \
         autovacuum {autovacuum}",
        clean * 10,
        (clean + held) * 10,
        trail.join(" ")
    ));
    super::report::print_row(&row);
    Ok(vec![row])
}

/// A connection, after the outbox was made again empty (a fresh file: nothing left of the
/// previous measurement).
async fn fresh_outbox(ctx: &Ctx) -> Result<tokio_postgres::Client> {
    let admin = ctx.connect().await?;
    admin
        .batch_execute(&format!(
            "SET client_min_messages = warning; DROP TABLE IF EXISTS {OUTBOX}; \
             SELECT inbox_create_outbox('{OUTBOX}')"
        ))
        .await?;
    Ok(admin)
}

async fn fresh_stream(js: &jetstream::Context) -> Result<()> {
    let _ = js.delete_stream("BENCH").await;
    js.create_stream(jetstream::stream::Config {
        name: "BENCH".to_owned(),
        subjects: vec!["bench.>".to_owned()],
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// `n` messages of 100 bytes over the keys, in transactions of 1,000.
async fn fill(ctx: &Ctx, outbox: bool, n: i64) -> Result<()> {
    let client = ctx.connect().await?;
    for from in (0..n).step_by(1000) {
        let sql = if outbox {
            format!(
                "SELECT count(inbox_publish_bytes('{OUTBOX}', 'bench.relay', \
                 decode(repeat('ab', 100), 'hex'), 'key-' || (g % {KEYS}))) \
                 FROM generate_series($1::int8, $1::int8 + 999) AS g"
            )
        } else {
            format!(
                "WITH inserted AS (INSERT INTO {RAW} (subject, ordering_key, payload) \
                 SELECT 'bench.relay', 'key-' || (g % {KEYS}), decode(repeat('ab', 100), 'hex') \
                 FROM generate_series($1::int8, $1::int8 + 999) AS g RETURNING 1) \
                 SELECT count(*) FROM inserted"
            )
        };
        client.query_one(&sql, &[&from]).await?;
    }
    client.batch_execute("VACUUM ANALYZE").await?;
    Ok(())
}

async fn drain_with_relay(ctx: &Ctx, nats: &NatsServer, n: i64) -> Result<f64> {
    let sink = NatsSink::new(nats.jetstream().await);
    let stop = CancellationToken::new();
    let relay = Relay::new(ctx.database(4)?, OUTBOX, sink).batch(1000);
    let counts = relay.counts();
    let started = Instant::now();
    let running = tokio::spawn(relay.run(stop.clone()));
    while counts.sent() < n as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    running.await??;
    Ok(rate)
}

/// The loop a service writes by hand: no lease, no order per key, no retries.
async fn drain_raw(ctx: &Ctx, js: &jetstream::Context, n: i64) -> Result<f64> {
    let mut client = ctx.connect().await?;
    let started = Instant::now();
    let mut sent = 0;
    while sent < n {
        let tx = client.transaction().await?;
        let rows = tx
            .query(
                &format!(
                    "SELECT id, subject, payload FROM {RAW} ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED"
                ),
                &[],
            )
            .await?;
        let mut acks = Vec::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get(0);
            let subject: String = row.get(1);
            let payload: Vec<u8> = row.get(2);
            let publish = PublishMessage::build()
                .payload(payload.into())
                .message_id(format!("{RAW}:{id}"));
            acks.push(js.send_publish(subject, publish).await?);
            ids.push(id);
        }
        for ack in acks {
            ack.await?;
        }
        tx.execute(&format!("DELETE FROM {RAW} WHERE id = ANY($1)"), &[&ids])
            .await?;
        tx.commit().await?;
        sent += ids.len() as i64;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// p50 and p99 seconds from a producer's commit to the message's arrival at a stream consumer.
async fn latency(ctx: &Ctx, nats: &NatsServer, listen: bool) -> Result<(f64, f64)> {
    let per_producer = if ctx.opts.quick { 250 } else { 1000 };
    let db = if listen {
        ctx.database(4)?
    } else {
        PgDatabase::from_pool(ctx.pool(4)?)
    };
    let stop = CancellationToken::new();
    let relay = Relay::new(db, OUTBOX, NatsSink::new(nats.jetstream().await));
    let running = tokio::spawn(relay.run(stop.clone()));
    let js = nats.jetstream().await;
    let stream = js.get_stream("BENCH").await?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?;
    // When each message's transaction was seen committed (its producer's COMMIT returned), by id.
    let committed = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let mut producers = Vec::new();
    for producer in 0..4_i64 {
        let client = ctx.connect().await?;
        let committed = committed.clone();
        producers.push(tokio::spawn(async move {
            let mut next = Instant::now();
            for n in 0..per_producer {
                next += Duration::from_millis(4);
                tokio::time::sleep_until(next.into()).await;
                client.batch_execute("BEGIN").await?;
                let id: i64 = client
                    .query_one(
                        &format!(
                            "SELECT inbox_publish_bytes('{OUTBOX}', 'bench.latency', '\\x00', $1)"
                        ),
                        &[&format!("key-{}", (producer * 7919 + n) % KEYS)],
                    )
                    .await?
                    .get(0);
                client.batch_execute("COMMIT").await?;
                committed.lock().unwrap().insert(id, micros_now());
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    let total = 4 * per_producer as usize;
    let mut arrivals = Vec::with_capacity(total);
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.len() < total && Instant::now() < deadline {
        let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(5), messages.next()).await
        else {
            break;
        };
        let message = message?;
        let arrived = micros_now();
        let id: Option<i64> = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .and_then(|v| {
                v.as_str()
                    .rsplit_once(':')
                    .and_then(|(_, n)| n.parse().ok())
            });
        if let Some(id) = id {
            arrivals.push((id, arrived));
        }
    }
    for producer in producers {
        producer.await??;
    }
    // A message can reach the stream before its producer's COMMIT returned: its latency is 0.
    let mut latencies: Vec<f64> = {
        let committed = committed.lock().unwrap();
        arrivals
            .iter()
            .filter_map(|(id, arrived)| committed.get(id).map(|at| arrived.saturating_sub(*at)))
            .map(|micros| micros as f64 / 1e6)
            .collect()
    };
    stop.cancel();
    running.await??;
    latencies.sort_by(f64::total_cmp);
    Ok((percentile(&latencies, 50.0), percentile(&latencies, 99.0)))
}

/// Transactions per second of 8 producers inserting a refund each, with or without publishing
/// its event in the same transaction.
async fn producers(ctx: &Ctx, publish: bool) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for producer in 0..8_i64 {
        let client = ctx.connect().await?;
        let (done, stop) = (done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0_i64;
            let insert = client
                .prepare(&format!(
                    "INSERT INTO {REFUNDS} (n, amount) VALUES ($1, 12.5) RETURNING id"
                ))
                .await?;
            let event = client
                .prepare(&format!(
                    "SELECT inbox_publish('{OUTBOX}', 'bench.refunds', \
                     jsonb_build_object('refund', $1::int8), $2)"
                ))
                .await?;
            while !stop.is_cancelled() {
                client.batch_execute("BEGIN").await?;
                let id: i64 = client.query_one(&insert, &[&n]).await?.get(0);
                if publish {
                    client
                        .query_one(&event, &[&id, &format!("order-{producer}-{n}")])
                        .await?;
                }
                client.batch_execute("COMMIT").await?;
                done.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    tokio::time::sleep(ctx.opts.warmup).await;
    let (from, started) = (done.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(ctx.opts.duration.max(Duration::from_secs(1))).await;
    let rate = (done.load(Ordering::Relaxed) - from) as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    for task in tasks {
        task.await??;
    }
    Ok(rate)
}
