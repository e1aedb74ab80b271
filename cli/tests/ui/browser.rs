//! `inbox ui` in a real headless Chromium, driven over WebDriver by Debian's `chromedriver`,
//! against a queue of 1,000,000 jobs: every page loads with no console error and no failed
//! request (under a base path too), the counts are the SQL counts or marked as estimates, a
//! filter changes the URL and the rows, actions change the database and the page without a
//! reload, read-only hides every button. Each page's screenshot is saved under `target/ui/`.
//!
//! Ignored by a plain `cargo test`: `scripts/test.sh` installs Chromium and its driver and runs
//! them with `--ignored` (`INBOX_CHROMEDRIVER` names another driver binary).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::elements::Element;
use fantoccini::error::CmdError;
use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use inbox_tests::TestDb;
use serde_json::{json, Value};

use super::{one_i64, Ui};

/// Jobs in the big queue.
const BIG: i64 = 1_000_000;

/// A running chromedriver, stopped when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start() -> Driver {
        let binary =
            std::env::var("INBOX_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_owned());
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary} (scripts/test.sh installs it): {e}"));
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while ureq::get(&format!("{url}/status")).call().is_err() {
            assert!(
                Instant::now() < deadline,
                "{binary} never answered on {url}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Driver { child, url }
    }

    async fn browser(&self) -> Client {
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_owned(),
            json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                            "--disable-dev-shm-usage", "--window-size=1400,1000"]}),
        );
        capabilities.insert("goog:loggingPrefs".to_owned(), json!({"browser": "ALL"}));
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a browser session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Chromium's console since the last call (`se/log`, which chromedriver keeps).
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/se/log",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (
            http::Method::POST,
            Some(json!({"type": "browser"}).to_string()),
        )
    }
}

