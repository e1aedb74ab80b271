//! [`Rows`] and [`Row`]: a query's result as owned [`Value`]s, read by column name.

use std::any::type_name;
use std::sync::Arc;

use chrono::{DateTime, NaiveDateTime, Utc};
use tokio_postgres::types::{FromSql, Type};

use crate::error::{DbError, ErrorKind};
use crate::statement::Value;

/// A Rust type that a [`Value`] converts to, for [`Row::get`].
///
/// Integers convert to any integer type they fit in; `Option<T>` reads `NULL` as `None`.
pub trait FromValue: Sized {
    /// The value as `Self`, or `None` when it is of another type or out of `Self`'s range.
    fn from_value(value: &Value) -> Option<Self>;
}

impl FromValue for Value {
    fn from_value(value: &Value) -> Option<Self> {
        Some(value.clone())
    }
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::Null => Some(None),
            v => T::from_value(v).map(Some),
        }
    }
}

macro_rules! integer_from_value {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn from_value(value: &Value) -> Option<Self> {
                match *value {
                    Value::I16(v) => <$t>::try_from(v).ok(),
                    Value::I32(v) => <$t>::try_from(v).ok(),
                    Value::I64(v) => <$t>::try_from(v).ok(),
                    _ => None,
                }
            }
        }
    )*};
}

integer_from_value!(i16, i32, i64, u32, u64);

macro_rules! variant_from_value {
    ($($t:ty => $variant:ident),*) => {$(
        impl FromValue for $t {
            fn from_value(value: &Value) -> Option<Self> {
                match value {
                    Value::$variant(v) => Some(v.clone()),
                    _ => None,
                }
            }
        }
    )*};
}

variant_from_value!(
    bool => Bool,
    f64 => F64,
    String => Text,
    Vec<u8> => Bytes,
    serde_json::Value => Json,
    DateTime<Utc> => Timestamp
);

/// A column that could not be decoded into a [`Value`]; the error surfaces when it is read.
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Value(Value),
    Undecodable(String),
}

/// One row of a result, its columns read by name with [`Row::get`].
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    columns: Arc<[String]>,
    cells: Vec<Cell>,
}

impl Row {
    /// A row of `values` named by `columns` (for other implementations of the port and tests).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when the two lengths differ.
    pub fn new(columns: Arc<[String]>, values: Vec<Value>) -> Result<Self, DbError> {
        if columns.len() != values.len() {
            return Err(DbError::new(
                ErrorKind::InvalidInput,
                format!(
                    "a row of {} values cannot have {} columns",
                    values.len(),
                    columns.len()
                ),
            ));
        }
        let cells = values.into_iter().map(Cell::Value).collect();
        Ok(Self { columns, cells })
    }

    /// The value of the column named `column` (the first one, if several share the name) as `T`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when there is no such column, when it is `NULL` and `T` is not an
    /// `Option`, when its type does not convert to `T` (or its value is out of `T`'s range), or
    /// when its SQL type is one this client does not decode (cast it in the query, e.g. `::text`).
    pub fn get<T: FromValue>(&self, column: &str) -> Result<T, DbError> {
        let invalid = |message: String| DbError::new(ErrorKind::InvalidInput, message);
        let index = self
            .columns
            .iter()
            .position(|c| c == column)
            .ok_or_else(|| {
                invalid(format!(
                    "no column `{column}` in the row (columns: {})",
                    self.columns.join(", ")
                ))
            })?;
        match self.cells.get(index) {
            Some(Cell::Value(value)) => T::from_value(value).ok_or_else(|| {
                invalid(match value {
                    Value::Null => format!(
                        "column `{column}` is NULL; read it as Option<{}>",
                        type_name::<T>()
                    ),
                    v => format!(
                        "column `{column}` of type {} cannot be read as {} (wrong type or out of range)",
                        v.type_name(),
                        type_name::<T>()
                    ),
                })
            }),
            Some(Cell::Undecodable(reason)) => {
                Err(invalid(format!("column `{column}`: {reason}")))
            }
            None => Err(invalid(format!("column `{column}` has no value"))),
        }
    }

