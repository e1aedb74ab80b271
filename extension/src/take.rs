//! The take: up to `max` due jobs locked with `FOR UPDATE SKIP LOCKED` in the queue's order (and
//! leased, for a lease), after the due ticks of the queue's schedules are enqueued. `queue`'s
//! leases and locks call it for a queue without limits, `controls` for the jobs it has slots for.

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::datum::{spi_result_datum, BigintArray, Bytea, Jsonb};
use crate::plans::{self, Op};
use crate::shape::{Payload, QueueShape};
use crate::statements;

/// One job handed to a worker: `payload` for a `jsonb` queue, `payload_bytes` for a `bytea` one.
/// (`#[pg_extern]` reads the column names from the signature, so `queue`'s takes spell them out.)
pub(crate) type Delivery = (
    i64,
    i32,
    i64,
    Option<Jsonb>,
    Option<Bytea>,
    Option<Interval>,
);

/// Locks up to `max` due jobs of `queue` (or of the jobs it `chose`) as if it had no limits, and
/// reads them; with `lease`, also leases them.
pub(crate) fn take_jobs(
    client: &mut SpiClient<'_>,
    queue: pg_sys::Oid,
    max: i32,
    lease: Option<Interval>,
    chose: Option<BigintArray>,
) -> Vec<Delivery> {
    crate::schedule::enqueue_due_ticks(client, queue);
    let shape = plans::queue(client, queue);
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    // SAFETY: a timestamptz is an int64 passed by value.
    let timestamptz = |t: i64| unsafe { DatumWithOid::new(t, pg_sys::TIMESTAMPTZOID) };
    // A lease of one job takes and leases it in one statement; others lease what they took.
    let leases_in_take = lease.filter(|_| max == 1 && chose.is_none());
    let taken = match chose {
        Some(chose) => {
            let plan = plans::generic_plan(client, queue, Op::LockChosen, statements::take_chosen);
            plan.run(&[chose.into(), timestamptz(now)])
                .min(max as usize)
        }
        None => take_in_order(client, queue, &shape, max, now, leases_in_take),
    };
    let deliveries: Vec<Delivery> = (0..taken)
        .map(|row| {
            // SAFETY: the statement returned `taken` rows of (int8 id, int4 attempt, payload,
            // ..., int4 snoozes, interval timeout), and SPI is still connected.
            let (id, attempt, payload, snoozes, timeout) = unsafe {
                (
                    spi_result_datum(row, 1).map_or(0, |d| d.value() as i64),
                    spi_result_datum(row, 2).map_or(0, |d| d.value() as i32),
                    spi_result_datum(row, 3),
                    spi_result_datum(row, statements::SNOOZES_COLUMN)
                        .map_or(0, |d| d.value() as i32),
                    spi_result_datum(row, statements::SNOOZES_COLUMN + 1)
                        .and_then(|d| Interval::from_datum(d, false)),
                )
            };
            let (json, bytes) = match shape.payload {
                Payload::Jsonb => (payload.map(Jsonb), None),
                Payload::Bytea => (None, payload.map(Bytea)),
            };
            // A lock's token is negative: its attempt is counted when it is settled. The
            // token is the count of deliveries; the attempt reported leaves out the snoozed.
            let token = if lease.is_some() {
                attempt as i64
            } else {
                -(attempt as i64)
            };
            (id, attempt - snoozes, token, json, bytes, timeout)
        })
        .collect();
    if let (Some(lease), None, false) = (lease, leases_in_take, deliveries.is_empty()) {
        // The jobs are locked by this transaction: the update finds every one of them.
        let plan = plans::generic_plan(client, queue, Op::Lease, statements::lease);
        let ids: Vec<i64> = deliveries.iter().map(|delivery| delivery.0).collect();
        plan.run(&[ids.into(), timestamptz(now), lease.into()]);
    }
    deliveries
}

/// Locks up to `max` due jobs in the queue's order (with `lease_one`, leases the one it takes),
/// starting past the dead entries at the head of its index (`head`); the rows are SPI's result.
fn take_in_order(
    client: &SpiClient<'_>,
    queue: pg_sys::Oid,
    shape: &QueueShape,
    max: i32,
    now: i64,
    lease_one: Option<Interval>,
) -> usize {
    let plan = match lease_one {
        Some(_) => plans::generic_plan(client, queue, Op::LeaseOne, statements::lease_one),
        None => plans::generic_plan(client, queue, Op::Lock, statements::take),
    };
    let run = |(rank, due, id): crate::head::Floor| {
        // SAFETY: timestamptz values are int64s passed by value.
        let timestamptz = |t: i64| unsafe { DatumWithOid::new(t, pg_sys::TIMESTAMPTZOID) };
        let mut args = vec![max.into(), timestamptz(now)];
        if !shape.nullable_locked_until {
            args.extend([rank.into(), timestamptz(due), id.into()]);
        }
        if let Some(lease) = lease_one {
            args.push(lease.into());
        }
        plan.run(&args)
    };
    let mut floor = crate::head::floor(queue, now);
    let mut taken = run(floor);
    if taken == 0 && floor != crate::head::WHOLE_QUEUE {
        floor = crate::head::WHOLE_QUEUE;
        taken = run(floor);
    }
    // SAFETY: reads the clock.
    let took = unsafe { pg_sys::GetCurrentTimestamp() } - now;
    // SAFETY: the statement returned `taken` rows of (int8 id, .., timestamptz due, int8 rank).
    let first = (taken > 0)
        .then(|| unsafe {
            (
                spi_result_datum(0, 5),
                spi_result_datum(0, 4),
                spi_result_datum(0, 1),
            )
        })
        .and_then(|(rank, due, id)| {
            Some((
                rank?.value() as i64,
                due?.value() as i64,
                id?.value() as i64,
            ))
        });
    crate::head::found(queue, floor, first, now, took);
    taken
}
