//! The [`Clock`] port: [`SystemClock`] for services, [`ManualClock`] for tests.

use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};

use crate::error::{DbError, ErrorKind};

/// A source of the current time, so that time-dependent code can be tested.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;

    /// The current instant as an RFC 3339 timestamp (see [`format_rfc3339`]), the form the ledger's
    /// `seen_at` takes.
    fn now_rfc3339(&self) -> String {
        format_rfc3339(self.now())
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> DateTime<Utc> {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> DateTime<Utc> {
        (**self).now()
    }
}

/// `at` as an RFC 3339 timestamp in UTC with microseconds, PostgreSQL's precision
/// (`2024-05-01T12:00:00.000000Z`).
pub fn format_rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Parses an RFC 3339 timestamp (any offset), naming `what` in the error.
pub(crate) fn parse_rfc3339(what: &str, text: &str) -> Result<DateTime<Utc>, DbError> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            DbError::new(
                ErrorKind::InvalidInput,
                format!("{what} {text:?} is not an RFC 3339 timestamp: {e}"),
            )
        })
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that stands still until it is [`set`](Self::set) or [`advance`](Self::advance)d; its
/// clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock showing `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// Makes the clock (and its clones) show `at`.
    pub fn set(&self, at: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = at;
    }

    /// Moves the clock (and its clones) by `by` (backwards when negative).
    pub fn advance(&self, by: TimeDelta) {
        let mut now = self.now.lock().unwrap_or_else(PoisonError::into_inner);
        *now += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn manual_clock_is_shared_and_settable() {
        let start = Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap();
        let clock = ManualClock::new(start);
        let shared = clock.clone();
        assert_eq!(shared.now(), start);
        clock.advance(TimeDelta::milliseconds(1500));
        assert_eq!(shared.now_rfc3339(), "2024-05-01T12:00:01.500000Z");
        shared.set(start - TimeDelta::days(1));
        assert_eq!(
            clock.now(),
            Utc.with_ymd_and_hms(2024, 4, 30, 12, 0, 0).unwrap()
        );
        let as_dyn: Arc<dyn Clock> = Arc::new(clock);
        assert_eq!(as_dyn.now(), start - TimeDelta::days(1));
    }

    #[test]
    fn system_clock_moves() {
        let before = Utc::now();
        let now = SystemClock.now();
        assert!(now >= before);
        // The text keeps microseconds; the clock may have had nanoseconds.
        let later = parse_rfc3339("now", &SystemClock.now_rfc3339()).unwrap();
        assert!(later >= chrono::SubsecRound::trunc_subsecs(now, 6));
    }

    #[test]
    fn rfc3339_round_trips_and_rejects_other_forms() {
        let at = parse_rfc3339("seen_at", "2024-05-01T14:00:00.25+02:00").unwrap();
        assert_eq!(format_rfc3339(at), "2024-05-01T12:00:00.250000Z");
        assert_eq!(parse_rfc3339("seen_at", &format_rfc3339(at)).unwrap(), at);
        for bad in [
            "",
            "now",
            "2024-05-01",
            "2024-05-01 12:00:00",
            "2024-13-01T00:00:00Z",
        ] {
            let error = parse_rfc3339("seen_at", bad).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidInput, "{bad}");
            assert!(error.to_string().starts_with("seen_at"), "{error}");
        }
    }
}
