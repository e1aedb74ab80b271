//! [`Statement`]: SQL with `$1..$n` placeholders and the owned [`Value`]s bound to them.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::sync::Arc;

use bytes::BytesMut;
use chrono::{DateTime, Utc};
use tokio_postgres::types::{IsNull, ToSql, Type, WrongType};

use crate::error::{DbError, ErrorKind, ParamError};

/// An owned SQL value: a statement parameter or a column of a result [`Row`](crate::Row).
///
/// As a parameter each variant is sent in PostgreSQL's binary format and checked against the type
/// the server expects: integers fit any of `smallint`, `integer`, `bigint` (and `oid`) when the
/// value is within that type's range, `F64` also fits `real` (rounded to the nearest `f32`),
/// `Timestamp` fits `timestamptz` and `timestamp` (as UTC), `Json` fits `json` and `jsonb`, and
/// `Null` fits every type. Any other pairing fails with [`ErrorKind::InvalidInput`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// SQL `NULL`.
    Null,
    /// A `boolean`.
    Bool(bool),
    /// A `smallint`.
    I16(i16),
    /// An `integer`.
    I32(i32),
    /// A `bigint`.
    I64(i64),
    /// A `double precision` (results of type `real` are widened to it).
    F64(f64),
    /// A `text` (also `varchar`, `char(n)` and `name`).
    Text(String),
    /// A `bytea`.
    Bytes(Vec<u8>),
    /// A `json` or `jsonb` document.
    Json(serde_json::Value),
    /// A `timestamptz` (results of type `timestamp` are read as UTC).
    Timestamp(DateTime<Utc>),
}

impl Value {
    /// The SQL name of the value's type (`"bigint"`, `"text"`, ...), or `"null"`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::I16(_) => "smallint",
            Value::I32(_) => "integer",
            Value::I64(_) => "bigint",
            Value::F64(_) => "double precision",
            Value::Text(_) => "text",
            Value::Bytes(_) => "bytea",
            Value::Json(_) => "json",
            Value::Timestamp(_) => "timestamptz",
        }
    }

    /// Whether this is [`Value::Null`].
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
}

type BoxError = Box<dyn StdError + Sync + Send>;

fn out_of_range(value: i64, ty: &Type) -> BoxError {
    Box::new(ParamError(format!(
        "integer {value} is out of range for type {ty}"
    )))
}

fn integer_to_sql(value: i64, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
    match *ty {
        Type::INT2 => i16::try_from(value)
            .map_err(|_| out_of_range(value, ty))?
            .to_sql(ty, out),
        Type::INT4 => i32::try_from(value)
            .map_err(|_| out_of_range(value, ty))?
            .to_sql(ty, out),
        Type::INT8 => value.to_sql(ty, out),
        Type::OID => u32::try_from(value)
            .map_err(|_| out_of_range(value, ty))?
            .to_sql(ty, out),
        _ => Err(Box::new(WrongType::new::<i64>(ty.clone()))),
    }
}

impl ToSql for Value {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Bool(v) if *ty == Type::BOOL => v.to_sql(ty, out),
            Value::Bool(_) => Err(Box::new(WrongType::new::<bool>(ty.clone()))),
            Value::I16(v) => integer_to_sql(i64::from(*v), ty, out),
            Value::I32(v) => integer_to_sql(i64::from(*v), ty, out),
            Value::I64(v) => integer_to_sql(*v, ty, out),
            Value::F64(v) => match *ty {
                Type::FLOAT8 => v.to_sql(ty, out),
                Type::FLOAT4 if v.is_finite() && v.abs() > f64::from(f32::MAX) => Err(Box::new(
                    ParamError(format!("float {v} is out of range for type real")),
                )),
                // Rounding to the nearest f32 is what PostgreSQL's own float8-to-real cast does.
                #[allow(clippy::cast_possible_truncation)]
                Type::FLOAT4 => (*v as f32).to_sql(ty, out),
                _ => Err(Box::new(WrongType::new::<f64>(ty.clone()))),
            },
            Value::Text(v) if <String as ToSql>::accepts(ty) => v.to_sql(ty, out),
            Value::Text(_) => Err(Box::new(WrongType::new::<String>(ty.clone()))),
            Value::Bytes(v) if <Vec<u8> as ToSql>::accepts(ty) => v.to_sql(ty, out),
            Value::Bytes(_) => Err(Box::new(WrongType::new::<Vec<u8>>(ty.clone()))),
            Value::Json(v) if <serde_json::Value as ToSql>::accepts(ty) => v.to_sql(ty, out),
            Value::Json(_) => Err(Box::new(WrongType::new::<serde_json::Value>(ty.clone()))),
            Value::Timestamp(v) => match *ty {
                Type::TIMESTAMPTZ => v.to_sql(ty, out),
                Type::TIMESTAMP => v.naive_utc().to_sql(ty, out),
                _ => Err(Box::new(WrongType::new::<DateTime<Utc>>(ty.clone()))),
            },
        }
    }

    /// Every type is accepted here; [`ToSql::to_sql_checked`] checks the pairing per variant.
    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn to_sql_checked(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
        self.to_sql(ty, out)
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Self {
                Value::$variant(v.into())
            }
        }
    )*};
}

