//! The refunds workload on eight tenants, each a distributed schema (its queue and its refunds
//! table on one node), spread over both worker nodes and drained through the coordinator by the
//! default transactional worker while the cluster is disturbed: a worker node crashed and
//! restarted; a tenant's schema moved to the other node; and, with each delivery also writing an
//! audit row on the other node (two-phase commit), the coordinator crashed and restarted. Every
//! refund is written exactly once. The refunds and audit tables have no key, so a delivery
//! committed twice would show.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use inbox_client::worker::{transactional, Job, Outcome, Worker};
use inbox_client::{Database, PgDatabase, Statement};
use serde::Deserialize;
use tokio_postgres::Client;

use crate::{Cluster, NODES};

const TENANTS: usize = 8;
const ORDERS: i64 = 400;

#[derive(Deserialize)]
struct Refund {
    order: i64,
    amount_cents: i32,
}

/// How many jobs are left, over every tenant, read through the coordinator.
async fn left(admin: &Client) -> Result<i64, tokio_postgres::Error> {
    let sql = (0..TENANTS)
        .map(|t| format!("(SELECT count(*) FROM tenant_{t}.refund_jobs)"))
        .collect::<Vec<_>>()
        .join(" + ");
    Ok(admin.query_one(&format!("SELECT {sql}"), &[]).await?.get(0))
}

/// Creates the tenants (each in a plain schema, then distributed with its tables) and fills
/// their queues; with `audit`, a single-shard table `audit.refunds` colocated with none of them.
async fn set_up(admin: &Client, audit: bool) {
    admin
        .batch_execute("DROP SCHEMA IF EXISTS audit CASCADE")
        .await
        .unwrap();
    for tenant in 0..TENANTS {
        admin
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS tenant_{tenant} CASCADE; CREATE SCHEMA tenant_{tenant}; \
                 SELECT inbox_create_queue('tenant_{tenant}.refund_jobs'); \
                 CREATE TABLE tenant_{tenant}.refunds (order_id bigint NOT NULL, amount_cents int NOT NULL); \
                 SELECT citus_schema_distribute('tenant_{tenant}')"
            ))
            .await
            .unwrap();
    }
    if audit {
        admin
            .batch_execute(
                "CREATE SCHEMA audit; \
                 CREATE TABLE audit.refunds (tenant int NOT NULL, order_id bigint NOT NULL); \
                 SELECT create_distributed_table('audit.refunds', NULL, colocate_with => 'none')",
            )
            .await
            .unwrap();
    }
    let nodes: i64 = admin
        .query_one(
            "SELECT count(DISTINCT nodeport) FROM citus_shards \
              WHERE table_name::text LIKE 'tenant\\__.refund_jobs'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(nodes, 2, "the tenants are spread over both worker nodes");
    for tenant in 0..TENANTS {
        admin
            .execute(
                &format!(
                    "SELECT count(*) FROM inbox_enqueue_batch('tenant_{tenant}.refund_jobs', \
                       ARRAY(SELECT jsonb_build_object('order', o, 'amount_cents', 100 + o) \
                               FROM generate_series(0, $1::int8 - 1) AS o ORDER BY o))"
                ),
                &[&ORDERS],
            )
            .await
            .unwrap();
    }
}

