//! [`StatementMode`]: how the client sends its statements, prepared once per connection (the
//! default) or unnamed, as connection poolers in transaction mode need.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

use crate::error::{DbError, ErrorKind};
use crate::rows::Rows;
use crate::statement::{Statement, Value};

type Param<'a> = &'a (dyn ToSql + Sync);

/// How statements reach the server.
///
/// - [`Prepared`](Self::Prepared) (the default): each statement is prepared once per connection
///   under a name and cached, then run with one round trip. The fastest, for direct connections
///   and for poolers in session mode.
/// - [`Unnamed`](Self::Unnamed): each statement is parsed, bound and run in one message as the
///   unnamed statement, with its parameters' types given explicitly (from the casts in its SQL,
///   else from the [`Value`]s bound), so no named prepared statement ever exists. Use it behind a
///   pooler in transaction mode that does not track prepared statements (pgbouncer before 1.21,
///   or with `max_prepared_statements = 0`): there the next transaction may run on another server
///   connection, where a named statement does not exist (`26000`).
///
/// In unnamed mode a parameter without a cast is sent as its value's own type (`I64` as
/// `bigint`, `Text` as `text`, `Timestamp` as `timestamptz`, `Json` as `jsonb`; `Null` is left
/// for the server to infer), and the server converts it as it would a typed literal: cast the
/// parameter in the SQL where that is not what the column wants (`$1::timestamp` for a
/// `timestamp` column, which would otherwise be converted in the session's time zone). An empty
/// result has no column names ([`Rows::columns`](crate::Rows::columns) is empty).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StatementMode {
    /// Named statements, prepared once per connection.
    #[default]
    Prepared,
    /// The unnamed statement, parsed on every call.
    Unnamed,
}