value_from! {
    bool => Bool,
    i16 => I16,
    i32 => I32,
    i64 => I64,
    f64 => F64,
    String => Text,
    &str => Text,
    &String => Text,
    Vec<u8> => Bytes,
    &[u8] => Bytes,
    serde_json::Value => Json,
    DateTime<Utc> => Timestamp,
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// One SQL statement with `$1..$n` placeholders and its owned parameters, ready to run through a
/// [`Database`](crate::Database) or to keep in a `Vec` for
/// [`batch_atomic`](crate::Database::batch_atomic).
///
/// Static SQL is not copied, so building one costs the parameters only.
///
/// ```
/// use inbox_client::{Statement, Value};
///
/// let insert = Statement::new("INSERT INTO refunds (order_id, note) VALUES ($1, $2)")
///     .bind(42_i64)
///     .bind(None::<String>);
/// assert_eq!(insert.params(), &[Value::I64(42), Value::Null]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Statement {
    sql: Cow<'static, str>,
    params: Vec<Value>,
    rejected: Option<Arc<str>>,
}

impl Statement {
    /// A statement of `sql` with no parameters yet.
    pub fn new(sql: impl Into<Cow<'static, str>>) -> Self {
        Self {
            sql: sql.into(),
            params: Vec::new(),
            rejected: None,
        }
    }

    /// This statement with `value` bound to the next placeholder (`$1` first).
    #[must_use]
    pub fn bind(mut self, value: impl Into<Value>) -> Self {
        self.params.push(value.into());
        self
    }

    /// Binds `value` to the next placeholder, in place.
    pub fn push(&mut self, value: impl Into<Value>) -> &mut Self {
        self.params.push(value.into());
        self
    }

    /// This statement marked as built from invalid input: every [`Database`](crate::Database)
    /// fails it with [`ErrorKind::InvalidInput`] and `reason` before running anything (a batch
    /// that holds it writes nothing).
    #[must_use]
    pub fn rejected(mut self, reason: impl Into<String>) -> Self {
        self.rejected = Some(Arc::from(reason.into()));
        self
    }

    /// The SQL text.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The bound parameters, `$1` first.
    pub fn params(&self) -> &[Value] {
        &self.params
    }

