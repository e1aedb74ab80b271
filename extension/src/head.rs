//! Where a take's scan starts: past the dead index entries at the head of the queue.
//!
//! Every lease leaves the job's old row version behind at the head of the `(locked_until, id)`
//! index, and every ack leaves one where the lease ended. Vacuum removes them, and scans mark
//! them dead so that later scans skip them cheaply, but neither can while a snapshot older than
//! them is held (a long transaction, a `REPEATABLE READ` report, a replica's feedback): then
//! every take walks over all of them, and reads their rows, before it reaches a job it can take.
//! In a queue turning over a thousand jobs a second that is tens of thousands of entries per take
//! after a minute. So each session remembers where its last take found the head of the queue and
//! starts its next scan there (`locked_until >= floor`), which the index reaches directly.
//!
//! What this can pass over: a job below the floor that becomes takeable later, i.e. a lease or
//! lock rolled back by its own transaction, a lease that expires with an end older than the
//! floor (taken before the floor's job was due), or an enqueue committed late with a due time
//! older than the floor (an explicit past `run_at`, or `now()` of a transaction that started long
//! before it committed). Retries and enqueues due now are at or above it. So a
//! take that finds nothing above the floor looks at the whole queue before it answers, and a
//! session scans the whole queue again once a second, or, when such a scan is slow (the dead
//! entries a held snapshot keeps), after a hundred times as long as the last one took, up to a
//! minute: such a job waits that long at most, and only while other jobs are taken ahead of it.

use std::cell::RefCell;
use std::collections::HashMap;

use pgrx::pg_sys::Oid;

/// Where a scan starts: a rank (minus the priority, or 0 on a table without priorities), a due
/// time (µs since 2000, as a `timestamptz`) and an id, in the order of the lease index
/// (`(-priority, locked_until, id)`, or `(locked_until, id)`; the jobs of one batch share their
/// due time).
pub(crate) type Floor = (i64, i64, i64);

/// `(the least rank, -infinity, the least id)`: the floor of a scan of the whole queue.
pub(crate) const WHOLE_QUEUE: Floor = (i64::MIN, i64::MIN, i64::MIN);

/// How often a session scans the whole queue (µs): every second, or a hundred times as long as
/// the last such scan took, up to a minute (so such scans take at most 1% of its time).
const WHOLE_SCAN_EVERY: i64 = 1_000_000;
const WHOLE_SCAN_SHARE: i64 = 100;
const WHOLE_SCAN_AT_MOST_EVERY: i64 = 60_000_000;

#[derive(Clone, Copy)]
struct Head {
    /// The first job the session's last take found.
    floor: Floor,
    /// When the session next scans the whole queue.
    whole_next: i64,
}

thread_local! {
    static HEADS: RefCell<HashMap<Oid, Head>> = RefCell::new(HashMap::new());
}

/// The floor of the next scan of `queue` at `now` (µs since 2000).
pub(crate) fn floor(queue: Oid, now: i64) -> Floor {
    HEADS.with(|heads| match heads.borrow().get(&queue) {
        Some(head) if now < head.whole_next => head.floor,
        _ => WHOLE_QUEUE,
    })
}

/// Records what a scan from `floor` at `now`, which took `took` µs, found: its first job, or
/// nothing (then the next scan looks at the whole queue).
pub(crate) fn found(queue: Oid, floor: Floor, first: Option<Floor>, now: i64, took: i64) {
    HEADS.with(|heads| {
        let mut heads = heads.borrow_mut();
        match first {
            Some(first) => {
                let whole_next = match (floor, heads.get(&queue)) {
                    (WHOLE_QUEUE, _) | (_, None) => {
                        let wait = (took.saturating_mul(WHOLE_SCAN_SHARE))
                            .clamp(WHOLE_SCAN_EVERY, WHOLE_SCAN_AT_MOST_EVERY);
                        now.saturating_add(wait)
                    }
                    (_, Some(head)) => head.whole_next,
                };
                heads.insert(
                    queue,
                    Head {
                        floor: first,
                        whole_next,
                    },
                );
            }
            None => {
                heads.remove(&queue);
            }
        }
    });
}
