//! The calls with which a worker commits a group of deliveries in one transaction without a
//! savepoint: settle the whole group or nothing (`inbox_ack_all`), and fence the jobs of a group
//! that is replayed after one of its deliveries failed (`inbox_fence`).

use pgrx::prelude::*;

use crate::datum::{array_facts, BigintArray, RegClass};
use crate::error::*;
use crate::plans::{self, Op};
use crate::shape::QueueShape;
use crate::statements::Sql;

/// `$1` ids, `$2` their tokens (as for `inbox_ack`): locks the rows of those jobs that the tokens
/// still hold, in id order, waiting for a lock held by another transaction (a heartbeat's, or a
/// worker's that will settle the job, after which it is no longer the token's).
fn fence(queue: &QueueShape) -> Sql {
    Sql {
        text: format!(
            "SELECT q.id::int8 FROM {} AS q JOIN unnest($1::int8[], $2::int8[]) AS s(id, token) \
                 ON q.id = s.id \
              WHERE q.attempt = CASE WHEN s.token < 0 THEN -s.token - 1 ELSE s.token END \
                AND q.locked_until IS DISTINCT FROM 'infinity' \
              ORDER BY q.id FOR UPDATE OF q",
            queue.table
        ),
        args: vec![pg_sys::INT8ARRAYOID, pg_sys::INT8ARRAYOID],
    }
}

/// Raises `2202E` unless `ids` and `tokens` have the same length; returns it.
fn same_length(ids: &BigintArray, tokens: &BigintArray) -> usize {
    let (id_facts, token_facts) = (array_facts(ids.0, "ids"), array_facts(tokens.0, "tokens"));
    if id_facts.len != token_facts.len {
        raise(
            ERRCODE_ARRAY_ELEMENT_ERROR,
            format!("{} ids given with {} tokens", id_facts.len, token_facts.len),
        );
    }
    id_facts.len
}

/// Locks, in the caller's transaction, the jobs among `ids` that their `tokens` still hold, and
/// returns their ids: from then until the transaction ends no one else can settle or take them.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
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
        let plan = plans::queue_plan(client, queue, Op::Fence, fence);
        client
            .update(&*plan, None, &[ids.into(), tokens.into()])
            .unwrap_or_else(|e| internal(e))
            .map(|row| row.get::<i64>(1).ok().flatten().unwrap_or_default())
            .collect::<Vec<i64>>()
    });
    SetOfIterator::new(held)
}

/// Acks every job of `ids` under its token, or raises `55000` (and so aborts the caller's
/// transaction) if any of them is no longer its token's; returns how many it acked.
#[pg_extern(volatile, parallel_unsafe)]
#[search_path(pg_catalog, pg_temp)]
fn inbox_ack_all(
    queue: Option<RegClass>,
    ids: Option<BigintArray>,
    tokens: Option<BigintArray>,
) -> i64 {
    let queue = required(queue, "queue").0;
    let ids = required(ids, "ids");
    let tokens = required(tokens, "tokens");
    let given = same_length(&ids, &tokens);
    let acked = Spi::connect_mut(|client| {
        let plan = plans::queue_plan(client, queue, Op::AckMany, crate::statements::ack_many);
        client
            .update(&*plan, None, &[ids.into(), tokens.into()])
            .unwrap_or_else(|e| internal(e))
            .len()
    });
    if acked != given {
        raise(
            ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "{} of {given} jobs are no longer held by their tokens",
                given - acked
            ),
        );
    }
    acked as i64
}

// Both statements join the given arrays to the queue by primary key; left to choose, the plan
// cache plans them again on every call (a third of the call's time, measured), while their
// generic plan, a nested loop over the arrays with an index scan, is the right one.
extension_sql!(
    r#"
ALTER FUNCTION inbox_ack_all(regclass, bigint[], bigint[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION inbox_fence(regclass, bigint[], bigint[]) SET plan_cache_mode = force_generic_plan;
"#,
    name = "worker_calls_generic_plans",
    requires = [inbox_ack_all, inbox_fence]
);
