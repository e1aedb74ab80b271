//! Durable steps (`Job::step`) on the real database: a step that succeeded is not run again by a
//! later delivery of its job, whatever rolled the delivery back; a step that failed or panicked
//! records nothing; a name is one step per delivery; records last while the job is in its queue;
//! `inbox_record_step` keeps the first record and refuses bad input by SQLSTATE.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use inbox_client::worker::{
    AsyncHandler, AsyncTxHandler, Claim, HandlerResult, Job, Outcome, StepError, Tx, Worker,
};
use inbox_client::{Database, JobType, PgDatabase, Statement};
use inbox_tests::TestDb;
use serde::{Deserialize, Serialize};

use crate::support::{assert_refused, effects, fast_retries, queue_with_effects};

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Order {
    n: i64,
}

impl JobType for Order {
    const QUEUE: &'static str = "jobs";
}

/// Calls of each step, by job.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<HashMap<(&'static str, i64), u32>>>);

impl Calls {
    fn count(&self, step: &'static str, n: i64) {
        *self.0.lock().unwrap().entry((step, n)).or_default() += 1;
    }

    fn of(&self, step: &'static str, n: i64) -> u32 {
        self.0.lock().unwrap().get(&(step, n)).copied().unwrap_or(0)
    }
}

/// Two steps, the second failing on the first two deliveries; what the first step returned to
/// each delivery, by job.
#[derive(Clone, Default)]
struct TwoSteps {
    calls: Calls,
    seen: Arc<Mutex<HashMap<i64, HashSet<String>>>>,
}

impl TwoSteps {
    async fn steps(&self, job: &Job<Order>) -> Result<(), StepError> {
        let n = job.payload.n;
        let attempt = job.attempt;
        let charge: String = job
            .step("charge", || async {
                self.calls.count("charge", n);
                Ok::<_, std::io::Error>(format!("charge-{n}-{attempt}"))
            })
            .await?;
        self.seen
            .lock()
            .unwrap()
            .entry(n)
            .or_default()
            .insert(charge);
        job.step("receipt", || async {
            self.calls.count("receipt", n);
            if attempt < 3 {
                return Err(format!(
                    "the mail server refused job {n} on delivery {attempt}"
                ));
            }
            Ok(())
        })
        .await
    }

    fn check(&self, jobs: i64, label: &str) {
        for n in 0..jobs {
            assert_eq!(self.calls.of("charge", n), 1, "{label}: job {n} charged");
            assert_eq!(self.calls.of("receipt", n), 3, "{label}: job {n} receipts");
            let seen = self.seen.lock().unwrap();
            assert_eq!(
                seen.get(&n).map(|s| s.iter().cloned().collect::<Vec<_>>()),
                Some(vec![format!("charge-{n}-1")]),
                "{label}: what the first step gave each delivery of job {n}"
            );
        }
    }
}

impl AsyncTxHandler<Order> for TwoSteps {
    async fn handle(&self, job: Job<Order>, tx: &Tx<'_>) -> HandlerResult {
        // Written before the steps: a delivery that fails rolls it back.
        tx.client()
            .await?
            .execute(
                "INSERT INTO effects (job, attempt) VALUES ($1, $2)",
                &[&job.payload.n, &job.attempt],
            )
            .await?;
        self.steps(&job).await?;
        Ok(Outcome::ack())
    }
}

impl AsyncHandler<Order> for TwoSteps {
    async fn handle(&self, job: Job<Order>) -> HandlerResult {
        self.steps(&job).await?;
        Ok(Outcome::ack())
    }
}

async fn setup(db: &TestDb, jobs: i64) -> PgDatabase {
    let (pg, _) = queue_with_effects(db, 8, "").await;
    for n in 0..jobs {
        Order { n }.enqueue(&pg).await.unwrap();
    }
    pg
}

