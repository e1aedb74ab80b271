//! Case 13, hostile input: NULL in every argument of every function, hostile and overlong
//! identifiers, tables of the wrong kind or shape, arrays of unequal length or with NULLs,
//! negative, zero and huge counts and intervals, non-finite and far-away timestamps, 1 MiB and
//! 100 MiB payloads, and arrays of a million payloads. What must hold: every bad input fails with
//! a clear ERROR of the fitting SQLSTATE, writes nothing (a fingerprint of the test's tables is
//! unchanged) and leaves the backend alive (the same connection and pid answer); every good one
//! works, with its payload intact.
//!
//! Probes marked with an agreed API change (the renamed bytea functions, non-finite times
//! rejected, priorities and groups, the dead-letter functions) fail until that change is in.

use inbox_tests::TestDb;
use tokio_postgres::Client;

use crate::common::{describe, sqlstate, Ctx, Result, Row};

pub const NAME: &str = "hostile input";

#[derive(Clone, Copy, Debug)]
enum Expect {
    /// An error with one of these SQLSTATEs, and nothing written.
    Error(&'static [&'static str]),
    /// Success.
    Ok,
    /// Success, or an error with one of these SQLSTATEs (and then nothing written).
    OkOr(&'static [&'static str]),
}

use Expect::{Error, Ok as Works, OkOr};

const NULL: &[&str] = &["22004"];
const RANGE: &[&str] = &["22023"];
const LENGTHS: &[&str] = &["2202E"];
const NAME_SYNTAX: &[&str] = &["42602"];

/// What a NULL in an argument must do.
#[derive(Clone, Copy)]
enum Nulls {
    Refused,
    Allowed,
    Either,
}

use Nulls::{Allowed, Either, Refused};

/// Each function of the API with good arguments: (SQL value, type, what a NULL there does), and
/// the agreed API change it needs, if any.
/// A function's name, its arguments and the agreed API change it needs.
type Function = (&'static str, Vec<Argument>, Option<&'static str>);

/// An argument: its SQL value, its type, and what a NULL there does.
type Argument = (&'static str, &'static str, Nulls);

fn functions() -> Vec<Function> {
    let q = ("'jobs'", "regclass", Refused);
    let l = ("'ledger'", "regclass", Refused);
    let id = ("999999", "int8", Refused);
    let token = ("1", "int8", Refused);
    vec![
        (
            "inbox_create_queue",
            vec![("'made_q'", "text", Refused)],
            None,
        ),
        (
            "inbox_create_ledger",
            vec![("'made_l'", "text", Refused)],
            None,
        ),
        (
            "inbox_claim",
            vec![
                l,
                ("'k1'", "text", Refused),
                ("now()", "timestamptz", Refused),
            ],
            None,
        ),
        (
            "inbox_claim_or_fail",
            vec![
                l,
                ("'k2'", "text", Refused),
                ("now()", "timestamptz", Refused),
            ],
            None,
        ),
        ("inbox_seen", vec![l, ("'k'", "text", Refused)], None),
        (
            "inbox_purge",
            vec![l, ("now() - interval '1 day'", "timestamptz", Refused)],
            None,
        ),
        ("inbox_channel", vec![q], None),
        (
            "inbox_enqueue",
            vec![
                q,
                ("'{}'", "jsonb", Refused),
                ("now()", "timestamptz", Either),
                ("'nk1'", "text", Allowed),
            ],
            None,
        ),
        (
            "inbox_enqueue_batch",
            vec![
                q,
                ("ARRAY['{}']", "jsonb[]", Refused),
                ("now()", "timestamptz", Either),
                ("ARRAY['nk2']", "text[]", Allowed),
            ],
            None,
        ),
        (
            "inbox_enqueue_bytes",
            vec![
                ("'bjobs'", "regclass", Refused),
                ("'\\x00'", "bytea", Refused),
                ("now()", "timestamptz", Either),
                ("'nk3'", "text", Allowed),
            ],
            Some("bytea variants renamed"),
        ),
        (
            "inbox_enqueue_batch_bytes",
            vec![
                ("'bjobs'", "regclass", Refused),
                ("ARRAY['\\x00'::bytea]", "bytea[]", Refused),
                ("now()", "timestamptz", Either),
                ("ARRAY['nk4']", "text[]", Allowed),
            ],
            Some("bytea variants renamed"),
        ),
        (
            "inbox_lease",
            vec![
                ("'empty'", "regclass", Refused),
                ("1", "int4", Either),
                ("'1 second'", "interval", Either),
            ],
            None,
        ),
        (
            "inbox_lock",
            vec![("'empty'", "regclass", Refused), ("1", "int4", Either)],
            None,
        ),
        ("inbox_ack", vec![q, id, token], None),
        (
            "inbox_ack_batch",
            vec![
                q,
                ("ARRAY[999999]", "int8[]", Refused),
                ("ARRAY[1]", "int8[]", Refused),
            ],
            None,
        ),
        (
            "inbox_retry",
            vec![
                q,
                id,
                token,
                ("'1 second'", "interval", Either),
                ("'e'", "text", Allowed),
                ("3", "int4", Allowed),
            ],
            None,
        ),
        (
            "inbox_dead",
            vec![q, id, token, ("'r'", "text", Either)],
            None,
        ),
        (
            "inbox_extend",
            vec![q, id, token, ("'1 second'", "interval", Either)],
            None,
        ),
        ("inbox_stats", vec![q], None),
        ("inbox_requeue", vec![q, id], Some("dead-letter functions")),
        (
            "inbox_requeue_dead",
            vec![q, ("10", "int4", Allowed)],
            Some("dead-letter functions"),
        ),
        ("inbox_discard", vec![q, id], Some("dead-letter functions")),
        (
            "inbox_dead_jobs",
            vec![q, ("10", "int4", Either)],
            Some("dead-letter functions"),
        ),
    ]
}

