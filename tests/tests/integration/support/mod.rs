//! Helpers that several modules of the integration tests share.

pub mod explain;

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
