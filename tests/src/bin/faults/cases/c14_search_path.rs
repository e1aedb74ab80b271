//! Case 14, search_path hijacks, privileges and row-level security, in a database of the case's
//! own. Clones of every `pg_catalog` operator on the types the extension compares, of the
//! functions its statements call (`now()`, `unnest`, `hashtext`, the advisory locks, ...) and
//! domains named like the types it casts to are created in `public`, each recording that it ran,
//! and sessions put `public` (and `pg_temp`, with temporary tables named like the real ones)
//! before `pg_catalog`; then every function of the API runs, including `inbox_create_queue` and
//! `inbox_create_ledger`, priorities, ordered groups and the worker's calls. What must hold: no
//! hostile object ever runs, writes land in the tables named, the created tables' defaults use
//! only `pg_catalog`; no function is SECURITY DEFINER, the functions on the job path set nothing
//! (their statements are qualified) and every other one pins its search_path; a role without the
//! table privileges gets 42501 (also after the owner's calls prepared the plans), and row-level
//! security limits what a role's leases, stats and settlements see.

use tokio_postgres::Client;

use crate::common::{connect, describe, sqlstate, Ctx, Result, Row};

pub const NAME: &str = "search_path, privileges, RLS";

/// The functions on the job path, which pin no setting (a `SET` clause costs every call a save and
/// restore of the setting): every name their statements use is qualified instead.
const UNPINNED: &[&str] = &[
    "inbox_claim(",
    "inbox_claim_or_fail(",
    "inbox_seen(",
    "inbox_enqueue(",
    "inbox_enqueue_bytes(",
    "inbox_enqueue_batch(",
    "inbox_enqueue_batch_bytes(",
    "inbox_lease(",
    "inbox_lock(",
    "inbox__take_unlimited(",
    "inbox_ack(",
    "inbox_ack_batch(",
    "inbox_retry(",
    "inbox_dead(",
    "inbox_extend(",
    "inbox_fence(",
    "inbox_ack_all(",
    // A producer's transaction calls it: native in this build, its statements qualified.
    "inbox_publish(",
    "inbox_publish_bytes(",
];

/// Hostile objects in `public`, each recording that it ran: a clone of every `pg_catalog`
/// operator on the types the extension compares and computes with, clones of the functions its
/// statements call, and domains named like the types it casts to, whose check records.
const HOSTILE: &str = r#"
CREATE TABLE public.hijacked (what text);
GRANT INSERT ON public.hijacked TO PUBLIC;
CREATE FUNCTION public.evil(what text) RETURNS void LANGUAGE plpgsql AS
  $$ BEGIN INSERT INTO public.hijacked VALUES (what); END $$;
CREATE FUNCTION public.evil_check(what text) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM public.evil(what); RETURN true; END $$;
CREATE TABLE public.hostile_count (kind text, n int);
DO $do$
DECLARE
  types regtype[] := ARRAY['int2', 'int4', 'int8', 'text', 'varchar', 'name', 'oid', 'tid',
                           'bool', 'timestamptz', 'interval', 'jsonb', 'bytea', '"char"',
                           'int8[]', 'text[]', 'regclass']::regtype[];
  o record;
  f record;
  fn text;
  made int := 0;
