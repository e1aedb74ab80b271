//! The columns the functions need, read from the catalog once per table and checked.
//!
//! A queue or ledger may be a table the extension created or one the user declared; either way
//! its shape decides the SQL prepared for it (which optional columns to write, which payload
//! type to pass through), and a missing or mistyped column is reported by name.

use std::collections::HashMap;

use pgrx::pg_sys::{self, Oid};
use pgrx::spi::SpiClient;
use pgrx::Spi;

use crate::datum::RegClass;
use crate::error::*;
use crate::names::{parse_qualified_name, quote_literal, schema};

/// How a queue stores its payloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Payload {
    Jsonb,
    Bytea,
}

impl Payload {
    pub fn type_name(self) -> &'static str {
        match self {
            Payload::Jsonb => "jsonb",
            Payload::Bytea => "bytea",
        }
    }

    pub fn type_oid(self) -> Oid {
        match self {
            Payload::Jsonb => pg_sys::JSONBOID,
            Payload::Bytea => pg_sys::BYTEAOID,
        }
    }

    pub fn array_type_oid(self) -> Oid {
        match self {
            Payload::Jsonb => pg_sys::JSONBARRAYOID,
            Payload::Bytea => pg_sys::BYTEAARRAYOID,
        }
    }
}

/// A job queue table.
#[derive(Debug)]
pub(crate) struct QueueShape {
    /// The table as SQL: schema and name, each quoted.
    pub table: String,
    pub payload: Payload,
    /// A user's table may leave `locked_until` NULL for a job that is due.
    pub nullable_locked_until: bool,
    pub has_key: bool,
    /// Where it has a key: the predicate of its unique index on `key` (`inbox_set_unique`).
    pub key_predicate: String,
    pub has_last_error: bool,
    /// Keeps every failed attempt's error (the last twenty), beside `last_error`.
    pub has_errors: bool,
    pub has_leased_at: bool,
    /// Counts the deliveries snoozed (`inbox_snooze`): a lease reports `attempt - snoozes`.
    pub has_snoozes: bool,
    /// Bounds the job's handler (`timeout` at enqueue): a take hands it over with the job.
    pub has_timeout: bool,
    /// Leases take the highest `priority` first.
    pub has_priority: bool,
    pub has_group_key: bool,
    /// When a job was dead-lettered; also what tells a dead job from one waiting in its group.
    pub has_dead_at: bool,
    /// The due time a job was enqueued with, kept for a job that waits behind its group's head.
    pub has_run_at: bool,
}

impl QueueShape {
    /// Whether the table keeps ordered groups: it needs `group_key`, and `dead_at` to tell a job
    /// waiting for its turn (`locked_until = 'infinity'`, `dead_at` NULL) from a dead one.
    pub fn groups(&self) -> bool {
        self.has_group_key && self.has_dead_at
    }

    /// The condition that a row is a dead-lettered job. Only where a job can also wait in its
    /// group does `dead_at` tell the two apart; elsewhere `'infinity'` alone means dead.
    pub fn dead(&self) -> &'static str {
        if self.groups() {
            "locked_until OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz \
             AND dead_at IS NOT NULL"
        } else {
            "locked_until OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz"
        }
    }

    /// The condition that a row is a job waiting behind its group's head.
    pub fn waiting(&self) -> &'static str {
        if self.groups() {
            "locked_until OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz \
             AND dead_at IS NULL"
        } else {
            "false"
        }
    }
}

/// A dedup ledger table.
#[derive(Debug)]
pub(crate) struct LedgerShape {
    /// The table as SQL: schema and name, each quoted.
    pub table: String,
}

const INTEGERS: &[Oid] = &[pg_sys::INT2OID, pg_sys::INT4OID, pg_sys::INT8OID];
const TEXTS: &[Oid] = &[pg_sys::TEXTOID, pg_sys::VARCHAROID];
const TIMESTAMPTZ: &[Oid] = &[pg_sys::TIMESTAMPTZOID];

