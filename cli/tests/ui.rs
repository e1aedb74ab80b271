//! `inbox ui` over HTTP against a real database: what its pages show is what the extension's
//! functions count, its actions change the database, and its guards (read-only, same origin,
//! token, base path) hold for a direct request, not only in the pages.

use std::time::Duration;

use inbox_tests::TestDb;

#[path = "ui/browser.rs"]
mod browser;
// Each test file uses part of it.
#[allow(dead_code)]
mod support;

use support::Served;

/// A running `inbox ui`.
struct Ui {
    _served: Served,
    /// `http://127.0.0.1:PORT`, without the base path.
    origin: String,
}

impl Ui {
    fn start(db: &TestDb, args: &[&str]) -> Ui {
        let args = [&["ui", "--listen", "127.0.0.1:0"], args].concat();
        let served = Served::start(&args, db.url(), "ui");
        let origin = served.url["http://".len()..]
            .split('/')
            .next()
            .map(|host| format!("http://{host}"))
            .unwrap();
        Ui {
            _served: served,
            origin,
        }
    }

    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into()
    }

    /// GET `path`: the status, the body, and the response's Content-Security-Policy.
    fn get(&self, path: &str) -> (u16, String, String) {
        let mut response = Self::agent()
            .get(&format!("{}{path}", self.origin))
            .call()
            .unwrap();
        let csp = response
            .headers()
            .get("content-security-policy")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (
            response.status().as_u16(),
            response.body_mut().read_to_string().unwrap(),
            csp,
        )
    }

    /// POST a form to `path` as a page of this dashboard would (same-origin headers) or as
    /// another site would; the status and where it redirects.
    fn post(&self, path: &str, form: &[(&str, &str)], site: Site) -> (u16, String) {
        let mut request = Self::agent().post(&format!("{}{path}", self.origin));
        request = match site {
            Site::Same => request
                .header("Origin", &self.origin)
                .header("Sec-Fetch-Site", "same-origin"),
            Site::SameByOrigin => request.header("Origin", &self.origin),
            Site::Foreign => request
                .header("Origin", "http://evil.example")
                .header("Sec-Fetch-Site", "cross-site"),
            Site::ForeignByOrigin => request.header("Origin", "http://evil.example"),
        };
        let response = request.send_form(form.iter().copied()).unwrap();
        let location = response
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (response.status().as_u16(), location)
    }
}

#[derive(Clone, Copy)]
enum Site {
    Same,
    SameByOrigin,
    Foreign,
    ForeignByOrigin,
}