BEGIN
  FOR o IN SELECT p.oid, p.oprname, p.oprleft, p.oprright, p.oprresult FROM pg_operator p
            WHERE p.oprnamespace = 'pg_catalog'::regnamespace
              AND (p.oprleft = 0 OR p.oprleft = ANY (types)) AND p.oprright = ANY (types)
  LOOP
    fn := 'hostile_op_' || o.oid;
    EXECUTE format('CREATE FUNCTION public.%I(%s) RETURNS %s LANGUAGE plpgsql AS %L', fn,
      concat_ws(', ', CASE WHEN o.oprleft <> 0 THEN o.oprleft::regtype::text END,
                o.oprright::regtype::text),
      o.oprresult::regtype,
      format('BEGIN PERFORM public.evil(%L); RETURN NULL; END', o.oid::regoperator::text));
    EXECUTE format('CREATE OPERATOR public.%s (%s RIGHTARG = %s, FUNCTION = public.%I)',
      o.oprname,
      CASE WHEN o.oprleft <> 0 THEN format('LEFTARG = %s,', o.oprleft::regtype) ELSE '' END,
      o.oprright::regtype, fn);
    made := made + 1;
  END LOOP;
  INSERT INTO public.hostile_count VALUES ('operators', made);
  made := 0;
  FOR f IN SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args,
                  pg_get_function_result(p.oid) AS result, p.proretset
             FROM pg_proc p
            WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.prokind = 'f'
              AND p.proname IN ('now', 'clock_timestamp', 'statement_timestamp', 'pg_notify',
                                'nextval', 'length', 'hashtext', 'unnest', 'pg_advisory_xact_lock',
                                'pg_advisory_xact_lock_shared', 'format', 'to_regclass',
                                'current_database', 'pg_has_role', 'coalesce', 'greatest',
                                'jsonb_build_object', 'array_agg', 'pg_stat_get_dead_tuples',
                                'pg_stat_get_live_tuples', 'int8', 'int4', 'text', 'timestamptz')
  LOOP
    BEGIN
      EXECUTE format('CREATE FUNCTION public.%I(%s) RETURNS %s LANGUAGE plpgsql AS %L',
        f.proname, f.args, f.result,
        format('BEGIN PERFORM public.evil(%L); %s END', f.proname || '(' || f.args || ')',
               CASE WHEN f.proretset OR f.result = 'void' THEN 'RETURN;' ELSE 'RETURN NULL;' END));
      made := made + 1;
    EXCEPTION WHEN others THEN
      NULL; -- a signature plpgsql cannot take (internal, "any"): not one the statements call
    END;
  END LOOP;
  INSERT INTO public.hostile_count VALUES ('functions', made);
  made := 0;
  FOREACH fn IN ARRAY ARRAY['int2', 'int4', 'int8', 'text', 'timestamptz', 'interval', 'jsonb',
                            'bytea', 'bool', 'oid', 'regclass'] LOOP
    EXECUTE format('CREATE DOMAIN public.%I AS pg_catalog.%I CHECK (public.evil_check(%L))',
                   fn, fn, 'type ' || fn);
    made := made + 1;
  END LOOP;
  INSERT INTO public.hostile_count VALUES ('types', made);
END
$do$;
"#;

/// Runs `sql`, expecting it to work; a failure is recorded in `row`.
async fn works(row: &mut Row, client: &Client, what: &str, sql: &str) -> Vec<tokio_postgres::Row> {
    row.inputs += 1;
    match client.query(sql, &[]).await {
        Ok(rows) => rows,
        Err(e) => {
            row.failures
                .push(format!("{what}: {sql}: {}", describe(&e)));
            Vec::new()
        }
    }
}

/// Runs `sql`, expecting SQLSTATE `code`.
async fn refused(row: &mut Row, client: &Client, what: &str, sql: &str, code: &str) {
    row.inputs += 1;
    match client.query(sql, &[]).await {
        Ok(_) => row
            .failures
            .push(format!("{what}: {sql}: succeeded; {code} expected")),
        Err(e) if sqlstate(&e) == code => {}
        Err(e) => row
            .failures
            .push(format!("{what}: {sql}: {}; {code} expected", describe(&e))),
    }
}

async fn one_i64(client: &Client, sql: &str) -> Result<i64> {
    Ok(client.query_one(sql, &[]).await?.get(0))
}