/// The parameters of `sql` (`$1` first, up to the highest one it names), each with the type its
/// first cast declares (`$2::int4` is `int4`, `$1::text::regclass` is `text`), `None` where no
/// cast names a type this module knows. Quoted strings, quoted identifiers, dollar-quoted bodies
/// and comments are skipped.
pub(crate) fn cast_types(sql: &str) -> Vec<Option<Type>> {
    let bytes = sql.as_bytes();
    let mut types: Vec<Option<Type>> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' => {
                i = skip_quoted(
                    bytes,
                    i,
                    b'\'',
                    i > 0 && matches!(bytes[i - 1], b'e' | b'E'),
                )
            }
            b'"' => i = skip_quoted(bytes, i, b'"', false),
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                i = sql[i..].find('\n').map_or(bytes.len(), |n| i + n + 1);
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = sql[i + 2..]
                    .find("*/")
                    .map_or(bytes.len(), |n| i + 2 + n + 2);
            }
            b'$' if bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                let start = i + 1;
                let mut end = start;
                while bytes.get(end).is_some_and(u8::is_ascii_digit) {
                    end += 1;
                }
                let index: usize = sql[start..end].parse().unwrap_or(0);
                if index == 0 {
                    i = end;
                    continue;
                }
                if types.len() < index {
                    types.resize(index, None);
                }
                let cast = sql[end..].strip_prefix("::").map(cast_type);
                if let (None, Some(ty)) = (&types[index - 1], cast.flatten()) {
                    types[index - 1] = Some(ty);
                }
                i = end;
            }
            b'$' if i == 0 || !is_identifier(bytes[i - 1]) => {
                // A dollar-quoted body: `$$...$$` or `$tag$...$tag$`.
                let tag_end = sql[i + 1..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end.filter(|&e| bytes[e] == b'$') {
                    Some(e) => {
                        let tag = &sql[i..=e];
                        i = sql[e + 1..]
                            .find(tag)
                            .map_or(bytes.len(), |n| e + 1 + n + tag.len());
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    types
}

fn is_identifier(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// The index after the string or identifier quoted with `quote` that starts at `start`.
fn skip_quoted(bytes: &[u8], start: usize, quote: u8, backslashes: bool) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        if backslashes && bytes[i] == b'\\' {
            i += 2;
        } else if bytes[i] == quote {
            if bytes.get(i + 1) == Some(&quote) {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    bytes.len()
}

/// The type named at the start of `rest` (what follows a `::`), if it is one the client binds.
fn cast_type(rest: &str) -> Option<Type> {
    let name_len = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = rest[..name_len].to_ascii_lowercase();
    let array = rest[name_len..].starts_with("[]");
    let ty = match name.as_str() {
        "bool" | "boolean" => [Type::BOOL, Type::BOOL_ARRAY],
        "int2" | "smallint" => [Type::INT2, Type::INT2_ARRAY],
        "int4" | "int" | "integer" => [Type::INT4, Type::INT4_ARRAY],
        "int8" | "bigint" => [Type::INT8, Type::INT8_ARRAY],
        "float4" | "real" => [Type::FLOAT4, Type::FLOAT4_ARRAY],
        "float8" => [Type::FLOAT8, Type::FLOAT8_ARRAY],
        "text" => [Type::TEXT, Type::TEXT_ARRAY],
        "varchar" => [Type::VARCHAR, Type::VARCHAR_ARRAY],
        "bytea" => [Type::BYTEA, Type::BYTEA_ARRAY],
        "json" => [Type::JSON, Type::JSON_ARRAY],
        "jsonb" => [Type::JSONB, Type::JSONB_ARRAY],
        "timestamptz" => [Type::TIMESTAMPTZ, Type::TIMESTAMPTZ_ARRAY],
        "timestamp" => [Type::TIMESTAMP, Type::TIMESTAMP_ARRAY],
        "oid" => [Type::OID, Type::OID_ARRAY],
        _ => return None,
    };
    let [scalar, array_type] = ty;
    Some(if array { array_type } else { scalar })
}

/// The type a [`Value`] is sent as when its SQL declares none: its own, or `unknown` for a NULL
/// (the server then infers the parameter's type, as it does for a prepared statement).
fn value_type(value: &Value) -> Type {
    match value {
        Value::Null => Type::UNKNOWN,
        Value::Bool(_) => Type::BOOL,
        Value::I16(_) => Type::INT2,
        Value::I32(_) => Type::INT4,
        Value::I64(_) => Type::INT8,
        Value::F64(_) => Type::FLOAT8,
        Value::Text(_) => Type::TEXT,
        Value::Bytes(_) => Type::BYTEA,
        Value::Json(_) => Type::JSONB,
        Value::Timestamp(_) => Type::TIMESTAMPTZ,
    }
}

/// The rows of an unnamed statement, and the number of rows it affected.
pub(crate) struct Ran {
    pub rows: Vec<tokio_postgres::Row>,
    pub affected: u64,
}

/// Runs `sql` as the unnamed statement with `values` bound, each typed by its cast in `sql` or
/// else by its variant.
///
/// # Errors
/// [`ErrorKind::InvalidInput`] when `sql` names another number of parameters than bound.
pub(crate) async fn run_values<C: GenericClient + Sync>(
    client: &C,
    sql: &str,
    values: &[Value],
) -> Result<Ran, DbError> {
    let casts = cast_types(sql);
    check_arity(casts.len(), values.len())?;
    let typed = values
        .iter()
        .zip(casts)
        .map(|(value, cast)| {
            let ty = cast.unwrap_or_else(|| value_type(value));
            (value as Param<'_>, ty)
        })
        .collect::<Vec<_>>();
    run_typed(client, sql, typed).await
}

/// Runs one of the client's own statements as the unnamed statement; every parameter of `sql`
/// is cast to a type in it (a unit test checks each of `sql.rs`'s).
pub(crate) async fn run<C: GenericClient + Sync>(
    client: &C,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Ran, DbError> {
    let casts = cast_types(sql);
    check_arity(casts.len(), params.len())?;
    let typed = params
        .iter()
        .zip(casts)
        .map(|(&param, cast)| (param, cast.unwrap_or(Type::UNKNOWN)))
        .collect::<Vec<_>>();
    run_typed(client, sql, typed).await
}

async fn run_typed<C: GenericClient + Sync>(
    client: &C,
    sql: &str,
    typed: Vec<(Param<'_>, Type)>,
) -> Result<Ran, DbError> {
    use futures_util::TryStreamExt;
    let stream = client.query_typed_raw(sql, typed).await?;
    futures_util::pin_mut!(stream);
    let mut rows = Vec::new();
    while let Some(row) = stream.try_next().await? {
        rows.push(row);
    }
    let affected = stream.rows_affected().unwrap_or(0);
    Ok(Ran { rows, affected })
}

/// Runs the prepared form of `statement` on `client` and returns the rows affected.
pub(crate) async fn execute_prepared<C: GenericClient + Sync>(
    client: &C,
    prepared: &tokio_postgres::Statement,
    statement: &Statement,
) -> Result<u64, DbError> {
    check_arity(prepared.params().len(), statement.params().len())?;
    Ok(client.execute(prepared, &params(statement)).await?)
}

/// Runs the prepared form of `statement` on `client` and returns its rows.
pub(crate) async fn query_prepared<C: GenericClient + Sync>(
    client: &C,
    prepared: &tokio_postgres::Statement,
    statement: &Statement,
) -> Result<Rows, DbError> {
    check_arity(prepared.params().len(), statement.params().len())?;
    let rows = client.query(prepared, &params(statement)).await?;
    Ok(Rows::decode(prepared, &rows))
}

/// The parameters of `statement` as tokio-postgres takes them.
fn params(statement: &Statement) -> Vec<Param<'_>> {
    statement.params().iter().map(|v| v as Param<'_>).collect()
}

fn check_arity(expected: usize, bound: usize) -> Result<(), DbError> {
    if expected == bound {
        Ok(())
    } else {
        Err(DbError::new(
            ErrorKind::InvalidInput,
            format!("the statement has {expected} placeholders but {bound} values were bound"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sql;

    #[test]
    fn casts_give_the_types_and_quoted_text_is_skipped() {
        assert_eq!(
            cast_types("SELECT f($1::text::regclass, $2::int8[], $3, $4::INT4)"),
            [
                Some(Type::TEXT),
                Some(Type::INT8_ARRAY),
                None,
                Some(Type::INT4)
            ]
        );
        assert_eq!(cast_types("SELECT 1"), []);
        assert_eq!(
            cast_types("SELECT $2::jsonb, $1"),
            [None, Some(Type::JSONB)]
        );
        assert_eq!(cast_types("SELECT $1, $1::bytea"), [Some(Type::BYTEA)]);
        assert_eq!(
            cast_types("SELECT '$1', \"$2\", E'\\'$3', $x$ $4 $x$, $$ $5 $$ -- $6\n /* $7 */ $1"),
            [None]
        );
        assert_eq!(cast_types("SELECT $1::interval"), [None]);
    }

    #[test]
    fn every_parameter_of_the_clients_statements_is_cast() {
        for statement in [
            sql::LEDGER_CLAIM,
            sql::LEDGER_CLAIM_OR_FAIL,
            sql::LEDGER_SEEN,
            sql::LEDGER_PURGE,
            sql::QUEUE_LEASE,
            sql::QUEUE_LOCK,
            sql::QUEUE_ACK_MANY,
            sql::QUEUE_ACK_ALL,
            sql::QUEUE_FENCE,
            sql::QUEUE_RETRY,
            sql::QUEUE_DEAD,
            sql::HEARTBEAT_EXTEND,
            sql::QUEUE_STATS,
            sql::QUEUE_CHANNEL,
            sql::QUEUE_ENQUEUE,
            sql::QUEUE_CREATE,
            sql::QUEUE_ENQUEUE_BATCH,
            sql::QUEUE_REQUEUE,
            sql::QUEUE_REQUEUE_DEAD,
            sql::QUEUE_DISCARD,
            sql::QUEUE_DEAD_JOBS,
            sql::SCHEDULE,
            sql::UNSCHEDULE,
            sql::SCHEDULES,
        ] {
            let types = cast_types(statement);
            assert!(!types.is_empty(), "{statement}");
            assert!(types.iter().all(Option::is_some), "{statement}: {types:?}");
        }
    }
}