/// Drains every tenant's queue with its own worker (4 deliveries at once) while `disturb` runs,
/// then checks each tenant's refunds (and audit rows, with `audit`): one per order.
async fn drain_while<F: Future<Output = ()>>(cluster: &Cluster, audit: bool, disturb: F) {
    let admin = cluster.connect().await;
    set_up(&admin, audit).await;
    let mut workers = Vec::new();
    for tenant in 0..TENANTS {
        let db = PgDatabase::connect_with_size(&cluster.url, Some(6))
            .await
            .unwrap();
        let mut writes = vec![format!(
            "INSERT INTO tenant_{tenant}.refunds (order_id, amount_cents) VALUES ($1, $2)"
        )];
        if audit {
            writes.push(format!(
                "INSERT INTO audit.refunds (tenant, order_id) VALUES ({tenant}, $1)"
            ));
        }
        let handler = transactional(move |job: Job<Refund>, tx: &dyn Database| {
            let writes = writes.clone();
            Box::pin(async move {
                tx.execute(
                    &Statement::new(writes[0].clone())
                        .bind(job.payload.order)
                        .bind(job.payload.amount_cents),
                )
                .await?;
                if let Some(audit) = writes.get(1) {
                    tx.execute(&Statement::new(audit.clone()).bind(job.payload.order))
                        .await?;
                }
                Ok(Outcome::ack())
            })
        });
        workers.push(
            Worker::transactional(db, format!("tenant_{tenant}.refund_jobs"), handler)
                .workers(4)
                .lease(Duration::from_secs(3))
                .poll_interval(Duration::from_millis(200))
                .start(),
        );
    }

    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = left(&admin).await.unwrap();
    assert!(before > 0, "the disturbance comes while jobs are left");
    disturb.await;

    // A new connection: the coordinator may have restarted.
    let admin = cluster.connect().await;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let left = left(&admin).await;
        if left.as_ref().is_ok_and(|&n| n == 0) {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: {left:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for worker in workers {
        worker.shutdown(Duration::from_secs(10)).await;
    }
    for tenant in 0..TENANTS {
        let row = admin
            .query_one(
                &format!(
                    "SELECT count(*), count(DISTINCT order_id), \
                            count(*) FILTER (WHERE amount_cents <> 100 + order_id) \
                       FROM tenant_{tenant}.refunds"
                ),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            (
                row.get::<_, i64>(0),
                row.get::<_, i64>(1),
                row.get::<_, i64>(2)
            ),
            (ORDERS, ORDERS, 0),
            "tenant_{tenant}: refunds written, distinct orders, wrong amounts"
        );
        if audit {
            let row = admin
                .query_one(
                    "SELECT count(*), count(DISTINCT order_id) FROM audit.refunds WHERE tenant = $1",
                    &[&(tenant as i32)],
                )
                .await
                .unwrap();
            assert_eq!(
                (row.get::<_, i64>(0), row.get::<_, i64>(1)),
                (ORDERS, ORDERS),
                "tenant_{tenant}: audit rows, distinct orders"
            );
        }
    }
    for tenant in 0..TENANTS {
        admin
            .batch_execute(&format!("DROP SCHEMA tenant_{tenant} CASCADE"))
            .await
            .unwrap();
    }
    admin
        .batch_execute("DROP SCHEMA IF EXISTS audit CASCADE")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn refunds_commit_once_through_a_worker_node_crash() {
    let cluster = Cluster::from_env();
    drain_while(&cluster, false, async {
        cluster.crash("worker1", Duration::from_secs(2)).await;
    })
    .await;
}

/// `citus_schema_move` of a tenant to the other node while its worker runs (writes to the
/// schema block during the move, then go to the new node).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn refunds_commit_once_while_a_tenant_moves_to_the_other_node() {
    let cluster = Cluster::from_env();
    let mover = cluster.connect().await;
    drain_while(&cluster, false, async {
        let row = mover
            .query_one(
                "SELECT s.nodeport, (SELECT min(nodeport) FROM pg_dist_node \
                                      WHERE nodeport <> s.nodeport AND noderole = 'primary' \
                                        AND groupid <> 0) \
                   FROM citus_shards s WHERE s.table_name = 'tenant_0.refund_jobs'::regclass",
                &[],
            )
            .await
            .unwrap();
        let (from, to): (i32, i32) = (row.get(0), row.get(1));
        mover
            .execute(
                "SELECT citus_schema_move('tenant_0', '127.0.0.1', $1, \
                                          shard_transfer_mode => 'block_writes')",
                &[&to],
            )
            .await
            .unwrap();
        let now: i32 = mover
            .query_one(
                "SELECT nodeport FROM citus_shards WHERE table_name = 'tenant_0.refund_jobs'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(now, to, "tenant_0 moved from {from} to {to}");
    })
    .await;
}

/// Every delivery also writes `audit.refunds` on the other node, so Citus commits it with
/// two-phase commit; the coordinator is crashed between the two phases of some deliveries and
/// started again. To catch them there, the coordinator's commits wait for a standby that does not
/// exist (synchronous replication): a delivery prepared on the worker nodes and committed in the
/// coordinator's log waits before its second phase. With the automatic recovery held back, the
/// test sees what the crash left prepared on the worker nodes, then runs the recovery, which
/// settles each of them: the deliveries it commits are there once, those it rolls back run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn refunds_written_on_two_nodes_commit_once_through_a_coordinator_crash() {
    let cluster = Cluster::from_env();
    drain_while(&cluster, true, async {
        set_on_coordinator(&cluster, "citus.recover_2pc_interval", Some("-1")).await;
        set_on_coordinator(&cluster, "synchronous_standby_names", Some("inbox_nobody")).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while prepared_before(&cluster, SystemTime::now()).await == 0 {
            assert!(
                Instant::now() < deadline,
                "no delivery waits between its phases"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let stopped = cluster.crash("coordinator", Duration::from_secs(1)).await;
        set_on_coordinator(&cluster, "synchronous_standby_names", None).await;
        let left_prepared = prepared_before(&cluster, stopped).await;
        assert!(left_prepared > 0, "the crash left no transaction prepared");
        let coordinator = cluster.connect().await;
        let recovered: i32 = coordinator
            .query_one("SELECT recover_prepared_transactions()", &[])
            .await
            .unwrap()
            .get(0);
        assert!(
            recovered as usize >= left_prepared,
            "{left_prepared} left prepared, {recovered} recovered"
        );
        assert_eq!(prepared_before(&cluster, stopped).await, 0);
        println!("the crash left {left_prepared} prepared; the recovery settled {recovered}");
        set_on_coordinator(&cluster, "citus.recover_2pc_interval", None).await;
    })
    .await;
}

/// Sets the coordinator's `setting` (None: back to its configuration file's), across restarts.
async fn set_on_coordinator(cluster: &Cluster, setting: &str, value: Option<&str>) {
    let coordinator = cluster.connect().await;
    // Two queries: a query string of several statements is one transaction, which ALTER SYSTEM
    // refuses.
    let sql = match value {
        Some(value) => format!("ALTER SYSTEM SET {setting} = '{value}'"),
        None => format!("ALTER SYSTEM RESET {setting}"),
    };
    coordinator.batch_execute(&sql).await.unwrap();
    coordinator
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
}

/// How many of Citus's transactions the worker nodes hold prepared since before `at`.
async fn prepared_before(cluster: &Cluster, at: SystemTime) -> usize {
    let mut prepared = 0;
    for node in &NODES[1..] {
        let client = cluster.connect_to(node).await;
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_prepared_xacts \
                  WHERE database = current_database() AND gid LIKE 'citus\\_%' AND prepared < $1",
                &[&at],
            )
            .await
            .unwrap()
            .get(0);
        prepared += n as usize;
    }
    prepared
}