/// The calls with one NULL argument each.
fn null_probes() -> Vec<(String, Expect, Option<&'static str>)> {
    let mut probes = Vec::new();
    for (name, args, needs) in functions() {
        for (i, (_, ty, nulls)) in args.iter().enumerate() {
            let list: Vec<String> = args
                .iter()
                .enumerate()
                .map(|(j, (value, ty, _))| {
                    if i == j {
                        format!("NULL::{ty}")
                    } else {
                        format!("({value})::{ty}")
                    }
                })
                .collect();
            let expect = match nulls {
                Refused => Error(NULL),
                Allowed => Works,
                Either => OkOr(NULL),
            };
            let _ = ty;
            probes.push((
                format!("SELECT * FROM {name}({})", list.join(", ")),
                expect,
                needs,
            ));
        }
    }
    for (arg, ty) in [("priority", "int4"), ("group_key", "text")] {
        probes.push((
            format!("SELECT inbox_enqueue('jobs', '{{}}'::jsonb, {arg} => NULL::{ty})"),
            OkOr(NULL),
            Some("priorities and groups"),
        ));
    }
    probes.push((
        "SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}'::jsonb], group_keys => NULL::text[])"
            .to_owned(),
        Works,
        Some("priorities and groups"),
    ));
    probes
}