/// Every API call, with `search_path` set to `path` in a session with hostile objects.
async fn hijack(row: &mut Row, url: &str, variant: u8, path: &str) -> Result<()> {
    let what = format!("search_path {path}");
    let client = connect(url).await?;
    let (q, l) = (format!("q{variant}"), format!("l{variant}"));
    // Temporary tables named like the real ones, and like the catalogs the extension reads.
    let shadowed = variant == 2;
    if shadowed {
        client
        .batch_execute(&format!(
            "CREATE TEMP TABLE {q} (id bigint, attempt int, locked_until timestamptz, payload jsonb, \
             key text, last_error text, leased_at timestamptz); \
             CREATE TEMP TABLE {l} (event_key text PRIMARY KEY, seen_at timestamptz)"
        ))
        .await?;
        for catalog in [
            "pg_class",
            "pg_attribute",
            "pg_index",
            "pg_namespace",
            "pg_type",
        ] {
            let _ = client
                .batch_execute(&format!(
                    "CREATE TEMP TABLE {catalog} (oid oid, relname name)"
                ))
                .await;
        }
    }
    client
        .batch_execute(&format!("SET search_path = {path}"))
        .await?;
    // Unqualified names resolve in the caller's search_path, as CREATE TABLE's do: with pg_temp
    // first (and temporary tables of those names), the names are qualified.
    let schema = if variant == 1 { "" } else { "public." };
    for create in [
        format!("SELECT inbox_create_queue('{schema}{q}')"),
        format!("SELECT inbox_create_ledger('{schema}{l}')"),
        format!("SELECT inbox_create_queue('{schema}{q}')"),
        format!("SELECT inbox_create_ledger('{schema}{l}')"),
    ] {
        works(row, &client, &what, &create).await;
    }
    let (pq, pl) = (format!("'public.{q}'"), format!("'public.{l}'"));
    let calls = [
        format!("SELECT inbox_enqueue({pq}, '{{\"n\": 1}}'::pg_catalog.jsonb)"),
        format!(
            "SELECT inbox_enqueue({pq}, '{{\"n\": 2}}'::pg_catalog.jsonb, pg_catalog.now(), 'key-2')"
        ),
        format!(
            "SELECT * FROM inbox_enqueue_batch({pq}, \
             ARRAY['{{}}', '{{}}', '{{}}']::pg_catalog.jsonb[])"
        ),
        format!("SELECT * FROM inbox_stats({pq})"),
        format!("SELECT inbox_channel({pq})"),
        format!("SELECT inbox_claim({pl}, 'k')"),
        format!("SELECT inbox_claim_or_fail({pl}, 'k2')"),
        format!("SELECT inbox_seen({pl}, 'k')"),
        format!("SELECT inbox_purge({pl}, pg_catalog.now() OPERATOR(pg_catalog.-) interval '1 day')"),
    ];
    for call in &calls {
        works(row, &client, &what, call).await;
    }
    let leased = works(
        row,
        &client,
        &what,
        &format!("SELECT id, token FROM inbox_lease({pq}, 4, '1 minute')"),
    )
    .await;
    let jobs: Vec<(i64, i64)> = leased.iter().map(|r| (r.get(0), r.get(1))).collect();
    row.check(jobs.len() == 4, || {
        format!("{what}: leased {} of the 4 due jobs", jobs.len())
    });
    for (i, (id, token)) in jobs.iter().enumerate() {
        works(
            row,
            &client,
            &what,
            &format!("SELECT inbox_extend({pq}, {id}, {token}, '1 minute')"),
        )
        .await;
        let settle = match i {
            0 => format!("SELECT inbox_ack({pq}, {id}, {token})"),
            1 => format!("SELECT inbox_retry({pq}, {id}, {token}, '0 seconds', 'again', 5)"),
            2 => format!("SELECT inbox_dead({pq}, {id}, {token}, 'dead')"),
            _ => {
                format!(
                    "SELECT inbox_ack_batch({pq}, ARRAY[{id}]::pg_catalog.int8[], \
                     ARRAY[{token}]::pg_catalog.int8[])"
                )
            }
        };
        let settled = works(row, &client, &what, &settle).await;
        row.check(
            settled.first().is_some_and(|r| {
                r.try_get::<_, bool>(0)
                    .unwrap_or_else(|_| r.get::<_, i64>(0) == 1)
            }),
            || format!("{what}: {settle} was refused"),
        );
    }
    // Locks, priorities, ordered groups (their locks and promotions) and the worker's calls, in
    // one transaction rolled back.
    client.batch_execute("BEGIN").await?;
    for call in [
        format!("SELECT inbox_enqueue({pq}, '{{}}'::pg_catalog.jsonb, priority => 5, group_key => 'g1')"),
        format!("SELECT inbox_enqueue({pq}, '{{}}'::pg_catalog.jsonb, group_key => 'g1')"),
        format!(
            "SELECT * FROM inbox_enqueue_batch({pq}, ARRAY['{{}}', '{{}}']::pg_catalog.jsonb[], \
             group_keys => ARRAY['g2', 'g2'])"
        ),
    ] {
        works(row, &client, &what, &call).await;
    }
    let locked = works(
        row,
        &client,
        &what,
        &format!("SELECT id, token FROM inbox_lock({pq}, 10)"),
    )
    .await;
    let jobs: Vec<(i64, i64)> = locked.iter().map(|r| (r.get(0), r.get(1))).collect();
    row.check(jobs.len() >= 3, || {
        format!(
            "{what}: locked {} jobs, the two groups' heads and the retried job expected",
            jobs.len()
        )
    });
    if let Some(((first, first_token), rest)) = jobs.split_first() {
        works(
            row,
            &client,
            &what,
            &format!("SELECT inbox_ack({pq}, {first}, {first_token})"),
        )
        .await;
        let ids: Vec<String> = rest.iter().map(|(id, _)| id.to_string()).collect();
        let tokens: Vec<String> = rest.iter().map(|(_, token)| token.to_string()).collect();
        let arrays = format!(
            "ARRAY[{}]::pg_catalog.int8[], ARRAY[{}]::pg_catalog.int8[]",
            ids.join(", "),
            tokens.join(", ")
        );
        let fenced = works(
            row,
            &client,
            &what,
            &format!("SELECT * FROM inbox_fence({pq}, {arrays})"),
        )
        .await;
        row.check(fenced.len() == rest.len(), || {
            format!(
                "{what}: the fence held {} of {} locked jobs",
                fenced.len(),
                rest.len()
            )
        });
        works(
            row,
            &client,
            &what,
            &format!("SELECT inbox_ack_all({pq}, {arrays})"),
        )
        .await;
    }
    // Pausing, limits, cancelling and the outbox's publishes, rolled back too.
    let po = format!("'public.{q}_events'");
    for call in [
        format!("SELECT inbox_pause({pq})"),
        format!("SELECT * FROM inbox_lease({pq}, 10, '1 minute')"),
        format!("SELECT inbox_paused_since({pq})"),
        format!("SELECT inbox_resume({pq})"),
        format!("SELECT inbox_set_concurrency({pq}, 2)"),
        format!("SELECT inbox_set_rate_limit({pq}, 5, '1 minute')"),
        format!("SELECT * FROM inbox_lease({pq}, 10, '1 minute')"),
        format!("SELECT * FROM inbox_limits({pq})"),
        format!("SELECT inbox_set_concurrency({pq}, 1, per_key => 'customer')"),
        format!("SELECT * FROM inbox_lease({pq}, 10, '1 minute')"),
        format!("SELECT * FROM inbox_limits({pq})"),
        format!("SELECT inbox_cancel({pq}, id) FROM public.{q} LIMIT 1"),
        format!("SELECT inbox_create_outbox({po})"),
        format!(
            "SELECT inbox_publish({po}, 'events.a', '{{}}'::pg_catalog.jsonb, 'k', \
             '{{\"h\": \"v\"}}'::pg_catalog.jsonb)"
        ),
        format!("SELECT inbox_publish_bytes({po}, 'events.b', '\\x00'::pg_catalog.bytea)"),
        format!("SELECT * FROM inbox_relay_claim({po}, 'relay', 10, '1 minute')"),
    ] {
        works(row, &client, &what, &call).await;
    }
    client.batch_execute("ROLLBACK").await?;
    let hijacked: Vec<String> = client
        .query("SELECT DISTINCT what FROM public.hijacked", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    row.faults += 1;
    row.check(hijacked.is_empty(), || {
        format!("{what}: hostile objects ran: {hijacked:?}")
    });
    let real = one_i64(
        &client,
        &format!("SELECT pg_catalog.count(*) FROM public.{q}"),
    )
    .await?;
    let shadow = if shadowed {
        one_i64(
            &client,
            &format!("SELECT pg_catalog.count(*) FROM pg_temp.{q}"),
        )
        .await?
    } else {
        0
    };
    row.check(real == 3 && shadow == 0, || {
        format!("{what}: public.{q} has {real} jobs (3 expected), the temporary {q} {shadow}")
    });
    let placed = one_i64(
        &client,
        &format!(
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) ANY \
             (ARRAY['public.{q}'::pg_catalog.regclass, 'public.{l}'::pg_catalog.regclass]) \
             AND c.relpersistence OPERATOR(pg_catalog.=) 'p' \
             AND c.relnamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace"
        ),
    )
    .await?;
    row.check(placed == 2, || {
        format!("{what}: the created tables are not both permanent tables in public")
    });
    let foreign = one_i64(
        &client,
        &format!(
            "SELECT pg_catalog.count(*) FROM pg_catalog.pg_depend d \
             JOIN pg_catalog.pg_attrdef a ON a.oid OPERATOR(pg_catalog.=) d.objid \
             JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) d.refobjid \
             WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass \
             AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass \
             AND a.adrelid OPERATOR(pg_catalog.=) ANY (ARRAY['public.{q}'::pg_catalog.regclass, 'public.{l}'::pg_catalog.regclass]) \
             AND p.pronamespace OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace"
        ),
    )
    .await?;
    row.check(foreign == 0, || {
        format!("{what}: {foreign} column defaults of the created tables call functions outside pg_catalog")
    });
    Ok(())
}

