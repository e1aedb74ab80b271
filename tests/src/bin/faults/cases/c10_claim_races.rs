//! Case 10, claim races: 32 connections claim one key at once, each in a transaction of the
//! isolation level under test (READ COMMITTED, REPEATABLE READ, SERIALIZABLE) that has already
//! taken its snapshot (it checked `inbox_seen` first), for many keys. What must hold: exactly one
//! claimer per key commits a `true`; every error is a serialization failure or deadlock that the
//! client's `DbError` calls retryable; and a failed claimer that retries gets `false`.

use std::sync::Arc;

use inbox_client::DbError;
use inbox_tests::TestDb;
use tokio::sync::Barrier;
use tokio_postgres::Client;

use crate::common::{Ctx, Result, Row};

pub const NAME: &str = "claim races";

const CLAIMERS: usize = 32;

#[derive(Debug)]
enum Claimed {
    Won,
    Lost,
    Retryable,
    Other(String),
}

/// One claim in a transaction at `level`; the barrier lines the claims up after the snapshots.
async fn claim(client: &Client, level: &str, key: &str, barrier: Option<&Barrier>) -> Claimed {
    let attempt = async {
        client
            .batch_execute(&format!("BEGIN ISOLATION LEVEL {level}"))
            .await?;
        client
            .query_one("SELECT inbox_seen('ledger', $1)", &[&key])
            .await?;
        if let Some(barrier) = barrier {
            barrier.wait().await;
        }
        let won: bool = client
            .query_one("SELECT inbox_claim('ledger', $1)", &[&key])
            .await?
            .get(0);
        client.batch_execute("COMMIT").await?;
        Ok::<bool, tokio_postgres::Error>(won)
    };
    let result = attempt.await;
    if result.is_err() {
        let _ = client.batch_execute("ROLLBACK").await;
    }
    match result {
        Ok(true) => Claimed::Won,
        Ok(false) => Claimed::Lost,
        Err(error) => {
            let error = DbError::from(error);
            if error.is_retryable() {
                Claimed::Retryable
            } else {
                Claimed::Other(error.to_string())
            }
        }
    }
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(10, NAME);
    let rounds = ctx.profile.pick(30, 100);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    admin
        .batch_execute("SELECT inbox_create_ledger('ledger')")
        .await?;
    let mut clients = Vec::new();
    for _ in 0..CLAIMERS {
        clients.push(Arc::new(db.client().await));
    }
    for level in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"] {
        let (mut failures, mut other) = (0u64, Vec::new());
        for round in 0..rounds {
            let key = format!("{level}/{round}");
            row.jobs += 1;
            let barrier = Arc::new(Barrier::new(CLAIMERS));
            let tasks: Vec<_> = clients
                .iter()
                .map(|client| {
                    let (client, barrier, key) = (client.clone(), barrier.clone(), key.clone());
                    tokio::spawn(async move {
                        let first = claim(&client, level, &key, Some(&barrier)).await;
                        // A retryable failure runs again, as a caller would.
                        let mut again = None;
                        if matches!(first, Claimed::Retryable) {
                            for _ in 0..20 {
                                let outcome = claim(&client, level, &key, None).await;
                                let retry = matches!(outcome, Claimed::Retryable);
                                again = Some(outcome);
                                if !retry {
                                    break;
                                }
                            }
                        }
                        (first, again)
                    })
                })
                .collect();
            let mut winners = 0;
            for task in tasks {
                let (first, again) = task.await?;
                row.inputs += 1 + u64::from(again.is_some());
                match first {
                    Claimed::Won => winners += 1,
                    Claimed::Lost => {}
                    Claimed::Retryable => failures += 1,
                    Claimed::Other(e) => other.push(e),
                }
                match again {
                    None | Some(Claimed::Lost) => {}
                    Some(Claimed::Won) => winners += 1,
                    Some(outcome) => other.push(format!("the retry: {outcome:?}")),
                }
            }
            row.check(winners == 1, || {
                format!("{level}, key {key}: {winners} claimers committed true")
            });
        }
        row.faults += failures;
        row.check(other.is_empty(), || {
            format!(
                "{level}: errors not marked retryable: {:?}",
                &other[..other.len().min(3)]
            )
        });
        row.note(format!(
            "{level}: {rounds} keys x {CLAIMERS} claimers, {failures} retryable serialization failures"
        ));
    }
    drop(clients);
    drop(admin);
    drop(db);
    Ok(row)
}