    /// `Err` with [`ErrorKind::InvalidInput`] if the statement was [`rejected`](Self::rejected);
    /// every implementation of [`Database`](crate::Database) calls this on each statement before it
    /// runs any of them.
    pub fn check(&self) -> Result<(), DbError> {
        match &self.rejected {
            None => Ok(()),
            Some(reason) => Err(DbError::new(ErrorKind::InvalidInput, reason.as_ref())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn encode(value: &Value, ty: &Type) -> Result<Vec<u8>, String> {
        let mut out = BytesMut::new();
        match value.to_sql_checked(ty, &mut out) {
            Ok(IsNull::No) => Ok(out.to_vec()),
            Ok(IsNull::Yes) => Ok(b"NULL".to_vec()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn statement_binds_params_in_order_without_copying_static_sql() {
        let mut statement = Statement::new("SELECT $1, $2, $3").bind(1_i32).bind("two");
        statement.push(Some(3.5_f64));
        assert!(matches!(statement.sql, Cow::Borrowed(_)));
        assert_eq!(statement.sql(), "SELECT $1, $2, $3");
        assert_eq!(
            statement.params(),
            &[Value::I32(1), Value::Text("two".into()), Value::F64(3.5)]
        );
        assert!(statement.check().is_ok());
    }

    #[test]
    fn rejected_statement_fails_its_check_with_invalid_input() {
        let statement = Statement::new("SELECT 1").rejected("seen_at is not RFC 3339");
        let error = statement.check().unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidInput);
        assert_eq!(error.to_string(), "seen_at is not RFC 3339");
    }

    #[test]
    fn conversions_pick_the_matching_variant() {
        let at = Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap();
        assert_eq!(Value::from(true), Value::Bool(true));
        assert_eq!(Value::from(7_i16), Value::I16(7));
        assert_eq!(Value::from(String::from("s")), Value::Text("s".into()));
        assert_eq!(Value::from(&b"ab"[..]), Value::Bytes(b"ab".to_vec()));
        assert_eq!(
            Value::from(serde_json::json!({"a": 1})),
            Value::Json(serde_json::json!({"a": 1}))
        );
        assert_eq!(Value::from(at), Value::Timestamp(at));
        assert_eq!(Value::from(None::<i64>), Value::Null);
        assert!(Value::Null.is_null());
        assert_eq!(Value::I64(1).type_name(), "bigint");
    }

    #[test]
    fn integers_fit_every_integer_width_within_range() {
        assert_eq!(
            encode(&Value::I64(5), &Type::INT4),
            Ok(5_i32.to_be_bytes().to_vec())
        );
        assert_eq!(
            encode(&Value::I64(5), &Type::INT2),
            Ok(5_i16.to_be_bytes().to_vec())
        );
        assert_eq!(
            encode(&Value::I16(-1), &Type::INT8),
            Ok((-1_i64).to_be_bytes().to_vec())
        );
        assert_eq!(
            encode(&Value::I32(9), &Type::OID),
            Ok(9_u32.to_be_bytes().to_vec())
        );
        let too_big = encode(&Value::I64(i64::from(i32::MAX) + 1), &Type::INT4).unwrap_err();
        assert!(too_big.contains("out of range for type int4"), "{too_big}");
        assert!(encode(&Value::I32(-1), &Type::OID).is_err());
        assert!(encode(&Value::I64(1), &Type::TEXT)
            .unwrap_err()
            .contains("cannot convert"));
    }

    #[test]
    fn other_variants_check_their_wire_type() {
        assert_eq!(
            encode(&Value::F64(1.5), &Type::FLOAT4),
            Ok(1.5_f32.to_be_bytes().to_vec())
        );
        assert!(encode(&Value::F64(1e300), &Type::FLOAT4).is_err());
        assert!(encode(&Value::F64(1.5), &Type::INT8).is_err());
        assert_eq!(
            encode(&Value::Text("x".into()), &Type::VARCHAR),
            Ok(b"x".to_vec())
        );
        assert!(encode(&Value::Text("x".into()), &Type::TIMESTAMPTZ).is_err());
        assert!(encode(&Value::Bool(true), &Type::TEXT).is_err());
        assert!(encode(&Value::Bytes(vec![1]), &Type::BYTEA).is_ok());
        assert!(encode(&Value::Json(serde_json::json!(1)), &Type::JSONB).is_ok());
        assert!(encode(&Value::Json(serde_json::json!(1)), &Type::TEXT).is_err());
        let at = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 1).unwrap();
        // PostgreSQL timestamps count microseconds from 2000-01-01 00:00:00.
        let micros = 1_000_000_i64.to_be_bytes().to_vec();
        assert_eq!(
            encode(&Value::Timestamp(at), &Type::TIMESTAMPTZ),
            Ok(micros.clone())
        );
        assert_eq!(encode(&Value::Timestamp(at), &Type::TIMESTAMP), Ok(micros));
        assert!(encode(&Value::Timestamp(at), &Type::DATE).is_err());
        assert_eq!(encode(&Value::Null, &Type::INT4), Ok(b"NULL".to_vec()));
    }
}
