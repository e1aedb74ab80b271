//! Where Citus puts queues and ledgers, and what is refused: a queue must be one shard, with the
//! tables its handlers write; a ledger may be hash-distributed by its key.

use std::collections::HashMap;

use tokio::task::JoinSet;

use crate::{sqlstate, Cluster};

/// A queue or a ledger created by a function in a distributed schema that has no table yet would
/// stay a local table of the coordinator (Citus distributes only top-level CREATE TABLEs):
/// refused with 0A000. Once the schema has a table, a queue and a ledger created there join its
/// shard group. Created in a plain schema that is distributed afterwards, the queue, its ledger
/// and the effect table share one shard group too, and every function routes to its node.
#[tokio::test]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn a_queue_is_one_shard_with_what_its_handlers_write() {
    let cluster = Cluster::from_env();
    let client = cluster.connect().await;
    client
        .batch_execute(
            "DROP SCHEMA IF EXISTS placed, sharded CASCADE; \
             SET citus.enable_schema_based_sharding = on; CREATE SCHEMA sharded; \
             RESET citus.enable_schema_based_sharding",
        )
        .await
        .unwrap();
    for sql in [
        "SELECT inbox_create_queue('sharded.jobs')",
        "SELECT inbox_create_ledger('sharded.seen')",
    ] {
        assert_eq!(sqlstate(&client, sql).await, "0A000", "{sql}");
    }
    let local: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'sharded'::regnamespace",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(local, 0, "the refused tables were rolled back");
    client
        .batch_execute(
            "CREATE TABLE sharded.effects (job bigint NOT NULL); \
             SELECT inbox_create_queue('sharded.jobs'), inbox_create_ledger('sharded.seen'); \
             SELECT inbox_enqueue('sharded.jobs', '{}'); \
             SELECT inbox_retry('sharded.jobs', id, token, error => 'declined') \
               FROM inbox_lease('sharded.jobs');",
        )
        .await
        .unwrap();
    let joined: Vec<(String, String, bool)> = client
        .query(
            "SELECT c.relname::text, p.partmethod::text, p.colocationid = s.colocationid \
               FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid \
               JOIN pg_dist_schema s ON s.schemaid = c.relnamespace \
              WHERE c.relnamespace = 'sharded'::regnamespace ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(
        joined,
        ["effects", "jobs", "seen"].map(|t| (t.to_owned(), "n".to_owned(), true)),
        "one shard each, in the schema's group"
    );
    let errors: serde_json::Value = client
        .query_one("SELECT errors FROM sharded.jobs", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(errors[0]["error"], "declined", "{errors}");

    client
        .batch_execute(
            "CREATE SCHEMA placed; \
             SELECT inbox_create_queue('placed.jobs'), inbox_create_ledger('placed.seen'); \
             CREATE TABLE placed.effects (job bigint NOT NULL); \
             SELECT citus_schema_distribute('placed')",
        )
        .await
        .unwrap();
    let groups: Vec<(String, String, i32)> = client
        .query(
            "SELECT logicalrelid::text, partmethod::text, colocationid FROM pg_dist_partition \
              WHERE logicalrelid::text LIKE 'placed.%' ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(groups.len(), 3, "{groups:?}");
    assert!(
        groups.iter().all(|g| g.1 == "n" && g.2 == groups[0].2),
        "single-shard, one colocation group: {groups:?}"
    );

    // The lease's statement is one task on the queue's node.
    let plan: Vec<String> = client
        .query(
            "EXPLAIN SELECT id FROM placed.jobs WHERE locked_until <= now() \
              ORDER BY locked_until, id LIMIT 1 FOR UPDATE SKIP LOCKED",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        plan.iter().any(|line| line.contains("Task Count: 1")),
        "{plan:#?}"
    );

    // Enqueue (one and a batch, in order), lease, ack, retry, dead-letter, a locked delivery whose
    // effect and ack commit together, and the counts, all through the coordinator.
    let ids: Vec<i64> = client
        .query(
            "SELECT inbox_enqueue('placed.jobs', '{\"n\": 0}') \
             UNION ALL SELECT * FROM inbox_enqueue_batch('placed.jobs', \
                 ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}']::jsonb[])",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    let leased: Vec<(i64, i64, serde_json::Value)> = client
        .query(
            "SELECT id, token, payload FROM inbox_lease('placed.jobs', 2)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(leased.iter().map(|l| l.0).collect::<Vec<_>>(), vec![1, 2]);
    let settled: (bool, bool) = {
        let row = client
            .query_one(
                "SELECT inbox_ack('placed.jobs', $1, $2), inbox_retry('placed.jobs', $3, $4, '0', 'again')",
                &[&leased[0].0, &leased[0].1, &leased[1].0, &leased[1].1],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(settled, (true, true));
    assert!(
        !client
            .query_one(
                "SELECT inbox_ack('placed.jobs', $1, $2)",
                &[&leased[0].0, &leased[0].1]
            )
            .await
            .unwrap()
            .get::<_, bool>(0),
        "a second ack of one delivery commits nothing"
    );
    client.batch_execute("BEGIN").await.unwrap();
    let locked = client
        .query_one("SELECT id, token FROM inbox_lock('placed.jobs', 1)", &[])
        .await
        .unwrap();
    let (id, token): (i64, i64) = (locked.get(0), locked.get(1));
    client
        .execute("INSERT INTO placed.effects VALUES ($1)", &[&id])
        .await
        .unwrap();
    client
        .query_one("SELECT inbox_ack('placed.jobs', $1, $2)", &[&id, &token])
        .await
        .unwrap();
    client.batch_execute("COMMIT").await.unwrap();
    let row = client
        .query_one(
            "SELECT ready, leased, dead FROM inbox_stats('placed.jobs')",
            &[],
        )
        .await
        .unwrap();
    let effects: i64 = client
        .query_one("SELECT count(*) FROM placed.effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
            effects
        ),
        (2, 0, 0, 1)
    );
    let claims = client
        .query_one(
            "SELECT inbox_claim('placed.seen', 'k'), inbox_claim('placed.seen', 'k'), \
                    inbox_seen('placed.seen', 'k')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            claims.get::<_, bool>(0),
            claims.get::<_, bool>(1),
            claims.get::<_, bool>(2)
        ),
        (true, false, true)
    );

    // Workflows and limits write the extension's own tables, local to each node, when a job
    // settles: refused on a distributed queue.
    for sql in [
        "SELECT inbox_set_concurrency('placed.jobs', 2)",
        "SELECT inbox_set_rate_limit('placed.jobs', 10, '1 second')",
        "SELECT inbox_keep_results('placed.jobs', '1 hour')",
        "SELECT inbox_enqueue_after('placed.jobs', '{}', ARRAY[inbox_job('placed.jobs', 4)])",
        "SELECT inbox_batch_add(inbox_batch_open(), 'placed.jobs', '{}')",
    ] {
        assert_eq!(sqlstate(&client, sql).await, "0A000", "{sql}");
    }

    // A queue spread over shards (a table of the user's: the unique index on `key` rules that
    // out for inbox_create_queue's), or copied to every node, is refused at its next use.
    client
        .batch_execute(
            "DROP TABLE IF EXISTS public.hashed_jobs, public.everywhere_jobs; \
             CREATE TABLE public.hashed_jobs (id bigint PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                 locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL); \
             SELECT inbox_create_queue('public.everywhere_jobs'); \
             SELECT create_distributed_table('public.hashed_jobs', 'id'); \
             SELECT create_reference_table('public.everywhere_jobs')",
        )
        .await
        .unwrap();
    let fresh = cluster.connect().await;
    for sql in [
        "SELECT inbox_create_queue('public.hashed_jobs')",
        "SELECT inbox_create_queue('public.everywhere_jobs')",
        "SELECT inbox_enqueue('public.hashed_jobs', '{}')",
    ] {
        let code = sqlstate(&fresh, sql).await;
        assert_eq!(code, "0A000", "{sql}");
    }
    client
        .batch_execute(
            "DROP TABLE public.hashed_jobs, public.everywhere_jobs; \
             DROP SCHEMA placed, sharded CASCADE",
        )
        .await
        .unwrap();
}

/// 16 connections claim the same 200 keys of a ledger hash-distributed by `event_key`, each key
/// on its shard: every key has exactly one winner, and the ledger one row per key. It is purged
/// shard by shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Citus cluster: scripts/citus.sh test"]
async fn claims_on_a_hash_distributed_ledger_have_one_winner_per_key() {
    const CONNECTIONS: usize = 16;
    const KEYS: usize = 200;
    let cluster = Cluster::from_env();
    let admin = cluster.connect().await;
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS public.payments_seen; \
             SELECT inbox_create_ledger('public.payments_seen'); \
             SELECT create_distributed_table('public.payments_seen', 'event_key')",
        )
        .await
        .unwrap();
    let shards: i64 = admin
        .query_one(
            "SELECT count(DISTINCT nodeport) FROM citus_shards \
              WHERE table_name = 'public.payments_seen'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(shards, 2, "the ledger's shards are on both workers");
    let mut claimers = JoinSet::new();
    for connection in 0..CONNECTIONS {
        let client = cluster.connect().await;
        claimers.spawn(async move {
            let mut won = Vec::new();
            // Each connection walks the keys from its own offset, so that they collide.
            for i in 0..KEYS {
                let key = format!("payment-{}", (i + connection * 13) % KEYS);
                let claimed: bool = client
                    .query_one("SELECT inbox_claim('public.payments_seen', $1)", &[&key])
                    .await
                    .unwrap()
                    .get(0);
                if claimed {
                    won.push(key);
                }
            }
            won
        });
    }
    let mut winners: HashMap<String, usize> = HashMap::new();
    while let Some(won) = claimers.join_next().await {
        for key in won.unwrap() {
            *winners.entry(key).or_default() += 1;
        }
    }
    assert_eq!(winners.len(), KEYS);
    assert!(winners.values().all(|&n| n == 1), "{winners:?}");
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM public.payments_seen", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, KEYS as i64);

    // A purge deletes by ctid, which Citus cannot plan across shards: refused on the
    // distributed table, it runs on each shard, where the shard is a plain table.
    assert_eq!(
        sqlstate(
            &admin,
            "SELECT inbox_purge('public.payments_seen', now() + interval '1 day')"
        )
        .await,
        "0A000"
    );
    let purged: i64 = admin
        .query_one(
            "SELECT sum(result::int8)::int8 FROM run_command_on_shards('public.payments_seen', \
               $$SELECT inbox_purge('%s', now() + interval '1 day', 10000)$$)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(purged, KEYS as i64);
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM public.payments_seen", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    admin
        .batch_execute("DROP TABLE public.payments_seen")
        .await
        .unwrap();
}