    /// The column names, in order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// The number of columns.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Whether the row has no columns.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// Decodes a tokio-postgres row whose column names are `columns`.
    pub(crate) fn decode(columns: Arc<[String]>, row: &tokio_postgres::Row) -> Self {
        let cells = row
            .columns()
            .iter()
            .enumerate()
            .map(|(i, c)| decode_cell(row, i, c.type_()))
            .collect();
        Self { columns, cells }
    }
}

fn cell<'a, T, F>(row: &'a tokio_postgres::Row, index: usize, wrap: F) -> Cell
where
    T: FromSql<'a>,
    F: FnOnce(T) -> Value,
{
    match row.try_get::<_, Option<T>>(index) {
        Ok(Some(v)) => Cell::Value(wrap(v)),
        Ok(None) => Cell::Value(Value::Null),
        Err(e) => Cell::Undecodable(DbError::from(e).to_string()),
    }
}

fn decode_cell(row: &tokio_postgres::Row, index: usize, ty: &Type) -> Cell {
    match *ty {
        Type::BOOL => cell(row, index, Value::Bool),
        Type::INT2 => cell(row, index, Value::I16),
        Type::INT4 => cell(row, index, Value::I32),
        Type::INT8 => cell(row, index, Value::I64),
        Type::OID => cell(row, index, |v: u32| Value::I64(v.into())),
        Type::FLOAT4 => cell(row, index, |v: f32| Value::F64(v.into())),
        Type::FLOAT8 => cell(row, index, Value::F64),
        Type::BYTEA => cell(row, index, Value::Bytes),
        Type::JSON | Type::JSONB => cell(row, index, Value::Json),
        Type::TIMESTAMPTZ => cell(row, index, Value::Timestamp),
        Type::TIMESTAMP => cell(row, index, |v: NaiveDateTime| Value::Timestamp(v.and_utc())),
        Type::VOID => Cell::Value(Value::Null),
        ref t if <String as FromSql>::accepts(t) => cell(row, index, Value::Text),
        ref t => Cell::Undecodable(format!(
            "type {t} is not decoded by this client; cast it in the query (e.g. `::text`)"
        )),
    }
}

/// The rows a query returned, in order, with the column names of the result.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rows {
    columns: Arc<[String]>,
    rows: Vec<Row>,
}

impl Rows {
    /// A result of `rows` named by `columns`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when a row's length differs from the number of columns.
    pub fn new(columns: Vec<String>, rows: Vec<Vec<Value>>) -> Result<Self, DbError> {
        let columns: Arc<[String]> = columns.into();
        let rows = rows
            .into_iter()
            .map(|values| Row::new(Arc::clone(&columns), values))
            .collect::<Result<_, _>>()?;
        Ok(Self { columns, rows })
    }

    /// Decodes a tokio-postgres result of an unnamed statement, its column names read from the
    /// first row (an empty result has none).
    pub(crate) fn decode_unnamed(rows: &[tokio_postgres::Row]) -> Self {
        let columns: Arc<[String]> = rows.first().map_or_else(
            || Arc::from(Vec::new()),
            |row| row.columns().iter().map(|c| c.name().to_owned()).collect(),
        );
        let rows = rows
            .iter()
            .map(|r| Row::decode(Arc::clone(&columns), r))
            .collect();
        Self { columns, rows }
    }

    /// Decodes a tokio-postgres result of the prepared `statement`.
    pub(crate) fn decode(
        statement: &tokio_postgres::Statement,
        rows: &[tokio_postgres::Row],
    ) -> Self {
        let columns: Arc<[String]> = statement
            .columns()
            .iter()
            .map(|c| c.name().to_owned())
            .collect();
        let rows = rows
            .iter()
            .map(|r| Row::decode(Arc::clone(&columns), r))
            .collect();
        Self { columns, rows }
    }