async fn definitions(row: &mut Row, client: &Client) -> Result<()> {
    let rows = client
        .query(
            "SELECT p.oid::regprocedure::text, p.prosecdef, \
                    coalesce(array_to_string(p.proconfig, ';'), '') \
             FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid \
             AND d.deptype = 'e' JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'inbox'",
            &[],
        )
        .await?;
    row.check(rows.len() >= 15, || {
        format!("only {} functions belong to the extension", rows.len())
    });
    for function in &rows {
        let (name, definer, config): (String, bool, String) =
            (function.get(0), function.get(1), function.get(2));
        row.inputs += 1;
        row.check(!definer, || format!("{name} is SECURITY DEFINER"));
        if UNPINNED.iter().any(|unpinned| name.starts_with(unpinned)) {
            row.check(config.is_empty(), || {
                format!("{name} sets {config:?}: a function on the job path sets nothing")
            });
        } else {
            let creates = name.starts_with("inbox_create_");
            row.check(
                creates || config.contains("search_path=pg_catalog, pg_temp"),
                || format!("{name} does not pin its search_path ({config:?})"),
            );
        }
    }
    Ok(())
}

async fn privileges(row: &mut Row, client: &Client, roles: &Roles) -> Result<()> {
    let Roles { none, read, app } = roles;
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('public.pq'); SELECT inbox_create_ledger('public.pl'); \
             GRANT SELECT ON public.pq, public.pl TO {read}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON public.pq, public.pl TO {app}; \
             SELECT inbox_enqueue('public.pq', '{{}}'::jsonb); \
             SELECT * FROM inbox_stats('public.pq'); SELECT inbox_claim('public.pl', 'owner'); \
             SELECT inbox_seen('public.pl', 'owner'); SELECT * FROM inbox_lease('public.pq', 1, '1 hour')"
        ))
        .await?;
    let count = "SELECT (SELECT count(*) FROM public.pq) + (SELECT count(*) FROM public.pl) \
                 + (SELECT sum(attempt) FROM public.pq)";
    let before = one_i64(client, count).await?;
    let denied = "42501";
    client.batch_execute(&format!("SET ROLE {none}")).await?;
    for sql in [
        "SELECT inbox_enqueue('public.pq', '{}'::jsonb)",
        "SELECT * FROM inbox_lease('public.pq', 1)",
        "SELECT * FROM inbox_stats('public.pq')",
        "SELECT inbox_ack('public.pq', 1, 1)",
        "SELECT inbox_retry('public.pq', 1, 1)",
        "SELECT inbox_claim('public.pl', 'x')",
        "SELECT inbox_seen('public.pl', 'owner')",
        "SELECT inbox_create_queue('public.newq')",
        "SELECT inbox_create_ledger('public.newl')",
    ] {
        refused(row, client, "a role without privileges", sql, denied).await;
    }
    client
        .batch_execute(&format!("RESET ROLE; SET ROLE {read}"))
        .await?;
    for sql in [
        "SELECT inbox_enqueue('public.pq', '{}'::jsonb)",
        "SELECT * FROM inbox_lease('public.pq', 1)",
        "SELECT inbox_claim('public.pl', 'x')",
        "SELECT inbox_purge('public.pl', now())",
    ] {
        refused(row, client, "a read-only role", sql, denied).await;
    }
    for sql in [
        "SELECT * FROM inbox_stats('public.pq')",
        "SELECT inbox_seen('public.pl', 'owner')",
    ] {
        works(row, client, "a read-only role", sql).await;
    }
    client.batch_execute("RESET ROLE").await?;
    let after = one_i64(client, count).await?;
    row.check(before == after, || {
        "refused calls changed the tables".to_owned()
    });
    client.batch_execute(&format!("SET ROLE {app}")).await?;
    for sql in [
        "SELECT inbox_enqueue('public.pq', '{}'::jsonb)",
        "SELECT * FROM inbox_lease('public.pq', 5, '1 minute')",
        "SELECT inbox_claim('public.pl', 'app')",
    ] {
        works(row, client, "a role with the privileges", sql).await;
    }
    client.batch_execute("RESET ROLE").await?;
    Ok(())
}

