//! The outbox commands of the `inbox` binary against a real database (`inbox_tests::TestDb`, a
//! fresh schema each) and a real NATS server with JetStream (`inbox_tests::NatsServer`, started
//! by the test): `inbox relay` as a child process, `inbox outboxes`, `inbox outbox ...`, and the
//! outbox gauges of `inbox metrics`.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{sample, Exporter};

use assert_cmd::Command;
use inbox_tests::nats::read_stream;
use inbox_tests::{NatsServer, TestDb};
use serde_json::Value;

/// The binary, pointed at the test database.
fn inbox(db: &TestDb) -> Command {
    let mut command = Command::cargo_bin("inbox").expect("the inbox binary is built");
    command
        .env("DATABASE_URL", db.url())
        .timeout(Duration::from_secs(120));
    command
}

/// Runs the binary with `--json` and the arguments, expecting success; returns its JSON output.
fn json(db: &TestDb, args: &[&str]) -> Value {
    let output = inbox(db).arg("--json").args(args).output().unwrap();
    assert!(
        output.status.success(),
        "inbox {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "inbox {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The test database's URL with the test's schema first on `search_path`.
fn with_search_path(db: &TestDb) -> String {
    let separator = if db.url().contains('?') { '&' } else { '?' };
    format!(
        "{}{separator}options=-c%20search_path%3D{}%2Cpublic",
        db.url(),
        db.schema()
    )
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Waits until `sql` (a count) reads `expected`, at most `within`; returns what it last read.
async fn wait_for(
    client: &tokio_postgres::Client,
    sql: &str,
    expected: i64,
    within: Duration,
) -> i64 {
    let deadline = Instant::now() + within;
    loop {
        let n = count(client, sql).await;
        if n == expected || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running `inbox relay`: its standard error is collected for the failure messages.
struct RelayProcess {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl RelayProcess {
    /// Starts `inbox --json relay ARGS` against `url` and waits for the line that says it runs.
    fn start(url: &str, args: &[&str]) -> RelayProcess {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
            .arg("--json")
            .arg("relay")
            .args(args)
            .env("DATABASE_URL", url)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut first = String::new();
        stderr.read_line(&mut first).unwrap();
        assert!(
            first.contains("relaying"),
            "the relay did not start: {first:?}"
        );
        let lines = Arc::new(Mutex::new(vec![first]));
        let collected = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                collected.lock().unwrap().push(line);
            }
        });
        RelayProcess {
            child,
            stderr: lines,
        }
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Sends SIGTERM and waits (at most 30 s) for the exit; returns its code and standard output.
    fn terminate(mut self) -> (Option<i32>, String) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the relay did not stop within 30 s of SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stdout = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .unwrap();
        (status.code(), stdout)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_sends_an_outbox_into_a_stream_and_gives_its_lease_up_on_sigterm() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let outbox = format!("{schema}.events");
    let client = db.client().await;
    let nats = NatsServer::start();
    let stream = nats.create_stream("EVENTS", &["events.>"]).await;
    // Published before the relay starts: 10 messages of key k1, one without a key.
    client
        .batch_execute(
            "SELECT inbox_create_outbox('events'); \
             SELECT inbox_publish('events', 'events.orders', jsonb_build_object('n', g), 'k1') \
               FROM generate_series(1, 10) g; \
             SELECT inbox_publish_bytes('events', 'events.raw', '\\x00ff', NULL, \
                                        '{\"kind\": \"raw\"}');",
        )
        .await
        .unwrap();

    // Named unqualified (found through search_path): the relay names its messages after the
    // outbox as given (`events:42`), as the client's relay does.
    let relay = RelayProcess::start(
        &format!("{}&application_name={schema}_a", with_search_path(&db)),
        &[
            "--outbox",
            "events",
            "--nats",
            &nats.url(),
            "--name",
            "cli-relay",
            "--batch",
            "4",
        ],
    );
    let unsent = "SELECT count(*) FROM events";
    assert_eq!(
        wait_for(&client, unsent, 0, Duration::from_secs(30)).await,
        0,
        "the relay did not send the backlog:\n{}",
        relay.log()
    );
    // Idle, it sleeps on the outbox in a LISTEN session of its own, to the database URL.
    let asleep = |application: &str| {
        format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{application}' \
               AND state = 'idle' AND query LIKE 'SELECT inbox_sleep(%'"
        )
    };
    assert_eq!(
        wait_for(
            &client,
            &asleep(&format!("{schema}_a")),
            1,
            Duration::from_secs(15)
        )
        .await,
        1,
        "the relay does not sleep on a LISTEN session:\n{}",
        relay.log()
    );
    // Published while it sleeps: the publish wakes it.
    client
        .batch_execute(
            "BEGIN; \
             SELECT inbox_publish('events', 'events.orders', jsonb_build_object('n', g), 'k2') \
               FROM generate_series(1, 5) g; \
             COMMIT;",
        )
        .await
        .unwrap();
    assert_eq!(
        wait_for(&client, unsent, 0, Duration::from_secs(6)).await,
        0,
        "the relay was not woken by the publish:\n{}",
        relay.log()
    );
    let holder = client
        .query_one(
            "SELECT relay, relay_lease_until > now(), sent FROM inbox_outbox_stats('events')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(holder.get::<_, String>(0), "cli-relay");
    assert!(
        holder.get::<_, bool>(1),
        "the running relay holds the lease"
    );
    assert_eq!(holder.get::<_, i64>(2), 16);

    let read = read_stream(&stream, 16).await;
    assert_eq!(read.len(), 16, "{read:?}");
    let of_key = |subject: &str| -> Vec<Value> {
        read.iter()
            .filter(|(_, s, _)| s == subject)
            .map(|(_, _, payload)| serde_json::from_slice(payload).unwrap())
            .collect()
    };
    let orders: Vec<i64> = of_key("events.orders")
        .iter()
        .map(|v| v["n"].as_i64().unwrap())
        .collect();
    assert_eq!(
        orders,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5],
        "each key in publish order"
    );
    let raw: Vec<&(String, String, Vec<u8>)> =
        read.iter().filter(|(_, s, _)| s == "events.raw").collect();
    assert_eq!(raw.len(), 1);
    assert_eq!(raw[0].2, [0x00, 0xff]);
    for (id, _, _) in &read {
        let (name, number) = id.rsplit_once(':').unwrap();
        assert_eq!(name, "events", "Nats-Msg-Id {id}");
        assert!(number.parse::<i64>().is_ok(), "Nats-Msg-Id {id}");
    }

    let (code, stdout) = relay.terminate();
    assert_eq!(code, Some(0), "stdout: {stdout}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["sent"], 16, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["relay"], "cli-relay");
    assert_eq!(report["outbox"], outbox.as_str());
    // The lease is given up: another relay may claim at once.
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_relays \
              WHERE outbox = 'events'::regclass AND leased_until <= now()"
        )
        .await,
        1,
        "the lease was not released"
    );
    let listed = json(&db, &["outboxes"]);
    let ours = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["outbox"] == outbox.as_str())
        .unwrap_or_else(|| panic!("{outbox} is not listed: {listed}"));
    assert_eq!(ours["sent"], 16);
    assert_eq!(ours["relay"], "cli-relay");
    assert_eq!(ours["relay_holds_lease"], false);
    assert_eq!(ours["pending"], 0);

    // A relay whose database URL is a pooler's LISTENs through --listen-url, the server's own.
    let url = with_search_path(&db);
    let listen_url = format!("{url}&application_name={schema}_direct");
    let standby = RelayProcess::start(
        &format!("{url}&application_name={schema}_pooled"),
        &[
            "--outbox",
            "events",
            "--nats",
            &nats.url(),
            "--name",
            "second",
            "--listen-url",
            &listen_url,
        ],
    );
    client
        .batch_execute(
            "SELECT inbox_publish('events', 'events.orders', jsonb_build_object('n', g), 'k3') \
               FROM generate_series(1, 3) g",
        )
        .await
        .unwrap();
    assert_eq!(
        wait_for(&client, unsent, 0, Duration::from_secs(30)).await,
        0,
        "the second relay did not send:\n{}",
        standby.log()
    );
    assert_eq!(
        wait_for(
            &client,
            &asleep(&format!("{schema}_direct")),
            1,
            Duration::from_secs(15)
        )
        .await,
        1,
        "the second relay does not sleep on its --listen-url session:\n{}",
        standby.log()
    );
    assert_eq!(
        count(&client, &asleep(&format!("{schema}_pooled"))).await,
        0
    );
    let (code, stdout) = standby.terminate();
    assert_eq!(code, Some(0), "stdout: {stdout}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["sent"], 3, "{report}");
    assert_eq!(read_stream(&stream, 19).await.len(), 19);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_refuses_a_missing_outbox_and_an_unreachable_nats() {
    let db = TestDb::new().await;
    let missing = format!("{}.no_such_outbox", db.schema());
    let output = inbox(&db)
        .args([
            "relay",
            "--outbox",
            &missing,
            "--nats",
            "nats://127.0.0.1:1",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("SQLSTATE 42P01"));
    db.client()
        .await
        .batch_execute("SELECT inbox_create_outbox('events')")
        .await
        .unwrap();
    let outbox = format!("{}.events", db.schema());
    let output = inbox(&db)
        .args([
            "relay",
            "--outbox",
            &outbox,
            "--nats",
            "nats://relay:hunter2@127.0.0.1:1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("NATS"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let output = inbox(&db)
        .args([
            "relay", "--outbox", &outbox, "--nats", "nats://x", "--lease", "10ms",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "a lease under 1s");
}

/// Creates the outbox `events` with four messages without a key, then claims two as relay `r`:
/// the first is sent (acknowledged as a duplicate), the second fails its last attempt and is
/// dead. Returns the dead message's id.
async fn outbox_with_a_dead_message(client: &tokio_postgres::Client) -> i64 {
    client
        .batch_execute(
            "SELECT inbox_create_outbox('events'); \
             SELECT inbox_publish('events', 'events.x', jsonb_build_object('n', g)) \
               FROM generate_series(1, 4) g;",
        )
        .await
        .unwrap();
    let claimed = client
        .query(
            "SELECT id, token FROM inbox_relay_claim('events', 'r', 2)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2);
    let token: i64 = claimed[0].get(1);
    let (sent, dead): (i64, i64) = (claimed[0].get(0), claimed[1].get(0));
    client
        .execute(
            "SELECT inbox_relay_sent('events', $1, ARRAY[$2::int8], 1)",
            &[&token, &sent],
        )
        .await
        .unwrap();
    client
        .execute(
            "SELECT inbox_relay_failed('events', $1, ARRAY[$2::int8], ARRAY['no stream'], 1)",
            &[&token, &dead],
        )
        .await
        .unwrap();
    dead
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_commands_list_requeue_and_discard_dead_messages() {
    let db = TestDb::new().await;
    let outbox = format!("{}.events", db.schema());
    let client = db.client().await;
    let dead = outbox_with_a_dead_message(&client).await;

    let listed = json(&db, &["outboxes"]);
    let ours = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["outbox"] == outbox.as_str())
        .unwrap_or_else(|| panic!("{outbox} is not listed: {listed}"));
    assert_eq!(
        (
            &ours["pending"],
            &ours["sending"],
            &ours["retrying"],
            &ours["dead"]
        ),
        (
            &Value::from(2),
            &Value::from(0),
            &Value::from(0),
            &Value::from(1)
        ),
        "{ours}"
    );
    assert_eq!(
        (&ours["sent"], &ours["duplicates"], &ours["failures"]),
        (&Value::from(1), &Value::from(1), &Value::from(1)),
        "{ours}"
    );
    assert_eq!(ours["relay"], "r");
    assert!(ours["oldest_unsent_age_seconds"].as_f64().unwrap() >= 0.0);
    let table = inbox(&db).arg("outboxes").output().unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.contains(&outbox), "{table}");
    assert!(table.contains("oldest publisher"), "{table}");

    let dead_list = json(&db, &["outbox", "dead", &outbox]);
    assert_eq!(dead_list.as_array().unwrap().len(), 1, "{dead_list}");
    assert_eq!(dead_list[0]["id"], dead);
    assert_eq!(dead_list[0]["state"], "dead");
    assert_eq!(dead_list[0]["last_error"], "no stream");
    assert_eq!(dead_list[0]["payload"]["json"]["n"], 2);
    let pending = json(&db, &["outbox", "messages", &outbox, "--state", "pending"]);
    assert_eq!(pending.as_array().unwrap().len(), 2, "{pending}");
    let all = json(&db, &["outbox", "messages", &outbox, "--limit", "1"]);
    assert_eq!(all.as_array().unwrap().len(), 1, "{all}");

    let requeued = json(&db, &["outbox", "requeue", &outbox, &dead.to_string()]);
    assert_eq!(requeued["requeued"][0], dead);
    assert_eq!(
        count(
            &client,
            &format!(
                "SELECT count(*) FROM events WHERE id = {dead} AND dead_at IS NULL AND attempt = 0"
            )
        )
        .await,
        1,
        "the requeued message is due again, its attempts from zero"
    );
    // Not dead any more: code 4, and the JSON names it.
    let output = inbox(&db)
        .args(["--json", "outbox", "requeue", &outbox, &dead.to_string()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(4));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["not_dead"][0], dead);
    assert_eq!(
        json(&db, &["outbox", "dead", &outbox]),
        Value::Array(vec![])
    );

    // Dead again (one attempt allowed), then requeued with --all, then dead and discarded.
    assert_eq!(kill_all(&client).await, 3);
    let all = json(&db, &["outbox", "requeue", &outbox, "--all"]);
    assert_eq!(all["requeued"], 3);
    assert_eq!(kill_all(&client).await, 3);
    let discarded = json(&db, &["outbox", "discard", &outbox, &dead.to_string()]);
    assert_eq!(discarded["discarded"][0], dead);
    assert_eq!(count(&client, "SELECT count(*) FROM events").await, 2);
    let output = inbox(&db)
        .args(["outbox", "requeue", &outbox])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "requeue needs ids or --all");
}

/// Claims every due message of `events` as relay `r` and fails each on its last attempt.
async fn kill_all(client: &tokio_postgres::Client) -> usize {
    let claimed = client
        .query(
            "SELECT id, token FROM inbox_relay_claim('events', 'r', 10) ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|r| r.get(0)).collect();
    let token: i64 = claimed[0].get(1);
    let errors = vec!["gone".to_owned(); ids.len()];
    client
        .execute(
            "SELECT inbox_relay_failed('events', $1, $2, $3, 1)",
            &[&token, &ids, &errors],
        )
        .await
        .unwrap();
    ids.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_each_outbox_gauges() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    outbox_with_a_dead_message(&client).await;
    // A transaction holding key k open: it holds back k's later publishers.
    let publisher = db.client().await;
    publisher
        .batch_execute(
            "BEGIN; SELECT inbox_publish('events', 'events.x', '{}', 'k'); \
             SELECT pg_sleep(0.2);",
        )
        .await
        .unwrap();

    // The exporter's search_path finds the outbox unqualified: its label is qualified anyway.
    let exporter = Exporter::start(&with_search_path(&db));
    let (_, body) = exporter.scrape();
    assert_eq!(sample(&body, "inbox_up"), Some(1.0), "{body}");
    let gauge =
        |body: &str, name: &str| sample(body, &format!("{name}{{outbox=\"{schema}.events\"}}"));
    assert_eq!(gauge(&body, "inbox_outbox_backlog"), Some(2.0), "{body}");
    assert_eq!(gauge(&body, "inbox_outbox_dead"), Some(1.0), "{body}");
    assert_eq!(gauge(&body, "inbox_outbox_sent_total"), Some(1.0), "{body}");
    assert_eq!(
        gauge(&body, "inbox_outbox_duplicate_acks_total"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        gauge(&body, "inbox_outbox_failures_total"),
        Some(1.0),
        "{body}"
    );
    assert!(
        gauge(&body, "inbox_outbox_oldest_unsent_age_seconds").is_some_and(|age| age > 0.0),
        "{body}"
    );
    let held = gauge(&body, "inbox_outbox_oldest_publisher_age_seconds");
    assert!(held.is_some_and(|age| age >= 0.2), "{body}");
    // Types as Prometheus reads them: the totals are counters.
    assert!(body.contains("# TYPE inbox_outbox_sent counter"), "{body}");
    assert!(body.contains("# TYPE inbox_outbox_backlog gauge"), "{body}");

    // Each scrape reads afresh: the publisher committed, its message is in the backlog, and no
    // transaction holds a key.
    publisher.batch_execute("COMMIT").await.unwrap();
    let (_, body) = exporter.scrape();
    assert_eq!(gauge(&body, "inbox_outbox_backlog"), Some(3.0), "{body}");
    assert_eq!(
        gauge(&body, "inbox_outbox_oldest_publisher_age_seconds"),
        Some(0.0),
        "{body}"
    );
}
