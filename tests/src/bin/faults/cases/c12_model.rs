//! Case 12, the model: a proptest of random sequences of SQL API calls (enqueue, batch enqueue,
//! lease, ack, retry, dead-letter, extend, stats, claim, seen; with current, stale, future and
//! lock-style tokens) against an in-memory model of a queue and a ledger, each step's result and
//! the final table compared with the model's (shrunk to a minimal failing sequence on a
//! mismatch). Then a long faulty run (workers of both claims, handler errors and panics, leases
//! that expire under slow handlers, backends terminated at random) whose recorded history, the
//! deliveries started and the effects committed, the checker classifies job by job as ok, lost,
//! doubled or unexpected. The checker is first shown a tampered history, which it must catch.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, RetryPolicy, TxHandler, Worker};
use inbox_client::{Database, Statement};
use inbox_tests::TestDb;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio_postgres::Client;

use crate::common::{self, classify, enqueue_range, setup, worker_db, Ctx, Queued, Result, Row};

pub const NAME: &str = "model and history checker";

#[derive(Clone, Copy, Debug)]
enum Token {
    Current,
    Stale,
    Future,
    /// Minus the next attempt, as a lock hands out.
    LockStyle,
}

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        key: Option<u8>,
        delayed: bool,
    },
    EnqueueBatch {
        keys: Vec<Option<u8>>,
    },
    Lease {
        max: i32,
    },
    Ack {
        job: usize,
        token: Token,
    },
    Retry {
        job: usize,
        token: Token,
        max_attempts: Option<i32>,
    },
    Dead {
        job: usize,
        token: Token,
    },
    Extend {
        job: usize,
        token: Token,
    },
    Stats,
    Claim {
        key: u8,
    },
    Seen {
        key: u8,
    },
}

