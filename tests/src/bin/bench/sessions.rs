//! The per-connection loops of figures 1 to 4, with the SQL of both sides side by side. Every
//! statement is prepared once per connection; the extension's functions get their table as a
//! `regclass` constant, so the comparison is function against raw SQL, not client overhead.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio_postgres::{Client, Row, Statement};

use super::measure::window;
use super::setup::{truncate, Ctx, Refill, Result, Side, DUE_IN_INDEX_ORDER, PAYLOAD_N, Q_RAW};

/// What one connection does again and again; each step settles or writes some units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `inbox_claim` / `INSERT ... ON CONFLICT DO NOTHING`; with `dup`, half the keys were
    /// claimed before.
    Claim { side: Side, dup: bool },
    /// One job per call, or `batch` jobs per call; `notify` is `inbox.notify` (the raw INSERT
    /// never notifies).
    Enqueue {
        side: Side,
        batch: usize,
        notify: bool,
    },
    /// Lease `batch` jobs (one transaction), then ack them (another).
    LeaseAck { side: Side, batch: usize },
    /// Lock one job and ack it, in one transaction.
    LockAck { side: Side },
    /// Raw only: `DELETE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)`.
    DeleteOne,
    /// Raw only, figure 4: the worker's transactions written by hand (the handler's insert
    /// included), `group` jobs per commit.
    WorkerLoop { lock: bool, group: usize },
    /// Raw only, figure 4: lock and delete 100 jobs in one statement, decode the payloads.
    DeleteBatch,
}

impl Step {
    pub fn side(self) -> Side {
        match self {
            Step::Claim { side, .. }
            | Step::Enqueue { side, .. }
            | Step::LeaseAck { side, .. }
            | Step::LockAck { side } => side,
            Step::DeleteOne | Step::WorkerLoop { .. } | Step::DeleteBatch => Side::Raw,
        }
    }

    /// Whether the step consumes jobs (its queue is kept filled while it runs).
    fn consumes(self) -> bool {
        !matches!(self, Step::Claim { .. } | Step::Enqueue { .. })
    }

    /// Jobs one connection holds at once (the refill keeps the queue deeper than all of them).
    fn in_flight(self) -> u64 {
        match self {
            Step::LeaseAck { batch, .. } => batch as u64,
            Step::WorkerLoop { group, .. } => group as u64,
            Step::DeleteBatch => 100,
            _ => 1,
        }
    }

    /// The statements the step runs, in the order `run` uses them.
    fn sql(self) -> Vec<String> {
        let side = self.side();
        let (q, ledger, done) = (side.queue(), side.ledger(), side.done());
        // The raw SQL's choice of due jobs is the extension's, skipping locked ones.
        let due = format!("FROM {q} WHERE {DUE_IN_INDEX_ORDER}");
        let next = |n: usize| format!("SELECT id {due} LIMIT {n} FOR UPDATE SKIP LOCKED");
        let raw_lease = |n: usize| {
            let which = if n == 1 {
                format!("id = ({})", next(1))
            } else {
                format!("id = ANY (ARRAY ({}))", next(n))
            };
            format!(
                "UPDATE {q} SET attempt = attempt + 1, locked_until = now() + interval '30 seconds', \
                 leased_at = now() WHERE {which} RETURNING id, attempt::int8, payload"
            )
        };
        let raw_ack = format!(
            "DELETE FROM {q} WHERE id = $1 AND attempt = $2::int8 AND locked_until <> 'infinity'"
        );
        let insert_done = format!("INSERT INTO {done} (n) VALUES ($1)");
        match self {
            Step::Claim {
                side: Side::Inbox, ..
            } => {
                vec![format!(
                    "SELECT inbox_claim('{ledger}'::regclass, $1::text)"
                )]
            }
            Step::Claim {
                side: Side::Raw, ..
            } => vec![format!(
                "INSERT INTO {ledger} (event_key, seen_at) VALUES ($1, now()) \
                 ON CONFLICT (event_key) DO NOTHING"
            )],
            Step::Enqueue {
                side: Side::Inbox,
                batch: 1,
                ..
            } => {
                vec![format!("SELECT inbox_enqueue('{q}'::regclass, $1::jsonb)")]
            }
            Step::Enqueue {
                side: Side::Inbox, ..
            } => vec![format!(
                "SELECT inbox_enqueue_batch('{q}'::regclass, $1::jsonb[])"
            )],
            Step::Enqueue {
                side: Side::Raw,
                batch: 1,
                ..
            } => {
                vec![format!(
                    "INSERT INTO {q} (payload) VALUES ($1) RETURNING id"
                )]
            }
            Step::Enqueue {
                side: Side::Raw, ..
            } => vec![format!(
                "INSERT INTO {q} (payload) SELECT p FROM unnest($1::jsonb[]) AS p RETURNING id"
            )],
            Step::LeaseAck {
                side: Side::Inbox,
                batch,
            } => {
                let ack = if batch == 1 {
                    format!("SELECT inbox_ack('{q}'::regclass, $1::int8, $2::int8)")
                } else {
                    format!("SELECT inbox_ack_batch('{q}'::regclass, $1::int8[], $2::int8[])")
                };
                vec![
                    format!(
                        "SELECT id, token, payload FROM inbox_lease('{q}'::regclass, {batch}, \
                         interval '30 seconds')"
                    ),
                    ack,
                ]
            }
            Step::LeaseAck {
                side: Side::Raw,
                batch,
            } => {
                let ack = if batch == 1 {
                    raw_ack
                } else {
                    format!(
                        "DELETE FROM {q} AS q USING unnest($1::int8[], $2::int8[]) AS s(id, token) \
                         WHERE q.id = s.id AND q.attempt = s.token AND q.locked_until <> 'infinity'"
                    )
                };
                vec![raw_lease(batch), ack]
            }
            Step::LockAck { side: Side::Inbox } => vec![
                format!("SELECT id, token, payload FROM inbox_lock('{q}'::regclass, 1)"),
                format!("SELECT inbox_ack('{q}'::regclass, $1::int8, $2::int8)"),
            ],
            Step::LockAck { side: Side::Raw } => vec![
                format!("SELECT id, attempt::int8, payload {due} LIMIT 1 FOR UPDATE SKIP LOCKED"),
                format!("DELETE FROM {q} WHERE id = $1"),
            ],
            Step::DeleteOne => vec![format!(
                "DELETE FROM {q} WHERE id = ({}) RETURNING id, payload",
                next(1)
            )],
            Step::WorkerLoop { lock: false, group } => vec![raw_lease(group), raw_ack, insert_done],
            Step::WorkerLoop { lock: true, group } => vec![
                format!(
                    "SELECT id, attempt::int8, payload {due} LIMIT {group} FOR UPDATE SKIP LOCKED"
                ),
                format!("DELETE FROM {q} WHERE id = $1"),
                insert_done,
            ],
            Step::DeleteBatch => vec![format!(
                "DELETE FROM {Q_RAW} WHERE id = ANY (ARRAY ({})) RETURNING id, payload",
                next(100)
            )],
        }
    }
}

