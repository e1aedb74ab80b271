//! Helpers that several modules of the integration tests share.

pub mod explain;

use std::time::Duration;

use inbox_client::worker::RetryPolicy;

/// Retries after 1–5 ms (capped at 20 ms), dead-lettering after `max_attempts` deliveries.
pub fn fast_retries(max_attempts: i32) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(2),
        cap: Duration::from_millis(20),
        max_attempts: Some(max_attempts),
        jitter: 0.5,
    }
}

/// Runs each statement and asserts that the server refused it with its SQLSTATE.
pub async fn assert_refused(client: &tokio_postgres::Client, cases: &[(&str, &str)]) {
    for &(sql, code) in cases {
        let error = client
            .batch_execute(sql)
            .await
            .expect_err(&format!("{sql} succeeded"));
        assert_eq!(
            error.code().map(|c| c.code()),
            Some(code),
            "{sql}: {error:?}"
        );
    }
}
