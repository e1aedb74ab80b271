//! What the CLI's test files share: a running `inbox metrics` and the samples of its scrapes.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

/// A running `inbox metrics`, stopped when dropped.
pub struct Exporter {
    child: Child,
    url: String,
}

impl Exporter {
    /// Starts the exporter on a free port against `database_url`, once it says where it listens.
    pub fn start(database_url: &str) -> Exporter {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("inbox"))
            .args(["metrics", "--listen", "127.0.0.1:0"])
            .env("DATABASE_URL", database_url)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        // Keep reading what it logs (a failed scrape), as a terminal or a journal would.
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                eprintln!("exporter: {line}");
            }
        });
        let url = line
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .unwrap_or_else(|| panic!("the exporter did not say where it listens: {line:?}"))
            .to_owned();
        Exporter { child, url }
    }

    /// One scrape: its content type and its body.
    pub fn scrape(&self) -> (String, String) {
        let mut response = ureq::get(&self.url).call().unwrap();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (content_type, response.body_mut().read_to_string().unwrap())
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the sample `name{labels}` in a scrape.
pub fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
