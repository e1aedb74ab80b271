//! What the CLI's test files share: a running `inbox metrics` or `inbox ui`, and the samples of
//! the exporter's scrapes.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

/// A running `inbox` command that serves HTTP (`metrics`, `ui`), stopped when dropped.
pub struct Served {
    child: Child,
    /// The URL it printed, where it listens.
    pub url: String,
}

impl Served {
    /// Starts `inbox ARGS` against `database_url`, once it says where it listens (the first line
    /// it writes to stderr); what it logs after, a failed read say, is passed on as a terminal or
    /// a journal would show it, after `label`. A token in the caller's environment is not passed.
    pub fn start(args: &[&str], database_url: &str, label: &'static str) -> Served {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
            .args(args)
            .env("DATABASE_URL", database_url)
            .env_remove("INBOX_UI_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                eprintln!("{label}: {line}");
            }
        });
        let url = line
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .unwrap_or_else(|| panic!("inbox {args:?} did not say where it listens: {line:?}"))
            .to_owned();
        Served { child, url }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `inbox metrics`.
pub struct Exporter(Served);

impl Exporter {
    /// Starts the exporter on a free port against `database_url`.
    pub fn start(database_url: &str) -> Exporter {
        Exporter(Served::start(
            &["metrics", "--listen", "127.0.0.1:0"],
            database_url,
            "exporter",
        ))
    }

    /// One scrape: its content type and its body.
    pub fn scrape(&self) -> (String, String) {
        let mut response = ureq::get(&self.0.url).call().unwrap();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (content_type, response.body_mut().read_to_string().unwrap())
    }
}

/// The value of the sample `name{labels}` in a scrape.
pub fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