/// The console's errors (failed requests and Content-Security-Policy refusals included).
async fn console_errors(browser: &Client) -> Vec<String> {
    let entries = browser.issue_cmd(BrowserLog).await.unwrap();
    entries
        .as_array()
        .into_iter()
        .flatten()
        .filter(|entry| entry["level"] == "SEVERE")
        .map(|entry| entry["message"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Opens `url`, checks the page loaded whole, and saves its screenshot as `target/ui/NAME.png`.
async fn visit(browser: &Client, url: &str, name: &str) {
    browser.goto(url).await.unwrap();
    browser
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("main[data-live]"))
        .await
        .unwrap_or_else(|e| panic!("{url}: no page: {e}"));
    let errors = console_errors(browser).await;
    assert!(errors.is_empty(), "{url}: console errors: {errors:?}");
    let styled: Value = browser
        .execute(
            "return getComputedStyle(document.querySelector('header')).borderBottomStyle",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(styled, "solid", "{url}: the style sheet did not apply");
    let screenshot = browser.screenshot().await.unwrap();
    let dir = screenshots();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{name}.png")), screenshot).unwrap();
}

/// `target/ui/` of the workspace.
fn screenshots() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("target/ui")
}

async fn attribute(browser: &Client, css: &str, name: &str) -> String {
    with_element(
        browser,
        css,
        |element| async move { element.attr(name).await },
    )
    .await
    .unwrap_or_else(|| panic!("{css} has no {name}"))
}

/// The text of `css`.
async fn text(browser: &Client, css: &str) -> String {
    with_element(browser, css, |element| async move { element.text().await }).await
}

/// Finds `css` and does `act` with it (reads it, or clicks or chooses as a person would). The
/// page replaces its content every 5 seconds, so an element found may be gone by the time it is
/// used: then it is found again and `act` starts over, up to five times.
async fn with_element<T, F, Fut>(browser: &Client, css: &str, act: F) -> T
where
    F: Fn(Element) -> Fut,
    Fut: std::future::Future<Output = Result<T, CmdError>>,
{
    for _ in 0..5 {
        let element = browser
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        match act(element).await {
            Err(e) if e.is_stale_element_reference() => continue,
            result => return result.unwrap_or_else(|e| panic!("{css}: {e}")),
        }
    }
    panic!("{css}: replaced by the page's refresh five times while in use");
}

/// Clicks `css`.
async fn click(browser: &Client, css: &str) {
    with_element(browser, css, |element| async move {
        element.click().await.map(drop)
    })
    .await;
}

/// Waits until `condition` holds of the page, without navigating (a marker set on `window`
/// before must survive: the page was updated in place, not reloaded).
async fn until_in_place(browser: &Client, condition: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state: Value = browser
            .execute(
                &format!("return [window.inboxMarker === 1, Boolean({condition})]"),
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(state[0], true, "{what}: the page was reloaded");
        if state[1] == true {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: never happened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn mark(browser: &Client) {
    browser
        .execute("window.inboxMarker = 1", vec![])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and chromedriver: scripts/test.sh runs it"]
async fn the_dashboard_works_in_a_real_browser_on_a_million_jobs() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // The big queue: rows as inbox_enqueue writes them, inserted in one statement (a million
    // calls would take minutes), then 2,000 dead of two errors and 100 delayed.
    client
        .batch_execute(&format!(
            "SELECT inbox_create_queue('big'); \
             INSERT INTO big (payload, key, priority) \
               SELECT jsonb_build_object('order', i), 'order-' || i, i % 3 \
                 FROM generate_series(1, {BIG}) AS i; \
             UPDATE big SET locked_until = 'infinity', dead_at = now(), attempt = 3, \
                            last_error = CASE WHEN id / 500 % 2 = 0 THEN 'card declined' ELSE 'gateway timeout' END \
              WHERE id % 500 = 0; \
             UPDATE big SET locked_until = now() + interval '1 hour' WHERE id % 10000 = 1; \
             ANALYZE big"
        ))
        .await
        .unwrap();
    let queue = format!("{}.big", db.schema());
    let driver = Driver::start();
    let browser = driver.browser().await;
    let ui = Ui::start(&db, &["--base-path", "/ops/inbox"]);
    let base = format!("{}/ops/inbox", ui.origin);

    // Every page, under the base path.
    visit(&browser, &base, "overview").await;
    let shown: i64 = attribute(
        &browser,
        &format!("tr[data-queue='{queue}'] td[data-count='dead']"),
        "data-n",
    )
    .await
    .parse()
    .unwrap();
    assert_eq!(
        shown,
        one_i64(&client, "SELECT dead FROM inbox_stats('big')").await
    );
    let queue_page = format!("{base}/queues/{queue}");
    visit(&browser, &queue_page, "queue").await;
    // A million jobs: the count is the planner's, and says so.
    assert_eq!(
        attribute(&browser, "#count span[data-jobs]", "data-exact").await,
        "false"
    );
    let estimate: i64 = attribute(&browser, "#count span[data-jobs]", "data-jobs")
        .await
        .parse()
        .unwrap();
    assert!((BIG / 2..=BIG * 2).contains(&estimate), "{estimate}");
    let count = text(&browser, "#count").await;
    assert!(
        count.contains("about") && count.contains("estimated"),
        "{count}"
    );

    // A filter: the URL holds it, the rows are in it, and a small count is exact.
    // The choice and the button of one form: a refresh in between starts both over.
    with_element(
        &browser,
        "form.filter select[name=state]",
        |select| async move {
            select.select_by_value("delayed").await?;
            select
                .find(Locator::XPath("ancestor::form//button[@type='submit']"))
                .await?
                .click()
                .await
                .map(drop)
        },
    )
    .await;
    browser
        .wait()
        .for_url(url::Url::parse(&format!("{queue_page}?state=delayed")).unwrap())
        .await
        .unwrap();
    assert_eq!(
        attribute(&browser, "#count span[data-jobs]", "data-exact").await,
        "true"
    );
    assert_eq!(
        attribute(&browser, "#count span[data-jobs]", "data-jobs").await,
        one_i64(&client, "SELECT delayed FROM inbox_stats('big')")
            .await
            .to_string()
    );
    // Read in one script: the page's live refresh replaces the rows, so rows found by one
    // command may be gone by the next.
    let states: Vec<String> = serde_json::from_value(
        browser
            .execute(
                "return Array.from(document.querySelectorAll('#jobs tbody tr'), \
                 row => row.getAttribute('data-state'))",
                vec![],
            )
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(states.len(), 50);
    assert!(states.iter().all(|s| s == "delayed"), "{states:?}");
    visit(
        &browser,
        &format!("{queue_page}?state=delayed"),
        "queue-filtered",
    )
    .await;

    // A dead job in full.
    let dead = one_i64(&client, "SELECT max(id) FROM big WHERE dead_at IS NOT NULL").await;
    visit(&browser, &format!("{queue_page}/jobs/{dead}"), "job").await;
    let job = text(&browser, "#job").await;
    assert!(
        job.contains("\"order\"") && job.contains("card declined"),
        "{job}"
    );

    visit(&browser, &format!("{queue_page}/groups"), "groups").await;

    // Requeue it from the dead jobs' page: the database changes, the row leaves the page, and
    // the page was never reloaded.
    browser
        .goto(&format!("{queue_page}?state=dead"))
        .await
        .unwrap();
    mark(&browser).await;
    click(
        &browser,
        &format!("tr[data-id='{dead}'] form[action$='/jobs/{dead}/requeue'] button"),
    )
    .await;
    until_in_place(
        &browser,
        &format!("!document.querySelector(\"tr[data-id='{dead}']\")"),
        "the requeued job leaves the dead jobs",
    )
    .await;
    assert_eq!(
        one_i64(
            &client,
            &format!("SELECT count(*) FROM big WHERE id = {dead} AND dead_at IS NULL")
        )
        .await,
        1
    );

    // The dead letters by error; requeue a whole group, after the confirmation.
    visit(&browser, &format!("{queue_page}/dead"), "dead-letters").await;
    mark(&browser).await;
    let timeouts = one_i64(
        &client,
        "SELECT count(*) FROM big WHERE last_error = 'gateway timeout' AND dead_at IS NOT NULL",
    )
    .await;
    assert_eq!(timeouts, 1000);
    // The group's row: its requeue form names the error.
    click(
        &browser,
        "#dead-groups tbody tr form:has(input[name=error][value='gateway timeout']) button",
    )
    .await;
    browser.accept_alert().await.unwrap();
    until_in_place(
        &browser,
        "!document.querySelector('#dead-groups') || !document.querySelector('#dead-groups').textContent.includes('gateway timeout')",
        "the group leaves the page",
    )
    .await;
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM big WHERE last_error = 'gateway timeout' AND dead_at IS NOT NULL"
        )
        .await,
        0
    );

    // Pause from the queue's page; then a job enqueued elsewhere shows up without a reload.
    browser
        .goto(&format!("{queue_page}?state=delayed"))
        .await
        .unwrap();
    mark(&browser).await;
    click(&browser, "form[action$='/pause'] button").await;
    until_in_place(
        &browser,
        "document.querySelector('h1 .paused')",
        "the queue shows paused",
    )
    .await;
    assert_eq!(
        one_i64(
            &client,
            "SELECT count(*) FROM inbox_stats('big') WHERE paused"
        )
        .await,
        1
    );
    let before = attribute(&browser, "#count span[data-jobs]", "data-jobs").await;
    client
        .batch_execute("SELECT inbox_enqueue('big', '{}', now() + interval '1 day')")
        .await
        .unwrap();
    until_in_place(
        &browser,
        &format!("document.querySelector('#count span[data-jobs]').dataset.jobs !== '{before}'"),
        "the live update shows the new job",
    )
    .await;
    let errors = console_errors(&browser).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");

    // The overview's charts: they draw from the second reading (every 10 seconds) on, and
    // the page shows them without a reload.
    browser.goto(&base).await.unwrap();
    mark(&browser).await;
    until_in_place(
        &browser,
        &format!("document.querySelector(\"tr[data-queue='{queue}'] svg.spark polyline\")"),
        "the depth chart",
    )
    .await;
    visit(&browser, &base, "overview-charts").await;

    // Read-only: everything shows, no button does.
    let read_only = Ui::start(&db, &["--read-only"]);
    for (path, name) in [
        ("/".to_owned(), "read-only-overview"),
        (format!("/queues/{queue}?state=dead"), "read-only-queue"),
        (format!("/queues/{queue}/dead"), "read-only-dead-letters"),
    ] {
        visit(&browser, &format!("{}{path}", read_only.origin), name).await;
        let buttons = browser
            .find_all(Locator::Css(
                "form[method=post], button[type=submit]:not(form.filter button)",
            ))
            .await
            .unwrap();
        assert!(
            buttons.is_empty(),
            "{path} offers {} actions",
            buttons.len()
        );
    }
    browser.close().await.unwrap();
}
