//! The transactional outbox: `inbox_publish` records a message in the caller's transaction, and
//! relays claim, publish and settle them (`inbox_relay_*`). `sql/shared/outbox.sql` holds all of
//! it for both builds and says how order per key is kept, except the publish: it runs in every
//! producer's transaction, so this build has it natively (the SQL-only build's is
//! `sql/sql-only/35-publish.sql`).

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

use crate::datum::{Bytea, Jsonb, RegClass, Text};
use crate::error::*;
use crate::plans::{self, Op};
use crate::shape::QueueShape;
use crate::statements::{self, Sql};

// After the schedules' table: the install script keeps one order of its blocks.
extension_sql_file!(
    "../../sql/shared/outbox.sql",
    name = "outbox",
    requires = ["periodic_jobs"]
);

/// Records a message (bytes) in the outbox inside the caller's transaction; returns its id.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_publish_bytes(
    outbox: Option<RegClass>,
    subject: Option<Text>,
    payload: Option<Bytea>,
    key: default!(Option<Text>, "NULL"),
    headers: default!(Option<Jsonb>, "NULL"),
) -> i64 {
    let payload = required(payload, "payload");
    publish(
        outbox,
        subject,
        payload.into(),
        key,
        headers,
        Op::PublishBytes,
        statements::publish_bytes,
    )
}

/// Records a message (JSON, sent as its UTF-8 text) in the outbox inside the caller's
/// transaction; returns its id.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_publish(
    outbox: Option<RegClass>,
    subject: Option<Text>,
    payload: Option<Jsonb>,
    key: default!(Option<Text>, "NULL"),
    headers: default!(Option<Jsonb>, "NULL"),
) -> i64 {
    let payload = required(payload, "payload");
    publish(
        outbox,
        subject,
        payload.into(),
        key,
        headers,
        Op::PublishJson,
        statements::publish_json,
    )
}

fn publish(
    outbox: Option<RegClass>,
    subject: Option<Text>,
    payload: DatumWithOid<'_>,
    key: Option<Text>,
    headers: Option<Jsonb>,
    op: Op,
    insert: fn(&QueueShape) -> Sql,
) -> i64 {
    let outbox = required(outbox, "outbox").0;
    let subject = required(subject, "subject");
    // SAFETY: a non-NULL text argument of this call. Its header gives its length: an empty text
    // is never compressed or stored out of line, so a length of zero means empty.
    if unsafe { pgrx::varsize_any_exhdr(subject.0.cast_mut_ptr::<pg_sys::varlena>()) } == 0 {
        raise(ERRCODE_INVALID_PARAMETER_VALUE, "subject must not be empty");
    }
    let id = Spi::connect_mut(|client| {
        if let Some(headers) = headers {
            let plan = plans::plan(outbox, Op::PublishHeaders, headers_are_strings);
            let valid = plan.read_rows(&[headers.into()]).get::<bool>(0, 1);
            if valid != Some(true) {
                raise(
                    ERRCODE_INVALID_PARAMETER_VALUE,
                    "headers must be a JSON object of strings or arrays of strings",
                );
            }
        }
        if let Some(key) = key {
            let outbox_key = outbox.to_u32() as i32;
            plans::plan(outbox, Op::PublishLock, key_lock).run(&[outbox_key.into(), key.into()]);
        }
        let plan = plans::queue_plan(client, outbox, op, insert);
        let key = key.map_or_else(
            || DatumWithOid::null_oid(pg_sys::TEXTOID),
            DatumWithOid::from,
        );
        let headers = headers.map_or_else(
            || DatumWithOid::null_oid(pg_sys::JSONBOID),
            DatumWithOid::from,
        );
        plan.rows(&[subject.into(), key, payload, headers])
            .get::<i64>(0, 1)
    });
    crate::wakeups::notify(outbox);
    id.unwrap_or_else(|| raise(ERRCODE_INTERNAL_ERROR, "the outbox's insert returned no id"))
}

/// `$1` the outbox's oid (as int4), `$2` the key: the transaction-level advisory lock that orders
/// a key's messages by commit (`sql/shared/outbox.sql`), the one the SQL-only build's publish
/// takes. Its second key is odd, apart from the even keys of the wake-ups.
fn key_lock() -> Sql {
    Sql {
        text: "SELECT pg_catalog.pg_advisory_xact_lock($1, \
                          pg_catalog.hashtext($2) OPERATOR(pg_catalog.|) 1)"
            .to_owned(),
        args: vec![pg_sys::INT4OID, pg_sys::TEXTOID],
    }
}

/// `$1` headers: whether they are a JSON object whose values are strings or arrays of strings.
fn headers_are_strings() -> Sql {
    Sql {
        text: "SELECT pg_catalog.jsonb_typeof($1) OPERATOR(pg_catalog.=) 'object' \
                  AND NOT EXISTS ( \
                      SELECT FROM pg_catalog.jsonb_each($1) AS h \
                       WHERE pg_catalog.jsonb_typeof(h.value) OPERATOR(pg_catalog.<>) 'string' \
                         AND (pg_catalog.jsonb_typeof(h.value) OPERATOR(pg_catalog.<>) 'array' \
                              OR EXISTS (SELECT FROM pg_catalog.jsonb_array_elements(h.value) AS v \
                                          WHERE pg_catalog.jsonb_typeof(v) \
                                                OPERATOR(pg_catalog.<>) 'string')))"
            .to_owned(),
        args: vec![pg_sys::JSONBOID],
    }
}
