//! The dedup ledger: `inbox_claim` records a key once, whatever the number of deliveries. Its
//! purges are shared SQL (`sql/shared/purge.sql`).

use pgrx::prelude::*;

use crate::datum::{RegClass, Text};
use crate::error::*;
use crate::plans::{self, Op};
use crate::shape::create_table;
use crate::statements;

/// Creates the ledger table `name` unless a valid one exists; returns it.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_create_ledger(name: Option<&str>) -> RegClass {
    create_table(
        required(name, "name"),
        statements::create_ledger,
        |client, oid| {
            plans::ledger(client, oid);
        },
    )
}

/// Records `key` in `ledger`: true the first time, false for any later or concurrent duplicate.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_claim(
    ledger: Option<RegClass>,
    key: Option<Text>,
    seen_at: default!(Option<TimestampWithTimeZone>, "now()"),
) -> bool {
    claim(ledger, key, seen_at)
}

/// Like `inbox_claim`, but a key already claimed raises `23505 unique_violation`, failing the
/// caller's transaction: the form for the first statement of an all-or-nothing batch.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_claim_or_fail(
    ledger: Option<RegClass>,
    key: Option<Text>,
    seen_at: default!(Option<TimestampWithTimeZone>, "now()"),
) {
    if !claim(ledger, key, seen_at) {
        raise(
            ERRCODE_UNIQUE_VIOLATION,
            "the key is already claimed in this ledger",
        );
    }
}

fn claim(
    ledger: Option<RegClass>,
    key: Option<Text>,
    seen_at: Option<TimestampWithTimeZone>,
) -> bool {
    let ledger = required(ledger, "ledger").0;
    let key = required(key, "key");
    let seen_at = finite_time(seen_at, "seen_at");
    Spi::connect_mut(|client| {
        let plan = plans::ledger_plan(client, ledger, Op::Claim, statements::claim);
        plan.run(&[key.into(), seen_at.into()]) == 1
    })
}

/// Whether `key` is recorded in `ledger`, as the caller's snapshot sees it.
#[pg_extern(stable, parallel_unsafe)]
fn inbox_seen(ledger: Option<RegClass>, key: Option<Text>) -> bool {
    let ledger = required(ledger, "ledger").0;
    let key = required(key, "key");
    Spi::connect(|client| {
        let plan = plans::ledger_plan(client, ledger, Op::Seen, statements::seen);
        plan.read_rows(&[key.into()]).get(0, 1).unwrap_or(false)
    })
}