fn probes() -> Vec<(String, Expect, Option<&'static str>)> {
    let fixed: Vec<(&str, Expect, Option<&'static str>)> = vec![
        // The README's own call, with untyped literals.
        ("SELECT inbox_enqueue('jobs', '{\"to\": \"b@example.com\"}', now() + interval '1 hour', key => 'b-welcome')", Works, Some("bytea variants renamed")),
        ("SELECT inbox_enqueue('jobs', '{}')", Works, Some("bytea variants renamed")),
        // Identifiers.
        ("SELECT inbox_create_queue('')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue('a.b.c')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue('\"unterminated')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue('x; DROP TABLE jobs')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue('jobs--')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue(' jobs')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue('a.')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_ledger('.a')", Error(NAME_SYNTAX), None),
        ("SELECT inbox_create_queue(repeat('a', 64))", Error(&["42622"]), None),
        ("SELECT inbox_create_ledger('\"' || repeat('é', 32) || '\"')", Error(&["42622"]), None),
        ("SELECT inbox_create_queue('no_such_schema.q')", Error(&["3F000"]), None),
        ("SELECT inbox_create_queue('pg_catalog.evil')", Error(&["42501"]), None),
        ("SELECT inbox_create_ledger('jobs')", Error(&["42703"]), None),
        ("SELECT inbox_create_queue('ledger')", Error(&["42703"]), None),
        ("SELECT inbox_create_queue('\"Robert''); DROP TABLE jobs;--\"')", Works, None),
        ("SELECT inbox_enqueue('\"Robert''); DROP TABLE jobs;--\"', '{}'::jsonb)", Works, None),
        ("SELECT * FROM inbox_lease('\"Robert''); DROP TABLE jobs;--\"', 5)", Works, None),
        ("SELECT inbox_create_queue('\"a.b\"')", Works, None),
        ("SELECT inbox_create_ledger('\"Odd \"\"Name\"\"\"')", Works, None),
        ("SELECT inbox_claim('\"Odd \"\"Name\"\"\"', 'k')", Works, None),
        // Tables that are not queues or ledgers.
        ("SELECT inbox_enqueue('jobs; DROP TABLE jobs', '{}'::jsonb)", Error(NAME_SYNTAX), None),
        ("SELECT inbox_enqueue('nosuch', '{}'::jsonb)", Error(&["42P01"]), None),
        ("SELECT inbox_enqueue(99999999::oid::regclass, '{}'::jsonb)", Error(&["42P01"]), None),
        ("SELECT inbox_enqueue(0::oid::regclass, '{}'::jsonb)", Error(&["42P01", "22004"]), None),
        ("SELECT inbox_enqueue('pg_class', '{}'::jsonb)", Error(&["42703"]), None),
        ("SELECT * FROM inbox_lease('pg_stat_activity')", Error(&["42809"]), None),
        ("SELECT * FROM inbox_lease('jobs_seq_view')", Error(&["42809"]), None),
        ("SELECT inbox_claim('jobs', 'k')", Error(&["42703"]), None),
        ("SELECT * FROM inbox_lease('ledger')", Error(&["42703"]), None),
        ("SELECT inbox_enqueue('bjobs', '{}'::jsonb)", Error(&["42804"]), None),
        ("SELECT inbox_enqueue_bytes('jobs', '\\x00'::bytea)", Error(&["42804"]), Some("bytea variants renamed")),
        ("SELECT inbox_enqueue('nokey', '{}'::jsonb, key => 'k')", Error(&["42703"]), None),
        // Arrays.
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}', '{}']::jsonb[], keys => ARRAY['a'])", Error(LENGTHS), None),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], keys => ARRAY['a', 'b'])", Error(LENGTHS), None),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}', NULL]::jsonb[])", Error(NULL), None),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY[['{}'], ['{}']]::jsonb[])", OkOr(&["2202E", "22023"]), None),
        ("SELECT * FROM inbox_enqueue_batch('jobs', '{}'::jsonb[])", Works, None),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}', '{}']::jsonb[], group_keys => ARRAY['g'])", Error(LENGTHS), Some("priorities and groups")),
        ("SELECT inbox_ack_batch('jobs', ARRAY[1, 2]::int8[], ARRAY[1]::int8[])", Error(LENGTHS), None),
        ("SELECT inbox_ack_batch('jobs', ARRAY[1]::int8[], ARRAY[1, 2]::int8[])", Error(LENGTHS), None),
        ("SELECT inbox_ack_batch('jobs', ARRAY[NULL]::int8[], ARRAY[1]::int8[])", OkOr(NULL), None),
        ("SELECT * FROM inbox_enqueue_batch_bytes('bjobs', ARRAY['\\x00'::bytea, NULL])", Error(NULL), Some("bytea variants renamed")),
        // Counts and intervals.
        ("SELECT * FROM inbox_lease('empty', 0)", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', -1)", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', -2147483648)", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', 2147483647)", Works, None),
        ("SELECT * FROM inbox_lease('empty', 1, '0 seconds')", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', 1, '-1 second')", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', 1, '1 month -31 days')", Error(RANGE), None),
        ("SELECT * FROM inbox_lease('empty', 1, '1000000 years')", OkOr(&["22008"]), None),
        ("SELECT * FROM inbox_lock('empty', 0)", Error(RANGE), None),
        ("SELECT * FROM inbox_lock('empty', -5)", Error(RANGE), None),
        ("SELECT * FROM inbox_lock('empty', 2147483647)", Works, None),
        ("SELECT inbox_retry('jobs', 999999, 1, '-1 second')", Error(RANGE), None),
        ("SELECT inbox_retry('jobs', 999999, 1, '0 seconds', 'e', 0)", Error(RANGE), None),
        ("SELECT inbox_retry('jobs', 999999, 1, '0 seconds', 'e', -1)", Error(RANGE), None),
        ("SELECT inbox_retry('jobs', 999999, 1, '0 seconds', 'e', 2147483647)", Works, None),
        ("SELECT inbox_retry('jobs', 999999, 1, '1000000 years')", OkOr(&["22008"]), None),
        ("SELECT inbox_extend('jobs', 999999, 1, '0 seconds')", Error(RANGE), None),
        ("SELECT inbox_extend('jobs', 999999, 1, '-1 day')", Error(RANGE), None),
        ("SELECT inbox_ack('jobs', -9223372036854775808, -9223372036854775808)", OkOr(&["22023", "22003"]), None),
        ("SELECT inbox_ack('jobs', 9223372036854775807, 9223372036854775807)", Works, None),
        ("SELECT inbox_requeue_dead('jobs', -1)", Error(RANGE), Some("dead-letter functions")),
        ("SELECT * FROM inbox_dead_jobs('jobs', 0)", Error(RANGE), Some("dead-letter functions")),
        ("SELECT * FROM inbox_dead_jobs('jobs', -1)", Error(RANGE), Some("dead-letter functions")),
        ("SELECT * FROM inbox_dead_jobs('jobs', 2147483647)", Works, Some("dead-letter functions")),
        // Times.
        ("SELECT inbox_enqueue('jobs', '{}'::jsonb, 'infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_enqueue('jobs', '{}'::jsonb, '-infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}'::jsonb], 'infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{}'::jsonb], '-infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_claim('ledger', 'ti', 'infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_claim_or_fail('ledger', 'tj', '-infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_purge('ledger', 'infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_purge('ledger', '-infinity')", Error(RANGE), Some("non-finite times")),
        ("SELECT inbox_enqueue('jobs', '{}'::jsonb, '200000-01-01 00:00:00+00')", Works, None),
        ("SELECT inbox_enqueue('jobs', '{}'::jsonb, '4000-01-01 00:00:00+00 BC')", Works, None),
        ("SELECT inbox_claim('ledger', 'far', '200000-01-01 00:00:00+00')", Works, None),
        // Fails while a '-infinity' job is accepted above.
        ("SELECT * FROM inbox_stats('jobs')", Works, Some("non-finite times")),
        // Large payloads.
        ("SELECT inbox_enqueue('big', to_jsonb(repeat('x', 1048576)))", Works, None),
        ("SELECT length(payload #>> '{}') = 1048576 OR NULL FROM inbox_lease('big', 1)", Works, None),
        ("SELECT inbox_enqueue('big', to_jsonb(repeat('y', 104857600)))", OkOr(&["54000"]), None),
        ("SELECT length(payload #>> '{}') = 104857600 OR NULL FROM inbox_lease('big', 1)", Works, None),
        ("SELECT inbox_enqueue_bytes('bbig', convert_to(repeat('z', 104857600), 'UTF8'))", OkOr(&["54000"]), Some("bytea variants renamed")),
        ("SELECT length(payload_bytes) = 104857600 OR NULL FROM inbox_lease('bbig', 1)", Works, Some("bytea variants renamed")),
        // A million payloads.
        ("SELECT count(*) = 1000000 OR NULL FROM inbox_enqueue_batch('mass', ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 1000000)))", OkOr(&["54000"]), None),
        ("SELECT count(*) = 1000000 OR NULL FROM inbox_lease('mass', 2147483647, '1 hour')", Works, None),
        ("TRUNCATE mass", Works, None),
        ("SELECT count(*) FROM inbox_enqueue_batch('mass', ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 1000000)), keys => ARRAY(SELECT g::text FROM generate_series(1, 999999) g))", Error(LENGTHS), None),
        ("SELECT count(*) = 1000000 OR NULL FROM inbox_enqueue_batch_bytes('bmass', ARRAY(SELECT '\\x01'::bytea FROM generate_series(1, 1000000)))", OkOr(&["54000"]), Some("bytea variants renamed")),
    ];
    let mut probes: Vec<(String, Expect, Option<&'static str>)> = fixed
        .into_iter()
        .map(|(sql, expect, needs)| (sql.to_owned(), expect, needs))
        .collect();
    probes.extend(null_probes());
    probes
}

