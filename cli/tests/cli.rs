//! The `inbox` binary against a real database: each test works in a fresh schema of the test
//! database (`INBOX_TEST_DATABASE_URL`, see `inbox_tests::TestDb`) and names its tables
//! schema-qualified, as an operator would name any queue.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod support;
use support::{sample, Exporter};

use assert_cmd::Command;
use inbox_tests::TestDb;
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

/// Runs the binary and returns its exit code and standard error.
fn failure(db: &TestDb, args: &[&str]) -> (i32, String) {
    let output = inbox(db).args(args).output().unwrap();
    assert!(!output.status.success(), "inbox {args:?} succeeded");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[test]
fn help_says_what_each_subcommand_does() {
    let output = Command::cargo_bin("inbox")
        .unwrap()
        .arg("--help")
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(help.contains("Exit codes"), "{help}");
    for command in [
        "queues",
        "stats",
        "pause",
        "resume",
        "cancel",
        "jobs",
        "dead",
        "requeue",
        "discard",
        "enqueue",
        "purge",
        "schedules",
        "outboxes",
        "outbox",
        "relay",
        "metrics",
    ] {
        let output = Command::cargo_bin("inbox")
            .unwrap()
            .args([command, "--help"])
            .output()
            .unwrap();
        assert!(output.status.success(), "{command} --help");
        let text = String::from_utf8(output.stdout).unwrap();
        let first = text.lines().next().unwrap_or_default();
        assert!(
            first.len() > 20 && !first.starts_with("Usage"),
            "{command} --help starts with a sentence: {text}"
        );
    }
    // No database and no DATABASE_URL: a usage error, code 2.
    let output = Command::cargo_bin("inbox")
        .unwrap()
        .env_remove("DATABASE_URL")
        .arg("queues")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("DATABASE_URL"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_lists_every_table_of_queue_shape_with_its_counts() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('mail'); \
             CREATE TABLE raw (id int PRIMARY KEY, attempt smallint NOT NULL DEFAULT 0, \
                               locked_until timestamptz, payload bytea NOT NULL); \
             CREATE TABLE not_a_queue (id int, attempt int, payload jsonb); \
             INSERT INTO raw VALUES (1, 0, NULL, '\\x01'); \
             SELECT inbox_enqueue('mail', '{\"n\": 1}'); \
             SELECT inbox_enqueue('mail', '{\"n\": 2}'); \
             SELECT inbox_enqueue('mail', '{\"n\": 3}'); \
             SELECT inbox_enqueue('mail', '{\"n\": 4}', now() + interval '1 hour'); \
             SELECT inbox_enqueue('mail', '{\"n\": 5}');",
        )
        .await
        .unwrap();
    // One leased, one dead: of the five, two stay ready and one delayed.
    let leased = client
        .query("SELECT id, token FROM inbox_lease('mail', 2)", &[])
        .await
        .unwrap();
    let (dead_id, dead_token): (i64, i64) = (leased[1].get(0), leased[1].get(1));
    client
        .execute(
            "SELECT inbox_dead('mail', $1, $2, 'bad')",
            &[&dead_id, &dead_token],
        )
        .await
        .unwrap();

    let queues = json(&db, &["queues"]);
    let ours: Vec<&Value> = queues
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| {
            q["queue"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{schema}."))
        })
        .collect();
    let names: Vec<&str> = ours.iter().map(|q| q["queue"].as_str().unwrap()).collect();
    assert_eq!(names, [format!("{schema}.mail"), format!("{schema}.raw")]);
    let mail = ours[0];
    assert_eq!(
        (
            &mail["ready"],
            &mail["delayed"],
            &mail["leased"],
            &mail["dead"]
        ),
        (
            &Value::from(2),
            &Value::from(1),
            &Value::from(1),
            &Value::from(1)
        )
    );
    assert!(mail["oldest_ready_age_seconds"].as_f64().unwrap() >= 0.0);
    assert!(mail["oldest_lease_age_seconds"].as_f64().unwrap() >= 0.0);
    let raw = ours[1];
    assert_eq!(raw["ready"], 1);
    assert_eq!(raw["oldest_lease_age_seconds"], Value::Null);

    // The table for people names the same queues.
    let table = inbox(&db).arg("queues").output().unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.contains(&format!("{schema}.mail")), "{table}");
    assert!(!table.contains("not_a_queue"), "{table}");

    let stats = json(&db, &["stats", &format!("{schema}.mail")]);
    assert_eq!(
        (
            &stats["ready"],
            &stats["delayed"],
            &stats["leased"],
            &stats["dead"]
        ),
        (
            &Value::from(2),
            &Value::from(1),
            &Value::from(1),
            &Value::from(1)
        )
    );

    // --watch prints one JSON object a line, each read afresh.
    let mut watch = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
        .args([
            "--json",
            "stats",
            &format!("{schema}.mail"),
            "--watch",
            "0.1",
        ])
        .env("DATABASE_URL", db.url())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut ready = || {
        let line = lines.next().expect("a line per refresh").unwrap();
        serde_json::from_str::<Value>(&line).unwrap()["ready"]
            .as_i64()
            .unwrap()
    };
    assert_eq!(ready(), 2);
    client
        .batch_execute("SELECT inbox_enqueue('mail', '{}')")
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while ready() != 3 {
        assert!(
            Instant::now() < deadline,
            "--watch never showed the new job"
        );
    }
    watch.kill().unwrap();
    watch.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_lists_a_queue_by_state_and_errors_carry_their_sqlstate() {
    let db = TestDb::new().await;
    let queue = format!("{}.work", db.schema());
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('work'); \
             SELECT inbox_enqueue('work', '{\"n\": 1}'); \
             SELECT inbox_enqueue('work', '{\"n\": 2}'); \
             SELECT inbox_enqueue('work', '{\"n\": 3}', now() + interval '1 day');",
        )
        .await
        .unwrap();
    let leased = client
        .query_one("SELECT id, token FROM inbox_lease('work', 1)", &[])
        .await
        .unwrap();
    let (id, token): (i64, i64) = (leased.get(0), leased.get(1));
    client
        .execute(
            "SELECT inbox_retry('work', $1, $2, '0', 'smtp timeout', 1)",
            &[&id, &token],
        )
        .await
        .unwrap();

    let all = json(&db, &["jobs", &queue]);
    let states: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["ready", "delayed", "dead"]);
    let dead = json(&db, &["jobs", &queue, "--state", "dead"]);
    assert_eq!(dead.as_array().unwrap().len(), 1);
    assert_eq!(dead[0]["id"], id);
    assert_eq!(dead[0]["attempt"], 1);
    assert_eq!(dead[0]["last_error"], "smtp timeout");
    assert_eq!(dead[0]["due"], "infinity");
    assert_eq!(dead[0]["payload"]["json"]["n"], 1);
    let first = json(&db, &["jobs", &queue, "--limit", "1"]);
    assert_eq!(first.as_array().unwrap().len(), 1);
    assert_eq!(first[0]["payload"]["json"]["n"], 2);

    // Usage errors are clap's (2); the database's carry their SQLSTATE (1).
    let (code, _) = failure(&db, &["jobs", &queue, "--state", "gone"]);
    assert_eq!(code, 2);
    let (code, _) = failure(&db, &["jobs", &queue, "--limit", "0"]);
    assert_eq!(code, 2);
    let missing = format!("{}.nothing_here", db.schema());
    let (code, stderr) = failure(&db, &["jobs", &missing]);
    assert_eq!(code, 1);
    assert!(stderr.contains("SQLSTATE 42P01"), "{stderr}");
    let (code, stderr) = failure(&db, &["--json", "stats", &missing]);
    assert_eq!(code, 1);
    let error: Value = serde_json::from_str(stderr.trim()).unwrap();
    assert_eq!(error["sqlstate"], "42P01");
    assert_eq!(error["exit"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_are_shown_in_base64_and_a_closed_pipe_ends_quietly() {
    let db = TestDb::new().await;
    let queue = format!("{}.blobs", db.schema());
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE blobs (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz, payload bytea NOT NULL); \
             INSERT INTO blobs SELECT g, 0, NULL, '\\x0001ff' FROM generate_series(1, 3000) g;",
        )
        .await
        .unwrap();
    let jobs = json(&db, &["jobs", &queue, "--limit", "2"]);
    assert_eq!(jobs[0]["payload"]["base64"], "AAH/");
    assert_eq!(
        jobs[0]["due"],
        Value::Null,
        "a NULL locked_until is due now"
    );
    assert_eq!(jobs[0]["state"], "ready");

    // `inbox jobs ... | head`: the reader goes away; the tool stops without a panic.
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
        .args(["jobs", &queue, "--limit", "3000"])
        .env("DATABASE_URL", db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_takes_one_job_or_a_stream_in_batches() {
    let db = TestDb::new().await;
    let queue = format!("{}.inbound", db.schema());
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('inbound')")
        .await
        .unwrap();

    let one = json(&db, &["enqueue", &queue, r#"{"to": "a"}"#, "--key", "a"]);
    assert!(one["id"].as_i64().unwrap() > 0);
    let again = json(&db, &["enqueue", &queue, r#"{"to": "a"}"#, "--key", "a"]);
    assert_eq!(
        again["id"],
        Value::Null,
        "a queued key is not enqueued twice"
    );
    json(
        &db,
        &[
            "enqueue",
            &queue,
            r#"{"to": "later"}"#,
            "--at",
            "2999-01-01 00:00+00",
        ],
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbound WHERE locked_until > now() + interval '100 years'"
        )
        .await,
        1
    );

    let lines: String = (0..2_345)
        .map(|n| format!("{{\"n\": {n}}}\n"))
        .chain(std::iter::once("\n".to_owned()))
        .collect();
    let output = inbox(&db)
        .args(["--json", "enqueue", &queue, "--batch", "1000"])
        .write_stdin(lines)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["enqueued"], 2_345);
    assert_eq!(
        count(
            &client,
            "SELECT count(DISTINCT payload->>'n') FROM inbound WHERE payload ? 'n'"
        )
        .await,
        2_345
    );

    // A bad line stops the stream: the batches before it are committed, its own is not.
    let mut lines: String = (0..25).map(|n| format!("{{\"m\": {n}}}\n")).collect();
    lines.push_str("{not json\n{\"m\": 99}\n");
    let output = inbox(&db)
        .args(["enqueue", &queue, "--batch", "10"])
        .write_stdin(lines)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("line 26"), "{stderr}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM inbound WHERE payload ? 'm'").await,
        20
    );

    let (code, stderr) = failure(&db, &["enqueue", &queue, "{oops"]);
    assert_eq!(code, 2, "{stderr}");
    let (code, _) = failure(&db, &["enqueue", &queue, "--key", "k"]);
    assert_eq!(code, 2, "--key needs a single payload");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_old_keys_in_bounded_transactions() {
    let db = TestDb::new().await;
    let ledger = format!("{}.seen", db.schema());
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_ledger('seen'); \
             INSERT INTO seen SELECT 'old-' || g, now() - interval '3 days' \
               FROM generate_series(1, 25000) g; \
             INSERT INTO seen SELECT 'new-' || g, now() FROM generate_series(1, 5) g;",
        )
        .await
        .unwrap();
    let report = json(
        &db,
        &[
            "purge",
            &ledger,
            "--older-than",
            "2 days",
            "--batch",
            "10000",
        ],
    );
    assert_eq!(report["purged"], 25_000);
    assert_eq!(report["batches"], 3, "10,000 + 10,000 + 5,000");
    assert_eq!(count(&client, "SELECT count(*) FROM seen").await, 5);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM seen WHERE event_key LIKE 'new-%'"
        )
        .await,
        5
    );

    let (code, stderr) = failure(&db, &["purge", &ledger, "--older-than", "-1 day"]);
    assert_eq!(code, 2, "{stderr}");
    let (code, stderr) = failure(&db, &["purge", &ledger, "--older-than", "soon"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("SQLSTATE 22007"), "{stderr}");
}

#[test]
fn connection_errors_exit_3_and_never_show_the_password() {
    // Nothing listens on port 1 of the loopback.
    let url = "postgres://operator:hunter2-secret@127.0.0.1:1/inbox";
    for args in [&["queues"][..], &["--json", "queues"][..]] {
        let output = Command::cargo_bin("inbox")
            .unwrap()
            .env("DATABASE_URL", url)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(3));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("connect"), "{stderr}");
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
    let output = Command::cargo_bin("inbox")
        .unwrap()
        .args(["--database-url", url, "metrics", "--listen", "127.0.0.1:0"])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(3));
    assert!(!String::from_utf8_lossy(&output.stderr).contains("hunter2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_serves_every_queue_at_slash_metrics() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('billing'); \
             SELECT inbox_enqueue('billing', '{}'); \
             SELECT inbox_enqueue('billing', '{}'); \
             SELECT inbox_enqueue('billing', '{}', now() + interval '1 hour'); \
             SELECT * FROM inbox_lease('billing', 1, '1 minute');",
        )
        .await
        .unwrap();
    let application = format!("{schema}_exporter");
    let separator = if db.url().contains('?') { '&' } else { '?' };
    let exporter = Exporter::start(&format!(
        "{}{separator}application_name={application}",
        db.url()
    ));

    let (content_type, body) = exporter.scrape();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert_eq!(sample(&body, "inbox_up"), Some(1.0), "{body}");
    let jobs = |body: &str, state: &str| {
        sample(
            body,
            &format!("inbox_jobs{{queue=\"{schema}.billing\",state=\"{state}\"}}"),
        )
    };
    assert_eq!(jobs(&body, "ready"), Some(1.0), "{body}");
    assert_eq!(jobs(&body, "delayed"), Some(1.0), "{body}");
    assert_eq!(jobs(&body, "leased"), Some(1.0), "{body}");
    assert_eq!(jobs(&body, "dead"), Some(0.0), "{body}");
    let lease_age = sample(
        &body,
        &format!("inbox_oldest_lease_age_seconds{{queue=\"{schema}.billing\"}}"),
    );
    assert!(lease_age.is_some_and(|age| age >= 0.0), "{body}");

    let paused = |body: &str| {
        sample(
            body,
            &format!("inbox_queue_paused{{queue=\"{schema}.billing\"}}"),
        )
    };
    assert_eq!(paused(&body), Some(0.0), "{body}");

    // Each scrape reads the database afresh.
    client
        .batch_execute("SELECT inbox_enqueue('billing', '{}'); SELECT inbox_pause('billing')")
        .await
        .unwrap();
    let (_, body) = exporter.scrape();
    assert_eq!(jobs(&body, "ready"), Some(2.0), "{body}");
    assert_eq!(paused(&body), Some(1.0), "{body}");
    // A queue's limits have gauges once it has them: the job leased before them counts under
    // each, and one more is leased under them (both of the key '').
    let gauge =
        |body: &str, name: &str| sample(body, &format!("{name}{{queue=\"{schema}.billing\"}}"));
    assert_eq!(
        gauge(&body, "inbox_queue_concurrency_limit"),
        None,
        "{body}"
    );
    client
        .batch_execute(
            "SELECT inbox_set_concurrency('billing', 5); \
             SELECT inbox_set_concurrency('billing', 2, per_key => 'customer'); \
             SELECT inbox_set_rate_limit('billing', 10, '1 minute'); \
             SELECT inbox_resume('billing'); \
             SELECT * FROM inbox_lease('billing', 1, '1 minute')",
        )
        .await
        .unwrap();
    let (_, body) = exporter.scrape();
    for (name, value) in [
        ("inbox_queue_concurrency_limit", 5.0),
        ("inbox_queue_concurrency_running", 2.0),
        ("inbox_queue_key_concurrency_limit", 2.0),
        ("inbox_queue_keys_running", 1.0),
        ("inbox_queue_most_running_per_key", 2.0),
        ("inbox_queue_rate_limit", 10.0),
        ("inbox_queue_rate_limit_recent_starts", 1.0),
        ("inbox_queue_rate_limit_window_seconds", 60.0),
    ] {
        assert_eq!(gauge(&body, name), Some(value), "{name}: {body}");
    }

    // A connection killed under the exporter is replaced: a later scrape reads the queues again.
    let killed = count(
        &client,
        &format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
              WHERE application_name = '{application}'"
        ),
    )
    .await;
    assert!(killed >= 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (_, body) = exporter.scrape();
        if sample(&body, "inbox_up") == Some(1.0) || Instant::now() > deadline {
            break body;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(sample(&body, "inbox_up"), Some(1.0), "{body}");
    // Two ready before the limits, one of them leased under them.
    assert_eq!(jobs(&body, "ready"), Some(1.0), "{body}");
}

// The dead-letter and schedule subcommands call `inbox_dead_jobs`, `inbox_requeue`,
// `inbox_requeue_dead`, `inbox_discard` and `inbox_schedules` (the agreed API), which the
// queue core and the schedules add.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_requeued_and_discarded() {
    let db = TestDb::new().await;
    let queue = format!("{}.jobs", db.schema());
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('jobs'); \
             SELECT inbox_enqueue_batch('jobs', ARRAY['{\"n\":1}', '{\"n\":2}', '{\"n\":3}', '{\"n\":4}']::jsonb[]);",
        )
        .await
        .unwrap();
    let leased = client
        .query("SELECT id, token FROM inbox_lease('jobs', 4)", &[])
        .await
        .unwrap();
    let mut ids = Vec::new();
    for row in &leased {
        let (id, token): (i64, i64) = (row.get(0), row.get(1));
        client
            .execute(
                "SELECT inbox_dead('jobs', $1, $2, 'poison')",
                &[&id, &token],
            )
            .await
            .unwrap();
        ids.push(id);
    }
    let dead = json(&db, &["dead", &queue]);
    assert_eq!(dead.as_array().unwrap().len(), 4);
    assert_eq!(dead[0]["last_error"], "poison");
    assert!(dead[0]["dead_at"].is_string());

    let requeued = json(&db, &["requeue", &queue, &ids[0].to_string()]);
    assert_eq!(requeued["requeued"][0], ids[0]);
    // Not dead any more: code 4, and the JSON names it.
    let output = inbox(&db)
        .args(["--json", "requeue", &queue, &ids[0].to_string()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(4));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["not_dead"][0], ids[0]);

    let discarded = json(&db, &["discard", &queue, &ids[1].to_string()]);
    assert_eq!(discarded["discarded"][0], ids[1]);
    let all = json(&db, &["requeue", &queue, "--all"]);
    assert_eq!(all["requeued"], 2);
    assert_eq!(count(&client, "SELECT count(*) FROM jobs").await, 3);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM jobs WHERE locked_until <= now()"
        )
        .await,
        3
    );
    let (code, _) = failure(&db, &["requeue", &queue]);
    assert_eq!(code, 2, "requeue needs ids or --all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_lists_a_queue_schedules() {
    let db = TestDb::new().await;
    let queue = format!("{}.cron_jobs", db.schema());
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('cron_jobs'); \
             SELECT inbox_schedule('cron_jobs', 'nightly', '0 3 * * *', '{\"report\": true}', 'Europe/Paris');",
        )
        .await
        .unwrap();
    let schedules = json(&db, &["schedules", &queue]);
    assert_eq!(schedules.as_array().unwrap().len(), 1);
    assert_eq!(schedules[0]["name"], "nightly");
    assert_eq!(schedules[0]["cron"], "0 3 * * *");
    assert_eq!(schedules[0]["time_zone"], "Europe/Paris");
    assert_eq!(schedules[0]["payload"]["report"], true);
    assert!(schedules[0]["next_tick"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_places_jobs_by_priority_and_group() {
    let db = TestDb::new().await;
    let queue = format!("{}.placed", db.schema());
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('placed')")
        .await
        .unwrap();
    json(
        &db,
        &["enqueue", &queue, r#"{"n": "low"}"#, "--priority", "-1"],
    );
    json(
        &db,
        &["enqueue", &queue, r#"{"n": "high"}"#, "--priority", "7"],
    );
    let lines: String = (0..5).map(|n| format!("{{\"g\": {n}}}\n")).collect();
    let output = inbox(&db)
        .args([
            "--json", "enqueue", &queue, "--group", "cart-1", "--batch", "2",
        ])
        .write_stdin(lines)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let priorities: Vec<(String, i32)> = client
        .query(
            "SELECT payload->>'n', priority FROM placed WHERE payload ? 'n' ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(priorities, [("low".to_owned(), -1), ("high".to_owned(), 7)]);
    let grouped: i64 = count(
        &client,
        "SELECT count(*) FROM placed WHERE group_key = 'cart-1'",
    )
    .await;
    assert_eq!(grouped, 5);
    // One head of the group is ready; the four behind it wait, and count as delayed.
    let stats = json(&db, &["stats", &queue]);
    assert_eq!(stats["ready"], 3, "low, high and the group's head");
    assert_eq!(stats["delayed"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_a_queue_and_show_it_in_queues_and_stats() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('mails'); SELECT inbox_enqueue('mails', '{}')")
        .await
        .unwrap();
    let queue = format!("{schema}.mails");
    let listed = |db: &TestDb| {
        json(db, &["queues"])
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["queue"] == queue.as_str())
            .cloned()
            .unwrap()
    };
    assert_eq!(listed(&db)["paused"], Value::Bool(false));

    assert_eq!(json(&db, &["pause", &queue])["paused"], Value::Bool(true));
    assert_eq!(json(&db, &["pause", &queue])["paused"], Value::Bool(false));
    assert_eq!(listed(&db)["paused"], Value::Bool(true));
    assert_eq!(json(&db, &["stats", &queue])["paused"], Value::Bool(true));
    let table = inbox(&db).args(["stats", &queue]).output().unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("yes"));
    assert_eq!(
        count(
            &client,
            &format!("SELECT count(*) FROM inbox_lease('{queue}', 10, '1 minute')")
        )
        .await,
        0,
        "a paused queue handed out a job"
    );

    let resumed = inbox(&db).args(["resume", &queue]).output().unwrap();
    assert!(resumed.status.success());
    assert_eq!(
        String::from_utf8_lossy(&resumed.stdout).trim(),
        format!("resumed {queue}")
    );
    assert_eq!(
        json(&db, &["resume", &queue])["resumed"],
        Value::Bool(false)
    );
    assert_eq!(listed(&db)["paused"], Value::Bool(false));

    let (code, error) = failure(&db, &["pause", &format!("{schema}.nope")]);
    assert_eq!(code, 1, "{error}");
    assert!(error.contains("42P01"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_makes_jobs_dead_marked_cancelled_and_exits_4_for_the_others() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('mails'); SELECT inbox_enqueue('mails', '{}'); \
             SELECT inbox_enqueue('mails', '{}')",
        )
        .await
        .unwrap();
    let queue = format!("{schema}.mails");
    let done = json(&db, &["cancel", &queue, "1"]);
    assert_eq!(done["cancelled"], serde_json::json!([1]));
    let (code, error) = failure(&db, &["cancel", &queue, "1", "2", "99"]);
    assert_eq!(code, 4, "{error}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM inbox_dead_jobs('mails') WHERE last_error = 'cancelled'"
        )
        .await,
        2
    );
}

/// `inbox unique` shows until when a queue's keys stay unique and sets it with `--until`; a rule
/// the queued jobs would break fails with the server's SQLSTATE and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_rules_are_shown_and_set() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute("SELECT inbox_create_queue('reports')")
        .await
        .unwrap();
    let queue = format!("{schema}.reports");
    assert_eq!(json(&db, &["unique", &queue])["until"], "acked");
    let set = json(&db, &["unique", &queue, "--until", "started"]);
    assert_eq!(set["until"], "started");
    let shown = inbox(&db).args(["unique", &queue]).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("until its first delivery starts"), "{shown}");

    // Under 'started', a running job and a waiting one may share a key; 'acked' would not let them.
    client
        .batch_execute(&format!(
            "SELECT inbox_enqueue('{queue}', '{{}}', key => 'k');              SELECT count(*) FROM inbox_lease('{queue}', 1);              SELECT inbox_enqueue('{queue}', '{{}}', key => 'k')"
        ))
        .await
        .unwrap();
    let (code, stderr) = failure(&db, &["unique", &queue, "--until", "acked"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("23505"), "{stderr}");
    assert_eq!(json(&db, &["unique", &queue])["until"], "started");
    let (_, stderr) = failure(&db, &["unique", &queue, "--until", "never"]);
    assert!(stderr.contains("never"), "{stderr}");
}

/// `inbox limits` sets a queue's limits through the extension's functions and shows them with
/// how much of them is in use; `none` removes one; a bad limit fails with the server's SQLSTATE
/// and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_set_shown_and_removed() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('mails'); \
             SELECT inbox_enqueue('mails', '{\"customer\": \"acme\"}'); \
             SELECT inbox_enqueue('mails', '{\"customer\": \"acme\"}')",
        )
        .await
        .unwrap();
    let queue = format!("{schema}.mails");
    let none = json(&db, &["limits", &queue]);
    assert_eq!(none["concurrency"], Value::Null);
    let plain = inbox(&db).args(["limits", &queue]).output().unwrap();
    assert!(String::from_utf8_lossy(&plain.stdout).contains("has no limits"));

    let set = json(
        &db,
        &[
            "limits",
            &queue,
            "--concurrency",
            "3",
            "--key-concurrency",
            "1",
            "--per-key",
            "customer",
            "--rate",
            "10",
            "--per",
            "1 minute",
        ],
    );
    assert_eq!(set["concurrency"], 3);
    assert_eq!(set["key_concurrency"], 1);
    assert_eq!(set["per_key"], "customer");
    assert_eq!(set["rate_limit"], 10);
    assert_eq!(set["rate_period"], "00:01:00");
    // Two jobs of one customer: one lease, and the limits show it.
    assert_eq!(
        count(
            &client,
            &format!("SELECT count(*) FROM inbox_lease('{queue}', 10, '1 minute')")
        )
        .await,
        1
    );
    let used = json(&db, &["limits", &queue]);
    assert_eq!(
        (
            &used["running"],
            &used["keys_running"],
            &used["most_running_per_key"],
            &used["recent_starts"]
        ),
        (
            &Value::from(1),
            &Value::from(1),
            &Value::from(1),
            &Value::from(1)
        )
    );
    let shown = inbox(&db).args(["limits", &queue]).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("concurrency per customer"), "{shown}");
    assert!(
        shown.contains("1 keys running, at most 1 of one"),
        "{shown}"
    );

    let (code, stderr) = failure(&db, &["limits", &queue, "--concurrency", "0"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("22023"), "{stderr}");
    assert_eq!(json(&db, &["limits", &queue])["concurrency"], 3);
    let (_, stderr) = failure(&db, &["limits", &queue, "--concurrency", "three"]);
    assert!(stderr.contains("neither a number nor `none`"), "{stderr}");
    let (_, stderr) = failure(&db, &["limits", &queue, "--key-concurrency", "1"]);
    assert!(stderr.contains("--per-key"), "{stderr}");

    let removed = json(
        &db,
        &[
            "limits",
            &queue,
            "--concurrency",
            "none",
            "--key-concurrency",
            "none",
            "--per-key",
            "customer",
            "--rate",
            "none",
        ],
    );
    for field in ["concurrency", "key_concurrency", "per_key", "rate_limit"] {
        assert_eq!(removed[field], Value::Null, "{field}: {removed}");
    }
}
