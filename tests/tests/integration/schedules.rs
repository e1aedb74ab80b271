//! Schedules over real connections: every tick of a schedule becomes exactly one job, fired by
//! the leases and locks of concurrent workers (restarted or not), a tick missed while no worker
//! ran fires once, a weekly schedule's next tick outlives the connections that declared it, and
//! bad declarations fail with their SQLSTATE.
//!
//! Each queue gets an AFTER INSERT trigger that records every job inserted into it, with its key,
//! in `fired`: a tick inserted twice would show twice there, even if its first job was already
//! acked (and its key free again) when the second came.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use chrono::{DateTime, Datelike, Timelike, Utc};
use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker};
use inbox_client::{Database, ErrorKind, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;
use tokio::time::sleep;
use tokio_postgres::Client;

/// A port with NOTIFY wake-ups over a pool of `size` connections to the test's schema.
fn port(db: &TestDb, size: usize) -> PgDatabase {
    PgDatabase::from_pool_and_config(db.pool(size), db.config())
}

/// Creates the queue `name` and the trigger that records each job inserted into it in `fired`
/// (with the test's search_path: the extension's functions run with their own).
async fn create_queue(client: &Client, name: &str) {
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('{name}'); \
             CREATE TABLE IF NOT EXISTS fired ( \
                 queue text NOT NULL, job bigint NOT NULL, key text, payload jsonb, \
                 at timestamptz NOT NULL DEFAULT clock_timestamp()); \
             CREATE OR REPLACE FUNCTION record_fired() RETURNS trigger LANGUAGE plpgsql \
                 SET search_path FROM CURRENT AS $$ \
             BEGIN \
                 INSERT INTO fired (queue, job, key, payload) \
                 VALUES (TG_TABLE_NAME, NEW.id, NEW.key, NEW.payload); \
                 RETURN NULL; \
             END $$; \
             CREATE TRIGGER record_fired AFTER INSERT ON {name} \
                 FOR EACH ROW EXECUTE FUNCTION record_fired();"
        ))
        .await
        .unwrap();
}