struct Column {
    type_oid: Oid,
    not_null: bool,
}

/// A table's name and live columns.
struct Table {
    table: String,
    columns: HashMap<String, Column>,
}

impl Table {
    fn load(client: &SpiClient<'_>, oid: Oid) -> Table {
        let rows = client
            .select(
                "SELECT c.relkind::pg_catalog.text, pg_catalog.format('%I.%I', n.nspname, c.relname), \
                        a.attname::pg_catalog.text, a.atttypid, a.attnotnull \
                   FROM pg_catalog.pg_class c \
                   JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
                   LEFT JOIN pg_catalog.pg_attribute a \
                          ON a.attrelid OPERATOR(pg_catalog.=) c.oid \
                         AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped \
                  WHERE c.oid OPERATOR(pg_catalog.=) $1",
                None,
                &[oid.into()],
            )
            .unwrap_or_else(|e| internal(e));
        let mut table = None;
        let mut columns = HashMap::new();
        for row in rows {
            let relkind: String = row.get(1).ok().flatten().unwrap_or_default();
            let name: String = row.get(2).ok().flatten().unwrap_or_default();
            if relkind != "r" && relkind != "p" {
                raise(ERRCODE_WRONG_OBJECT_TYPE, format!("{name} is not a table"));
            }
            table.get_or_insert(name);
            if let Ok(Some(column)) = row.get::<String>(3) {
                let type_oid = row.get(4).ok().flatten().unwrap_or(pg_sys::InvalidOid);
                let not_null = row.get(5).ok().flatten().unwrap_or(false);
                columns.insert(column, Column { type_oid, not_null });
            }
        }
        let Some(table) = table else {
            raise(
                ERRCODE_UNDEFINED_TABLE,
                format!("no table with oid {}", oid.to_u32()),
            );
        };
        Table { table, columns }
    }

    /// The column `name`, required to be of one of `types`; `None` when absent and optional.
    fn column(&self, kind: &str, name: &str, types: &[Oid], required: bool) -> Option<&Column> {
        let Some(column) = self.columns.get(name) else {
            if required {
                raise(
                    ERRCODE_UNDEFINED_COLUMN,
                    format!("{kind} table {} has no column \"{name}\"", self.table),
                );
            }
            return None;
        };
        if !types.contains(&column.type_oid) {
            let expected: Vec<String> = types.iter().map(|&oid| type_name(oid)).collect();
            raise(
                ERRCODE_DATATYPE_MISMATCH,
                format!(
                    "column \"{name}\" of {kind} table {} is of type {}, expected {}",
                    self.table,
                    type_name(column.type_oid),
                    expected.join(" or ")
                ),
            );
        }
        Some(column)
    }
}

fn type_name(oid: Oid) -> String {
    // SAFETY: format_type_be handles any oid, unknown ones included, and returns a palloc'd string.
    unsafe {
        let name = pg_sys::format_type_be(oid);
        std::ffi::CStr::from_ptr(name)
            .to_string_lossy()
            .into_owned()
    }
}

