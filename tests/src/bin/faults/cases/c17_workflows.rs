//! Case 17, workflows through SIGKILLs and a server crash: on a throwaway cluster of the case's
//! own, a random DAG of 1,000 jobs (3,000 with `--full`; seeded) over three queues, each job
//! enqueued after 0 to 3 of the 50 jobs before it (`inbox_enqueue_after`; parents of any of the
//! queues), about a quarter of them members of batches of 5 (`inbox_batch_add`) whose
//! `on_complete` callback goes to a fourth queue. 4 child processes (this program's `child --mode
//! dag`; two leasing, lease 2 s, two locking) each run one slot on every queue, 16 in all; their
//! handlers work 0 to 100 ms and fail 15 % of the deliveries (retried, never dead-lettered).
//!
//! The producer enqueues a job every 8 ms while the children work, so that parents are acked
//! before, while and after their dependants are enqueued; each batch is sealed once its members
//! are added, but the first, held open. Meanwhile, 300 to 1,000 ms apart (1 to 4 s with `--full`),
//! a child running a delivery is killed with SIGKILL and started again, 5 times (15), and the
//! server is stopped with `pg_ctl -m immediate` and started again, once (3) among the kills. A
//! producer's call cut by the crash is looked up once the server is back (a job is in its queue,
//! or done with its id in its effect), and made again only when it did not commit.
//!
//! Each delivery is logged outside its transaction; through it, a DAG job writes its effect (with
//! its id) and a violation row for each parent whose effect it does not see committed, and a
//! callback writes its batch's counts with how many of the batch's members' effects it sees.
//!
//! What must hold: every job's effect committed exactly once, with the id it was enqueued as,
//! none lost, stuck blocked or dead-lettered; no violation (no job started before all its
//! parents' effects committed); the queues empty at the end, and `inbox_blocked` and
//! `inbox_dependencies` with nothing of theirs; each sealed batch's callback ran exactly once,
//! with members = succeeded = its size, none died and every member's effect seen; the batch held
//! open fired nothing although all its members succeeded, and exactly once when sealed at the
//! end; every effect committed before a crash is still there after it; and no deadlock, neither
//! the producer's (its call is made again, and counted) nor a worker's (from the server's
//! statistics; the server's log names the statements of each in the notes).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_client::{
    Batch, BatchCallbacks, Database, DbError, EnqueueOptions, ErrorKind, JobRef, PgDatabase, Queue,
    Statement,
};
use serde_json::json;
use tokio_postgres::Client;

use crate::child::{self, DagJob, DAG_CALLBACKS, DAG_QUEUES};
use crate::cluster::Cluster;
use crate::common::{self, worker_db, Ctx, Error, Queued, Result, Row, EFFECTS};

pub const NAME: &str = "workflows: DAGs, kills, a crash";

const PROCESSES: usize = 4;
/// A job's parents are among the jobs this close before it (long chains, across the queues).
const WINDOW: usize = 50;
const BATCH: usize = 5;
/// The batch held open until every other job is done.
const HELD: usize = 0;
const WORK_MS: u64 = 100;
const FAIL_PCT: u64 = 15;
/// The producer enqueues a job every this many milliseconds.
const PACE_MS: u64 = 8;

/// The DAG, drawn before anything is enqueued.
struct Plan {
    jobs: Vec<Planned>,
    /// Each batch's members (the jobs' numbers), in the order they are added.
    batches: Vec<Vec<i64>>,
}

struct Planned {
    queue: usize,
    parents: Vec<i64>,
    batch: Option<usize>,
}

