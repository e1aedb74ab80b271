//! The operator's view of the outboxes: `inbox outboxes` (every outbox's counts, relay and
//! publisher age) and `inbox outbox messages|dead|requeue|discard` (one outbox's messages, and
//! its dead letters sent again or deleted). The relay itself is in [`crate::relay`].

use serde_json::{json, Value};

use crate::commands::{self, PREVIEW};
use crate::db::Db;
use crate::error::CliError;
use crate::output::{age, preview, table, Output};
use crate::sql;

/// One row of `inbox_outboxes()`.
struct OutboxRow {
    outbox: String,
    /// pending, sending, retrying, dead.
    counts: [i64; 4],
    oldest_unsent_age: Option<f64>,
    /// sent, duplicates, failures.
    totals: [i64; 3],
    relay: Option<String>,
    relay_lease_until: Option<String>,
    relay_holds: Option<bool>,
    oldest_publisher_age: Option<f64>,
}

pub async fn outboxes(db: &Db, out: &Output) -> Result<(), CliError> {
    let rows = db.rows(&sql::OUTBOXES, &[]).await?;
    let outboxes: Vec<OutboxRow> = rows
        .iter()
        .map(|row| OutboxRow {
            outbox: row.get(0),
            counts: [row.get(1), row.get(2), row.get(3), row.get(4)],
            oldest_unsent_age: row.get(5),
            totals: [row.get(6), row.get(7), row.get(8)],
            relay: row.get(9),
            relay_lease_until: row.get(10),
            relay_holds: row.get(11),
            oldest_publisher_age: row.get(12),
        })
        .collect();
    let value = Value::Array(
        outboxes
            .iter()
            .map(|o| {
                let [pending, sending, retrying, dead] = o.counts;
                let [sent, duplicates, failures] = o.totals;
                json!({
                    "outbox": o.outbox, "pending": pending, "sending": sending,
                    "retrying": retrying, "dead": dead,
                    "oldest_unsent_age_seconds": o.oldest_unsent_age,
                    "sent": sent, "duplicates": duplicates, "failures": failures,
                    "relay": o.relay, "relay_lease_until": o.relay_lease_until,
                    "relay_holds_lease": o.relay_holds.unwrap_or(false),
                    "oldest_publisher_age_seconds": o.oldest_publisher_age,
                })
            })
            .collect(),
    );
    out.emit(value, || {
        table(
            &[
                "outbox",
                "pending",
                "sending",
                "retrying",
                "dead",
                "oldest unsent",
                "sent",
                "duplicates",
                "failures",
                "relay",
                "oldest publisher",
            ],
            outboxes
                .iter()
                .map(|o| {
                    let mut cells = vec![o.outbox.clone()];
                    cells.extend(o.counts.iter().map(i64::to_string));
                    cells.push(age(o.oldest_unsent_age));
                    cells.extend(o.totals.iter().map(i64::to_string));
                    cells.push(match (&o.relay, o.relay_holds) {
                        (Some(relay), Some(true)) => relay.clone(),
                        (Some(relay), _) => format!("{relay} (lease ended)"),
                        (None, _) => "-".to_owned(),
                    });
                    cells.push(age(o.oldest_publisher_age));
                    cells
                })
                .collect(),
            &[1, 2, 3, 4, 5, 6, 7, 8, 10],
        )
    });
    Ok(())
}

/// A message's payload for scripts: the JSON it holds, else its text, else its bytes in base64.
fn payload_value(bytes: &[u8], base64: &str) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => match serde_json::from_str::<Value>(text) {
            Ok(value) => json!({ "json": value }),
            Err(_) => json!({ "text": text }),
        },
        Err(_) => json!({ "base64": base64 }),
    }
}

/// The same for a table cell.
fn payload_text(bytes: &[u8], base64: &str) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => preview(text, PREVIEW),
        Err(_) => preview(&format!("base64:{base64}"), PREVIEW),
    }
}

/// `inbox outbox messages` (all, or one state) and `inbox outbox dead` (state `dead`).
pub async fn messages(
    db: &Db,
    out: &Output,
    outbox: &str,
    state: Option<&str>,
    limit: i32,
) -> Result<(), CliError> {
    let rows = db
        .rows(&sql::OUTBOX_MESSAGES, &[&outbox, &state, &limit])
        .await?;
    let value = Value::Array(
        rows.iter()
            .map(|row| {
                let payload: Vec<u8> = row.get(8);
                let base64: String = row.get(9);
                json!({
                    "id": row.get::<_, i64>(0),
                    "state": row.get::<_, String>(1),
                    "subject": row.get::<_, String>(2),
                    "key": row.get::<_, Option<String>>(3),
                    "attempt": row.get::<_, i32>(4),
                    "published_at": row.get::<_, Option<String>>(5),
                    "due": row.get::<_, Option<String>>(6),
                    "last_error": row.get::<_, Option<String>>(7),
                    "payload": payload_value(&payload, &base64),
                    "headers": row.get::<_, Option<Value>>(10),
                })
            })
            .collect(),
    );
    out.emit(value, || {
        table(
            &[
                "id",
                "state",
                "subject",
                "key",
                "attempt",
                "published at",
                "last error",
                "payload",
            ],
            rows.iter()
                .map(|row| {
                    let payload: Vec<u8> = row.get(8);
                    let base64: String = row.get(9);
                    vec![
                        row.get::<_, i64>(0).to_string(),
                        row.get(1),
                        row.get(2),
                        row.get::<_, Option<String>>(3).unwrap_or_default(),
                        row.get::<_, i32>(4).to_string(),
                        row.get::<_, Option<String>>(5).unwrap_or_default(),
                        preview(row.get::<_, Option<&str>>(7).unwrap_or_default(), PREVIEW),
                        payload_text(&payload, &base64),
                    ]
                })
                .collect(),
            &[0, 4],
        )
    });
    Ok(())
}

pub async fn requeue(
    db: &Db,
    out: &Output,
    outbox: &str,
    ids: &[i64],
    all: bool,
) -> Result<(), CliError> {
    if !all {
        return commands::each_dead(
            db,
            out,
            &sql::OUTBOX_REQUEUE,
            (outbox, "message"),
            ids,
            "requeued",
        )
        .await;
    }
    let requeued = commands::requeue_all(db, &sql::OUTBOX_REQUEUE_DEAD, outbox).await?;
    out.emit(json!({ "requeued": requeued }), || {
        format!("requeued {requeued} message(s)")
    });
    Ok(())
}

pub async fn discard(db: &Db, out: &Output, outbox: &str, ids: &[i64]) -> Result<(), CliError> {
    commands::each_dead(
        db,
        out,
        &sql::OUTBOX_DISCARD,
        (outbox, "message"),
        ids,
        "discarded",
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_show_as_json_text_or_base64() {
        assert_eq!(
            payload_value(br#"{"a":1}"#, "eyJhIjoxfQ=="),
            json!({"json": {"a": 1}})
        );
        assert_eq!(
            payload_value(b"hello", "aGVsbG8="),
            json!({"text": "hello"})
        );
        assert_eq!(
            payload_value(&[0xff, 0x00], "/wA="),
            json!({"base64": "/wA="})
        );
        assert_eq!(payload_text(&[0xff, 0x00], "/wA="), "base64:/wA=");
    }
}