impl QueueShape {
    pub fn load(client: &SpiClient<'_>, oid: Oid) -> QueueShape {
        let table = Table::load(client, oid);
        const KIND: &str = "queue";
        crate::citus::check(client, oid, KIND);
        table.column(KIND, "id", INTEGERS, true);
        table.column(KIND, "attempt", INTEGERS, true);
        let locked_until = table.column(KIND, "locked_until", TIMESTAMPTZ, true);
        let payload = table.column(KIND, "payload", &[pg_sys::JSONBOID, pg_sys::BYTEAOID], true);
        let has_key = table.column(KIND, "key", TEXTS, false).is_some();
        QueueShape {
            payload: match payload.map(|column| column.type_oid) {
                Some(pg_sys::BYTEAOID) => Payload::Bytea,
                _ => Payload::Jsonb,
            },
            nullable_locked_until: !locked_until.is_some_and(|column| column.not_null),
            has_key,
            key_predicate: if has_key {
                key_predicate(client, oid)
            } else {
                String::new()
            },
            has_last_error: table.column(KIND, "last_error", TEXTS, false).is_some(),
            has_errors: table
                .column(KIND, "errors", &[pg_sys::JSONBOID], false)
                .is_some(),
            has_leased_at: table
                .column(KIND, "leased_at", TIMESTAMPTZ, false)
                .is_some(),
            has_snoozes: table.column(KIND, "snoozes", INTEGERS, false).is_some(),
            has_timeout: table
                .column(KIND, "timeout", &[pg_sys::INTERVALOID], false)
                .is_some(),
            has_priority: table.column(KIND, "priority", INTEGERS, false).is_some(),
            has_group_key: table.column(KIND, "group_key", TEXTS, false).is_some(),
            has_dead_at: table.column(KIND, "dead_at", TIMESTAMPTZ, false).is_some(),
            has_run_at: table.column(KIND, "run_at", TIMESTAMPTZ, false).is_some(),
            table: table.table,
        }
    }
}

/// The predicate of the queue's unique index on `key` (`inbox__key_predicate`,
/// sql/shared/controls.sql), which an enqueue's ON CONFLICT clause names so that it is inferred.
fn key_predicate(client: &SpiClient<'_>, queue: Oid) -> String {
    let schema = schema(client);
    client
        .select(
            &format!("SELECT {schema}.inbox__key_predicate($1)"),
            None,
            &[RegClass(queue).into()],
        )
        .and_then(|rows| rows.first().get_one::<String>())
        .unwrap_or_else(|e| internal(e))
        .unwrap_or_else(|| "key IS NOT NULL".to_owned())
}

impl LedgerShape {
    pub fn load(client: &SpiClient<'_>, oid: Oid) -> LedgerShape {
        let table = Table::load(client, oid);
        crate::citus::check(client, oid, "ledger");
        table.column("ledger", "event_key", TEXTS, true);
        table.column("ledger", "seen_at", TIMESTAMPTZ, true);
        LedgerShape { table: table.table }
    }
}

/// Creates a table from `ddl` unless it exists; checks the shape either way with `check`.
///
/// The `inbox_create_*` functions that call this keep the caller's search_path, so that an
/// unqualified name lands where `CREATE TABLE` would put it; everything they reference is
/// therefore qualified with `pg_catalog`.
pub(crate) fn create_table(
    name: &str,
    ddl: fn(&str) -> String,
    check: impl Fn(&SpiClient<'_>, Oid),
) -> RegClass {
    let table = parse_qualified_name(name).quoted();
    Spi::connect_mut(|client| {
        let existing = client
            .select(
                &format!(
                    "SELECT pg_catalog.to_regclass({})::pg_catalog.oid",
                    quote_literal(&table)
                ),
                None,
                &[],
            )
            .and_then(|rows| rows.first().get_one::<Oid>())
            .unwrap_or_else(|e| internal(e));
        let oid = match existing {
            Some(oid) => oid,
            None => {
                client
                    .update(ddl(&table).as_str(), None, &[])
                    .unwrap_or_else(|e| internal(e));
                let oid = client
                    .select(
                        &format!(
                            "SELECT {}::pg_catalog.regclass::pg_catalog.oid",
                            quote_literal(&table)
                        ),
                        None,
                        &[],
                    )
                    .and_then(|rows| rows.first().get_one::<Oid>())
                    .unwrap_or_else(|e| internal(e))
                    .unwrap_or_else(|| {
                        raise(ERRCODE_UNDEFINED_TABLE, format!("{table} was not created"))
                    });
                crate::citus::join_tenant(client, oid);
                oid
            }
        };
        check(client, oid);
        RegClass(oid)
    })
}
