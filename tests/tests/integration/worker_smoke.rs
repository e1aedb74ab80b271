//! The worker end to end on a small queue: every mode and claim form finishes its jobs.

use std::time::Duration;

use inbox_client::worker::{transactional, Claim, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Queue, Statement};
use inbox_tests::TestDb;

async fn setup(db: &TestDb, jobs: i64) -> PgDatabase {
    let pg = PgDatabase::from_pool_and_config(db.pool(8), db.config());
    let queue = Queue::new("jobs");
    pg.execute(&queue.create_statement()).await.unwrap();
    pg.execute(&Statement::new("CREATE TABLE done (n bigint PRIMARY KEY)"))
        .await
        .unwrap();
    for n in 0..jobs {
        queue.enqueue(&pg, &n, None, None).await.unwrap();
    }
    pg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_form_finishes_its_jobs() {
    for (claim, group) in [
        (Claim::Lease, 1),
        (Claim::Lock, 1),
        (Claim::Lease, 8),
        (Claim::Lock, 8),
    ] {
        let db = TestDb::new().await;
        let pg = setup(&db, 200).await;
        let handler = transactional(|job: Job<i64>, tx: &dyn Database| {
            Box::pin(async move {
                tx.execute(&Statement::new("INSERT INTO done VALUES ($1)").bind(job.payload))
                    .await?;
                Ok(Outcome::ack())
            })
        });
        let stats = Worker::transactional(pg.clone(), "jobs", handler)
            .workers(4)
            .claim(claim)
            .group_size(group)
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!(stats.acked, 200, "{claim:?} x{group}: {stats:?}");
        let done = pg
            .query(&Statement::new("SELECT count(*) AS n FROM done"))
            .await
            .unwrap();
        assert_eq!(done.one().unwrap().get::<i64>("n").unwrap(), 200);
    }
    let db = TestDb::new().await;
    let pg = setup(&db, 500).await;
    let stats = Worker::plain(pg.clone(), "jobs", |_job: Job<i64>| async {
        Ok(Outcome::ack())
    })
    .workers(16)
    .poll_interval(Duration::from_millis(50))
    .run_until_idle()
    .await
    .unwrap();
    assert_eq!(stats.acked, 500, "{stats:?}");
}