async fn one_i64(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The number in `data-<attribute>="N"` after `marker` in `page`.
fn data_after(page: &str, marker: &str, attribute: &str) -> i64 {
    let at = page
        .find(marker)
        .unwrap_or_else(|| panic!("{marker} not in the page:\n{page}"));
    let rest = &page[at..];
    let key = format!("data-{attribute}=\"");
    let start = rest.find(&key).unwrap() + key.len();
    rest[start..]
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{attribute} after {marker}"))
}

/// The ids of the job rows (`data-id`) of a jobs page, with their states.
fn rows(page: &str) -> Vec<(i64, String)> {
    page.split("<tr data-id=\"")
        .skip(1)
        .map(|row| {
            let id = row.split('"').next().unwrap().parse().unwrap();
            let state = row
                .split("data-state=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_owned();
            (id, state)
        })
        .collect()
}

/// A queue of 60 jobs: 40 ready (priorities 0 and 5, two groups' worth of keys), 10 delayed,
/// 3 leased, 4 dead of "card declined", 2 dead of "timeout", 1 cancelled.
async fn seeded() -> (TestDb, tokio_postgres::Client, String) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "SELECT inbox_create_queue('billing'); \
             SELECT inbox_enqueue('billing', jsonb_build_object('n', i), \
                                  priority => CASE WHEN i % 4 = 0 THEN 5 ELSE 0 END, \
                                  key => 'order-' || i) \
               FROM generate_series(1, 50) AS i; \
             SELECT inbox_enqueue('billing', jsonb_build_object('n', i), now() + interval '1 hour') \
               FROM generate_series(51, 60) AS i; \
             SELECT inbox_dead('billing', id, token, 'card declined') \
               FROM inbox_lease('billing', 4, '1 minute'); \
             SELECT inbox_dead('billing', id, token, 'timeout') \
               FROM inbox_lease('billing', 2, '1 minute'); \
             SELECT inbox_cancel('billing', (SELECT min(id) FROM billing WHERE dead_at IS NULL \
                                                AND locked_until < 'infinity' AND attempt = 0)); \
             SELECT count(*) FROM inbox_lease('billing', 3, '10 minutes');",
        )
        .await
        .unwrap();
    let queue = format!("{}.billing", db.schema());
    (db, client, queue)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_show_what_the_functions_count() {
    let (db, client, queue) = seeded().await;
    let ui = Ui::start(&db, &[]);

    let (status, page, csp) = ui.get("/");
    assert_eq!(status, 200, "{page}");
    assert!(csp.contains("script-src 'self'"), "{csp}");
    let row = format!("data-queue=\"{queue}\"");
    for (state, sql) in [
        ("ready", "ready"),
        ("delayed", "delayed"),
        ("leased", "leased"),
        ("dead", "dead"),
    ] {
        let cells = &page[page.find(&row).unwrap()..];
        let shown = data_after(cells, &format!("data-count=\"{state}\""), "n");
        let counted = one_i64(
            &client,
            &format!("SELECT {sql} FROM inbox_stats('billing')"),
        )
        .await;
        assert_eq!(shown, counted, "{state}");
    }

    // Ledgers are listed, with their size.
    client
        .batch_execute("SELECT inbox_create_ledger('seen')")
        .await
        .unwrap();
    let (_, page, _) = ui.get("/");
    assert!(
        page.contains(&format!("data-ledger=\"{}.seen\"", db.schema())),
        "{page}"
    );

    // Each state's filter: the rows are in it, and the count is the SQL count.
    for state in ["ready", "delayed", "leased", "dead", "cancelled"] {
        let (status, page, _) = ui.get(&format!("/queues/{queue}?state={state}"));
        assert_eq!(status, 200, "{page}");
        let counted = one_i64(
            &client,
            &format!("SELECT jobs FROM inbox_job_count('billing', '{state}')"),
        )
        .await;
        assert_eq!(
            data_after(&page, "id=\"count\"", "jobs"),
            counted,
            "{state}"
        );
        let shown = rows(&page);
        assert_eq!(shown.len() as i64, counted, "{state}");
        let expected = if state == "cancelled" { "dead" } else { state };
        assert!(
            shown.iter().all(|(_, s)| s == expected),
            "{state}: {shown:?}"
        );
    }
    let (_, page, _) = ui.get(&format!("/queues/{queue}?priority=5&state=ready"));
    let ids: Vec<i64> = rows(&page).into_iter().map(|(id, _)| id).collect();
    let expected: Vec<i64> = client
        .query(
            "SELECT id FROM inbox_job_page('billing', 'ready', priority => 5) ORDER BY id DESC",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!ids.is_empty());
    assert_eq!(ids, expected);
    // The filter is in the URL of the next page, which continues below the last id.
    let (_, all, _) = ui.get(&format!("/queues/{queue}"));
    assert_eq!(rows(&all).len(), 50);
    let next = all
        .split("rel=\"next\" href=\"")
        .nth(1)
        .expect("a link to older jobs")
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let (_, older, _) = ui.get(&next);
    let last_first_page = rows(&all).last().unwrap().0;
    let older_ids: Vec<i64> = rows(&older).into_iter().map(|(id, _)| id).collect();
    assert_eq!(older_ids.len(), 10);
    assert!(older_ids.iter().all(|&id| id < last_first_page));

    // One job in full; a job no longer in the queue; a queue that does not exist.
    let dead_id = one_i64(
        &client,
        "SELECT min(id) FROM billing WHERE last_error = 'card declined'",
    )
    .await;
    let (status, page, _) = ui.get(&format!("/queues/{queue}/jobs/{dead_id}"));
    assert_eq!(status, 200);
    // Its fields, its payload, its errors by attempt, then the whole row.
    let section = |id: &str| {
        let from = page
            .find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in the page:\n{page}"));
        page[from..]
            .split("</table>")
            .next()
            .unwrap()
            .split("</pre>")
            .next()
            .unwrap()
            .to_owned()
    };
    assert!(section("job-fields").contains("<th>died</th>"), "{page}");
    let payload = section("payload");
    assert!(
        payload.contains("&quot;n&quot;:") || payload.contains("\"n\":"),
        "{payload}"
    );
    let errors = section("errors");
    assert!(
        errors.contains("<td class=\"n\">1</td>") && errors.contains("card declined"),
        "{errors}"
    );
    assert!(section("job").contains("card declined"), "{page}");
    let leased = one_i64(
        &client,
        "SELECT min(id) FROM billing WHERE leased_at IS NOT NULL",
    )
    .await;
    let (_, page, _) = ui.get(&format!("/queues/{queue}/jobs/{leased}"));
    assert!(
        page.contains("<th>lease expires</th>")
            && page.contains("<th>lease held by</th><td>the delivery of token 1</td>"),
        "{page}"
    );
    let (status, page, _) = ui.get(&format!("/queues/{queue}/jobs/999999"));
    assert_eq!(status, 200);
    assert!(page.contains("Not in the queue"), "{page}");
    let (status, _, _) = ui.get(&format!("/queues/{}.nope", db.schema()));
    assert_eq!(status, 404);
    let (status, _, _) = ui.get(&format!("/queues/{queue}?priority=high"));
    assert_eq!(status, 400);

    // Dead letters by error, the biggest group first.
    let (status, page, _) = ui.get(&format!("/queues/{queue}/dead"));
    assert_eq!(status, 200);
    let declined = page.find("card declined").unwrap();
    let timeout = page.find("timeout").unwrap();
    assert!(declined < timeout, "{page}");
    assert!(page.contains("Requeue these 4"), "{page}");

    // Ordered groups: each group waiting, with its head; a queue without groups says so.
    client
        .batch_execute(
            "SELECT inbox_create_queue('orders'); \
             SELECT inbox_enqueue('orders', '{}', group_key => 'c' || (i % 2)) FROM generate_series(1, 7) AS i; \
             SELECT count(*) FROM inbox_lease('orders', 1, '1 minute'); \
             CREATE TABLE bare (id bigserial PRIMARY KEY, attempt int NOT NULL DEFAULT 0, \
                                locked_until timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL)",
        )
        .await
        .unwrap();
    let (status, page, _) = ui.get(&format!("/queues/{}.orders/groups", db.schema()));
    assert_eq!(status, 200, "{page}");
    let shown: Vec<&str> = page
        .split("<tr data-group=\"")
        .skip(1)
        .map(|row| row.split('"').next().unwrap())
        .collect();
    assert_eq!(shown, ["c1", "c0"], "{page}");
    assert!(page.contains("leased"), "{page}");
    let (status, page, _) = ui.get(&format!("/queues/{}.bare/groups", db.schema()));
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("has no ordered groups"), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_change_the_database_and_come_only_from_its_own_pages() {
    let (db, client, queue) = seeded().await;
    let ui = Ui::start(&db, &[]);
    let dead_id = one_i64(
        &client,
        "SELECT min(id) FROM billing WHERE last_error = 'timeout'",
    )
    .await;
    let back = format!("/queues/{queue}?state=dead");

    // Another site's form is refused, whichever header tells it; nothing changes.
    for site in [Site::Foreign, Site::ForeignByOrigin] {
        let (status, _) = ui.post(
            &format!("/queues/{queue}/jobs/{dead_id}/requeue"),
            &[("back", &back)],
            site,
        );
        assert_eq!(status, 403);
    }
    assert_eq!(
        one_i64(
            &client,
            &format!("SELECT count(*) FROM billing WHERE id = {dead_id} AND dead_at IS NOT NULL")
        )
        .await,
        1
    );

    // Requeue one dead job: back to the page it came from, the job due again.
    let (status, location) = ui.post(
        &format!("/queues/{queue}/jobs/{dead_id}/requeue"),
        &[("back", &back)],
        Site::Same,
    );
    assert_eq!((status, location.as_str()), (303, back.as_str()));
    assert_eq!(
        one_i64(
            &client,
            &format!("SELECT count(*) FROM billing WHERE id = {dead_id} AND dead_at IS NULL")
        )
        .await,
        1
    );
    // The same action again conflicts: the job is no longer dead.
    let (status, _) = ui.post(
        &format!("/queues/{queue}/jobs/{dead_id}/discard"),
        &[("back", &back)],
        Site::SameByOrigin,
    );
    assert_eq!(status, 409);

    // Requeue a whole group of dead letters by their error.
    let (status, _) = ui.post(
        &format!("/queues/{queue}/dead/requeue"),
        &[("back", &back), ("error", "card declined")],
        Site::Same,
    );
    assert_eq!(status, 303);
    assert_eq!(
        one_i64(&client, "SELECT count(*) FROM billing WHERE dead_at IS NOT NULL AND last_error = 'card declined'").await,
        0
    );

    // Everything a filter matches: the remaining dead jobs (a timeout and the cancelled one) are
    // requeued in one click.
    let (_, page, _) = ui.get(&format!("/queues/{queue}?state=dead"));
    assert!(page.contains("Requeue 2 matching"), "{page}");
    let (status, _) = ui.post(
        &format!("/queues/{queue}/matching"),
        &[("back", &back), ("action", "requeue"), ("state", "dead")],
        Site::Same,
    );
    assert_eq!(status, 303);
    assert_eq!(
        one_i64(&client, "SELECT dead FROM inbox_stats('billing')").await,
        0
    );

    // Cancel, pause, resume, enqueue.
    let ready = one_i64(
        &client,
        "SELECT max(id) FROM billing WHERE dead_at IS NULL AND locked_until < 'infinity'",
    )
    .await;
    let (status, _) = ui.post(
        &format!("/queues/{queue}/jobs/{ready}/cancel"),
        &[],
        Site::Same,
    );
    assert_eq!(status, 303);
    assert_eq!(
        one_i64(
            &client,
            &format!(
                "SELECT count(*) FROM billing WHERE id = {ready} AND last_error = 'cancelled'"
            )
        )
        .await,
        1
    );
    let (status, location) = ui.post(
        &format!("/queues/{queue}/pause"),
        &[("back", "https://evil.example/")],
        Site::Same,
    );
    assert_eq!(
        (status, location.as_str()),
        (303, "/"),
        "a foreign back link leads home"
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_stats('billing') WHERE paused"
        )
        .await,
        1
    );
    let (status, _) = ui.post(&format!("/queues/{queue}/resume"), &[], Site::Same);
    assert_eq!(status, 303);
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_stats('billing') WHERE paused"
        )
        .await,
        0
    );
    let (status, _) = ui.post(
        &format!("/queues/{queue}/enqueue"),
        &[
            ("payload", "{\"from\": \"ui\"}"),
            ("priority", "7"),
            ("key", "k-ui"),
            ("group", ""),
        ],
        Site::Same,
    );
    assert_eq!(status, 303);
    assert_eq!(
        one_i64(&client, "SELECT count(*) FROM billing WHERE key = 'k-ui' AND priority = 7 AND payload = '{\"from\": \"ui\"}'").await,
        1
    );
    // A payload that is not JSON is refused, and nothing is enqueued.
    let before = one_i64(&client, "SELECT count(*) FROM billing").await;
    let (status, _) = ui.post(
        &format!("/queues/{queue}/enqueue"),
        &[("payload", "{oops")],
        Site::Same,
    );
    assert_eq!(status, 400);
    assert_eq!(
        one_i64(&client, "SELECT count(*) FROM billing").await,
        before
    );

    // A schedule shows its ticks on the queue's page; "Run now" enqueues its job and shows it.
    client
        .batch_execute("SELECT inbox_schedule('billing', 'nightly', '0 3 * * *', '{\"run\": 1}')")
        .await
        .unwrap();
    let (_, page, _) = ui.get(&format!("/queues/{queue}"));
    assert!(
        page.contains("nightly") && page.contains("/schedules/run"),
        "{page}"
    );
    let (status, location) = ui.post(
        &format!("/queues/{queue}/schedules/run"),
        &[("name", "nightly")],
        Site::Same,
    );
    assert_eq!(status, 303);
    let ran = one_i64(
        &client,
        "SELECT id FROM billing WHERE key LIKE 'schedule:nightly:run:%' AND payload = '{\"run\": 1}'",
    )
    .await;
    assert!(location.ends_with(&format!("/jobs/{ran}")), "{location}");
    let (status, _) = ui.post(
        &format!("/queues/{queue}/schedules/run"),
        &[("name", "weekly")],
        Site::Same,
    );
    assert_eq!(status, 404, "no such schedule");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_under_a_base_path_shows_everything_and_changes_nothing() {
    let (db, client, queue) = seeded().await;
    let ui = Ui::start(&db, &["--read-only", "--base-path", "/ops/inbox/"]);
    for path in [
        "/ops/inbox".to_owned(),
        "/ops/inbox/".to_owned(),
        format!("/ops/inbox/queues/{queue}"),
        format!("/ops/inbox/queues/{queue}/dead"),
        "/ops/inbox/assets/app.js".to_owned(),
        "/ops/inbox/assets/app.css".to_owned(),
    ] {
        let mut response = Ui::agent()
            .get(&format!("{}{path}", ui.origin))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        let page = response.body_mut().read_to_string().unwrap();
        assert!(status == 200 || status == 308, "{path}: {status}");
        if status == 200 {
            assert!(
                !page.contains("method=\"post\""),
                "{path} offers an action:\n{page}"
            );
            // Every link and asset stays under the base path.
            for link in page
                .split("href=\"")
                .skip(1)
                .chain(page.split("src=\"").skip(1))
            {
                let target = link.split('"').next().unwrap();
                assert!(target.starts_with("/ops/inbox"), "{path}: {target}");
            }
        }
    }
    let (status, _, csp) = ui.get(&format!("/queues/{queue}"));
    assert_eq!(status, 404, "nothing outside the base path");
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let dead_id = one_i64(
        &client,
        "SELECT min(id) FROM billing WHERE dead_at IS NOT NULL",
    )
    .await;
    for path in [
        format!("/ops/inbox/queues/{queue}/jobs/{dead_id}/requeue"),
        format!("/ops/inbox/queues/{queue}/pause"),
        format!("/ops/inbox/queues/{queue}/enqueue"),
        format!("/ops/inbox/queues/{queue}/schedules/run"),
    ] {
        let (status, _) = ui.post(&path, &[("payload", "{}")], Site::Same);
        assert_eq!(status, 403, "{path}");
    }
    assert_eq!(
        one_i64(
            &client,
            &format!("SELECT count(*) FROM billing WHERE id = {dead_id} AND dead_at IS NOT NULL")
        )
        .await,
        1
    );
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_stats('billing') WHERE paused"
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_guards_every_request_and_other_machines_need_one() {
    let (db, _client, _queue) = seeded().await;
    let output = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
        .args(["ui", "--listen", "0.0.0.0:0"])
        .env("DATABASE_URL", db.url())
        .env_remove("INBOX_UI_TOKEN")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--token"));

    let ui = Ui::start(&db, &["--token", "s3cret"]);
    let (status, _, _) = ui.get("/");
    assert_eq!(status, 401);
    let mut response = Ui::agent()
        .get(&format!("{}/", ui.origin))
        .header("Authorization", "Bearer s3cret")
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(response
        .body_mut()
        .read_to_string()
        .unwrap()
        .contains("billing"));
    let response = Ui::agent()
        .get(&format!("{}/", ui.origin))
        .header("Authorization", "Bearer wrong")
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
}