/// The step records of the test's queues: inbox_steps is one table for every queue of the
/// database, and tests run side by side, each in a schema of its own.
async fn recorded_steps(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM inbox_steps s \
              WHERE s.queue IN (SELECT c.oid FROM pg_class c \
                                 WHERE c.relnamespace = current_schema()::regnamespace)",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A job whose second step fails on its first two deliveries runs its first step once, and
/// every delivery gets the first delivery's result; the delivery's own writes commit once, with
/// the third delivery's ack. Transactional workers with leases and with locks, and a plain
/// worker. Once the jobs are gone, the upkeep's purge deletes their records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_later_step_does_not_run_an_earlier_one_again() {
    const JOBS: i64 = 20;
    for claim in [Claim::Lease, Claim::Lock] {
        let db = TestDb::new().await;
        let pg = setup(&db, JOBS).await;
        let handler = TwoSteps::default();
        let stats = Worker::transactional_for(pg.clone(), handler.clone())
            .claim(claim)
            .retry(fast_retries(5))
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!((stats.acked, stats.retried), (JOBS as u64, 2 * JOBS as u64));
        handler.check(JOBS, &format!("{claim:?}"));
        let committed: Vec<(i64, i32)> = (0..JOBS).map(|n| (n, 3)).collect();
        assert_eq!(effects(&db).await, committed, "{claim:?}");
        purge(&pg).await;
        assert_eq!(recorded_steps(&db).await, 0, "{claim:?}: purged");
    }

    let db = TestDb::new().await;
    let pg = setup(&db, JOBS).await;
    let handler = TwoSteps::default();
    let stats = Worker::plain_for(pg.clone(), handler.clone())
        .retry(fast_retries(5))
        .poll_interval(std::time::Duration::from_millis(20))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.acked, JOBS as u64);
    handler.check(JOBS, "plain");
}

async fn purge(pg: &PgDatabase) {
    pg.query(&Statement::new("SELECT inbox_purge_results(1000)"))
        .await
        .unwrap();
}

/// A step that panics on the first delivery and fails on the second.
struct Flaky {
    calls: Calls,
}

impl AsyncTxHandler<Order> for Flaky {
    async fn handle(&self, job: Job<Order>, _tx: &Tx<'_>) -> HandlerResult {
        let attempt = job.attempt;
        job.step("flaky", || async {
            self.calls.count("flaky", 0);
            match attempt {
                1 => panic!("the step panicked"),
                2 => Err("the step failed"),
                _ => Ok(attempt),
            }
        })
        .await?;
        Ok(Outcome::ack())
    }
}

/// A step that panics, then fails, records nothing: it runs again on the next delivery, and is
/// recorded by the third, which it succeeds in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_that_panics_or_fails_records_nothing() {
    let db = TestDb::new().await;
    let pg = setup(&db, 1).await;
    let calls = Calls::default();
    let handler = Flaky {
        calls: calls.clone(),
    };
    let stats = Worker::transactional_for(pg.clone(), handler)
        .retry(fast_retries(5))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!((stats.acked, stats.failed), (1, 2));
    assert_eq!(calls.of("flaky", 0), 3);
}

/// Runs step `once` twice in each delivery; what the first gave, and whether the second was
/// refused for its name, by delivery.
#[derive(Clone, Default)]
struct Twice {
    outcomes: Arc<Mutex<Vec<(i32, bool)>>>,
}

impl AsyncTxHandler<Order> for Twice {
    async fn handle(&self, job: Job<Order>, _tx: &Tx<'_>) -> HandlerResult {
        let attempt = job.attempt;
        let first: i32 = job
            .step("once", || async { Ok::<_, std::io::Error>(attempt) })
            .await?;
        let again = job
            .step("once", || async { Ok::<_, std::io::Error>(attempt * 10) })
            .await;
        self.outcomes.lock().unwrap().push((
            first,
            matches!(again, Err(StepError::NameReused(ref name)) if name == "once"),
        ));
        Ok(if attempt == 1 {
            Outcome::retry()
        } else {
            Outcome::ack()
        })
    }
}

/// A name is one step per delivery: a second step of the same name is refused, and the first's
/// record is what the next delivery gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_name_is_one_step_per_delivery() {
    let db = TestDb::new().await;
    let pg = setup(&db, 1).await;
    let handler = Twice::default();
    Worker::transactional_for(pg.clone(), handler.clone())
        .retry(fast_retries(5))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(
        *handler.outcomes.lock().unwrap(),
        vec![(1, true), (1, true)]
    );
}