async fn row_security(row: &mut Row, client: &Client, roles: &Roles) -> Result<()> {
    let app = &roles.app;
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('public.tq'); \
             ALTER TABLE public.tq ENABLE ROW LEVEL SECURITY; \
             CREATE POLICY tenant ON public.tq TO {app} \
               USING (payload->>'tenant' = current_setting('app.tenant', true)) \
               WITH CHECK (payload->>'tenant' = current_setting('app.tenant', true)); \
             GRANT SELECT, INSERT, UPDATE, DELETE ON public.tq TO {app}; \
             SELECT count(*) FROM inbox_enqueue_batch('public.tq', \
               ARRAY(SELECT jsonb_build_object('tenant', t) FROM unnest(ARRAY['a','a','a','b','b']) t)); \
             SELECT * FROM inbox_stats('public.tq')"
        ))
        .await?;
    let b_job = one_i64(
        client,
        "SELECT min(id) FROM public.tq WHERE payload->>'tenant' = 'b'",
    )
    .await?;
    client
        .batch_execute(&format!("SET ROLE {app}; SET app.tenant = 'a'"))
        .await?;
    let what = "row-level security";
    let stats = works(
        row,
        client,
        what,
        "SELECT ready FROM inbox_stats('public.tq')",
    )
    .await;
    let ready: i64 = stats.first().map_or(-1, |r| r.get(0));
    row.check(ready == 3, || {
        format!("{what}: stats show {ready} ready jobs, the role sees 3")
    });
    let leased = works(
        row,
        client,
        what,
        "SELECT payload->>'tenant' FROM inbox_lease('public.tq', 100, '1 minute')",
    )
    .await;
    let tenants: Vec<String> = leased.iter().map(|r| r.get(0)).collect();
    row.check(
        tenants.len() == 3 && tenants.iter().all(|t| t == "a"),
        || format!("{what}: the role leased {tenants:?}"),
    );
    let acked = works(
        row,
        client,
        what,
        &format!("SELECT inbox_ack('public.tq', {b_job}, 0)"),
    )
    .await;
    row.check(acked.first().is_some_and(|r| !r.get::<_, bool>(0)), || {
        format!("{what}: the role acked another tenant's job")
    });
    refused(
        row,
        client,
        what,
        "SELECT inbox_enqueue('public.tq', '{\"tenant\": \"b\"}'::jsonb)",
        "42501",
    )
    .await;
    works(
        row,
        client,
        what,
        "SELECT inbox_enqueue('public.tq', '{\"tenant\": \"a\"}'::jsonb)",
    )
    .await;
    client.batch_execute("RESET ROLE; RESET app.tenant").await?;
    let untouched = one_i64(
        client,
        "SELECT count(*) FROM public.tq WHERE payload->>'tenant' = 'b' AND attempt = 0",
    )
    .await?;
    row.check(untouched == 2, || {
        format!("{what}: {untouched} of the other tenant's 2 jobs are untouched")
    });
    Ok(())
}

