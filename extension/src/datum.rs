//! Arguments and results that pass through the extension as PostgreSQL datums.
//!
//! Payloads, keys and arrays are handed from the caller to the prepared statement (and from the
//! statement back to the caller) without being converted to Rust values: a `jsonb` payload is
//! never parsed, a `bytea` never copied, however large.

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{self, Datum, Oid};
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::{FromDatum, IntoDatum};

/// Lets a type be a `#[pg_extern]` argument and result through its `FromDatum`/`IntoDatum`.
macro_rules! pass_as_datum {
    ($name:ident) => {
        unsafe impl<'fcx> ArgAbi<'fcx> for $name {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                unsafe { arg.unbox_arg_using_from_datum() }
                    .unwrap_or_else(|| panic!("argument {index} must not be null"))
            }
        }

        unsafe impl BoxRet for $name {
            unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
                match self.into_datum() {
                    Some(datum) => unsafe { fcinfo.return_raw_datum(datum) },
                    None => fcinfo.return_null(),
                }
            }
        }
    };
}

macro_rules! raw_datum {
    ($(#[$doc:meta])* $name:ident, $sql:literal, $oid:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name(pub Datum);

        impl FromDatum for $name {
            unsafe fn from_polymorphic_datum(datum: Datum, is_null: bool, _: Oid) -> Option<Self> {
                (!is_null).then_some($name(datum))
            }
        }

        impl IntoDatum for $name {
            fn into_datum(self) -> Option<Datum> {
                Some(self.0)
            }

            fn type_oid() -> Oid {
                $oid
            }
        }

        pass_as_datum!($name);

        unsafe impl SqlTranslatable for $name {
            const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!($name);
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
                Ok(SqlMappingRef::literal($sql));
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                Ok(ReturnsRef::One(SqlMappingRef::literal($sql)));
        }
    };
}

raw_datum!(
    /// A `jsonb` value.
    Jsonb, "jsonb", pg_sys::JSONBOID
);
raw_datum!(
    /// A `bytea` value.
    Bytea, "bytea", pg_sys::BYTEAOID
);
raw_datum!(
    /// A `text` value.
    Text, "text", pg_sys::TEXTOID
);
raw_datum!(
    /// A `jsonb[]` value.
    JsonbArray, "jsonb[]", pg_sys::JSONBARRAYOID
);
raw_datum!(
    /// A `bytea[]` value.
    ByteaArray, "bytea[]", pg_sys::BYTEAARRAYOID
);
raw_datum!(
    /// A `text[]` value.
    TextArray, "text[]", pg_sys::TEXTARRAYOID
);
raw_datum!(
    /// A `bigint[]` value.
    BigintArray, "bigint[]", pg_sys::INT8ARRAYOID
);
raw_datum!(
    /// A `timestamptz[]` value.
    TimestamptzArray, "timestamptz[]", pg_sys::TIMESTAMPTZARRAYOID
);

/// What a one-dimensional array argument holds, read from its header.
pub(crate) struct ArrayFacts {
    pub len: usize,
    pub has_nulls: bool,
}

/// Reads the length of an array argument and whether it holds a NULL, raising
/// `2202E array_subscript_error` for an array of more than one dimension.
pub(crate) fn array_facts(array: Datum, argument: &str) -> ArrayFacts {
    // SAFETY: `array` is a non-NULL array argument of the current call; detoasting it allocates in
    // the call's memory context, which outlives this read.
    unsafe {
        let array = pg_sys::pg_detoast_datum(array.cast_mut_ptr()) as *mut pg_sys::ArrayType;
        let dimensions = (*array).ndim;
        if dimensions > 1 {
            crate::error::raise(
                crate::error::ERRCODE_ARRAY_ELEMENT_ERROR,
                format!("{argument} must be a one-dimensional array"),
            );
        }
        let len = if dimensions == 0 {
            0
        } else {
            // The dimensions follow the fixed header (PostgreSQL's ARR_DIMS).
            let dims = (array as *mut u8).add(std::mem::size_of::<pg_sys::ArrayType>()) as *mut i32;
            pg_sys::ArrayGetNItems(dimensions, dims) as usize
        };
        ArrayFacts {
            len,
            has_nulls: pg_sys::array_contains_nulls(array),
        }
    }
}

/// Copies column `column` (1-based) of row `row` of the last SPI result out of SPI's memory, so
/// it outlives `SPI_finish`; `None` for NULL.
///
/// # Safety
/// Must be called while connected to SPI, after a statement that returned at least `row + 1` rows
/// with at least `column` columns.
pub(crate) unsafe fn spi_result_datum(row: usize, column: i32) -> Option<Datum> {
    unsafe {
        let table = pg_sys::SPI_tuptable;
        let tuple = *(*table).vals.add(row);
        let descriptor = (*table).tupdesc;
        let mut is_null = false;
        let datum = pg_sys::SPI_getbinval(tuple, descriptor, column, &mut is_null);
        if is_null {
            return None;
        }
        let attribute = &*(*descriptor).attrs.as_ptr().add(column as usize - 1);
        Some(pg_sys::SPI_datumTransfer(
            datum,
            attribute.attbyval,
            attribute.attlen as i32,
        ))
    }
}

/// A table argument or result: SQL `regclass`, its oid to Rust.
#[derive(Clone, Copy)]
pub(crate) struct RegClass(pub Oid);

impl FromDatum for RegClass {
    unsafe fn from_polymorphic_datum(datum: Datum, is_null: bool, typoid: Oid) -> Option<Self> {
        unsafe { Oid::from_polymorphic_datum(datum, is_null, typoid) }.map(RegClass)
    }
}

impl IntoDatum for RegClass {
    fn into_datum(self) -> Option<Datum> {
        self.0.into_datum()
    }

    fn type_oid() -> Oid {
        pg_sys::REGCLASSOID
    }
}

pass_as_datum!(RegClass);

unsafe impl SqlTranslatable for RegClass {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(RegClass);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
        Ok(SqlMappingRef::literal("regclass"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("regclass")));
}

/// Raises `2202E` unless `ids` and `tokens` have the same length; returns it.
pub(crate) fn same_length(ids: &BigintArray, tokens: &BigintArray) -> usize {
    let (id_facts, token_facts) = (array_facts(ids.0, "ids"), array_facts(tokens.0, "tokens"));
    if id_facts.len != token_facts.len {
        crate::error::raise(
            crate::error::ERRCODE_ARRAY_ELEMENT_ERROR,
            format!("{} ids given with {} tokens", id_facts.len, token_facts.len),
        );
    }
    id_facts.len
}

/// The current time, read from the clock (not the transaction's start): due checks, leases and
/// retry delays are measured from the moment of the call.
pub(crate) fn clock_now() -> DatumWithOid<'static> {
    // SAFETY: a timestamptz is an int64 passed by value.
    unsafe { DatumWithOid::new(pg_sys::GetCurrentTimestamp(), pg_sys::TIMESTAMPTZOID) }
}