/// What an error may not change: the rows and attempts of every table of the test's schema.
async fn fingerprint(client: &Client) -> Result<String> {
    Ok(client
        .query_one(
            "SELECT concat_ws(',', (SELECT count(*) FROM jobs), (SELECT sum(attempt) FROM jobs), \
             (SELECT count(*) FROM bjobs), (SELECT count(*) FROM ledger), \
             (SELECT count(*) FROM big), (SELECT count(*) FROM mass), \
             (SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace))",
            &[],
        )
        .await?
        .get(0))
}

const SETUP: &str = "SELECT inbox_create_queue('jobs'); SELECT inbox_create_queue('empty'); \
     SELECT inbox_create_queue('big'); SELECT inbox_create_queue('mass'); \
     SELECT inbox_create_ledger('ledger'); \
     CREATE TABLE bjobs (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
       attempt integer NOT NULL DEFAULT 0, locked_until timestamptz NOT NULL DEFAULT now(), \
       leased_at timestamptz, payload bytea NOT NULL, key text, last_error text); \
     CREATE UNIQUE INDEX ON bjobs (key) WHERE key IS NOT NULL; \
     CREATE TABLE bbig (LIKE bjobs INCLUDING ALL); CREATE TABLE bmass (LIKE bjobs INCLUDING ALL); \
     CREATE TABLE nokey (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
       attempt integer NOT NULL DEFAULT 0, locked_until timestamptz NOT NULL DEFAULT now(), \
       payload jsonb NOT NULL); \
     CREATE VIEW jobs_seq_view AS SELECT * FROM jobs";

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(13, NAME);
    let db = TestDb::at(&ctx.url).await;
    let client = db.client().await;
    client.batch_execute(SETUP).await?;
    client
        .batch_execute("SET statement_timeout = '120s'")
        .await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let mut waiting = Vec::new();
    for (sql, expect, needs) in probes() {
        row.inputs += 1;
        let before = fingerprint(&client).await?;
        let result = client.query(sql.as_str(), &[]).await;
        let mut wrong: Option<String> = None;
        match (&result, expect) {
            (Ok(rows), Works | OkOr(_)) => {
                // A probe that checks a round trip returns NULL when the payload changed.
                let intact = rows.iter().all(|r| {
                    r.columns()
                        .first()
                        .is_none_or(|c| c.type_() != &tokio_postgres::types::Type::BOOL)
                        || r.try_get::<_, Option<bool>>(0).ok().flatten().is_some()
                });
                if !intact {
                    wrong = Some("succeeded but the payload did not round-trip".into());
                }
            }
            (Ok(_), Error(codes)) => {
                wrong = Some(format!("succeeded; {codes:?} expected"));
            }
            (Err(e), Error(codes) | OkOr(codes)) => {
                let code = sqlstate(e);
                if !codes.contains(&code.as_str()) {
                    wrong = Some(format!("failed with {}; {codes:?} expected", describe(e)));
                } else if fingerprint(&client).await? != before {
                    wrong = Some(format!("failed with {code} but wrote something"));
                }
            }
            (Err(e), Works) => wrong = Some(format!("failed: {}", describe(e))),
        }
        let alive = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .map(|r| r.get::<_, i32>(0) == pid)
            .unwrap_or(false);
        if !alive {
            row.failures
                .push(format!("{sql}: the backend did not survive"));
            break;
        }
        if let Some(wrong) = wrong {
            let line = format!("{sql}: {wrong}");
            match needs {
                Some(change) => waiting.push(format!("[{change}] {line}")),
                None => row.failures.push(line),
            }
        }
    }
    let tables: i64 = client
        .query_one("SELECT count(*) FROM jobs", &[])
        .await?
        .get(0);
    row.check(tables >= 0, || "the queue table is gone".into());
    row.faults = row.inputs;
    row.note(format!(
        "{} inputs; {} fail until agreed API changes are in",
        row.inputs,
        waiting.len()
    ));
    row.failures.extend(waiting);
    drop(client);
    drop(db);
    Ok(row)
}