    /// The exactly one row of the result.
    ///
    /// # Errors
    /// [`ErrorKind::Other`] when the result has no row or more than one.
    pub fn one(&self) -> Result<&Row, DbError> {
        match self.rows.as_slice() {
            [row] => Ok(row),
            rows => Err(DbError::new(
                ErrorKind::Other,
                format!("expected exactly one row, got {}", rows.len()),
            )),
        }
    }

    /// The first row, if any.
    pub fn first(&self) -> Option<&Row> {
        self.rows.first()
    }

    /// The row at `index`, if any.
    pub fn get(&self, index: usize) -> Option<&Row> {
        self.rows.get(index)
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the result has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The column names of the result (known even when it has no rows).
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// The rows, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Row> {
        self.rows.iter()
    }
}

impl IntoIterator for Rows {
    type Item = Row;
    type IntoIter = std::vec::IntoIter<Row>;

    fn into_iter(self) -> Self::IntoIter {
        self.rows.into_iter()
    }
}

impl<'a> IntoIterator for &'a Rows {
    type Item = &'a Row;
    type IntoIter = std::slice::Iter<'a, Row>;

    fn into_iter(self) -> Self::IntoIter {
        self.rows.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Rows {
        Rows::new(
            vec!["id".into(), "name".into(), "note".into()],
            vec![
                vec![Value::I64(7), Value::Text("a".into()), Value::Null],
                vec![
                    Value::I16(8),
                    Value::Text("b".into()),
                    Value::Text("n".into()),
                ],
            ],
        )
        .unwrap()
    }

    #[test]
    fn typed_access_by_column_name() {
        let rows = sample();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows.columns(), ["id", "name", "note"]);
        let first = rows.first().unwrap();
        assert_eq!(first.get::<i64>("id").unwrap(), 7);
        assert_eq!(first.get::<i32>("id").unwrap(), 7);
        assert_eq!(first.get::<String>("name").unwrap(), "a");
        assert_eq!(first.get::<Option<String>>("note").unwrap(), None);
        assert_eq!(first.get::<Value>("note").unwrap(), Value::Null);
        let second = rows.get(1).unwrap();
        assert_eq!(second.get::<i64>("id").unwrap(), 8);
        assert_eq!(
            second.get::<Option<String>>("note").unwrap().as_deref(),
            Some("n")
        );
        let ids: Vec<i64> = rows.iter().map(|r| r.get("id").unwrap()).collect();
        assert_eq!(ids, [7, 8]);
    }

    #[test]
    fn clear_errors_for_missing_column_wrong_type_null_and_range() {
        let rows = sample();
        let row = rows.first().unwrap();
        let missing = row.get::<i64>("nope").unwrap_err();
        assert_eq!(missing.kind(), ErrorKind::InvalidInput);
        assert!(
            missing.to_string().contains("no column `nope`"),
            "{missing}"
        );
        let wrong = row.get::<bool>("name").unwrap_err();
        assert!(
            wrong
                .to_string()
                .contains("`name` of type text cannot be read as bool"),
            "{wrong}"
        );
        let null = row.get::<String>("note").unwrap_err();
        assert!(
            null.to_string().contains("is NULL; read it as Option<"),
            "{null}"
        );
        let big = Rows::new(vec!["n".into()], vec![vec![Value::I64(1 << 40)]]).unwrap();
        assert!(big.one().unwrap().get::<i32>("n").is_err());
        assert_eq!(big.one().unwrap().get::<i64>("n").unwrap(), 1 << 40);
    }

    #[test]
    fn one_requires_exactly_one_row_and_lengths_must_match() {
        assert!(sample().one().is_err());
        assert!(Rows::default().one().is_err());
        assert!(Rows::new(vec!["a".into()], vec![vec![]]).is_err());
    }
}
