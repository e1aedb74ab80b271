//! The `inbox` binary through a real pgbouncer in transaction mode (`inbox_tests::PgBouncer`,
//! started by each test), which runs each transaction of a client on whichever server connection
//! is free and does not track named prepared statements: every subcommand must work there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod support;
use support::{sample, Exporter};

use assert_cmd::Command;
use inbox_tests::{PgBouncer, TestDb};
use serde_json::Value;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

async fn connect(config: &tokio_postgres::Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// The connection string of the test database through `bouncer`.
fn pooler_url(bouncer: &PgBouncer) -> String {
    let config = bouncer.config();
    format!(
        "postgres://{}@127.0.0.1:{}/{}",
        config.get_user().unwrap(),
        bouncer.port(),
        config.get_dbname().unwrap()
    )
}

/// The binary, pointed at `url`.
fn inbox(url: &str) -> Command {
    let mut command = Command::cargo_bin("inbox").expect("the inbox binary is built");
    command
        .env("DATABASE_URL", url)
        .timeout(Duration::from_secs(120));
    command
}

/// Runs the binary with `--json`, the arguments and `stdin`, expecting success; returns its JSON.
fn json_with_input(url: &str, args: &[&str], stdin: &str) -> Value {
    let output = inbox(url)
        .arg("--json")
        .args(args)
        .write_stdin(stdin)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "inbox {args:?} failed through pgbouncer: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "inbox {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn json(url: &str, args: &[&str]) -> Value {
    json_with_input(url, args, "")
}

/// Creates the queue `mail` (with a schedule), the ledger `seen` (25 keys three days old, 5
/// new ones) and the outbox `events` (3 messages) in the test's schema, on a direct connection.
async fn create_queue_and_ledger(direct: &Client) {
    direct
        .batch_execute(
            "SELECT inbox_create_queue('mail'); \
             SELECT inbox_schedule('mail', 'nightly', '0 3 * * *', '{\"report\": true}', 'UTC'); \
             SELECT inbox_create_ledger('seen'); \
             INSERT INTO seen SELECT 'old-' || g, now() - interval '3 days' \
               FROM generate_series(1, 25) g; \
             INSERT INTO seen SELECT 'new-' || g, now() FROM generate_series(1, 5) g; \
             SELECT inbox_create_outbox('events'); \
             SELECT inbox_publish('events', 'events.x', jsonb_build_object('n', g)) \
               FROM generate_series(1, 3) g;",
        )
        .await
        .unwrap();
}

/// Dead-letters every due message of the outbox `events` (one attempt allowed); their ids.
async fn dead_letter_the_outbox(direct: &Client) -> Vec<String> {
    let claimed = direct
        .query(
            "SELECT id, token FROM inbox_relay_claim('events', 'r', 10) ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|row| row.get(0)).collect();
    let token: i64 = claimed[0].get(1);
    let errors = vec!["no stream".to_owned(); ids.len()];
    direct
        .execute(
            "SELECT inbox_relay_failed('events', $1, $2, $3, 1)",
            &[&token, &ids, &errors],
        )
        .await
        .unwrap();
    ids.iter().map(i64::to_string).collect()
}

/// Runs every subcommand (but the relay) through the pooler at `url` on the queue, ledger and
/// outbox of [`create_queue_and_ledger`], checking each result; `direct` reaches the server itself.
async fn every_subcommand(db: &TestDb, direct: &Client, url: &str) {
    let queue = format!("{}.mail", db.schema());
    let ledger = format!("{}.seen", db.schema());
    // The pooler's server connections have the schema on their search_path: `inbox_queues()`
    // prints the name bare.
    let listed_as = "mail";

    let one = json(url, &["enqueue", &queue, r#"{"n": 1}"#]);
    assert!(one["id"].as_i64().unwrap() > 0, "{one}");
    let placed = json(
        url,
        &[
            "enqueue",
            &queue,
            r#"{"n": 2}"#,
            "--key",
            "k2",
            "--priority",
            "5",
            "--group",
            "g",
        ],
    );
    assert!(placed["id"].as_i64().unwrap() > 0, "{placed}");
    let lines: String = (3..8).map(|n| format!("{{\"n\": {n}}}\n")).collect();
    let batch = json_with_input(url, &["enqueue", &queue, "--batch", "2"], &lines);
    assert_eq!(batch["enqueued"], 5, "three batches");
    let lines: String = (8..10).map(|n| format!("{{\"n\": {n}}}\n")).collect();
    let batch = json_with_input(
        url,
        &["enqueue", &queue, "--priority", "1", "--batch", "2"],
        &lines,
    );
    assert_eq!(batch["enqueued"], 2);

    let queues = json(url, &["queues"]);
    let ours = queues
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == listed_as)
        .unwrap_or_else(|| panic!("{listed_as} is not listed: {queues}"));
    assert_eq!(ours["ready"], 9, "{ours}");
    let stats = json(url, &["stats", &queue]);
    assert_eq!(
        (stats["ready"].clone(), stats["dead"].clone()),
        (9.into(), 0.into())
    );
    let jobs = json(url, &["jobs", &queue, "--state", "ready", "--limit", "100"]);
    assert_eq!(jobs.as_array().unwrap().len(), 9, "{jobs}");

    let mut dead = Vec::new();
    for row in direct
        .query("SELECT id, token FROM inbox_lease('mail', 3)", &[])
        .await
        .unwrap()
    {
        let (id, token): (i64, i64) = (row.get(0), row.get(1));
        direct
            .execute(
                "SELECT inbox_dead('mail', $1, $2, 'poison')",
                &[&id, &token],
            )
            .await
            .unwrap();
        dead.push(id.to_string());
    }
    let listed = json(url, &["dead", &queue]);
    assert_eq!(listed.as_array().unwrap().len(), 3, "{listed}");
    assert_eq!(listed[0]["last_error"], "poison");
    let requeued = json(url, &["requeue", &queue, &dead[0]]);
    assert_eq!(requeued["requeued"][0].to_string(), dead[0]);
    let discarded = json(url, &["discard", &queue, &dead[1]]);
    assert_eq!(discarded["discarded"][0].to_string(), dead[1]);
    let all = json(url, &["requeue", &queue, "--all"]);
    assert_eq!(all["requeued"], 1);
    let stats = json(url, &["stats", &queue]);
    assert_eq!(
        (stats["ready"].clone(), stats["dead"].clone()),
        (8.into(), 0.into())
    );

    let schedules = json(url, &["schedules", &queue]);
    assert_eq!(schedules[0]["name"], "nightly", "{schedules}");

    let purged = json(
        url,
        &["purge", &ledger, "--older-than", "2 days", "--batch", "10"],
    );
    assert_eq!(purged["purged"], 25, "{purged}");
    assert_eq!(purged["batches"], 3, "10 + 10 + 5");

    let outbox = format!("{}.events", db.schema());
    let dead = dead_letter_the_outbox(direct).await;
    let outboxes = json(url, &["outboxes"]);
    let ours = outboxes
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["outbox"] == outbox.as_str())
        .unwrap_or_else(|| panic!("{outbox} is not listed: {outboxes}"));
    assert_eq!(ours["dead"], 3, "{ours}");
    let listed = json(url, &["outbox", "dead", &outbox]);
    assert_eq!(listed.as_array().unwrap().len(), 3, "{listed}");
    let requeued = json(url, &["outbox", "requeue", &outbox, &dead[0]]);
    assert_eq!(requeued["requeued"][0].to_string(), dead[0]);
    let discarded = json(url, &["outbox", "discard", &outbox, &dead[1]]);
    assert_eq!(discarded["discarded"][0].to_string(), dead[1]);
    let all = json(url, &["outbox", "requeue", &outbox, "--all"]);
    assert_eq!(all["requeued"], 1);
    let pending = json(url, &["outbox", "messages", &outbox, "--state", "pending"]);
    assert_eq!(pending.as_array().unwrap().len(), 2, "{pending}");

    let exporter = Exporter::start(url);
    // `inbox_metrics()` qualifies every name, and the tool qualifies the outboxes'.
    let ready = format!("inbox_jobs{{queue=\"{queue}\",state=\"ready\"}}");
    let backlog = format!("inbox_outbox_backlog{{outbox=\"{outbox}\"}}");
    for _ in 0..5 {
        let (_, body) = exporter.scrape();
        assert_eq!(sample(&body, "inbox_up"), Some(1.0), "{body}");
        assert_eq!(sample(&body, &ready), Some(8.0), "{body}");
        assert_eq!(sample(&body, &backlog), Some(2.0), "{body}");
    }
}

/// The names of the prepared statements of the session `client` runs on (simple protocol).
/// The named statements of the server connection `client` runs on, but those the SQL-only build's
/// functions prepare for themselves (`inbox_<hash>` and its probe `inbox_<hash>_probe`, made and
/// used by its calls on whichever server connection runs them; docs/sql-only.md).
async fn prepared_statements(client: &Client) -> Vec<String> {
    client
        .simple_query(
            "SELECT name FROM pg_prepared_statements WHERE name !~ '^inbox_[0-9a-f]{32}(_probe)?$' \
             ORDER BY name",
        )
        .await
        .unwrap()
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// One server connection, on which another client of the pooler keeps statements named as
/// tokio-postgres names those of a new process (`s0`, `s1`, ...), as another process of that
/// driver would: a named statement of the tool's own would clash with them (`42P05`); its
/// unnamed ones cannot, and it leaves none behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_shares_one_server_connection_with_another_clients_statements() {
    let db = TestDb::new().await;
    let direct = db.client().await;
    create_queue_and_ledger(&direct).await;
    let bouncer = PgBouncer::start(&db, 1);
    let other = connect(&bouncer.config()).await;
    other
        .batch_execute(
            "PREPARE s0 AS SELECT 0; PREPARE s1 AS SELECT 1; PREPARE s2 AS SELECT 2; \
             PREPARE s3 AS SELECT 3",
        )
        .await
        .unwrap();
    let names = prepared_statements(&other).await;
    assert_eq!(names, ["s0", "s1", "s2", "s3"]);

    every_subcommand(&db, &direct, &pooler_url(&bouncer)).await;

    assert_eq!(prepared_statements(&other).await, names);
}

/// Two server connections kept busy by other clients' short transactions: each statement of the
/// tool waits in the pooler's queue and runs on whichever server connection frees first, so a
/// statement prepared in one round trip would often be run in the next on the other server
/// connection, where it does not exist (`26000`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_subcommand_works_while_other_clients_keep_both_server_connections_busy() {
    let db = TestDb::new().await;
    let direct = db.client().await;
    create_queue_and_ledger(&direct).await;
    let bouncer = PgBouncer::start(&db, 2);
    let stop = Arc::new(AtomicBool::new(false));
    let mut busy = Vec::new();
    for _ in 0..4 {
        let client = connect(&bouncer.config()).await;
        let stop = stop.clone();
        // An error is returned, not raised: when the test fails first, the pooler is gone.
        busy.push(tokio::spawn(async move {
            let mut transactions = 0u64;
            while !stop.load(Ordering::Relaxed) {
                client.batch_execute("SELECT pg_sleep(0.002)").await?;
                transactions += 1;
            }
            Ok::<_, tokio_postgres::Error>(transactions)
        }));
    }

    every_subcommand(&db, &direct, &pooler_url(&bouncer)).await;

    stop.store(true, Ordering::Relaxed);
    for task in busy {
        let transactions = task
            .await
            .unwrap()
            .expect("the other clients' transactions");
        assert!(transactions > 10, "the other clients ran");
    }
}