/// The keys of the jobs inserted into `queue`, in the order they were inserted (duplicates kept).
async fn fired_keys(client: &Client, queue: &str) -> Vec<String> {
    client
        .query(
            "SELECT key FROM fired WHERE queue = $1 ORDER BY at, job",
            &[&queue],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The tick a schedule's job key names (`schedule:<name>:<RFC 3339>`).
fn tick_of(key: &str, schedule: &str) -> DateTime<Utc> {
    let tick = key
        .strip_prefix(&format!("schedule:{schedule}:"))
        .unwrap_or_else(|| panic!("{key} is not a key of schedule {schedule}"));
    DateTime::parse_from_rfc3339(tick)
        .unwrap_or_else(|e| panic!("{key}: {e}"))
        .with_timezone(&Utc)
}

/// The stored next tick of schedule `name` of `queue`.
async fn next_tick(client: &Client, queue: &str, name: &str) -> DateTime<Utc> {
    client
        .query_one(
            "SELECT next_tick FROM inbox_schedules($1::text::regclass) WHERE name = $2",
            &[&queue, &name],
        )
        .await
        .unwrap()
        .get(0)
}

async fn now(client: &Client) -> DateTime<Utc> {
    client
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Leases up to 10 jobs of `queue` and acks them; returns their ids.
async fn lease_and_ack(client: &Client, queue: &str) -> Vec<i64> {
    let rows = client
        .query(
            "SELECT id, token FROM inbox_lease($1::text::regclass, 10)",
            &[&queue],
        )
        .await
        .unwrap();
    let mut ids = Vec::new();
    for row in rows {
        let (id, token): (i64, i64) = (row.get(0), row.get(1));
        client
            .execute(
                "SELECT inbox_ack($1::text::regclass, $2::int8, $3::int8)",
                &[&queue, &id, &token],
            )
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

/// The SQLSTATE `sql` fails with.
async fn sqlstate(client: &Client, sql: &str) -> String {
    match client.batch_execute(sql).await {
        Ok(()) => panic!("{sql} succeeded"),
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("{sql}: {e} has no SQLSTATE"))
            .code()
            .to_owned(),
    }
}

/// The message of the error `sql` fails with.
async fn message(client: &Client, sql: &str) -> String {
    match client.batch_execute(sql).await {
        Ok(()) => panic!("{sql} succeeded"),
        Err(e) => e.as_db_error().map(|e| e.message().to_owned()).unwrap(),
    }
}

/// A schedule every second, fired for 10 seconds by 8 concurrent workers on 4 connections (two
/// workers of 4 slots, one leasing and one locking, each over a pool of 2 connections, so that
/// slots wait for a connection too), one of them restarted in the middle: every tick from the first to the last becomes exactly one job, none is missed,
/// none doubled, and each job's handler committed its effect exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_second_for_ten_seconds_one_job_per_tick_across_workers_and_a_restart() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    create_queue(&admin, "ticks").await;
    admin
        .batch_execute("CREATE TABLE handled (job bigint NOT NULL, tick text NOT NULL)")
        .await
        .unwrap();
    let (leasing, locking) = (port(&db, 2), port(&db, 2));
    let queue = Queue::new("ticks");
    queue
        .schedule(
            &leasing,
            "every-second",
            "* * * * * *",
            &serde_json::json!({"report": "heartbeat"}),
            "UTC",
        )
        .await
        .unwrap();
    let first = next_tick(&admin, "ticks", "every-second").await;

    let handler = transactional(|job: Job<serde_json::Value>, tx: &dyn Database| {
        Box::pin(async move {
            assert_eq!(job.payload, serde_json::json!({"report": "heartbeat"}));
            tx.execute(
                &Statement::new(
                    "INSERT INTO handled (job, tick) \
                         SELECT $1, key FROM fired WHERE queue = 'ticks' AND job = $1",
                )
                .bind(job.id),
            )
            .await?;
            Ok(Outcome::ack())
        })
    });
    let start = |db: &PgDatabase, claim: Claim| {
        Worker::transactional(db.clone(), "ticks", handler)
            .workers(4)
            .claim(claim)
            .poll_interval(Duration::from_millis(100))
            .start()
    };
    let lease_worker = start(&leasing, Claim::Lease);
    let lock_worker = start(&locking, Claim::Lock);
    sleep(Duration::from_secs(5)).await;
    // A restart: the locking worker stops and another takes its place.
    let before_restart = lock_worker.shutdown(Duration::from_secs(5)).await;
    let lock_worker = start(&locking, Claim::Lock);
    sleep(Duration::from_secs(5)).await;
    // On the test's own connection: a worker slot holds its pooled connection, and the pools
    // have fewer connections than slots.
    let removed: bool = admin
        .query_one("SELECT inbox_unschedule('ticks', 'every-second')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(removed);
    let end = now(&admin).await;
    // The last ticks' jobs are taken before the workers stop.
    sleep(Duration::from_secs(1)).await;
    let lease_stats = lease_worker.shutdown(Duration::from_secs(5)).await;
    let lock_stats = lock_worker.shutdown(Duration::from_secs(5)).await;
    eprintln!("leasing {lease_stats:?}; locking {before_restart:?} then {lock_stats:?}");

    let keys = fired_keys(&admin, "ticks").await;
    let ticks: Vec<DateTime<Utc>> = keys.iter().map(|k| tick_of(k, "every-second")).collect();
    let distinct: BTreeSet<DateTime<Utc>> = ticks.iter().copied().collect();
    assert_eq!(distinct.len(), ticks.len(), "a tick fired twice: {keys:?}");
    let distinct: Vec<DateTime<Utc>> = distinct.into_iter().collect();
    assert_eq!(
        distinct[0], first,
        "the first tick is the one stored by inbox_schedule"
    );
    for pair in distinct.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            chrono::Duration::seconds(1),
            "a tick was missed: {keys:?}"
        );
    }
    let last = *distinct.last().unwrap();
    assert!(
        last >= end - chrono::Duration::seconds(2),
        "ticks stopped at {last}, unscheduled at {end}: {keys:?}"
    );
    assert!(
        distinct.len() >= 9,
        "{} ticks in 10 seconds",
        distinct.len()
    );
    // Both kinds of worker fired and took ticks.
    assert!(lease_stats.acked > 0 && before_restart.acked + lock_stats.acked > 0);

    // Every job was handled once, in the transaction that acked it, and nothing is left.
    let handled: Vec<(i64, String)> = admin
        .query("SELECT job, tick FROM handled ORDER BY job", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut per_job: HashMap<i64, usize> = HashMap::new();
    for (job, _) in &handled {
        *per_job.entry(*job).or_default() += 1;
    }
    assert!(per_job.values().all(|&n| n == 1), "{handled:?}");
    let mut handled_ticks: Vec<String> = handled.into_iter().map(|(_, tick)| tick).collect();
    handled_ticks.sort();
    let mut fired_sorted = keys.clone();
    fired_sorted.sort();
    assert_eq!(handled_ticks, fired_sorted);
    let left: i64 = admin
        .query_one("SELECT count(*) FROM ticks", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

/// Ticks that pass while no one leases collapse into one job, for the latest of them, when a
/// lease comes; the next tick is then after that lease.
#[tokio::test]
async fn ticks_missed_while_no_worker_ran_give_one_job_for_the_latest() {
    let db = TestDb::new().await;
    let client = db.client().await;
    create_queue(&client, "jobs").await;
    client
        .batch_execute("SELECT inbox_schedule('jobs', 'often', '* * * * * *')")
        .await
        .unwrap();
    let scheduled = next_tick(&client, "jobs", "often").await;
    sleep(Duration::from_millis(3_500)).await;

    let before = now(&client).await;
    let taken = lease_and_ack(&client, "jobs").await;
    let after = now(&client).await;
    assert_eq!(taken.len(), 1);
    let keys = fired_keys(&client, "jobs").await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let tick = tick_of(&keys[0], "often");
    // Three ticks or more were due; only the latest at the lease fired.
    assert!(
        tick >= scheduled + chrono::Duration::seconds(2),
        "{tick} {scheduled}"
    );
    assert!(
        tick > before - chrono::Duration::seconds(1) && tick <= after,
        "{tick}"
    );
    assert!(next_tick(&client, "jobs", "often").await > tick);
    let last: Option<DateTime<Utc>> = client
        .query_one(
            "SELECT last_tick FROM inbox_schedules('jobs') WHERE name = 'often'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(last, Some(tick), "the last tick is the one fired");
}

/// Running a schedule now enqueues its job at once, keyed apart from its ticks, and leaves its
/// timetable alone; it needs INSERT on the queue, and a schedule that exists.
#[tokio::test]
async fn a_schedule_runs_now_outside_its_timetable() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let client = db.client().await;
    create_queue(&client, "jobs").await;
    client
        .batch_execute(
            "SELECT inbox_schedule('jobs', 'weekly', '0 9 * * 1', '{\"report\": \"weekly\"}')",
        )
        .await
        .unwrap();
    let scheduled = next_tick(&client, "jobs", "weekly").await;

    let before = now(&client).await;
    let ran: Vec<i64> = {
        let mut ids = Vec::new();
        for _ in 0..2 {
            ids.push(
                client
                    .query_one("SELECT inbox_run_schedule('jobs', 'weekly')", &[])
                    .await
                    .unwrap()
                    .get(0),
            );
        }
        ids
    };
    assert_ne!(ran[0], ran[1], "each run enqueues its own job");
    let keys = fired_keys(&client, "jobs").await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        let at = key
            .strip_prefix("schedule:weekly:run:")
            .unwrap_or_else(|| panic!("{key}"));
        let at = DateTime::parse_from_rfc3339(at)
            .unwrap()
            .with_timezone(&Utc);
        assert!(at >= before && at <= now(&client).await, "{key}");
    }
    // Due now, with the schedule's payload; the timetable is unchanged and nothing was a tick.
    let taken = lease_and_ack(&client, "jobs").await;
    assert_eq!(taken.len(), 2);
    let payloads: Vec<serde_json::Value> = client
        .query("SELECT payload FROM fired ORDER BY job", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(payloads, vec![serde_json::json!({"report": "weekly"}); 2]);
    assert_eq!(next_tick(&client, "jobs", "weekly").await, scheduled);
    let last: Option<DateTime<Utc>> = client
        .query_one("SELECT last_tick FROM inbox_schedules('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(last, None);

    assert_eq!(
        sqlstate(&client, "SELECT inbox_run_schedule('jobs', 'daily')").await,
        "42704"
    );
    assert_eq!(
        sqlstate(&client, "SELECT inbox_run_schedule('jobs', NULL)").await,
        "22004"
    );
    let reader = format!("sched_{schema}_run");
    client
        .batch_execute(&format!(
            "CREATE ROLE {reader} NOLOGIN; GRANT USAGE ON SCHEMA {schema}, public TO {reader}; \
             GRANT SELECT, UPDATE ON jobs TO {reader};"
        ))
        .await
        .unwrap();
    let _roles = Roles {
        url: db.url().to_owned(),
        names: vec![reader.clone()],
    };
    let as_reader = db.client().await;
    assert_eq!(
        sqlstate(
            &as_reader,
            &format!("SET ROLE {reader}; SELECT inbox_run_schedule('jobs', 'weekly')")
        )
        .await,
        "42501"
    );
    assert_eq!(fired_keys(&client, "jobs").await.len(), 2);
}

/// A session remembers which queues have schedules, so that its leases on the others run no
/// statement for them: a schedule declared after its leases found none, by another session
/// (through `inbox_schedule`, or by a row inserted into the table directly) or by itself in the
/// lease's own transaction, still fires at its next lease.
#[tokio::test]
async fn a_schedule_declared_after_leases_found_none_fires_at_the_next_lease() {
    let db = TestDb::new().await;
    let worker = db.client().await;
    let other = db.client().await;
    for queue in ["first", "second", "third"] {
        create_queue(&worker, queue).await;
        assert!(lease_and_ack(&worker, queue).await.is_empty());
    }
    other
        .batch_execute("SELECT inbox_schedule('first', 'often', '* * * * * *')")
        .await
        .unwrap();
    other
        .batch_execute(
            "INSERT INTO inbox_periodic_jobs (queue, name, cron, time_zone, payload, next_tick) \
             VALUES ('second'::regclass, 'direct', '* * * * * *', 'UTC', '{}', clock_timestamp())",
        )
        .await
        .unwrap();
    sleep(Duration::from_millis(1_100)).await;
    assert_eq!(lease_and_ack(&worker, "first").await.len(), 1);
    assert_eq!(lease_and_ack(&worker, "second").await.len(), 1);
    // Declared and leased in one transaction of the session that found none before.
    worker
        .batch_execute(
            "BEGIN; \
             INSERT INTO inbox_periodic_jobs (queue, name, cron, time_zone, payload, next_tick) \
             VALUES ('third'::regclass, 'own', '* * * * * *', 'UTC', '{}', clock_timestamp() - interval '1 second')",
        )
        .await
        .unwrap();
    let taken = worker
        .query("SELECT id FROM inbox_lease('third'::regclass, 10)", &[])
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
    worker.batch_execute("ROLLBACK").await.unwrap();
    assert!(fired_keys(&worker, "third").await.is_empty());
}

/// A weekly schedule's next tick is stored: a new connection (a restarted service) sees it, a
/// service that declares the schedule again at its start keeps it, and once the week has passed
/// (the stored tick moved back a week, as if the service had been down over it) the first lease
/// on a new connection enqueues that tick's job once and stores the following week's tick.
#[tokio::test]
async fn a_weekly_schedule_keeps_its_next_tick_across_connections() {
    let db = TestDb::new().await;
    let declare =
        "SELECT inbox_schedule('jobs', 'weekly', '0 3 * * 0', '{\"report\": \"weekly\"}')";
    let stored = {
        let first = db.client().await;
        create_queue(&first, "jobs").await;
        first.batch_execute(declare).await.unwrap();
        next_tick(&first, "jobs", "weekly").await
    };
    assert_eq!(stored.weekday(), chrono::Weekday::Sun);
    assert_eq!((stored.hour(), stored.minute(), stored.second()), (3, 0, 0));

    let second = db.client().await;
    assert_eq!(next_tick(&second, "jobs", "weekly").await, stored);
    // The week passes with no service running.
    second
        .batch_execute(
            "UPDATE inbox_periodic_jobs SET next_tick = next_tick - interval '7 days' \
              WHERE queue = 'jobs'::regclass AND name = 'weekly'",
        )
        .await
        .unwrap();
    drop(second);

    let restarted = db.client().await;
    restarted.batch_execute(declare).await.unwrap();
    let due = stored - chrono::Duration::days(7);
    assert_eq!(next_tick(&restarted, "jobs", "weekly").await, due);
    assert_eq!(lease_and_ack(&restarted, "jobs").await.len(), 1);
    assert!(lease_and_ack(&restarted, "jobs").await.is_empty());
    assert_eq!(
        fired_keys(&restarted, "jobs").await,
        vec![format!(
            "schedule:weekly:{}",
            due.format("%Y-%m-%dT%H:%M:%SZ")
        )]
    );
    assert_eq!(next_tick(&restarted, "jobs", "weekly").await, stored);
}

/// A lock fires a due tick in its own transaction: meanwhile other callers skip the schedule
/// (they neither wait nor fire it), a rollback undoes the firing so the next caller fires the
/// same tick, and a commit makes it fired for everyone.
#[tokio::test]
async fn a_tick_fired_in_an_open_transaction_is_skipped_by_others_and_undone_by_its_rollback() {
    let db = TestDb::new().await;
    let a = db.client().await;
    let b = db.client().await;
    create_queue(&a, "jobs").await;
    a.batch_execute(
        "SELECT inbox_schedule('jobs', 'weekly', '0 3 * * 0'); \
         UPDATE inbox_periodic_jobs SET next_tick = next_tick - interval '7 days' \
          WHERE queue = 'jobs'::regclass",
    )
    .await
    .unwrap();
    let due = next_tick(&a, "jobs", "weekly").await;
    let key = format!("schedule:weekly:{}", due.format("%Y-%m-%dT%H:%M:%SZ"));
    let committed_jobs = |client| async move {
        let client: &Client = client;
        client
            .query_one("SELECT count(*) FROM jobs", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };

    for outcome in ["ROLLBACK", "COMMIT"] {
        a.batch_execute("BEGIN").await.unwrap();
        let locked = a
            .query("SELECT id FROM inbox_lock('jobs')", &[])
            .await
            .unwrap();
        assert_eq!(locked.len(), 1, "the lock fires the tick and takes its job");
        // The other connection neither blocks nor fires the tick a second time.
        let taken = tokio::time::timeout(
            Duration::from_secs(5),
            b.query("SELECT id FROM inbox_lease('jobs', 10)", &[]),
        )
        .await
        .expect("a lease does not wait for a schedule being fired")
        .unwrap();
        assert!(taken.is_empty());
        assert_eq!(committed_jobs(&b).await, 0);
        assert_eq!(next_tick(&b, "jobs", "weekly").await, due);
        a.batch_execute(outcome).await.unwrap();
    }
    // The rolled-back firing left no trace; the committed one fired the tick once, and its job
    // (locked, not settled) is still queued under the tick's key.
    assert_eq!(fired_keys(&b, "jobs").await, std::slice::from_ref(&key));
    assert!(next_tick(&b, "jobs", "weekly").await > due);
    assert_eq!(lease_and_ack(&b, "jobs").await.len(), 1);
    assert!(lease_and_ack(&b, "jobs").await.is_empty());
    assert_eq!(fired_keys(&b, "jobs").await, [key]);
}

/// Replacing a schedule changes its payload at once and keeps its next tick unless the cron
/// expression or time zone changed; unscheduling stops its ticks and leaves its jobs queued.
#[tokio::test]
async fn replace_and_unschedule() {
    let db = TestDb::new().await;
    let client = db.client().await;
    create_queue(&client, "jobs").await;
    client
        .batch_execute("SELECT inbox_schedule('jobs', 'r', '*/5 * * * *', '{\"v\": 1}')")
        .await
        .unwrap();
    // Its tick is due (moved to the previous five-minute tick).
    client
        .batch_execute(
            "UPDATE inbox_periodic_jobs \
                SET next_tick = next_tick - interval '5 minutes' WHERE name = 'r'",
        )
        .await
        .unwrap();
    let due = next_tick(&client, "jobs", "r").await;
    client
        .batch_execute("SELECT inbox_schedule('jobs', 'r', '*/5 * * * *', '{\"v\": 2}')")
        .await
        .unwrap();
    assert_eq!(next_tick(&client, "jobs", "r").await, due);
    assert_eq!(lease_and_ack(&client, "jobs").await.len(), 1);
    let payload: serde_json::Value = client
        .query_one("SELECT payload FROM fired", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(payload, serde_json::json!({"v": 2}));

    // Another expression: the next tick is recomputed from now.
    client
        .batch_execute(
            "SELECT inbox_schedule('jobs', 'r', '17 4 * * *', '{\"v\": 3}', 'Asia/Tokyo')",
        )
        .await
        .unwrap();
    let row = client
        .query_one(
            "SELECT cron, time_zone, payload, next_tick > now(), \
                    (next_tick AT TIME ZONE 'Asia/Tokyo')::time::text \
               FROM inbox_schedules('jobs')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "17 4 * * *");
    assert_eq!(row.get::<_, String>(1), "Asia/Tokyo");
    assert_eq!(
        row.get::<_, serde_json::Value>(2),
        serde_json::json!({"v": 3})
    );
    assert!(row.get::<_, bool>(3));
    assert_eq!(row.get::<_, String>(4), "04:17:00");

    // A job still queued stays queued when its schedule goes.
    client
        .batch_execute(
            "UPDATE inbox_periodic_jobs SET next_tick = next_tick - interval '1 day' \
              WHERE name = 'r'",
        )
        .await
        .unwrap();
    let job: i64 = client
        .query_one(
            "SELECT count(*) FROM inbox_lock('jobs') WHERE payload = '{\"v\": 3}'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(job, 1);
    let removed = |sql| {
        let client = &client;
        async move { client.query_one(sql, &[]).await.unwrap().get::<_, bool>(0) }
    };
    assert!(removed("SELECT inbox_unschedule('jobs', 'r')").await);
    assert!(!removed("SELECT inbox_unschedule('jobs', 'r')").await);
    assert!(!removed("SELECT inbox_unschedule('jobs', 'never')").await);
    let (schedules, queued): (i64, i64) = {
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM inbox_schedules('jobs')), \
                        (SELECT count(*) FROM jobs)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((schedules, queued), (0, 1));
}

/// Dropping a queue drops its schedules (and only its own), also through `DROP SCHEMA CASCADE`.
/// The pgrx build deletes them in the `DROP` (an event trigger); the SQL-only build, installed
/// without a superuser, has no event trigger: there they never fire, and the next
/// `inbox_schedule` or `inbox_unschedule` deletes them (the unschedule below).
#[tokio::test]
async fn a_dropped_queue_takes_its_schedules_with_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('kept'); SELECT inbox_create_queue('dropped'); \
             SELECT inbox_schedule('kept', 'a', '* * * * *'); \
             SELECT inbox_schedule('dropped', 'a', '* * * * *'); \
             SELECT inbox_schedule('dropped', 'b', '0 0 * * *');",
        )
        .await
        .unwrap();
    let oid: u32 = client
        .query_one("SELECT 'dropped'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("DROP TABLE dropped").await.unwrap();
    client
        .batch_execute("SELECT inbox_unschedule('kept', 'none such')")
        .await
        .unwrap();
    let left: Vec<(String, String)> = client
        .query(
            "SELECT queue::text, name FROM inbox_periodic_jobs \
              WHERE queue::oid = $1 OR queue = 'kept'::regclass",
            &[&oid],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(left, [("kept".to_owned(), "a".to_owned())]);
}

/// Both forms of cron expression, nicknames, and the time zone the ticks are read in.
#[tokio::test]
async fn five_and_six_field_expressions_in_their_time_zone() {
    let db = TestDb::new().await;
    let client = db.client().await;
    create_queue(&client, "jobs").await;
    client
        .batch_execute(
            "SELECT inbox_schedule('jobs', 'tens', '*/10 * * * * *'); \
             SELECT inbox_schedule('jobs', 'nightly', '30 2 * * *'); \
             SELECT inbox_schedule('jobs', 'hourly', '@hourly'); \
             SELECT inbox_schedule('jobs', 'ny', '0 9 * * 1-5', '{}', 'America/New_York'); \
             SELECT inbox_schedule('jobs', 'kolkata', '0 9 * * *', '{}', 'Asia/Kolkata');",
        )
        .await
        .unwrap();
    let at = now(&client).await;
    let tens = next_tick(&client, "jobs", "tens").await;
    assert_eq!(tens.second() % 10, 0);
    assert!(tens > at - chrono::Duration::seconds(1) && tens <= at + chrono::Duration::seconds(10));
    let nightly = next_tick(&client, "jobs", "nightly").await;
    assert_eq!(
        (nightly.hour(), nightly.minute(), nightly.second()),
        (2, 30, 0)
    );
    assert!(nightly > at && nightly <= at + chrono::Duration::days(1));
    let hourly = next_tick(&client, "jobs", "hourly").await;
    assert_eq!((hourly.minute(), hourly.second()), (0, 0));
    for (name, zone) in [("ny", "America/New_York"), ("kolkata", "Asia/Kolkata")] {
        let local: String = client
            .query_one(
                "SELECT (next_tick AT TIME ZONE $2)::time::text FROM inbox_schedules('jobs') \
                  WHERE name = $1",
                &[&name, &zone],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(local, "09:00:00", "{name}");
    }
    // Kolkata is UTC+05:30 all year.
    let kolkata = next_tick(&client, "jobs", "kolkata").await;
    assert_eq!((kolkata.hour(), kolkata.minute()), (3, 30));
    let names: Vec<String> = client
        .query("SELECT name FROM inbox_schedules('jobs')", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(names, ["hourly", "kolkata", "nightly", "ny", "tens"]);
}

/// Bad declarations fail with their SQLSTATE, name what is wrong, and store nothing.
#[tokio::test]
async fn invalid_schedules_fail_with_their_sqlstate() {
    let db = TestDb::new().await;
    let client = db.client().await;
    create_queue(&client, "jobs").await;
    client
        .batch_execute(
            "CREATE TABLE bytes (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                 locked_until timestamptz, payload bytea NOT NULL, key text UNIQUE); \
             CREATE TABLE keyless (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                   locked_until timestamptz, payload jsonb NOT NULL); \
             CREATE TABLE loose_keys (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                      locked_until timestamptz, payload jsonb NOT NULL, key text); \
             CREATE TABLE other (n int); \
             CREATE VIEW jobs_view AS SELECT * FROM jobs;",
        )
        .await
        .unwrap();
    for (sql, code, says) in [
        (
            "SELECT inbox_schedule('jobs', 'a', '* * * *')",
            "22023",
            "\"* * * *\"",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '61 * * * *')",
            "22023",
            "\"61 * * * *\"",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '0 0 1 1 * * 2030')",
            "22023",
            "invalid cron",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', 'every day')",
            "22023",
            "\"every day\"",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '0 0 30 2 *')",
            "22023",
            "no tick",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '* * * * *', '{}', 'Mars/Olympus')",
            "22023",
            "\"Mars/Olympus\"",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '* * * * *', '{}', '')",
            "22023",
            "time zone",
        ),
        (
            "SELECT inbox_schedule('jobs', '', '* * * * *')",
            "22023",
            "name",
        ),
        (
            "SELECT inbox_schedule('jobs', NULL, '* * * * *')",
            "22004",
            "name",
        ),
        ("SELECT inbox_schedule('jobs', 'a', NULL)", "22004", "cron"),
        (
            "SELECT inbox_schedule('jobs', 'a', '* * * * *', NULL)",
            "22004",
            "payload",
        ),
        (
            "SELECT inbox_schedule('jobs', 'a', '* * * * *', '{}', NULL)",
            "22004",
            "time_zone",
        ),
        (
            "SELECT inbox_schedule('bytes', 'a', '* * * * *')",
            "42804",
            "bytea",
        ),
        (
            "SELECT inbox_schedule('keyless', 'a', '* * * * *')",
            "42703",
            "\"key\"",
        ),
        (
            "SELECT inbox_schedule('loose_keys', 'a', '* * * * *')",
            "42P10",
            "unique index",
        ),
        (
            "SELECT inbox_schedule('other', 'a', '* * * * *')",
            "42703",
            "\"id\"",
        ),
        (
            "SELECT inbox_schedule('jobs_view', 'a', '* * * * *')",
            "42809",
            "not a table",
        ),
        (
            "SELECT inbox_schedule('missing', 'a', '* * * * *')",
            "42P01",
            "missing",
        ),
        ("SELECT inbox_unschedule('jobs', NULL)", "22004", "name"),
        ("SELECT * FROM inbox_schedules(NULL)", "22004", "queue"),
    ] {
        assert_eq!(sqlstate(&client, sql).await, code, "{sql}");
        let text = message(&client, sql).await;
        assert!(text.contains(says), "{sql}: {text}");
    }
    let stored: i64 = client
        .query_one(
            "SELECT count(*) FROM inbox_periodic_jobs \
              WHERE queue::oid IN (SELECT oid FROM pg_class \
                                    WHERE relnamespace = current_schema()::regnamespace)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 0);
}

/// The schedule table follows the queue's privileges: a role that may insert into a queue
/// declares its schedules and fires them when it leases; a role that may lease but not insert
/// cannot declare one, and its leases leave the ticks to others instead of failing.
#[tokio::test]
async fn schedules_follow_the_queues_privileges() {
    let db = TestDb::new().await;
    let schema = db.schema().to_owned();
    let (producer, reader, nobody) = (
        format!("sched_{schema}_p"),
        format!("sched_{schema}_r"),
        format!("sched_{schema}_n"),
    );
    let admin = db.client().await;
    create_queue(&admin, "jobs").await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE {producer} NOLOGIN; CREATE ROLE {reader} NOLOGIN; \
             CREATE ROLE {nobody} NOLOGIN; \
             GRANT USAGE ON SCHEMA {schema}, public TO {producer}, {reader}, {nobody}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON jobs TO {producer}; \
             GRANT SELECT, UPDATE, DELETE ON jobs TO {reader}; \
             GRANT INSERT ON fired TO {producer};"
        ))
        .await
        .unwrap();
    let _roles = Roles {
        url: db.url().to_owned(),
        names: vec![producer.clone(), reader.clone(), nobody.clone()],
    };

    let as_reader = db.client().await;
    as_reader
        .batch_execute(&format!("SET ROLE {reader}"))
        .await
        .unwrap();
    assert_eq!(
        sqlstate(
            &as_reader,
            "SELECT inbox_schedule('jobs', 'a', '* * * * * *')"
        )
        .await,
        "42501"
    );
    let as_producer = db.client().await;
    as_producer
        .batch_execute(&format!(
            "SET ROLE {producer}; SELECT inbox_schedule('jobs', 'a', '* * * * * *')"
        ))
        .await
        .unwrap();
    sleep(Duration::from_millis(1_200)).await;
    // The reader sees the due schedule, leases nothing, and leaves the tick due.
    assert!(lease_and_ack(&as_reader, "jobs").await.is_empty());
    assert!(next_tick(&as_reader, "jobs", "a").await <= now(&as_reader).await);
    assert!(!as_reader
        .query_one("SELECT inbox_unschedule('jobs', 'a')", &[])
        .await
        .unwrap()
        .get::<_, bool>(0));
    assert!(fired_keys(&admin, "jobs").await.is_empty());
    // The producer's lease fires the tick and takes its job.
    assert_eq!(lease_and_ack(&as_producer, "jobs").await.len(), 1);
    assert_eq!(fired_keys(&admin, "jobs").await.len(), 1);
    // A role with no privilege on the queue sees none of its schedules.
    let as_nobody = db.client().await;
    as_nobody
        .batch_execute(&format!("SET ROLE {nobody}"))
        .await
        .unwrap();
    let seen: i64 = as_nobody
        .query_one("SELECT count(*) FROM inbox_schedules('jobs')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 0);
}

/// Drops the test's roles (and what they own) when the test ends, however it ends.
struct Roles {
    url: String,
    names: Vec<String>,
}

impl Drop for Roles {
    fn drop(&mut self) {
        let url = self.url.clone();
        let names = self.names.join(", ");
        let sql = format!("DROP OWNED BY {names}; DROP ROLE {names}");
        // Drop cannot await: a thread with a runtime of its own does the work.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                if let Ok((client, connection)) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                {
                    tokio::spawn(connection);
                    let _ = client.batch_execute(&sql).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// The client's `Queue` methods over the database port.
#[tokio::test]
async fn the_client_declares_lists_and_removes_schedules() {
    let db = TestDb::new().await;
    let pg = port(&db, 2);
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    queue
        .schedule(
            &pg,
            "digest",
            "0 8 * * 1",
            &serde_json::json!({"digest": true}),
            "Europe/Paris",
        )
        .await
        .unwrap();
    queue
        .schedule(
            &pg,
            "beat",
            "*/15 * * * * *",
            &serde_json::json!([1, 2]),
            "UTC",
        )
        .await
        .unwrap();
    let schedules = queue.schedules(&pg).await.unwrap();
    assert_eq!(
        schedules
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>(),
        ["beat", "digest"]
    );
    let digest = &schedules[1];
    assert_eq!(
        (digest.cron.as_str(), digest.time_zone.as_str()),
        ("0 8 * * 1", "Europe/Paris")
    );
    assert_eq!(digest.payload, serde_json::json!({"digest": true}));
    let tick = digest.next_tick.expect("a next tick");
    assert_eq!(tick.weekday(), chrono::Weekday::Mon);
    assert!(tick > Utc::now());

    let error = queue
        .schedule(&pg, "bad", "* * *", &serde_json::json!({}), "UTC")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert_eq!(error.sqlstate(), Some("22023"));
    let error = queue
        .schedule(
            &pg,
            "bad",
            "* * * * *",
            &serde_json::json!({}),
            "Nowhere/Town",
        )
        .await
        .unwrap_err();
    assert_eq!(error.sqlstate(), Some("22023"));

    assert!(queue.unschedule(&pg, "beat").await.unwrap());
    assert!(!queue.unschedule(&pg, "beat").await.unwrap());
    assert_eq!(queue.schedules(&pg).await.unwrap().len(), 1);
}