fn token() -> impl Strategy<Value = Token> {
    prop_oneof![
        6 => Just(Token::Current),
        1 => Just(Token::Stale),
        1 => Just(Token::Future),
        1 => Just(Token::LockStyle),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = proptest::option::weighted(0.4, 0u8..6);
    prop_oneof![
        4 => (key.clone(), proptest::bool::weighted(0.2))
            .prop_map(|(key, delayed)| Op::Enqueue { key, delayed }),
        1 => proptest::collection::vec(key, 0..5).prop_map(|keys| Op::EnqueueBatch { keys }),
        4 => (1i32..4).prop_map(|max| Op::Lease { max }),
        3 => (any::<usize>(), token()).prop_map(|(job, token)| Op::Ack { job, token }),
        2 => (any::<usize>(), token(), proptest::option::of(1i32..4))
            .prop_map(|(job, token, max_attempts)| Op::Retry { job, token, max_attempts }),
        1 => (any::<usize>(), token()).prop_map(|(job, token)| Op::Dead { job, token }),
        1 => (any::<usize>(), token()).prop_map(|(job, token)| Op::Extend { job, token }),
        1 => Just(Op::Stats),
        1 => (0u8..6).prop_map(|key| Op::Claim { key }),
        1 => (0u8..6).prop_map(|key| Op::Seen { key }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Due; the number orders due jobs (when they became due), then the id.
    Ready(u64),
    Delayed,
    Leased,
    Dead,
}

#[derive(Clone, Debug)]
struct ModelJob {
    attempt: i32,
    state: State,
    key: Option<String>,
}

#[derive(Default)]
struct Model {
    jobs: BTreeMap<i64, ModelJob>,
    /// Every id ever returned, so that settlements also aim at finished jobs; with each one's
    /// last attempt, for its tokens.
    known: Vec<i64>,
    last_attempt: HashMap<i64, i32>,
    ledger: HashSet<String>,
    clock: u64,
}

impl Model {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn pick(&self, job: usize) -> i64 {
        if self.known.is_empty() {
            return 0;
        }
        self.known[job % self.known.len()]
    }

    fn token(&self, id: i64, token: Token) -> i64 {
        let attempt = i64::from(self.last_attempt.get(&id).copied().unwrap_or(1));
        match token {
            Token::Current => attempt,
            Token::Stale => attempt - 1,
            Token::Future => attempt + 1,
            Token::LockStyle => -(attempt + 1),
        }
    }

    /// Whether `token` settles job `id` now (the extension's fence), and how much the
    /// settlement adds to its attempt.
    fn fence(&self, id: i64, token: i64) -> Option<i32> {
        let job = self.jobs.get(&id)?;
        let wanted = if token < 0 { -token - 1 } else { token };
        (job.state != State::Dead && i64::from(job.attempt) == wanted)
            .then_some(i32::from(token < 0))
    }

    fn key_queued(&self, key: &str) -> bool {
        self.jobs
            .values()
            .any(|job| job.key.as_deref() == Some(key))
    }

    fn add(&mut self, id: i64, key: Option<String>, state: State) {
        self.jobs.insert(
            id,
            ModelJob {
                attempt: 0,
                state,
                key,
            },
        );
        self.known.push(id);
        self.last_attempt.insert(id, 0);
    }
}

fn fail(what: String) -> TestCaseError {
    TestCaseError::fail(what)
}

fn db_error(error: tokio_postgres::Error) -> TestCaseError {
    fail(format!("unexpected error: {}", common::describe(&error)))
}

/// Runs `ops` on a fresh queue and ledger, step by step against the model.
async fn check_sequence(client: &Client, case: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let (queue, ledger) = (format!("m_{case}"), format!("l_{case}"));
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('{queue}'); SELECT inbox_create_ledger('{ledger}')"
        ))
        .await
        .map_err(db_error)?;
    let result = steps(client, &queue, &ledger, ops).await;
    let _ = client
        .batch_execute(&format!("DROP TABLE {queue}, {ledger}"))
        .await;
    result
}

async fn steps(
    client: &Client,
    queue: &str,
    ledger: &str,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let at = |what: String| fail(format!("step {step} {op:?}: {what}"));
        match op {
            Op::Enqueue { key, delayed } => {
                let key = key.map(|k| format!("k{k}"));
                let id: Option<i64> = client
                    .query_one(
                        "SELECT inbox_enqueue($1::text::regclass, '{}'::jsonb, \
                         CASE WHEN $2 THEN now() + interval '1 hour' ELSE now() END, $3::text)",
                        &[&queue, delayed, &key],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let conflict = key.as_deref().is_some_and(|k| model.key_queued(k));
                match (id, conflict) {
                    (None, true) => {}
                    (Some(id), false) => {
                        let state = if *delayed {
                            State::Delayed
                        } else {
                            State::Ready(model.tick())
                        };
                        model.add(id, key, state);
                    }
                    (id, _) => return Err(at(format!("returned {id:?}, key conflict {conflict}"))),
                }
            }
            Op::EnqueueBatch { keys } => {
                let payloads: Vec<serde_json::Value> =
                    keys.iter().map(|_| serde_json::json!({})).collect();
                let texts: Vec<Option<String>> =
                    keys.iter().map(|k| k.map(|k| format!("k{k}"))).collect();
                let ids: Vec<i64> = client
                    .query(
                        "SELECT id FROM inbox_enqueue_batch($1::text::regclass, $2::jsonb[], \
                         now(), $3::text[]) AS id",
                        &[&queue, &payloads, &texts],
                    )
                    .await
                    .map_err(db_error)?
                    .iter()
                    .map(|row| row.get(0))
                    .collect();
                let mut inserted = Vec::new();
                let mut batch_keys = HashSet::new();
                for key in &texts {
                    let skip = key
                        .as_deref()
                        .is_some_and(|k| model.key_queued(k) || !batch_keys.insert(k.to_owned()));
                    if !skip {
                        inserted.push(key.clone());
                    }
                }
                if ids.len() != inserted.len() {
                    return Err(at(format!(
                        "inserted {ids:?}, the model {}",
                        inserted.len()
                    )));
                }
                let seq = model.tick();
                for (id, key) in ids.into_iter().zip(inserted) {
                    model.add(id, key, State::Ready(seq));
                }
            }
            Op::Lease { max } => {
                let got: Vec<(i64, i32, i64)> = client
                    .query(
                        "SELECT id, attempt, token FROM inbox_lease($1::text::regclass, $2::int4, '1 hour')",
                        &[&queue, max],
                    )
                    .await
                    .map_err(db_error)?
                    .iter()
                    .map(|row| (row.get(0), row.get(1), row.get(2)))
                    .collect();
                let mut ready: Vec<(u64, i64)> = model
                    .jobs
                    .iter()
                    .filter_map(|(&id, job)| match job.state {
                        State::Ready(seq) => Some((seq, id)),
                        _ => None,
                    })
                    .collect();
                ready.sort_unstable();
                let mut want = Vec::new();
                for &(_, id) in ready.iter().take(*max as usize) {
                    let job = model.jobs.get_mut(&id).expect("a ready job");
                    job.attempt += 1;
                    job.state = State::Leased;
                    model.last_attempt.insert(id, job.attempt);
                    want.push((id, job.attempt, i64::from(job.attempt)));
                }
                if got != want {
                    return Err(at(format!("leased {got:?}, the model {want:?}")));
                }
            }
            Op::Ack { job, token } => {
                let id = model.pick(*job);
                let token = model.token(id, *token);
                let acked: bool = client
                    .query_one(
                        "SELECT inbox_ack($1::text::regclass, $2::int8, $3::int8)",
                        &[&queue, &id, &token],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let want = model.fence(id, token).is_some();
                if want {
                    model.jobs.remove(&id);
                }
                if acked != want {
                    return Err(at(format!(
                        "ack({id}, {token}) = {acked}, the model {want}"
                    )));
                }
            }
            Op::Retry {
                job,
                token,
                max_attempts,
            } => {
                let id = model.pick(*job);
                let token = model.token(id, *token);
                let retried: bool = client
                    .query_one(
                        "SELECT inbox_retry($1::text::regclass, $2::int8, $3::int8, '0 seconds', 'retried', $4::int4)",
                        &[&queue, &id, &token, max_attempts],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let fence = model.fence(id, token);
                if let Some(count) = fence {
                    let seq = model.tick();
                    let job = model.jobs.get_mut(&id).expect("a fenced job");
                    job.attempt += count;
                    job.state = if max_attempts.is_some_and(|max| job.attempt >= max) {
                        State::Dead
                    } else {
                        State::Ready(seq)
                    };
                    model.last_attempt.insert(id, job.attempt);
                }
                if retried != fence.is_some() {
                    return Err(at(format!(
                        "retry({id}, {token}) = {retried}, the model {fence:?}"
                    )));
                }
            }
            Op::Dead { job, token } => {
                let id = model.pick(*job);
                let token = model.token(id, *token);
                let dead: bool = client
                    .query_one(
                        "SELECT inbox_dead($1::text::regclass, $2::int8, $3::int8, 'dead')",
                        &[&queue, &id, &token],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let fence = model.fence(id, token);
                if let Some(count) = fence {
                    let job = model.jobs.get_mut(&id).expect("a fenced job");
                    job.attempt += count;
                    job.state = State::Dead;
                    model.last_attempt.insert(id, job.attempt);
                }
                if dead != fence.is_some() {
                    return Err(at(format!(
                        "dead({id}, {token}) = {dead}, the model {fence:?}"
                    )));
                }
            }
            Op::Extend { job, token } => {
                let id = model.pick(*job);
                let token = model.token(id, *token);
                let extended: bool = client
                    .query_one(
                        "SELECT inbox_extend($1::text::regclass, $2::int8, $3::int8, '1 hour')",
                        &[&queue, &id, &token],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let want = token > 0
                    && model.fence(id, token).is_some()
                    && model
                        .jobs
                        .get(&id)
                        .is_some_and(|job| job.state == State::Leased);
                if extended != want {
                    return Err(at(format!(
                        "extend({id}, {token}) = {extended}, the model {want}"
                    )));
                }
            }
            Op::Stats => {
                let row = client
                    .query_one(
                        "SELECT ready, delayed, leased, dead FROM inbox_stats($1::text::regclass)",
                        &[&queue],
                    )
                    .await
                    .map_err(db_error)?;
                let got: [i64; 4] = [row.get(0), row.get(1), row.get(2), row.get(3)];
                let mut want = [0i64; 4];
                for job in model.jobs.values() {
                    want[match job.state {
                        State::Ready(_) => 0,
                        State::Delayed => 1,
                        State::Leased => 2,
                        State::Dead => 3,
                    }] += 1;
                }
                if got != want {
                    return Err(at(format!("stats {got:?}, the model {want:?}")));
                }
            }
            Op::Claim { key } => {
                let key = format!("e{key}");
                let claimed: bool = client
                    .query_one(
                        "SELECT inbox_claim($1::text::regclass, $2)",
                        &[&ledger, &key],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let want = model.ledger.insert(key.clone());
                if claimed != want {
                    return Err(at(format!("claim({key}) = {claimed}, the model {want}")));
                }
            }
            Op::Seen { key } => {
                let key = format!("e{key}");
                let seen: bool = client
                    .query_one(
                        "SELECT inbox_seen($1::text::regclass, $2)",
                        &[&ledger, &key],
                    )
                    .await
                    .map_err(db_error)?
                    .get(0);
                let want = model.ledger.contains(&key);
                if seen != want {
                    return Err(at(format!("seen({key}) = {seen}, the model {want}")));
                }
            }
        }
    }
    // The whole table, as the model has it.
    let rows = client
        .query(
            &format!("SELECT id, attempt, locked_until = 'infinity' FROM {queue} ORDER BY id"),
            &[],
        )
        .await
        .map_err(db_error)?;
    let got: Vec<(i64, i32, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let want: Vec<(i64, i32, bool)> = model
        .jobs
        .iter()
        .map(|(&id, job)| (id, job.attempt, job.state == State::Dead))
        .collect();
    if got != want {
        return Err(fail(format!("final table {got:?}, the model {want:?}")));
    }
    Ok(())
}

/// The proptest: `cases` sequences of up to 40 calls; returns the calls made and the failure.
async fn model_test(db: &TestDb, cases: u32) -> Result<(u64, Option<String>)> {
    let client = Arc::new(db.client().await);
    let runtime = tokio::runtime::Handle::current();
    let calls = Arc::new(AtomicU64::new(0));
    let counter = Arc::new(AtomicU64::new(0));
    let (client2, calls2) = (client.clone(), calls.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        let mut runner = TestRunner::new(Config {
            cases,
            max_shrink_iters: 500,
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
            let case = counter.fetch_add(1, Ordering::Relaxed);
            calls2.fetch_add(ops.len() as u64, Ordering::Relaxed);
            runtime.block_on(check_sequence(&client2, case, &ops))
        });
        result.err().map(|e| e.to_string())
    })
    .await?;
    Ok((calls.load(Ordering::Relaxed), outcome))
}

/// The checker must catch a tampered history: a lost effect, a doubled one, an effect of a
/// delivery that never started, and a job left stuck.
fn checker_catches_tampering() -> bool {
    let expected = 1..=4i64;
    let started: HashSet<(i64, i32)> = [(1, 1), (2, 1), (3, 1), (4, 1)].into();
    let mut effects: BTreeMap<i64, Vec<i32>> = BTreeMap::new();
    effects.insert(2, vec![1, 1]);
    effects.insert(3, vec![2]);
    let queued: HashMap<i64, Queued> = [(
        4,
        Queued {
            dead: false,
            attempt: 1,
        },
    )]
    .into();
    let tally = classify(expected, &effects, &queued, Some(&started));
    tally.lost == vec![1, 4]
        && tally.stuck == 1
        && tally.doubled == vec![2]
        && tally.unexpected.len() == 1
}

fn faulty_handler(
    started: Arc<Mutex<HashSet<(i64, i32)>>>,
    injected: Arc<AtomicU64>,
) -> impl TxHandler<i64> {
    transactional(move |job: Job<i64>, tx: &dyn Database| {
        let (started, injected) = (started.clone(), injected.clone());
        Box::pin(async move {
            started.lock().unwrap().insert((job.payload, job.attempt));
            tx.execute(
                &Statement::new("INSERT INTO effects (n, attempt) VALUES ($1, $2)")
                    .bind(job.payload)
                    .bind(job.attempt),
            )
            .await?;
            let roll = fastrand::u32(0..100);
            if job.attempt < 5 {
                match roll {
                    0..5 => {
                        injected.fetch_add(1, Ordering::Relaxed);
                        return Err("injected error".into());
                    }
                    5..10 => {
                        injected.fetch_add(1, Ordering::Relaxed);
                        panic!("injected panic");
                    }
                    10..11 => {
                        // Outlives the 1 s lease (no heartbeat): another worker takes the job.
                        injected.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                    }
                    _ => {}
                }
            }
            Ok(Outcome::ack())
        })
    })
}

/// The long faulty run, classified by the checker from its recorded history.
async fn faulty_run(ctx: &Ctx, row: &mut Row) -> Result<()> {
    let jobs: i64 = ctx.profile.pick(5_000, 20_000);
    let db = TestDb::at(&ctx.url).await;
    let admin = db.client().await;
    setup(&admin, "jobs").await?;
    row.jobs = enqueue_range(&admin, "jobs", 1, jobs).await?;
    let started: Arc<Mutex<HashSet<(i64, i32)>>> = Arc::default();
    let injected = Arc::new(AtomicU64::new(0));
    let start = |claim: Claim, group: usize| {
        Worker::transactional(
            worker_db(&db, 6),
            "jobs",
            faulty_handler(started.clone(), injected.clone()),
        )
        .workers(3)
        .claim(claim)
        .group_size(group)
        .lease(Duration::from_secs(1))
        .heartbeat(false)
        .poll_interval(Duration::from_millis(50))
        .retry(RetryPolicy {
            base: Duration::from_millis(5),
            cap: Duration::from_millis(50),
            max_attempts: Some(20),
            jitter: 0.0,
        })
        .start()
    };
    let workers = [start(Claim::Lease, 1), start(Claim::Lock, 5)];
    let stop = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(AtomicU64::new(0));
    let spared: i32 = admin
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let killer = {
        let (client, stop, killed) = (db.client().await, stop.clone(), killed.clone());
        let app = db.schema().to_owned();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(100..300))).await;
                if let Ok(done) = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity \
                         WHERE application_name = $1 AND pid <> pg_backend_pid() \
                         AND pid <> $2 AND state <> 'idle' ORDER BY random() LIMIT 1) victim",
                        &[&app, &spared],
                    )
                    .await
                {
                    killed.fetch_add(done.get::<_, i64>(0) as u64, Ordering::Relaxed);
                }
            }
        })
    };
    let finished = common::wait_drained(&admin, "jobs", Duration::from_secs(400)).await?;
    stop.store(true, Ordering::Relaxed);
    killer.await?;
    for worker in workers {
        worker.shutdown(Duration::from_secs(10)).await;
    }
    row.check(finished, || "the faulty run did not drain".into());
    let history = started.lock().unwrap().clone();
    let tally = common::tally(&admin, "jobs", 1..=jobs, Some(&history)).await?;
    row.add("faulty run", &tally);
    row.faults = injected.load(Ordering::Relaxed) + killed.load(Ordering::Relaxed);
    row.note(format!(
        "faulty run: {} deliveries, {} handler faults, {} backends terminated; checker: {} ok \
         (acked), {} ok (dead), {} lost, {} doubled, {} unexpected",
        history.len(),
        injected.load(Ordering::Relaxed),
        killed.load(Ordering::Relaxed),
        tally.acked,
        tally.dead,
        tally.lost.len(),
        tally.doubled.len(),
        tally.unexpected.len()
    ));
    drop(admin);
    drop(db);
    Ok(())
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(12, NAME);
    row.check(checker_catches_tampering(), || {
        "the checker did not catch a tampered history".into()
    });
    let db = TestDb::at(&ctx.url).await;
    let cases = ctx.profile.pick(64, 512);
    let (calls, failure) = model_test(&db, cases).await?;
    row.inputs = calls;
    row.check(failure.is_none(), || {
        format!(
            "the model disagrees: {}",
            failure.clone().unwrap_or_default()
        )
    });
    row.note(format!(
        "model: {cases} sequences, {calls} SQL calls (shrinking included)"
    ));
    drop(db);
    faulty_run(ctx, &mut row).await?;
    Ok(row)
}
