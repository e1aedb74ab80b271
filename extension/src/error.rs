//! Errors raised to the caller, each with the SQLSTATE a client branches on.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

pub(crate) use pgrx::PgSqlErrorCode::*;

/// Raises an ERROR with `code` and `message`; the current transaction (or subtransaction) aborts,
/// so nothing the call did is kept.
pub(crate) fn raise(code: PgSqlErrorCode, message: impl Into<String>) -> ! {
    ErrorReport::new(code, message.into(), "inbox").report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

/// Unwraps a required argument, raising `22004 null_value_not_allowed` naming it when NULL.
pub(crate) fn required<T>(value: Option<T>, argument: &str) -> T {
    match value {
        Some(value) => value,
        None => raise(
            ERRCODE_NULL_VALUE_NOT_ALLOWED,
            format!("{argument} must not be NULL"),
        ),
    }
}

/// Raises an SPI failure that PostgreSQL did not raise itself (a misuse of SPI, not bad input)
/// as `XX000 internal_error`.
pub(crate) fn internal(error: pgrx::spi::SpiError) -> ! {
    raise(ERRCODE_INTERNAL_ERROR, error.to_string())
}

/// Returns a required time, raising `22004` when NULL and `22023 invalid_parameter_value` when it
/// is `infinity` or `-infinity` (a job due at infinity would look dead, and one due at
/// `-infinity` breaks every age computed from it).
pub(crate) fn finite_time(
    value: Option<pgrx::datum::TimestampWithTimeZone>,
    argument: &str,
) -> pgrx::datum::TimestampWithTimeZone {
    let value = required(value, argument);
    if !value.is_finite() {
        raise(
            ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "{argument} must be a finite time, not {}",
                if value.is_infinity() {
                    "infinity"
                } else {
                    "-infinity"
                }
            ),
        );
    }
    value
}