impl Plan {
    fn draw(jobs: usize, seed: u64) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut planned = Vec::with_capacity(jobs);
        let mut batches: Vec<Vec<i64>> = Vec::new();
        for n in 0..jobs {
            let mut parents: Vec<i64> = if n == 0 {
                Vec::new()
            } else {
                (0..rng.usize(0..=3))
                    .map(|_| rng.usize(n.saturating_sub(WINDOW)..n) as i64)
                    .collect()
            };
            parents.sort_unstable();
            parents.dedup();
            // A quarter of the jobs join the open batch, BATCH members to a batch.
            let batch = (rng.u8(0..4) == 0).then(|| {
                if batches.last().is_none_or(|members| members.len() == BATCH) {
                    batches.push(Vec::new());
                }
                batches.last_mut().expect("pushed above").push(n as i64);
                batches.len() - 1
            });
            planned.push(Planned {
                queue: rng.usize(0..DAG_QUEUES.len()),
                parents,
                batch,
            });
        }
        Plan {
            jobs: planned,
            batches,
        }
    }

    /// The dependencies, how many join two queues, and the longest chain of jobs.
    fn shape(&self) -> (usize, usize, usize) {
        let mut depth = vec![0usize; self.jobs.len()];
        let (mut edges, mut across) = (0, 0);
        for (n, job) in self.jobs.iter().enumerate() {
            edges += job.parents.len();
            for &p in &job.parents {
                across += usize::from(self.jobs[p as usize].queue != job.queue);
                depth[n] = depth[n].max(depth[p as usize]);
            }
            depth[n] += 1;
        }
        (edges, across, depth.into_iter().max().unwrap_or(0))
    }
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(17, NAME);
    let jobs = ctx.profile.pick(1_000, 3_000);
    let kills = ctx.profile.pick(5, 15);
    let crashes = ctx.profile.pick(1, 3);
    let plan = Plan::draw(jobs, 17);
    let cluster = Cluster::create(&ctx.pg_bin).await?;
    let db = cluster.faults_database().await?;
    let mut admin = db.client().await;
    let queues: Vec<String> = DAG_QUEUES
        .iter()
        .chain([&DAG_CALLBACKS])
        .map(|q| q.to_string())
        .collect();
    // Each DAG queue is made ready for workflows as a migration would, so that no enqueue of
    // the run creates a queue's triggers (which locks the queue against its workers a moment).
    let create: Vec<String> = queues
        .iter()
        .map(|queue| format!("inbox_create_queue('{queue}')"))
        .collect();
    let enable: Vec<String> = DAG_QUEUES
        .iter()
        .map(|queue| format!("inbox_enable_workflows('{queue}')"))
        .collect();
    admin
        .batch_execute(&format!(
            "SELECT {}; SELECT {}; {EFFECTS}; ALTER TABLE effects ADD COLUMN job bigint; \
             CREATE INDEX ON effects (n); \
             CREATE TABLE deliveries (kind text NOT NULL, n bigint NOT NULL, \
                 attempt int NOT NULL, worker text, fails bool NOT NULL, \
                 at timestamptz NOT NULL DEFAULT clock_timestamp()); \
             CREATE TABLE violations (n bigint NOT NULL, attempt int NOT NULL, worker text, \
                 parent bigint NOT NULL); \
             CREATE TABLE callbacks (batch bigint NOT NULL, members int NOT NULL, \
                 succeeded int NOT NULL, died int NOT NULL, done int NOT NULL, \
                 attempt int NOT NULL, worker text, \
                 at timestamptz NOT NULL DEFAULT clock_timestamp())",
            create.join(", "),
            enable.join(", ")
        ))
        .await?;

    let args = |name: &str, claim: &str| -> Vec<String> {
        [
            ("--mode", "dag".to_owned()),
            ("--url", db.url().to_owned()),
            ("--schema", db.schema().to_owned()),
            ("--label", name.to_owned()),
            ("--claim", claim.to_owned()),
            ("--lease-ms", "2000".to_owned()),
            ("--work-ms", WORK_MS.to_string()),
            ("--fail-pct", FAIL_PCT.to_string()),
        ]
        .into_iter()
        .flat_map(|(name, value)| [name.to_owned(), value])
        .collect()
    };
    let claim_of = |process: usize| {
        if process.is_multiple_of(2) {
            "lease"
        } else {
            "lock"
        }
    };
    // Each child's label names its process and generation, so that a killed one's deliveries
    // are told from those of the one started in its place.
    let mut children = Vec::new();
    for process in 0..PROCESSES {
        let name = format!("{process}.0");
        children.push((
            name.clone(),
            child::spawn(&ctx.exe, &args(&name, claim_of(process)), &[])?,
        ));
    }
    // The producer enqueues the DAG at a steady pace while the children work, so that parents
    // are acked before, while and after their dependants are enqueued, and the faults come
    // meanwhile.
    let started = Instant::now();
    let plan = Arc::new(plan);
    let producer = tokio::spawn(produce(worker_db(&db, 4), plan.clone()));

    // The faults: the kills, with the crashes spread among them (true for a crash).
    let mut rng = fastrand::Rng::with_seed(17);
    let mut faults: Vec<bool> = Vec::new();
    let mut placed = 0;
    for kill in 1..=kills {
        faults.push(false);
        if placed < crashes && kill == (placed + 1) * kills / (crashes + 1) {
            faults.push(true);
            placed += 1;
        }
    }
    let (mut killed, mut mid_handler, mut crashed, mut deadlocks) = (0, 0, 0, 0);
    let mut at_crashes = Vec::new();
    for (generation, crash) in (1..).zip(faults) {
        let gap = ctx.profile.pick(300..1000, 1000..4000);
        tokio::time::sleep(Duration::from_millis(rng.u64(gap))).await;
        if crash {
            // A crash resets the server's statistics.
            deadlocks += count(&admin, DEADLOCKS).await?;
            let before = count(&admin, "SELECT count(*) FROM effects").await?;
            let running = in_flight(&admin, None).await?;
            let left = remaining(&admin, &queues).await?;
            cluster.stop("immediate").await?;
            row.faults += 1;
            crashed += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.start().await?;
            admin = db.client().await;
            let after = count(&admin, "SELECT count(*) FROM effects").await?;
            row.check(after >= before, || {
                format!("{before} effects committed before a crash, {after} after it")
            });
            at_crashes.push(format!(
                "{running} deliveries running, {before} jobs done, {left} queued"
            ));
            continue;
        }
        // The victim: a child running a delivery, waited for up to 3 s; any child if none is.
        let live: Vec<String> = children.iter().map(|(name, _)| name.clone()).collect();
        let deadline = Instant::now() + Duration::from_secs(3);
        let busy = loop {
            let busy = running_workers(&admin, &live).await?;
            if !busy.is_empty() || Instant::now() > deadline {
                break busy;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let victim = match busy.get(rng.usize(..busy.len().max(1))) {
            Some(name) => live.iter().position(|n| n == name).unwrap_or(0),
            None => rng.usize(..PROCESSES),
        };
        let (name, mut worker) = children.remove(victim);
        worker.start_kill()?;
        worker.wait().await?;
        row.faults += 1;
        killed += 1;
        // Killed mid-handler: a delivery it started just before did not commit (nor fail).
        mid_handler += u64::from(in_flight(&admin, Some(&name)).await? > 0);
        let name = format!("{victim}.{generation}");
        children.insert(
            victim,
            (
                name.clone(),
                child::spawn(&ctx.exe, &args(&name, claim_of(victim)), &[])?,
            ),
        );
    }

    let Produced {
        batches,
        ids,
        deadlocked,
        cut,
        sealed_twice,
        took: enqueued,
    } = producer.await??;
    row.check(sealed_twice.is_empty(), || {
        format!("batches found sealed already when sealed: {sealed_twice:?}")
    });

    // Everything runs to the end, but the held batch's callback, which is not due.
    let deadline = Instant::now() + Duration::from_secs(240);
    let finished = loop {
        if remaining(&admin, &queues).await? == 0 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drained = started.elapsed();
    row.check(finished, || {
        "the queues did not drain after the faults".to_owned()
    });
    // Let a callback of the held batch, or a second one of any batch, show itself.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = batches[HELD].id();
    let early = count_of(
        &admin,
        "SELECT count(*) FROM callbacks WHERE batch = $1",
        held,
    )
    .await?;
    let unsealed = admin
        .query_one(
            "SELECT members, succeeded, finished_at IS NULL FROM inbox_batch($1)",
            &[&held],
        )
        .await?;
    let (members, succeeded, open): (i32, i32, bool) =
        (unsealed.get(0), unsealed.get(1), unsealed.get(2));
    let size = plan.batches[HELD].len() as i32;
    row.check(early == 0 && open, || {
        format!(
            "the batch held open fired {early} callbacks (finished: {}) before it was sealed",
            !open
        )
    });
    row.check(members == size && succeeded == size, || {
        format!(
            "the batch held open counts {succeeded} of {members} members succeeded, not {size} of {size}"
        )
    });
    let sealer = worker_db(&db, 1);
    row.check(batches[HELD].seal(&sealer).await?, || {
        "the batch held open was sealed already".to_owned()
    });
    drop(sealer);
    let fired = common::wait_drained(&admin, DAG_CALLBACKS, Duration::from_secs(30)).await?;
    row.check(fired, || {
        "the callback of the batch sealed last did not run".to_owned()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (_, mut worker) in children {
        worker.start_kill()?;
        worker.wait().await?;
    }

    // Every DAG job: its effect exactly once, never dead-lettered, nothing left behind.
    let effects = common::effects(&admin).await?;
    let mut queued: HashMap<i64, Queued> = HashMap::new();
    let mut left = Vec::new();
    for queue in &queues {
        let rows = admin
            .query(
                &format!(
                    "SELECT coalesce((payload ->> 'n')::int8, -1), dead_at IS NOT NULL, attempt \
                       FROM {queue}"
                ),
                &[],
            )
            .await?;
        if !rows.is_empty() {
            left.push(format!("{queue}: {}", rows.len()));
        }
        for r in rows {
            queued.insert(
                r.get(0),
                Queued {
                    dead: r.get(1),
                    attempt: r.get(2),
                },
            );
        }
    }
    let started_deliveries: HashSet<(i64, i32)> = admin
        .query("SELECT n, attempt FROM deliveries WHERE kind = 'dag'", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let tally = common::classify(0..jobs as i64, &effects, &queued, Some(&started_deliveries));
    row.add("", &tally);
    row.check(tally.dead == 0, || {
        format!("{} jobs dead-lettered (retries are unlimited)", tally.dead)
    });
    row.check(left.is_empty(), || {
        format!("jobs left in the queues: {}", left.join(", "))
    });
    // A job's effect carries the id the producer was given (a cut enqueue made twice would not).
    let strays: Vec<(i64, Option<i64>)> = admin
        .query("SELECT n, job FROM effects", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .filter(|&(n, job): &(i64, Option<i64>)| ids.get(n as usize) != job.as_ref())
        .collect();
    row.check(strays.is_empty(), || {
        format!(
            "{} effects of a job whose id is not the one enqueued, e.g. (job, id) {:?}",
            strays.len(),
            &strays[..strays.len().min(5)]
        )
    });
    let violations: Vec<(i64, i64)> = admin
        .query("SELECT n, parent FROM violations ORDER BY n", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    row.check(violations.is_empty(), || {
        format!(
            "{} deliveries ran before a parent's effect committed, e.g. (job, parent) {:?}",
            violations.len(),
            &violations[..violations.len().min(5)]
        )
    });
    let leftovers = admin
        .query_one(
            "WITH q AS (SELECT q::regclass AS queue FROM unnest($1::text[]) q) \
             SELECT (SELECT count(*) FROM inbox_blocked WHERE queue IN (SELECT queue FROM q)), \
                    (SELECT count(*) FROM inbox_dependencies \
                      WHERE parent_queue IN (SELECT queue FROM q) \
                         OR child_queue IN (SELECT queue FROM q))",
            &[&queues],
        )
        .await?;
    let (blocked, dependencies): (i64, i64) = (leftovers.get(0), leftovers.get(1));
    row.check(blocked == 0 && dependencies == 0, || {
        format!("{blocked} jobs still in inbox_blocked, {dependencies} rows in inbox_dependencies")
    });

    // Every batch's callback exactly once, after all its members succeeded.
    let mut callbacks: BTreeMap<i64, Vec<(i32, i32, i32, i32)>> = BTreeMap::new();
    for r in admin
        .query(
            "SELECT batch, members, succeeded, died, done FROM callbacks",
            &[],
        )
        .await?
    {
        callbacks
            .entry(r.get(0))
            .or_default()
            .push((r.get(1), r.get(2), r.get(3), r.get(4)));
    }
    let (mut missing, mut twice, mut wrong) = (Vec::new(), Vec::new(), Vec::new());
    for (k, batch) in batches.iter().enumerate() {
        let size = plan.batches[k].len() as i32;
        match callbacks.remove(&batch.id()).as_deref() {
            None | Some([]) => missing.push(k),
            Some([counts]) if *counts == (size, size, 0, size) => {}
            Some([counts]) => wrong.push(format!(
                "batch {k} of {size}: (members, succeeded, died, seen) {counts:?}"
            )),
            Some(more) => twice.push(format!("batch {k}: {}", more.len())),
        }
    }
    row.lost += missing.len() as u64;
    row.doubled += twice.len() as u64;
    // What became of the batches whose callback never ran, for the report.
    for &k in missing.iter().take(5) {
        let id = batches[k].id();
        let status = admin
            .query_opt(
                "SELECT format('members %s, succeeded %s, died %s, sealed %s, finished %s', \
                        members, succeeded, died, sealed_at IS NOT NULL, finished_at IS NOT NULL) \
                   FROM inbox_batch($1)",
                &[&id],
            )
            .await?
            .map_or_else(|| "no such batch".to_owned(), |r| r.get(0));
        let queued: Vec<String> = admin
            .query(
                &format!(
                    "SELECT format('attempt %s, dead %s, %s', attempt, dead_at IS NOT NULL, \
                            last_error) FROM {DAG_CALLBACKS} \
                      WHERE (payload #>> '{{batch,id}}')::int8 = $1"
                ),
                &[&id],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        row.note(format!(
            "batch {k} (id {id}, members {:?}), its callback never ran: {status}; in {DAG_CALLBACKS}: {queued:?}",
            plan.batches[k]
        ));
    }
    row.check(missing.is_empty(), || {
        format!(
            "{} batches' callbacks never ran, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        )
    });
    row.check(twice.is_empty(), || {
        format!("callbacks ran more than once: {twice:?}")
    });
    row.check(wrong.is_empty(), || {
        format!("callbacks with the wrong counts: {wrong:?}")
    });
    row.check(callbacks.is_empty(), || {
        format!("callbacks of batches never opened: {:?}", callbacks.keys())
    });

    // Deadlocks: the producer's (its enqueues ran again), and all the server detected, the
    // workers' included (their deliveries ran again). Neither breaks exactly once, but a
    // producer's enqueue fails with them, and the workflows' locks are taken in orders meant to
    // rule them out.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    deadlocks += count(&admin, DEADLOCKS).await?;
    row.check(deadlocked.is_empty(), || {
        format!(
            "{} of the producer's enqueues failed with a deadlock (40P01; run again), e.g. {:?}",
            deadlocked.len(),
            &deadlocked[..deadlocked.len().min(3)]
        )
    });
    if deadlocks > 0 {
        // The server's log names the statements of each deadlock's transactions.
        let log: String = admin
            .query_one(
                "SELECT pg_read_file(current_setting('data_directory') || '/../log')",
                &[],
            )
            .await?
            .get(0);
        for line in log
            .lines()
            .filter(|line| line.starts_with("\tProcess ") && line.contains(": "))
            .take(12)
        {
            let line: String = line.trim().chars().take(300).collect();
            row.note(format!("deadlock: {line}"));
        }
    }
    row.check(deadlocks == 0, || {
        format!("the server detected {deadlocks} deadlocks (pg_stat_database), the producer's and the workers'")
    });
    let deliveries = count(&admin, "SELECT count(*) FROM deliveries").await?;
    let failures = count(&admin, "SELECT count(*) FROM deliveries WHERE fails").await?;
    row.jobs = (jobs + batches.len()) as u64;
    row.faults += failures as u64;
    row.inputs = deliveries as u64;
    let (edges, across, longest) = plan.shape();
    row.note(format!(
        "{jobs} jobs over {} queues, {edges} dependencies ({across} across queues), the longest \
         chain {longest} jobs; {} batches (callbacks: {} fired once); enqueued in {:.1} s beside \
         the workers (calls cut by a crash: {}), all done in {:.1} s",
        DAG_QUEUES.len(),
        batches.len(),
        batches.len() - missing.len() - twice.len(),
        enqueued.as_secs_f64(),
        cut.join(", "),
        drained.as_secs_f64()
    ));
    row.note(format!(
        "{killed} kills ({mid_handler} mid-handler), {crashed} crashes (with {}), {failures} \
         handler failures injected; {deliveries} deliveries; {deadlocks} deadlocks ({} of the \
         producer); the batch held open fired only once sealed: {}",
        at_crashes.join("; "),
        deadlocked.len(),
        early == 0 && fired
    ));
    drop(admin);
    drop(db);
    drop(cluster);
    Ok(row)
}

/// What the producer did.
struct Produced {
    batches: Vec<Batch>,
    /// Each job's id in its queue.
    ids: Vec<i64>,
    /// Its calls that failed with a deadlock (40P01), and were run again: each rolled its
    /// statement back whole.
    deadlocked: Vec<String>,
    /// Its calls whose connection was lost (the crash): each was looked up, and run again when it
    /// had not committed.
    cut: Vec<String>,
    /// The batches whose seal found them sealed already.
    sealed_twice: Vec<usize>,
    took: Duration,
}

/// Enqueues the DAG of `plan`, job `n` at `n` × [`PACE_MS`], each after its parents, the
/// members of a batch added to it and the batch sealed after its last member (but [`HELD`]).
/// A call whose connection is lost to a crash is looked up once the server is back, and made
/// again unless it committed.
async fn produce(pg: PgDatabase, plan: Arc<Plan>) -> Result<Produced> {
    let started = Instant::now();
    let targets: Vec<Queue> = DAG_QUEUES.iter().map(|q| Queue::new(*q)).collect();
    let callback_queue = Queue::new(DAG_CALLBACKS);
    let options = EnqueueOptions::default();
    let mut deadlocked: Vec<String> = Vec::new();
    let mut cut = Vec::new();
    // Runs `$call` until it succeeds, again after a deadlock, and after a lost connection unless
    // `$committed` (what it made, when it committed) finds it done.
    macro_rules! call {
        ($what:expr, $call:expr, $committed:expr) => {
            loop {
                match $call.await {
                    Err(error) if error.sqlstate() == Some("40P01") => {
                        deadlocked.push(format!("{}: {}", $what, error.message()))
                    }
                    Err(error) if error.kind() == ErrorKind::ConnectionLost => {
                        let made = $committed.await?;
                        cut.push(format!(
                            "{} ({})",
                            $what,
                            if made.is_some() {
                                "committed"
                            } else {
                                "made again"
                            }
                        ));
                        if let Some(made) = made {
                            break Ok::<_, Error>(made);
                        }
                    }
                    result => break Ok(result?),
                }
            }
        };
    }
    let mut refs: Vec<JobRef> = Vec::with_capacity(plan.jobs.len());
    let mut opened: Vec<Option<Batch>> = vec![None; plan.batches.len()];
    let mut added = vec![0; plan.batches.len()];
    let mut sealed_twice = Vec::new();
    for (n, job) in plan.jobs.iter().enumerate() {
        tokio::time::sleep_until((started + Duration::from_millis(PACE_MS * n as u64)).into())
            .await;
        let queue = &targets[job.queue];
        let payload = DagJob {
            n: n as i64,
            parents: job.parents.clone(),
        };
        let parents: Vec<JobRef> = job
            .parents
            .iter()
            .map(|&p| refs[p as usize].clone())
            .collect();
        let id = match job.batch {
            None => call!(
                format!("inbox_enqueue_after of job {n}"),
                queue.enqueue_after(&pg, &payload, &parents, &options),
                committed_job(&pg, queue.table(), n as i64)
            )?,
            Some(k) => {
                let batch = match opened[k] {
                    Some(batch) => batch,
                    None => {
                        let callbacks = BatchCallbacks::default()
                            .on_complete(&callback_queue, json!({ "members": plan.batches[k] }));
                        // A batch opened by a call that was cut stays empty and open: harmless.
                        *opened[k].insert(call!(
                            "inbox_batch_open",
                            Batch::open(&pg, &callbacks),
                            async { Ok::<_, Error>(None) }
                        )?)
                    }
                };
                let id = call!(
                    format!("inbox_batch_add of job {n}"),
                    batch.add(&pg, queue, &payload, &parents, &options),
                    committed_job(&pg, queue.table(), n as i64)
                )?;
                added[k] += 1;
                if added[k] == plan.batches[k].len() && k != HELD {
                    let sealed = call!(
                        "inbox_batch_seal",
                        batch.seal(&pg),
                        committed_seal(&pg, batch.id())
                    )?;
                    if !sealed {
                        sealed_twice.push(k);
                    }
                }
                id
            }
        };
        refs.push(queue.job(id.ok_or("an enqueue without a key inserted nothing")?));
    }
    let batches = opened
        .into_iter()
        .map(|batch| batch.ok_or("a batch was never opened"))
        .collect::<std::result::Result<_, _>>()?;
    Ok(Produced {
        batches,
        ids: refs.iter().map(|job| job.id).collect(),
        deadlocked,
        cut,
        sealed_twice,
        took: started.elapsed(),
    })
}

/// Runs `call` until the server answers (for up to a minute after a crash).
async fn answered<T, F, Fut>(mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, DbError>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call().await {
            Err(error)
                if error.kind() == ErrorKind::ConnectionLost && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            result => return Ok(result?),
        }
    }
}

/// Job `n`'s id when its enqueue committed: it is in its queue, or done (its effect has its id).
async fn committed_job(pg: &PgDatabase, queue: &str, n: i64) -> Result<Option<Option<i64>>> {
    let statement = Statement::new(format!(
        "SELECT id FROM {queue} WHERE (payload ->> 'n')::int8 = $1 \
         UNION ALL SELECT job FROM effects WHERE n = $1 LIMIT 1"
    ))
    .bind(n);
    let statement = &statement;
    let rows = answered(move || pg.query(statement)).await?;
    Ok(rows
        .first()
        .map(|row| row.get::<i64>("id"))
        .transpose()?
        .map(Some))
}

/// `Some(true)` when batch `id`'s seal committed.
async fn committed_seal(pg: &PgDatabase, id: i64) -> Result<Option<bool>> {
    let statement =
        Statement::new("SELECT sealed_at IS NOT NULL AS sealed FROM inbox_batch($1)").bind(id);
    let statement = &statement;
    let rows = answered(move || pg.query(statement)).await?;
    let sealed = rows
        .first()
        .map(|row| row.get::<bool>("sealed"))
        .transpose()?;
    Ok(sealed.unwrap_or(false).then_some(true))
}

async fn count(client: &Client, sql: &str) -> Result<i64> {
    Ok(client.query_one(sql, &[]).await?.get(0))
}

async fn count_of(client: &Client, sql: &str, id: i64) -> Result<i64> {
    Ok(client.query_one(sql, &[&id]).await?.get(0))
}

/// The jobs of the queues not done yet (dead-lettered ones aside: they would never be).
async fn remaining(client: &Client, queues: &[String]) -> Result<i64> {
    let mut total = 0;
    for queue in queues {
        total += count(
            client,
            &format!("SELECT count(*) FROM {queue} WHERE dead_at IS NULL"),
        )
        .await?;
    }
    Ok(total)
}

/// The deliveries started in the last second that neither committed nor were drawn to fail
/// (running, or cut short), of worker `worker` or of any.
async fn in_flight(client: &Client, worker: Option<&str>) -> Result<i64> {
    Ok(client
        .query_one(
            &format!(
                "SELECT count(*) FROM ({UNFINISHED}) d WHERE $1::text IS NULL OR d.worker = $1"
            ),
            &[&worker],
        )
        .await?
        .get(0))
}

/// Which of `live` are running a delivery.
async fn running_workers(client: &Client, live: &[String]) -> Result<Vec<String>> {
    Ok(client
        .query(
            &format!("SELECT DISTINCT d.worker FROM ({UNFINISHED}) d WHERE d.worker = ANY($1)"),
            &[&live],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The deadlocks the server detected in the database since its statistics were last reset.
const DEADLOCKS: &str = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()";

/// The deliveries of the last second without their effect and not drawn to fail.
const UNFINISHED: &str = "SELECT d.worker FROM deliveries d \
     WHERE NOT d.fails AND d.at > clock_timestamp() - interval '1 second' \
       AND NOT CASE d.kind \
             WHEN 'dag' THEN EXISTS (SELECT FROM effects e \
                 WHERE e.n = d.n AND e.attempt = d.attempt AND e.worker = d.worker) \
             ELSE EXISTS (SELECT FROM callbacks c \
                 WHERE c.batch = d.n AND c.attempt = d.attempt AND c.worker = d.worker) END";