/// Records last while their job is in its queue (dead-lettered, it keeps them, and
/// `inbox_job_steps` lists them); the purge deletes them once it is gone (discarded), and those
/// of a dropped queue. `inbox_record_step` keeps the first record of a step and returns it to a
/// later one, and refuses bad input by SQLSTATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_last_while_their_job_is_in_its_queue() {
    let db = TestDb::new().await;
    let pg = setup(&db, 1).await;
    let handler = async |job: Job<Order>, _tx: &Tx<'_>| -> HandlerResult {
        let _: String = job
            .step("looked-up", || async {
                Ok::<_, std::io::Error>("found".to_owned())
            })
            .await?;
        Ok(Outcome::Dead {
            reason: "given up".into(),
        })
    };
    let stats = Worker::transactional_for(pg.clone(), handler)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.dead, 1);
    let client = db.client().await;
    let id: i64 = client
        .query_one("SELECT id FROM jobs", &[])
        .await
        .unwrap()
        .get(0);
    let listed = client
        .query(
            "SELECT name, result, attempt FROM inbox_job_steps('jobs', $1)",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].get::<_, String>(0), "looked-up");
    assert_eq!(listed[0].get::<_, serde_json::Value>(1), "found");
    assert_eq!(listed[0].get::<_, i32>(2), 1);
    purge(&pg).await;
    assert_eq!(
        recorded_steps(&db).await,
        1,
        "a dead-lettered job keeps its steps"
    );

    // The first record stands; a later one gets it back.
    let again = client
        .query_one(
            "SELECT recorded, recorded_attempt, inserted \
               FROM inbox_record_step('jobs', $1, 2, 'looked-up', '\"other\"')",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(again.get::<_, serde_json::Value>(0), "found");
    assert_eq!(
        (again.get::<_, i32>(1), again.get::<_, bool>(2)),
        (1, false)
    );

    client
        .batch_execute(&format!("SELECT inbox_discard('jobs', {id})"))
        .await
        .unwrap();
    purge(&pg).await;
    assert_eq!(
        recorded_steps(&db).await,
        0,
        "a discarded job's steps are purged"
    );

    client
        .batch_execute(
            "SELECT inbox_create_queue('gone'); \
             SELECT * FROM inbox_record_step('gone', inbox_enqueue('gone', '{}'), 1, 's', '1')",
        )
        .await
        .unwrap();
    let gone: u32 = client
        .query_one("SELECT 'gone'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("DROP TABLE gone").await.unwrap();
    let of_gone = "SELECT count(*) FROM inbox_steps WHERE queue::oid = $1";
    let of_gone = async || -> i64 { client.query_one(of_gone, &[&gone]).await.unwrap().get(0) };
    assert_eq!(of_gone().await, 1);
    purge(&pg).await;
    assert_eq!(of_gone().await, 0, "a dropped queue's steps are purged");

    client
        .batch_execute("CREATE TABLE not_a_queue (x int)")
        .await
        .unwrap();
    assert_refused(
        &client,
        &[
            ("SELECT inbox_record_step('jobs', 1, 1, NULL, '1')", "22004"),
            (
                "SELECT inbox_record_step('jobs', NULL, 1, 's', '1')",
                "22004",
            ),
            ("SELECT inbox_record_step('jobs', 1, 1, 's', NULL)", "22004"),
            ("SELECT inbox_record_step('jobs', 1, 0, 's', '1')", "22023"),
            ("SELECT inbox_record_step('jobs', 1, 1, '', '1')", "22023"),
            (
                "SELECT inbox_record_step('jobs', 1, 1, repeat('x', 201), '1')",
                "22023",
            ),
            (
                "SELECT inbox_record_step('not_a_queue', 1, 1, 's', '1')",
                "42703",
            ),
            ("SELECT inbox_job_steps('not_a_queue', 1)", "42703"),
            ("SELECT inbox_job_steps('jobs', NULL)", "22004"),
        ],
    )
    .await;
    assert_eq!(
        recorded_steps(&db).await,
        0,
        "nothing recorded by bad input"
    );
}

/// Two deliveries that record the same step at once (a lost lease's holder and the job's next
/// holder): one record stands, and both get it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_records_of_one_step_agree_on_the_first() {
    let db = TestDb::new().await;
    let _pg = setup(&db, 1).await;
    let (a, b) = (db.client().await, db.client().await);
    let id: i64 = a
        .query_one("SELECT id FROM jobs", &[])
        .await
        .unwrap()
        .get(0);
    a.batch_execute("BEGIN").await.unwrap();
    a.query(
        "SELECT * FROM inbox_record_step('jobs', $1, 1, 'charge', '\"first\"')",
        &[&id],
    )
    .await
    .unwrap();
    let second = tokio::spawn(async move {
        b.query_one(
            "SELECT recorded, inserted FROM inbox_record_step('jobs', $1, 2, 'charge', '\"second\"')",
            &[&id],
        )
        .await
        .unwrap()
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "the second record waits for the first"
    );
    a.batch_execute("COMMIT").await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(second.get::<_, serde_json::Value>(0), "first");
    assert!(!second.get::<_, bool>(1));
}