/// A job as either side's take returns it: id, token (the attempt), the payload's `n`.
struct Taken {
    id: i64,
    token: i64,
    n: i64,
}

fn taken(row: &Row) -> Result<Taken> {
    let payload: Value = row.try_get(2)?;
    Ok(Taken {
        id: row.try_get(0)?,
        token: row.try_get(1)?,
        n: payload["n"].as_i64().unwrap_or_default(),
    })
}

/// One connection running one step.
pub struct Session {
    client: Client,
    step: Step,
    statements: Vec<Statement>,
    /// Keys this connection claimed, for the duplicates of figure 1.
    keys: Vec<String>,
    rng: fastrand::Rng,
    /// Payload counter.
    n: i64,
}

impl Session {
    pub async fn open(ctx: &Ctx, step: Step) -> Result<Self> {
        let client = ctx.connect().await?;
        if let Step::Enqueue { notify: false, .. } = step {
            client.batch_execute("SET inbox.notify = off").await?;
        }
        let mut statements = Vec::new();
        for sql in step.sql() {
            statements.push(client.prepare(&sql).await?);
        }
        Ok(Self {
            client,
            step,
            statements,
            keys: Vec::new(),
            rng: fastrand::Rng::new(),
            n: 0,
        })
    }

    /// Runs the step once; returns the units it did (claims, jobs).
    pub async fn run(&mut self) -> Result<u64> {
        let Self {
            client,
            step,
            statements: s,
            keys,
            rng,
            n,
        } = self;
        let mut payload = || {
            *n += 1;
            json!({ "n": *n })
        };
        match *step {
            Step::Claim { side, dup } => {
                let key = if dup && !keys.is_empty() && rng.bool() {
                    keys[rng.usize(..keys.len())].clone()
                } else {
                    let key = format!("{:016x}{:016x}", rng.u64(..), rng.u64(..));
                    if dup {
                        keys.push(key.clone());
                    }
                    key
                };
                match side {
                    Side::Inbox => {
                        let _: bool = client.query_one(&s[0], &[&key]).await?.try_get(0)?;
                    }
                    Side::Raw => {
                        client.execute(&s[0], &[&key]).await?;
                    }
                }
                Ok(1)
            }
            Step::Enqueue { batch: 1, .. } => {
                let payload = payload();
                client.query_one(&s[0], &[&payload]).await?;
                Ok(1)
            }
            Step::Enqueue { batch, .. } => {
                let payloads: Vec<Value> = (0..batch).map(|_| payload()).collect();
                let rows = client.query(&s[0], &[&payloads]).await?;
                Ok(rows.len() as u64)
            }
            Step::LeaseAck { batch: 1, .. } => {
                let Some(row) = client.query_opt(&s[0], &[]).await? else {
                    return Ok(0);
                };
                let job = taken(&row)?;
                client.query(&s[1], &[&job.id, &job.token]).await?;
                Ok(1)
            }
            Step::LeaseAck { .. } => {
                let jobs = client.query(&s[0], &[]).await?;
                let jobs = jobs.iter().map(taken).collect::<Result<Vec<_>>>()?;
                let ids: Vec<i64> = jobs.iter().map(|job| job.id).collect();
                let tokens: Vec<i64> = jobs.iter().map(|job| job.token).collect();
                if !ids.is_empty() {
                    client.query(&s[1], &[&ids, &tokens]).await?;
                }
                Ok(ids.len() as u64)
            }
            Step::LockAck { side } => {
                let tx = client.transaction().await?;
                let Some(row) = tx.query_opt(&s[0], &[]).await? else {
                    return Ok(0);
                };
                let job = taken(&row)?;
                match side {
                    Side::Inbox => tx.query(&s[1], &[&job.id, &job.token]).await?,
                    Side::Raw => tx.query(&s[1], &[&job.id]).await?,
                };
                tx.commit().await?;
                Ok(1)
            }
            Step::DeleteOne => Ok(client.query_opt(&s[0], &[]).await?.map_or(0, |_| 1)),
            Step::WorkerLoop { lock, .. } => {
                // As a worker would: take (committed lease, or a lock in the transaction), then
                // per job the handler's insert and the fenced delete, then one commit (no
                // savepoints: the worker replays a group without a failed job instead).
                let leased = if lock {
                    Vec::new()
                } else {
                    client.query(&s[0], &[]).await?
                };
                let tx = client.transaction().await?;
                let rows = if lock {
                    tx.query(&s[0], &[]).await?
                } else {
                    leased
                };
                let jobs = rows.iter().map(taken).collect::<Result<Vec<_>>>()?;
                for job in &jobs {
                    tx.execute(&s[2], &[&job.n]).await?;
                    if lock {
                        tx.execute(&s[1], &[&job.id]).await?;
                    } else {
                        tx.execute(&s[1], &[&job.id, &job.token]).await?;
                    }
                }
                tx.commit().await?;
                Ok(jobs.len() as u64)
            }
            Step::DeleteBatch => {
                let rows = client.query(&s[0], &[]).await?;
                for row in &rows {
                    let payload: Value = row.try_get(1)?;
                    std::hint::black_box(payload["n"].as_i64());
                }
                Ok(rows.len() as u64)
            }
        }
    }
}

