//! In-database tests (`cargo pgrx test`). Each runs inside a transaction that is rolled back, so
//! they cover what one session sees; commits, races and visibility across connections are
//! tested over real connections in the workspace's `tests/` crate.

#[pgrx::pg_schema]
mod tests {
    use pgrx::pg_sys::panic::CaughtError;
    use pgrx::prelude::*;

    /// Runs `sql` in a subtransaction and returns the SQLSTATE it failed with, or `None`.
    fn sqlstate(sql: &str) -> Option<String> {
        // SAFETY: the standard internal-subtransaction pattern of PL/pgSQL's exception blocks:
        // the memory context and resource owner are restored whichever way it ends.
        unsafe {
            let context = pg_sys::CurrentMemoryContext;
            let owner = pg_sys::CurrentResourceOwner;
            pg_sys::BeginInternalSubTransaction(std::ptr::null());
            let outcome = PgTryBuilder::new(|| {
                Spi::run(sql).expect("SPI");
                pg_sys::ReleaseCurrentSubTransaction();
                None
            })
            .catch_others(|error| {
                pg_sys::RollbackAndReleaseCurrentSubTransaction();
                match error {
                    CaughtError::PostgresError(report)
                    | CaughtError::ErrorReport(report)
                    | CaughtError::RustPanic {
                        ereport: report, ..
                    } => Some(format!("{:?}", report.sql_error_code())),
                }
            })
            .execute();
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
            outcome
        }
    }

    fn assert_sqlstate(sql: &str, expected: &str) {
        let code = sqlstate(sql);
        assert!(
            code.as_deref().is_some_and(|code| code.ends_with(expected)),
            "{sql}\n  expected ERRCODE_{expected}, got {code:?}"
        );
    }

    fn one<T: IntoDatum + FromDatum>(sql: &str) -> Option<T> {
        Spi::get_one::<T>(sql).expect(sql)
    }

    fn count(sql: &str) -> i64 {
        one::<i64>(sql).unwrap_or(0)
    }

    fn setup() {
        Spi::run(
            "SELECT inbox_create_ledger('seen'); SELECT inbox_create_queue('jobs');
             CREATE TABLE refund_jobs (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 1,
                                       locked_until timestamptz, payload bytea NOT NULL);",
        )
        .expect("setup");
    }

    #[pg_test]
    fn claim_is_true_once_and_seen_after() {
        setup();
        assert_eq!(one::<bool>("SELECT inbox_seen('seen', 'k')"), Some(false));
        assert_eq!(one::<bool>("SELECT inbox_claim('seen', 'k')"), Some(true));
        assert_eq!(
            one::<bool>("SELECT inbox_claim('seen', 'k', now() + '1 day')"),
            Some(false)
        );
        assert_eq!(one::<bool>("SELECT inbox_seen('seen', 'k')"), Some(true));
        assert_eq!(count("SELECT count(*) FROM seen"), 1);
    }

    #[pg_test]
    fn claim_or_fail_raises_unique_violation_for_a_duplicate() {
        setup();
        Spi::run("SELECT inbox_claim_or_fail('seen', 'k')").expect("first claim");
        assert_sqlstate(
            "SELECT inbox_claim_or_fail('seen', 'k')",
            "UNIQUE_VIOLATION",
        );
        assert_eq!(count("SELECT count(*) FROM seen"), 1);
    }

    #[pg_test]
    fn purge_deletes_old_keys_in_batches() {
        setup();
        Spi::run(
            "INSERT INTO seen SELECT 'old' || i, now() - '2 days'::interval FROM generate_series(1, 25000) i;
             INSERT INTO seen VALUES ('new', now())",
        )
        .expect("keys");
        assert_eq!(
            one::<i64>("SELECT inbox_purge('seen', now() - '1 day'::interval)"),
            Some(25000)
        );
        assert_eq!(count("SELECT count(*) FROM seen"), 1);
        assert_eq!(
            one::<bool>("SELECT inbox_claim('seen', 'old1')"),
            Some(true)
        );
    }