struct Roles {
    none: String,
    read: String,
    app: String,
}

pub async fn run(ctx: &Ctx) -> Result<Row> {
    let mut row = Row::new(14, NAME);
    let tag = std::process::id();
    let name = format!("inbox_faults_sp_{tag}");
    let roles = Roles {
        none: format!("inbox_faults_{tag}_none"),
        read: format!("inbox_faults_{tag}_read"),
        app: format!("inbox_faults_{tag}_app"),
    };
    let url = ctx.own_database(&name).await?;
    let server = connect(&ctx.url).await?;
    let create = format!(
        "DROP ROLE IF EXISTS {0}; DROP ROLE IF EXISTS {1}; DROP ROLE IF EXISTS {2}; \
         CREATE ROLE {0} NOLOGIN; CREATE ROLE {1} NOLOGIN; CREATE ROLE {2} NOLOGIN",
        roles.none, roles.read, roles.app
    );
    server.batch_execute(&create).await?;
    let result = async {
        let owner = connect(&url).await?;
        definitions(&mut row, &owner).await?;
        owner.batch_execute(HOSTILE).await?;
        let made = owner
            .query(
                "SELECT kind, n FROM public.hostile_count ORDER BY kind",
                &[],
            )
            .await?;
        let made: Vec<(String, i32)> = made.iter().map(|r| (r.get(0), r.get(1))).collect();
        row.check(
            made.iter().all(|(kind, n)| match kind.as_str() {
                "operators" => *n >= 200,
                "functions" => *n >= 15,
                _ => *n >= 11,
            }),
            || format!("too few hostile objects were created: {made:?}"),
        );
        hijack(&mut row, &url, 1, "public, pg_catalog").await?;
        hijack(&mut row, &url, 2, "pg_temp, public, pg_catalog").await?;
        privileges(&mut row, &owner, &roles).await?;
        row_security(&mut row, &owner, &roles).await?;
        Ok::<(), crate::common::Error>(())
    }
    .await;
    ctx.drop_database(&name).await;
    let _ = server
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS {}; DROP ROLE IF EXISTS {}; DROP ROLE IF EXISTS {}",
            roles.none, roles.read, roles.app
        ))
        .await;
    result?;
    Ok(row)
}
