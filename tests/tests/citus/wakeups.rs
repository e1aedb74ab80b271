//! Wake-ups on Citus: an enqueue notifies the sessions asleep on its queue on the node where the
//! function runs, whichever node holds the queue's shard (docs/scaling.md, "NOTIFY").

use std::time::Duration;

use futures_util::{stream, StreamExt};
use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, NoTls};

use crate::{Cluster, NODES};

/// Long enough for a notification sent at a commit to arrive on this machine.
const DELIVERED: Duration = Duration::from_secs(5);
/// How long a sleeper that should hear nothing listens.
const QUIET: Duration = Duration::from_secs(1);

/// A session on `node` asleep on `queue` (`LISTEN` on the queue's channel as that node names it,
/// then `inbox_sleep`), and the channels of the notifications it receives.
async fn sleeper(
    cluster: &Cluster,
    node: &str,
    queue: &str,
) -> (Client, mpsc::UnboundedReceiver<String>) {
    let (client, mut connection) = cluster.config(node).connect(NoTls).await.unwrap();
    let (send, receive) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                let _ = send.send(n.channel().to_owned());
            }
        }
    });
    let channel: String = client
        .query_one("SELECT inbox_channel($1::text::regclass)", &[&queue])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .unwrap();
    let slept: bool = client
        .query_one("SELECT inbox_sleep($1::text::regclass)", &[&queue])
        .await
        .unwrap()
        .get(0);
    assert!(slept, "{node}: nothing is due, so the session sleeps");
    (client, receive)
}

/// Whether a notification arrives within `wait`; the others pending are consumed.
async fn notified(receiver: &mut mpsc::UnboundedReceiver<String>, wait: Duration) -> bool {
    let got = tokio::time::timeout(wait, receiver.recv()).await.is_ok();
    while receiver.try_recv().is_ok() {}
    got
}

/// A sleeper on each node; an enqueue through each node in turn wakes that node's sleeper and no
/// other. Then the client's worker, connected to the coordinator and polling only once a minute,
/// is woken by an enqueue through the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn an_enqueue_wakes_the_sleepers_of_the_node_it_runs_on() {
    let cluster = Cluster::from_env();
    let admin = cluster.connect().await;
    admin
        .batch_execute(
            "DROP SCHEMA IF EXISTS woken CASCADE; CREATE SCHEMA woken; \
             SELECT inbox_create_queue('woken.jobs'); \
             CREATE TABLE woken.done (n int NOT NULL); \
             SELECT citus_schema_distribute('woken')",
        )
        .await
        .unwrap();
    let mut sleepers = Vec::new();
    for node in NODES {
        sleepers.push(sleeper(&cluster, node, "woken.jobs").await);
    }
    for (n, producer_node) in NODES.iter().enumerate() {
        let producer = cluster.connect_to(producer_node).await;
        producer
            .execute(
                "SELECT inbox_enqueue('woken.jobs', jsonb_build_object('n', $1::int))",
                &[&(n as i32)],
            )
            .await
            .unwrap();
        for (node, (_, notes)) in NODES.iter().zip(&mut sleepers) {
            let wait = if node == producer_node {
                DELIVERED
            } else {
                QUIET
            };
            assert_eq!(
                notified(notes, wait).await,
                node == producer_node,
                "an enqueue through {producer_node}: notified on {node}"
            );
        }
    }
    drop(sleepers);
    admin.batch_execute("DELETE FROM woken.jobs").await.unwrap();

    let db = PgDatabase::connect_with_size(&cluster.url, Some(3))
        .await
        .unwrap();
    let handler = transactional(|job: Job<serde_json::Value>, tx: &dyn Database| {
        Box::pin(async move {
            tx.execute(
                &Statement::new("INSERT INTO woken.done (n) VALUES ($1)")
                    .bind(job.payload["n"].as_i64().unwrap() as i32),
            )
            .await?;
            Ok(Outcome::ack())
        })
    });
    let worker = Worker::transactional(db, "woken.jobs", handler)
        .workers(1)
        .poll_interval(Duration::from_secs(60))
        .start();
    // The worker found nothing and sleeps (on the coordinator, where it is connected).
    let deadline = tokio::time::Instant::now() + DELIVERED;
    while admin
        .query("SELECT inbox_sleepers('woken.jobs')", &[])
        .await
        .unwrap()
        .is_empty()
    {
        assert!(tokio::time::Instant::now() < deadline, "the worker sleeps");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    admin
        .execute("SELECT inbox_enqueue('woken.jobs', '{\"n\": 7}')", &[])
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + DELIVERED;
    loop {
        let done: i64 = admin
            .query_one("SELECT count(*) FROM woken.done WHERE n = 7", &[])
            .await
            .unwrap()
            .get(0);
        if done == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sleeping worker was not woken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.shutdown(Duration::from_secs(10)).await;
    admin
        .batch_execute("DROP SCHEMA woken CASCADE")
        .await
        .unwrap();
}