    #[pg_test]
    fn create_is_idempotent_and_refuses_a_wrong_shape() {
        setup();
        assert_eq!(
            one::<String>("SELECT inbox_create_queue('jobs')::text").as_deref(),
            Some("jobs")
        );
        assert_eq!(
            one::<String>("SELECT inbox_create_ledger('seen')::text").as_deref(),
            Some("seen")
        );
        Spi::run("CREATE SCHEMA app; CREATE TABLE app.notes (event_key text)").expect("schema");
        assert_eq!(
            one::<String>("SELECT inbox_create_ledger('app.\"Odd \"\"Name\"\"\"')::text")
                .as_deref(),
            Some("app.\"Odd \"\"Name\"\"\"")
        );
        assert_sqlstate(
            "SELECT inbox_create_ledger('app.notes')",
            "UNDEFINED_COLUMN",
        );
        assert_sqlstate("SELECT inbox_create_queue('seen')", "UNDEFINED_COLUMN");
    }

    #[pg_test]
    fn bad_names_change_nothing() {
        let tables = "SELECT count(*) FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace";
        let before = count(tables);
        assert_sqlstate(
            "SELECT inbox_create_ledger('x; DROP TABLE y')",
            "INVALID_NAME",
        );
        assert_sqlstate("SELECT inbox_create_queue('a''b')", "INVALID_NAME");
        assert_sqlstate(
            "SELECT inbox_create_queue('\"unterminated')",
            "INVALID_NAME",
        );
        assert_sqlstate("SELECT inbox_create_queue('a.b.c')", "INVALID_NAME");
        assert_sqlstate(
            &format!("SELECT inbox_create_queue('{}')", "q".repeat(64)),
            "NAME_TOO_LONG",
        );
        assert_sqlstate("SELECT inbox_create_queue(NULL)", "NULL_VALUE_NOT_ALLOWED");
        assert_sqlstate(
            "SELECT inbox_create_queue('nosuchschema.q')",
            "INVALID_SCHEMA_NAME",
        );
        assert_eq!(count(tables), before);
        // 63 bytes is the longest name PostgreSQL keeps whole.
        Spi::run(&format!("SELECT inbox_create_queue('{}')", "q".repeat(63))).expect("63 bytes");
    }

