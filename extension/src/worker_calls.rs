//! The calls with which a worker commits a group of deliveries in one transaction without a
//! savepoint: settle the whole group or nothing (`inbox_ack_all`), and fence the jobs of a group
//! that is replayed after one of its deliveries failed (`inbox_fence`).

use pgrx::prelude::*;

use crate::datum::{array_facts, same_length, spi_result_datum, BigintArray, RegClass};
use crate::error::*;
use crate::plans::{self, Op};
use crate::shape::QueueShape;
use crate::statements::{self, Sql};

/// `$1` ids, `$2` their tokens (as for `inbox_ack`): locks the rows of those jobs that the tokens
/// still hold, in id order, waiting for a lock held by another transaction (a heartbeat's, or a
/// worker's that will settle the job, after which it is no longer the token's).
fn fence(queue: &QueueShape) -> Sql {
    Sql {
        text: format!(
            "SELECT q.id::pg_catalog.int8 FROM {} AS q \
               JOIN ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), \
                               pg_catalog.unnest($2::pg_catalog.int8[])) AS s(id, token) \
                 ON {} \
              ORDER BY q.id FOR UPDATE OF q",
            queue.table,
            statements::held("q.", "s.id", "s.token")
        ),
        args: vec![pg_sys::INT8ARRAYOID, pg_sys::INT8ARRAYOID],
    }
}

/// Locks, in the caller's transaction, the jobs among `ids` that their `tokens` still hold, and
/// returns their ids: from then until the transaction ends no one else can settle or take them.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_fence(
    queue: Option<RegClass>,
    ids: Option<BigintArray>,
    tokens: Option<BigintArray>,
) -> SetOfIterator<'static, i64> {
    let queue = required(queue, "queue").0;
    let ids = required(ids, "ids");
    let tokens = required(tokens, "tokens");
    same_length(&ids, &tokens);
    let held = Spi::connect_mut(|client| {
        let plan = plans::generic_plan(client, queue, Op::Fence, fence);
        let held = plan.run(&[ids.into(), tokens.into()]);
        (0..held)
            // SAFETY: the statement returned `held` rows of one int8 column, never NULL.
            .map(|row| unsafe { spi_result_datum(row, 1) }.map_or(0, |id| id.value() as i64))
            .collect::<Vec<i64>>()
    });
    SetOfIterator::new(held)
}

/// Acks every job of `ids` under its token, or raises `55000` (and so aborts the caller's
/// transaction) if any of them is no longer its token's; returns how many it acked.
#[pg_extern(volatile, parallel_unsafe)]
fn inbox_ack_all(
    queue: Option<RegClass>,
    ids: Option<BigintArray>,
    tokens: Option<BigintArray>,
) -> i64 {
    let queue = required(queue, "queue").0;
    let ids = required(ids, "ids");
    let tokens = required(tokens, "tokens");
    let given = array_facts(ids.0, "ids").len as i64;
    // The batch ack checks the arrays' lengths, and promotes the next job of each ordered group
    // whose head it finished.
    let acked = crate::queue::ack_batch(queue, ids, tokens);
    if acked != given {
        raise(
            ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "{} of {given} jobs are no longer held by their tokens",
                given - acked
            ),
        );
    }
    acked
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn count(sql: &str) -> i64 {
        Spi::get_one::<i64>(sql).expect(sql).unwrap_or(0)
    }

    /// A queue `jobs` with jobs 1, 2 and 3 leased once (token 1), and job 4 dead.
    fn setup() {
        Spi::run(
            "SELECT inbox_create_queue('jobs');
             SELECT inbox_enqueue('jobs', '{}') FROM generate_series(1, 4);
             SELECT count(*) FROM inbox_lease('jobs', 4, '30 seconds');
             SELECT inbox_dead('jobs', 4, 1, 'gone');",
        )
        .expect("setup");
    }

    #[pg_test]
    fn ack_all_acks_every_job_held() {
        setup();
        assert_eq!(
            count("SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1, 1]::int8[])"),
            2
        );
        assert_eq!(count("SELECT count(*) FROM jobs"), 2);
        assert_eq!(
            count("SELECT inbox_ack_all('jobs', '{}'::int8[], '{}'::int8[])"),
            0
        );
    }

    /// Acking a group's head promotes the next job of its group.
    #[pg_test]
    fn ack_all_promotes_the_next_job_of_a_group() {
        Spi::run(
            "SELECT inbox_create_queue('jobs');
             SELECT inbox_enqueue('jobs', '{}', group_key => 'g') FROM generate_series(1, 2);",
        )
        .expect("setup");
        assert_eq!(count("SELECT count(*) FROM inbox_lease('jobs', 10)"), 1);
        assert_eq!(
            count("SELECT inbox_ack_all('jobs', ARRAY[1]::int8[], ARRAY[1]::int8[])"),
            1
        );
        assert_eq!(
            count("SELECT id FROM inbox_lease('jobs', 10)"),
            2,
            "job 2 became its group's head"
        );
    }

    #[pg_test(error = "1 of 2 jobs are no longer held by their tokens")]
    fn ack_all_raises_when_a_job_is_no_longer_held() {
        setup();
        Spi::run("SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1, 2]::int8[])")
            .expect("the ack raises");
    }

    #[pg_test(error = "1 of 1 jobs are no longer held by their tokens")]
    fn ack_all_raises_for_a_dead_job() {
        setup();
        Spi::run("SELECT inbox_ack_all('jobs', ARRAY[4]::int8[], ARRAY[1]::int8[])")
            .expect("the ack raises");
    }

    #[pg_test(error = "2 ids given with 1 tokens")]
    fn ack_all_refuses_arrays_of_different_lengths() {
        setup();
        Spi::run("SELECT inbox_ack_all('jobs', ARRAY[1, 2]::int8[], ARRAY[1]::int8[])")
            .expect("the ack raises");
    }

    #[pg_test]
    fn fence_returns_the_jobs_their_tokens_still_hold() {
        setup();
        // Job 2's token is stale, job 4 is dead, job 9 does not exist.
        let held = Spi::get_one::<Vec<i64>>(
            "SELECT array_agg(f ORDER BY f) FROM inbox_fence('jobs', \
             ARRAY[3, 1, 2, 4, 9]::int8[], ARRAY[1, 1, 2, 1, 1]::int8[]) AS f",
        )
        .expect("fence");
        assert_eq!(held, Some(vec![1, 3]));
        // A lock's token (minus the attempt it will count) fences a job not yet counted.
        Spi::run("SELECT inbox_enqueue('jobs', '{}')").expect("enqueue");
        assert_eq!(
            count("SELECT count(*) FROM inbox_fence('jobs', ARRAY[5]::int8[], ARRAY[-1]::int8[])"),
            1
        );
        assert_eq!(
            count("SELECT count(*) FROM inbox_fence('jobs', ARRAY[5]::int8[], ARRAY[-2]::int8[])"),
            0
        );
    }

    #[pg_test(error = "ids must not be NULL")]
    fn fence_refuses_null_ids() {
        setup();
        Spi::run("SELECT inbox_fence('jobs', NULL, ARRAY[1]::int8[])").expect("the fence raises");
    }
}
