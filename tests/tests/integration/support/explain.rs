//! The plans the extension's functions really run, read with `auto_explain`: a session that
//! loads it with `log_nested_statements` and `log_level = notice` receives, as a notice, the
//! plan (with actual rows and buffers) of every statement a function runs through SPI.

use std::future::poll_fn;

use inbox_tests::TestDb;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, NoTls};

/// A fragment of the text of a lease's (and a lock's) scan of a queue with priorities, in both
/// builds (`ORDER BY <rank>, locked_until, id LIMIT ...`): the pgrx build spells the rank
/// `(OPERATOR(pg_catalog.-) priority::pg_catalog.int8)`, the SQL-only build `(-(priority::int8))`.
pub const TAKE_SCAN: &str = "), locked_until, id LIMIT";

/// A connection whose nested statements' plans arrive on `plans`.
pub struct Explaining {
    pub client: Client,
    plans: mpsc::UnboundedReceiver<String>,
}

impl Explaining {
    pub async fn connect(db: &TestDb) -> Explaining {
        let (client, mut connection) = db.config().connect(NoTls).await.unwrap();
        let (sender, plans) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(message) = poll_fn(|cx| connection.poll_message(cx)).await {
                match message {
                    Ok(AsyncMessage::Notice(notice)) => {
                        if sender.send(notice.message().to_owned()).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        client
            .batch_execute(
                "LOAD 'auto_explain'; \
                 SET auto_explain.log_min_duration = 0; \
                 SET auto_explain.log_nested_statements = on; \
                 SET auto_explain.log_analyze = on; \
                 SET auto_explain.log_buffers = on; \
                 SET auto_explain.log_timing = off; \
                 SET auto_explain.log_format = json; \
                 SET auto_explain.log_level = notice",
            )
            .await
            .unwrap();
        Explaining { client, plans }
    }

    /// Runs `sql` and returns the plans of the nested statements whose text contains `marker`.
    pub async fn plans_of(&mut self, sql: &str, marker: &str) -> Vec<Value> {
        while self.plans.try_recv().is_ok() {}
        self.client.batch_execute(sql).await.unwrap();
        // A notice that marks the end of what this call logged.
        self.client
            .batch_execute("DO $$ BEGIN RAISE NOTICE 'explain-fence'; END $$")
            .await
            .unwrap();
        let mut found = Vec::new();
        while let Some(message) = self.plans.recv().await {
            if message == "explain-fence" {
                break;
            }
            let Some(start) = message.find('{') else {
                continue;
            };
            let Ok(plan) = serde_json::from_str::<Value>(&message[start..]) else {
                continue;
            };
            if plan["Query Text"]
                .as_str()
                .is_some_and(|text| text.contains(marker))
            {
                found.push(plan);
            }
        }
        found
    }
}

/// Every node of a plan tree, depth first.
pub fn nodes(plan: &Value) -> Vec<&Value> {
    let mut all = vec![plan];
    if let Some(children) = plan["Plans"].as_array() {
        for child in children {
            all.extend(nodes(child));
        }
    }
    all
}

/// The buffers a node and its children touched (shared hits and reads).
pub fn buffers(node: &Value) -> i64 {
    node["Shared Hit Blocks"].as_i64().unwrap_or(0)
        + node["Shared Read Blocks"].as_i64().unwrap_or(0)
}

/// Asserts that `plan` reads `table` only by an index scan of `index` (no sequential scan, no
/// sort of more than `max_sorted` rows) and touches at most `max_buffers` buffers; returns the
/// plan's one-line summary for the test's output.
pub fn assert_index_scan(
    plan: &Value,
    table: &str,
    index: &str,
    max_sorted: i64,
    max_buffers: i64,
) -> String {
    let root = &plan["Plan"];
    let all = nodes(root);
    let mut summary = Vec::new();
    for node in &all {
        let kind = node["Node Type"].as_str().unwrap_or("?");
        let rows = node["Actual Rows"].as_i64().unwrap_or(0);
        let relation = node["Relation Name"].as_str().unwrap_or("");
        assert!(
            !(kind == "Seq Scan" && relation == table),
            "a sequential scan of {table}: {plan:#}"
        );
        if kind == "Sort" {
            assert!(rows <= max_sorted, "a sort of {rows} rows: {plan:#}");
        }
        summary.push(match node["Index Name"].as_str() {
            Some(name) => format!("{kind} using {name} ({rows} rows)"),
            None => format!("{kind} ({rows} rows)"),
        });
    }
    assert!(
        all.iter().any(|node| node["Node Type"] == "Index Scan"
            && node["Relation Name"] == table
            && node["Index Name"] == index),
        "no index scan of {table} using {index}: {plan:#}"
    );
    let touched = buffers(root);
    assert!(
        touched <= max_buffers,
        "{touched} buffers touched: {plan:#}"
    );
    format!("{} | {touched} buffers", summary.join(" > "))
}