    #[pg_test]
    fn every_function_refuses_nulls_and_unknown_tables() {
        setup();
        for sql in [
            "SELECT inbox_claim('seen', NULL)",
            "SELECT inbox_claim('seen', 'k', NULL)",
            "SELECT inbox_claim(NULL, 'k')",
            "SELECT inbox_seen('seen', NULL)",
            "SELECT inbox_purge('seen', NULL)",
            "SELECT inbox_enqueue('jobs', NULL::jsonb)",
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}', NULL]::jsonb[])",
            "SELECT inbox_enqueue_batch('jobs', NULL::jsonb[])",
            "SELECT * FROM inbox_lease('jobs', NULL)",
            "SELECT * FROM inbox_lease('jobs', 1, NULL)",
            "SELECT inbox_ack('jobs', NULL, 1)",
            "SELECT inbox_ack('jobs', 1, NULL)",
            "SELECT inbox_retry('jobs', 1, 1, NULL)",
            "SELECT inbox_extend('jobs', 1, 1, NULL)",
            "SELECT inbox_stats(NULL)",
        ] {
            assert_sqlstate(sql, "NULL_VALUE_NOT_ALLOWED");
        }
        assert_sqlstate("SELECT inbox_claim('nosuch', 'k')", "UNDEFINED_TABLE");
        assert_sqlstate(
            "SELECT inbox_claim(4000000000::oid::regclass, 'k')",
            "UNDEFINED_TABLE",
        );
        assert_sqlstate(
            "SELECT inbox_ack(4000000000::oid::regclass, 1, 1)",
            "UNDEFINED_TABLE",
        );
        assert_sqlstate(
            "SELECT inbox_claim('pg_class_oid_index', 'k')",
            "WRONG_OBJECT_TYPE",
        );
    }

    #[pg_test]
    fn wrong_shapes_are_named() {
        setup();
        Spi::run(
            "CREATE TABLE no_payload (id bigint, attempt int, locked_until timestamptz);
             CREATE TABLE text_payload (id bigint, attempt int, locked_until timestamptz, payload text);
             CREATE TABLE no_unique (event_key text, seen_at timestamptz);
             CREATE TABLE keys_not_unique (id bigint, attempt int, locked_until timestamptz, payload jsonb, key text);",
        )
        .expect("tables");
        assert_sqlstate(
            "SELECT inbox_enqueue('no_payload', '{}')",
            "UNDEFINED_COLUMN",
        );
        assert_sqlstate(
            "SELECT * FROM inbox_lease('no_payload')",
            "UNDEFINED_COLUMN",
        );
        assert_sqlstate("SELECT inbox_ack('no_payload', 1, 1)", "UNDEFINED_COLUMN");
        assert_sqlstate(
            "SELECT inbox_enqueue('text_payload', '{}')",
            "DATATYPE_MISMATCH",
        );
        assert_sqlstate(
            "SELECT inbox_claim('no_unique', 'k')",
            "INVALID_COLUMN_REFERENCE",
        );
        assert_sqlstate("SELECT inbox_claim('jobs', 'k')", "UNDEFINED_COLUMN");
        assert_sqlstate(
            "SELECT inbox_enqueue('keys_not_unique', '{}')",
            "INVALID_COLUMN_REFERENCE",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_bytes('jobs', '\\x00'::bytea)",
            "DATATYPE_MISMATCH",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue('refund_jobs', '{}'::jsonb)",
            "DATATYPE_MISMATCH",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x00'::bytea, now(), 'k')",
            "UNDEFINED_COLUMN",
        );
    }

    #[pg_test]
    fn bad_arguments_are_refused() {
        setup();
        assert_sqlstate(
            "SELECT * FROM inbox_lease('jobs', 0)",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT * FROM inbox_lease('jobs', 1, '0 seconds')",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT * FROM inbox_lock('jobs', -1)",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT inbox_extend('jobs', 1, 1, '-1 second')",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT inbox_retry('jobs', 1, 1, '-1 second')",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT inbox_retry('jobs', 1, 1, '1 second', 'e', 0)",
            "INVALID_PARAMETER_VALUE",
        );
        assert_sqlstate(
            "SELECT inbox_ack_batch('jobs', ARRAY[1,2]::bigint[], ARRAY[1]::bigint[])",
            "ARRAY_ELEMENT_ERROR",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], now(), ARRAY['a','b'])",
            "ARRAY_ELEMENT_ERROR",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_batch('jobs', ARRAY[['{}']]::jsonb[])",
            "ARRAY_ELEMENT_ERROR",
        );
    }

    #[pg_test]
    fn untyped_literals_pick_one_function() {
        setup();
        // Each of these was ambiguous while the bytea forms and the array ack were overloads.
        for sql in [
            "SELECT inbox_enqueue('jobs', '{\"to\": \"a\"}')",
            "SELECT inbox_enqueue('jobs', '{}', now() + interval '1 hour', key => 'k')",
            "SELECT inbox_enqueue('jobs', '{}', '2030-01-01', 'k2')",
            "SELECT inbox_enqueue_batch('jobs', '{\"{}\",\"{}\"}')",
            "SELECT inbox_ack('jobs', '1', '1')",
            "SELECT inbox_ack_batch('jobs', '{1}', '{1}')",
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01')",
            "SELECT inbox_enqueue_batch_bytes('refund_jobs', '{\"\\\\x01\"}')",
        ] {
            assert_eq!(sqlstate(sql), None, "{sql}");
        }
        assert_eq!(count("SELECT count(*) FROM jobs"), 5);
        assert_eq!(count("SELECT count(*) FROM refund_jobs"), 2);
    }

    #[pg_test]
    fn non_finite_times_are_refused_and_write_nothing() {
        setup();
        for sql in [
            "SELECT inbox_enqueue('jobs', '{}', 'infinity')",
            "SELECT inbox_enqueue('jobs', '{}', '-infinity')",
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], 'infinity')",
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', '-infinity')",
            "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01']::bytea[], 'infinity')",
            "SELECT inbox_claim('seen', 'k', 'infinity')",
            "SELECT inbox_claim_or_fail('seen', 'k', '-infinity')",
            "SELECT inbox_purge('seen', 'infinity')",
            "SELECT inbox_purge('seen', '-infinity')",
        ] {
            assert_sqlstate(sql, "INVALID_PARAMETER_VALUE");
        }
        for sql in [
            "SELECT inbox_enqueue('jobs', '{}', NULL)",
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], NULL)",
        ] {
            assert_sqlstate(sql, "NULL_VALUE_NOT_ALLOWED");
        }
        assert_eq!(count("SELECT count(*) FROM jobs"), 0);
        assert_eq!(count("SELECT count(*) FROM refund_jobs"), 0);
        assert_eq!(count("SELECT count(*) FROM seen"), 0);
        assert_eq!(
            count("SELECT ready + delayed + leased + dead FROM inbox_stats('jobs')"),
            0
        );
    }

    #[pg_test]
    fn the_new_arguments_refuse_nulls_and_bad_counts() {
        setup();
        for sql in [
            "SELECT inbox_enqueue_bytes('refund_jobs', NULL)",
            "SELECT inbox_enqueue_batch_bytes('refund_jobs', NULL)",
            "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY[NULL]::bytea[])",
            "SELECT inbox_enqueue('jobs', '{}', priority => NULL)",
            "SELECT inbox_ack_batch('jobs', ARRAY[1]::int8[], NULL)",
            "SELECT inbox_dead('jobs', NULL, 1)",
            "SELECT * FROM inbox_lock('jobs', NULL)",
            "SELECT inbox_requeue('jobs', NULL)",
            "SELECT inbox_requeue(NULL, 1)",
            "SELECT inbox_requeue_dead(NULL)",
            "SELECT inbox_discard('jobs', NULL)",
            "SELECT * FROM inbox_dead_jobs('jobs', NULL)",
            "SELECT inbox_channel(NULL)",
        ] {
            assert_sqlstate(sql, "NULL_VALUE_NOT_ALLOWED");
        }
        for sql in [
            "SELECT inbox_requeue_dead('jobs', 0)",
            "SELECT * FROM inbox_dead_jobs('jobs', -1)",
        ] {
            assert_sqlstate(sql, "INVALID_PARAMETER_VALUE");
        }
        assert_sqlstate(
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}']::jsonb[], group_keys => ARRAY['a', 'b'])",
            "ARRAY_ELEMENT_ERROR",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue('refund_jobs', '{}', priority => 2)",
            "DATATYPE_MISMATCH",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', priority => 2)",
            "UNDEFINED_COLUMN",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue_bytes('refund_jobs', '\\x01', group_key => 'g')",
            "UNDEFINED_COLUMN",
        );
        assert_eq!(count("SELECT count(*) FROM jobs"), 0);
        assert_eq!(count("SELECT count(*) FROM refund_jobs"), 0);
    }

    #[pg_test]
    fn dead_letters_of_a_table_without_dead_at() {
        setup();
        // refund_jobs has no dead_at, last_error or group_key: 'infinity' alone marks the dead.
        Spi::run(
            "SELECT inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01', '\\x02']::bytea[]);
             SELECT count(*) FROM inbox_lease('refund_jobs', 2);
             SELECT inbox_dead('refund_jobs', 1, 2, 'x'); SELECT inbox_dead('refund_jobs', 2, 2, 'y')",
        )
        .expect("dead-lettered");
        assert_eq!(
            count("SELECT count(*) FROM inbox_dead_jobs('refund_jobs')"),
            2
        );
        assert_eq!(
            count(
                "SELECT count(*) FROM inbox_dead_jobs('refund_jobs')
                  WHERE payload_bytes IS NOT NULL AND payload IS NULL AND dead_at IS NULL AND last_error IS NULL"
            ),
            2
        );
        assert_eq!(
            one::<bool>("SELECT inbox_requeue('refund_jobs', 1)"),
            Some(true)
        );
        assert_eq!(
            one::<bool>("SELECT inbox_discard('refund_jobs', 1)"),
            Some(false)
        );
        assert_eq!(
            one::<bool>("SELECT inbox_discard('refund_jobs', 2)"),
            Some(true)
        );
        assert_eq!(
            one::<i32>("SELECT attempt FROM refund_jobs WHERE id = 1 AND locked_until <= clock_timestamp()"),
            Some(0)
        );
        assert_eq!(
            count("SELECT ready + delayed + leased + dead FROM inbox_stats('refund_jobs')"),
            1
        );
    }

    #[pg_test]
    fn waiting_jobs_count_as_delayed_and_cannot_be_settled() {
        setup();
        Spi::run(
            "SELECT inbox_enqueue('jobs', '1', group_key => 'g');
             SELECT inbox_enqueue('jobs', '2', group_key => 'g');
             SELECT inbox_enqueue('jobs', '3', group_key => 'g')",
        )
        .expect("enqueued");
        assert_eq!(
            count("SELECT ready * 100 + delayed * 10 + dead FROM inbox_stats('jobs')"),
            120
        );
        // A waiting job has never been delivered: no token settles it, it is not dead.
        for sql in [
            "SELECT inbox_ack('jobs', 2, -1)",
            "SELECT inbox_ack('jobs', 2, 0)",
            "SELECT inbox_dead('jobs', 2, -1)",
            "SELECT inbox_requeue('jobs', 2)",
            "SELECT inbox_discard('jobs', 2)",
        ] {
            assert_eq!(one::<bool>(sql), Some(false), "{sql}");
        }
        assert_eq!(count("SELECT count(*) FROM jobs"), 3);
    }

    #[pg_test]
    fn enqueue_dedups_by_key_and_batches_in_order() {
        setup();
        let first = one::<i64>("SELECT inbox_enqueue('jobs', '{\"n\":1}', key => 'k')");
        assert!(first.is_some());
        assert_eq!(
            one::<i64>("SELECT inbox_enqueue('jobs', '{\"n\":2}', key => 'k')"),
            None
        );
        let ids: Vec<i64> = Spi::connect(|client| {
            client
                .select(
                    "SELECT * FROM inbox_enqueue_batch('jobs', ARRAY['{\"n\":3}','{\"n\":4}','{\"n\":5}']::jsonb[],
                                                      now(), ARRAY['k', 'x', 'x'])",
                    None,
                    &[],
                )
                .expect("batch")
                .map(|row| row.get::<i64>(1).expect("id").expect("id"))
                .collect()
        });
        assert_eq!(
            ids.len(),
            1,
            "k is queued and x is repeated within the batch"
        );
        assert_eq!(count("SELECT count(*) FROM jobs"), 2);
        let bytes = one::<i64>("SELECT count(*) FROM inbox_enqueue_batch_bytes('refund_jobs', ARRAY['\\x01', '\\x02']::bytea[])");
        assert_eq!(bytes, Some(2));
        let (first_due, second_due) = (
            one::<i64>("SELECT id FROM refund_jobs ORDER BY id LIMIT 1").expect("id"),
            one::<i64>("SELECT id FROM refund_jobs ORDER BY id DESC LIMIT 1").expect("id"),
        );
        assert!(first_due < second_due);
    }

    #[pg_test]
    fn lease_takes_due_jobs_in_order_and_counts_attempts() {
        setup();
        Spi::run(
            "SELECT inbox_enqueue('jobs', '{\"n\":2}', now() - '1 minute'::interval);
             SELECT inbox_enqueue('jobs', '{\"n\":1}', now() - '2 minutes'::interval);
             SELECT inbox_enqueue('jobs', '{\"n\":3}', now() + '1 hour'::interval);",
        )
        .expect("jobs");
        let taken: Vec<(i32, i64, String)> = Spi::connect(|client| {
            client
                .select(
                    "SELECT attempt, token, payload->>'n' FROM inbox_lease('jobs', 10, '1 minute')",
                    None,
                    &[],
                )
                .expect("lease")
                .map(|row| {
                    (
                        row.get(1).unwrap().unwrap(),
                        row.get(2).unwrap().unwrap(),
                        row.get(3).unwrap().unwrap(),
                    )
                })
                .collect()
        });
        assert_eq!(
            taken,
            vec![(1, 1, "1".to_string()), (1, 1, "2".to_string())]
        );
        assert_eq!(
            count("SELECT count(*) FROM inbox_lease('jobs', 10)"),
            0,
            "leased and delayed jobs are invisible"
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE leased_at IS NOT NULL AND locked_until > now()"),
            2
        );
        let stats = one::<String>("SELECT s::text FROM inbox_stats('jobs') s");
        assert_eq!(stats.as_deref(), Some("(0,1,2,0,,f)"));
    }

    #[pg_test]
    fn lock_writes_nothing_and_its_settlement_counts_the_attempt() {
        setup();
        Spi::run("SELECT inbox_enqueue('jobs', '{}')").expect("job");
        assert_eq!(
            one::<String>("SELECT format('%s %s', attempt, token) FROM inbox_lock('jobs')")
                .as_deref(),
            Some("1 -1"),
            "the first delivery, with a lock's (negative) token"
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE attempt = 0 AND leased_at IS NULL"),
            1
        );
        assert_eq!(
            one::<bool>("SELECT inbox_extend('jobs', 1, -1, '1 hour')"),
            Some(false),
            "no lease to extend"
        );
        assert_eq!(
            one::<bool>("SELECT inbox_ack('jobs', 1, 1)"),
            Some(false),
            "not a lease's token"
        );
        assert_eq!(
            one::<bool>("SELECT inbox_retry('jobs', 1, -1, '0 seconds', 'again', 2)"),
            Some(true)
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE attempt = 1 AND last_error = 'again'"),
            1
        );
        assert_eq!(
            one::<bool>("SELECT inbox_retry('jobs', 1, -1)"),
            Some(false),
            "settled once"
        );
        assert_eq!(
            one::<String>("SELECT format('%s %s', attempt, token) FROM inbox_lock('jobs')")
                .as_deref(),
            Some("2 -2")
        );
        // The second delivery reaches max_attempts: dead-lettered, its attempt counted.
        assert_eq!(
            one::<bool>("SELECT inbox_retry('jobs', 1, -2, '0 seconds', 'last', 2)"),
            Some(true)
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE attempt = 2 AND locked_until = 'infinity'"),
            1
        );
    }

    #[pg_test]
    fn user_tables_with_nullable_locked_until_and_bytea_work() {
        setup();
        Spi::run("INSERT INTO refund_jobs (payload) VALUES ('\\x01'); SELECT inbox_enqueue_bytes('refund_jobs', '\\x02'::bytea)")
            .expect("jobs");
        let taken: Vec<(i32, Option<Vec<u8>>, bool)> = Spi::connect(|client| {
            client
                .select("SELECT attempt, payload_bytes, payload IS NULL FROM inbox_lease('refund_jobs', 5)", None, &[])
                .expect("lease")
                .map(|row| (row.get(1).unwrap().unwrap(), row.get(2).unwrap(), row.get(3).unwrap().unwrap()))
                .collect()
        });
        assert_eq!(
            taken,
            vec![(2, Some(vec![1]), true), (2, Some(vec![2]), true)],
            "NULL locked_until is due first"
        );
        assert_eq!(
            one::<bool>("SELECT inbox_ack('refund_jobs', 1, 2)"),
            Some(true)
        );
        assert_eq!(one::<bool>("SELECT inbox_retry('refund_jobs', 2, 2, '1 hour', 'ignored: no last_error column')"), Some(true));
        assert_eq!(
            one::<String>("SELECT s::text FROM inbox_stats('refund_jobs') s").as_deref(),
            Some("(0,0,1,0,,f)")
        );
    }

    #[pg_test]
    fn settlement_is_fenced_by_the_token() {
        setup();
        Spi::run("SELECT inbox_enqueue('jobs', '{}'); SELECT * FROM inbox_lease('jobs')")
            .expect("leased");
        // The lease expires and a second worker takes the job: the first token is stale.
        Spi::run("UPDATE jobs SET locked_until = now() - '1 second'::interval").expect("expire");
        assert_eq!(one::<i64>("SELECT token FROM inbox_lease('jobs')"), Some(2));
        for stale in [
            "SELECT inbox_ack('jobs', 1, 1)",
            "SELECT inbox_retry('jobs', 1, 1)",
            "SELECT inbox_dead('jobs', 1, 1, 'x')",
            "SELECT inbox_extend('jobs', 1, 1, '1 hour')",
        ] {
            assert_eq!(one::<bool>(stale), Some(false), "{stale}");
        }
        assert_eq!(
            one::<i64>("SELECT inbox_ack_batch('jobs', ARRAY[1]::bigint[], ARRAY[1]::bigint[])"),
            Some(0)
        );
        assert_eq!(
            one::<bool>("SELECT inbox_extend('jobs', 1, 2, '1 hour')"),
            Some(true)
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE locked_until > now() + '59 minutes'::interval"),
            1
        );
        assert_eq!(one::<bool>("SELECT inbox_ack('jobs', 1, 2)"), Some(true));
        assert_eq!(count("SELECT count(*) FROM jobs"), 0);
    }

    #[pg_test]
    fn ack_many_finishes_only_current_tokens() {
        setup();
        Spi::run("SELECT inbox_enqueue_batch('jobs', ARRAY['{}','{}','{}']::jsonb[]); SELECT * FROM inbox_lease('jobs', 3)")
            .expect("leased");
        assert_eq!(
            one::<i64>(
                "SELECT inbox_ack_batch('jobs', ARRAY[1,2,3]::bigint[], ARRAY[1,1,9]::bigint[])"
            ),
            Some(2)
        );
        assert_eq!(count("SELECT count(*) FROM jobs"), 1);
    }

    #[pg_test]
    fn retry_delays_and_dead_letters_past_max_attempts() {
        setup();
        Spi::run("SELECT inbox_enqueue('jobs', '{}'); SELECT * FROM inbox_lease('jobs')")
            .expect("leased");
        assert_eq!(
            one::<bool>("SELECT inbox_retry('jobs', 1, 1, '1 hour', 'timeout', 2)"),
            Some(true)
        );
        assert_eq!(
            one::<bool>("SELECT inbox_extend('jobs', 1, 1, '2 hours')"),
            Some(false),
            "a retried job is no longer leased"
        );
        assert_eq!(
            one::<String>("SELECT format('%s|%s|%s', locked_until > now() + '59 minutes', leased_at IS NULL, last_error) FROM jobs").as_deref(),
            Some("t|t|timeout")
        );
        Spi::run("UPDATE jobs SET locked_until = now() - '1 second'::interval").expect("due");
        assert_eq!(one::<i64>("SELECT token FROM inbox_lease('jobs')"), Some(2));
        assert_eq!(
            one::<bool>("SELECT inbox_retry('jobs', 1, 2, '1 second', 'again', 2)"),
            Some(true)
        );
        assert_eq!(
            one::<String>("SELECT s::text FROM inbox_stats('jobs') s").as_deref(),
            Some("(0,0,0,1,,f)")
        );
        assert_eq!(
            one::<String>("SELECT last_error FROM jobs WHERE locked_until = 'infinity'").as_deref(),
            Some("again")
        );
        assert_eq!(
            one::<bool>("SELECT inbox_ack('jobs', 1, 2)"),
            Some(false),
            "dead jobs are settled by no one"
        );
    }

    #[pg_test]
    fn dead_keeps_the_job_with_its_reason() {
        setup();
        Spi::run("SELECT inbox_enqueue('jobs', '{}'); SELECT * FROM inbox_lock('jobs')")
            .expect("locked");
        assert_eq!(
            one::<bool>("SELECT inbox_dead('jobs', 1, -1, 'undecodable')"),
            Some(true)
        );
        assert_eq!(
            count("SELECT count(*) FROM jobs WHERE attempt = 1"),
            1,
            "the locked delivery counted"
        );
        assert_eq!(
            one::<String>("SELECT last_error FROM jobs WHERE locked_until = 'infinity'").as_deref(),
            Some("undecodable")
        );
        assert_eq!(count("SELECT count(*) FROM inbox_lease('jobs')"), 0);
    }

    #[pg_test]
    fn stats_tells_states_apart() {
        setup();
        Spi::run(
            "SELECT inbox_enqueue_batch('jobs', ARRAY['{}','{}','{}','{}']::jsonb[], now() - '1 minute'::interval);
             SELECT inbox_enqueue('jobs', '{}', now() + '1 hour'::interval);
             SELECT * FROM inbox_lease('jobs', 2);
             SELECT inbox_dead('jobs', 2, 1, 'x');",
        )
        .expect("jobs");
        let row = one::<String>("SELECT format('%s %s %s %s %s', ready, delayed, leased, dead, oldest_ready_age >= '1 minute') FROM inbox_stats('jobs')");
        assert_eq!(row.as_deref(), Some("2 1 1 1 t"));
    }

    #[pg_test]
    fn channel_names_the_queue() {
        setup();
        let expected = format!(
            "inbox_{}",
            one::<pg_sys::Oid>("SELECT 'jobs'::regclass::oid")
                .unwrap()
                .to_u32()
        );
        assert_eq!(
            one::<String>("SELECT inbox_channel('jobs')"),
            Some(expected)
        );
    }

    #[pg_test]
    fn plans_follow_the_table_through_ddl() {
        setup();
        assert_eq!(one::<bool>("SELECT inbox_claim('seen', 'a')"), Some(true));
        // The cached plan named the table; after a rename and a new table of the old name, each
        // oid must still reach its own table.
        Spi::run("ALTER TABLE seen RENAME TO seen_before; SELECT inbox_create_ledger('seen')")
            .expect("ddl");
        assert_eq!(one::<bool>("SELECT inbox_claim('seen', 'a')"), Some(true));
        assert_eq!(
            one::<bool>("SELECT inbox_claim('seen_before', 'a')"),
            Some(false)
        );
        Spi::run("ALTER TABLE seen_before DROP COLUMN seen_at").expect("drop column");
        assert_sqlstate("SELECT inbox_claim('seen_before', 'b')", "UNDEFINED_COLUMN");
    }

    #[pg_test]
    fn a_role_without_privilege_gets_insufficient_privilege() {
        setup();
        Spi::run("CREATE ROLE inbox_nobody; GRANT USAGE ON SCHEMA public TO inbox_nobody; SET ROLE inbox_nobody")
            .expect("role");
        assert_sqlstate("SELECT inbox_claim('seen', 'k')", "INSUFFICIENT_PRIVILEGE");
        assert_sqlstate(
            "SELECT * FROM inbox_lease('jobs')",
            "INSUFFICIENT_PRIVILEGE",
        );
        assert_sqlstate(
            "SELECT inbox_enqueue('jobs', '{}')",
            "INSUFFICIENT_PRIVILEGE",
        );
        Spi::run("RESET ROLE").expect("reset");
        assert_eq!(
            count("SELECT count(*) FROM jobs") + count("SELECT count(*) FROM seen"),
            0
        );
    }

    #[pg_test]
    fn errors_leave_the_backend_usable() {
        // An error raised from Rust aborts the statement only; the session carries on.
        assert_sqlstate("SELECT inbox_seen(NULL, 'k')", "NULL_VALUE_NOT_ALLOWED");
        assert_eq!(one::<i32>("SELECT 1"), Some(1));
    }
}