/// Runs `step` on `connections` connections of their own and returns its rate (units per second)
/// over the measurement window. The tables of the step's side are emptied first; a step that
/// consumes jobs has its queue kept filled.
pub async fn run_clients(ctx: &Ctx, connections: usize, step: Step) -> Result<f64> {
    let run = run_clients_with(ctx, connections, step, PAYLOAD_N).await?;
    if run.dry > 0 {
        eprintln!(
            "  note: {step:?} x{connections} found its queue empty {} times",
            run.dry
        );
    }
    Ok(run.rate)
}

/// What [`run_clients_with`] measured.
#[derive(Clone, Copy, Debug)]
pub struct ClientsRun {
    /// Units per second over the window.
    pub rate: f64,
    /// Steps that did nothing (a take that found no job it could have), over the whole run
    /// (warm-up included).
    pub dry: u64,
}

/// [`run_clients`] with the refill's payloads `payload` (an SQL expression of `g`, see
/// [`fill_with`](super::setup::fill_with)); tells how many steps did nothing rather than print it.
pub async fn run_clients_with(
    ctx: &Ctx,
    connections: usize,
    step: Step,
    payload: &'static str,
) -> Result<ClientsRun> {
    let side = step.side();
    let admin = ctx.connect().await?;
    truncate(&admin, &[side.queue(), side.ledger(), side.done()]).await?;
    let done = Arc::new(AtomicU64::new(0));
    let refill = if step.consumes() {
        let depth = ctx.opts.depth(connections, step.in_flight() as usize);
        Some(Refill::start_with(ctx, side.queue(), depth, done.clone(), payload).await?)
    } else {
        None
    };
    let dry = Arc::new(AtomicU64::new(0));
    // The refill stops also when a session fails (a caller may go on after the error).
    let measured = async {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..connections {
            let mut session = Session::open(ctx, step).await?;
            let (stop, done, dry) = (stop.clone(), done.clone(), dry.clone());
            tasks.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let units = session.run().await?;
                    done.fetch_add(units, Ordering::Relaxed);
                    if units == 0 {
                        dry.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                Result::Ok(())
            });
        }
        let rate = window(ctx, || done.load(Ordering::Relaxed)).await?;
        stop.store(true, Ordering::Relaxed);
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        Result::Ok(rate)
    }
    .await;
    let stopped = match refill {
        Some(refill) => refill.stop().await,
        None => Ok(()),
    };
    let rate = measured?;
    stopped?;
    Ok(ClientsRun {
        rate,
        dry: dry.load(Ordering::Relaxed),
    })
}
