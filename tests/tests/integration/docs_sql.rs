//! Every SQL example in the documentation runs as written.
//!
//! The ```` ```sql ```` fenced blocks of `README.md` and of each `docs/*.md` are run verbatim, in
//! the order they appear, against a fresh database per file (created on the server of
//! `INBOX_TEST_DATABASE_URL` and dropped afterwards), so the examples must start from
//! `CREATE EXTENSION inbox` and build what they use. A block that is deliberately not runnable
//! (a fragment, a statement meant to fail) is fenced as ```` ```sql,ignore ```` instead; any other
//! info string beginning with `sql` fails the test, so that a typo cannot skip a block.

use std::path::{Path, PathBuf};

use inbox_tests::{DEFAULT_URL, URL_VAR};
use tokio_postgres::{Client, Config, NoTls};

/// A fenced SQL block: where it starts (1-based line of its fence) and its text.
struct Block {
    line: usize,
    sql: String,
}

/// Where the scan of a markdown file is.
enum Fence {
    Outside,
    /// Inside a ```` ```sql ```` block opened on `line`; `run` is false for `sql,ignore`.
    Sql {
        line: usize,
        run: bool,
        sql: String,
    },
    /// Inside a block of another language, whose lines are not fences.
    Other,
}

/// The runnable ```` ```sql ```` blocks of `markdown`, and how many were marked `sql,ignore`.
fn sql_blocks(markdown: &str, file: &Path) -> (Vec<Block>, usize) {
    let mut blocks = Vec::new();
    let mut ignored = 0;
    let mut state = Fence::Outside;
    for (index, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        let is_fence = trimmed.starts_with("```");
        // A closing fence carries no info string (CommonMark), so "```sql" inside a block of
        // another language does not end it.
        let is_close = is_fence && trimmed.trim_end().chars().all(|c| c == '`');
        state = match state {
            Fence::Outside if is_fence => match trimmed[3..].trim() {
                "sql" => Fence::Sql { line: index + 1, run: true, sql: String::new() },
                "sql,ignore" => Fence::Sql { line: index + 1, run: false, sql: String::new() },
                other if other.to_ascii_lowercase().starts_with("sql") => panic!(
                    "{}:{}: unknown fence `{other}`: use ```sql (run by the tests) or ```sql,ignore",
                    file.display(),
                    index + 1
                ),
                _ => Fence::Other,
            },
            Fence::Outside => Fence::Outside,
            Fence::Sql { line, run, sql } if is_close => {
                if run {
                    blocks.push(Block { line, sql });
                } else {
                    ignored += 1;
                }
                Fence::Outside
            }
            Fence::Sql { line: start, run, mut sql } => {
                sql.push_str(line);
                sql.push('\n');
                Fence::Sql { line: start, run, sql }
            }
            Fence::Other if is_close => Fence::Outside,
            Fence::Other => Fence::Other,
        };
    }
    if let Fence::Sql { line, .. } = state {
        panic!("{}:{line}: unterminated ```sql block", file.display());
    }
    (blocks, ignored)
}

fn documentation_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

async fn connect(config: &Config) -> Client {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test server ({URL_VAR}): {e}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Runs `blocks` in order in a new database; returns the first failure, naming its block.
async fn run_in_fresh_database(
    admin: &Client,
    server: &Config,
    name: &str,
    file: &Path,
    blocks: &[Block],
) -> Result<(), String> {
    // One statement per call: CREATE DATABASE cannot run inside a multi-statement batch.
    for ddl in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        admin
            .batch_execute(&ddl)
            .await
            .unwrap_or_else(|e| panic!("{ddl}: {e:?}"));
    }
    let mut config = server.clone();
    config.dbname(name);
    let client = connect(&config).await;
    let mut outcome = Ok(());
    for block in blocks {
        if let Err(e) = client.batch_execute(&block.sql).await {
            let detail = e
                .as_db_error()
                .map(|db| format!("{} ({})", db.message(), db.code().code()))
                .unwrap_or_else(|| e.to_string());
            outcome = Err(format!(
                "{}:{}: the ```sql block fails: {detail}\n{}",
                file.display(),
                block.line,
                block.sql
            ));
            break;
        }
    }
    drop(client);
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .unwrap_or_else(|e| panic!("cannot drop database {name}: {e:?}"));
    outcome
}

#[tokio::test]
async fn every_sql_block_of_the_docs_runs_verbatim() {
    let url = std::env::var(URL_VAR).unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let server: Config = url.parse().expect("a connection string");
    let admin = connect(&server).await;
    let mut failures = Vec::new();
    let mut ran = 0;
    for (index, file) in documentation_files().iter().enumerate() {
        let markdown = std::fs::read_to_string(file).expect("a readable file");
        let (blocks, ignored) = sql_blocks(&markdown, file);
        if blocks.is_empty() {
            continue;
        }
        ran += blocks.len();
        println!(
            "{}: {} blocks run, {ignored} marked sql,ignore",
            file.display(),
            blocks.len()
        );
        let name = format!("inbox_docs_{}_{index}", std::process::id());
        if let Err(failure) = run_in_fresh_database(&admin, &server, &name, file, &blocks).await {
            failures.push(failure);
        }
    }
    assert!(ran > 0, "no ```sql block found in README.md or docs/");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn blocks_are_found_in_order_and_markers_respected() {
    let markdown = "text\n```sql\nSELECT 1;\n```\n```sh\n```sql inside sh\n```\n```sql,ignore\nbroken\n```\n  ```sql\nSELECT 2;\n  ```\n";
    let (blocks, ignored) = sql_blocks(markdown, Path::new("x.md"));
    let texts: Vec<&str> = blocks.iter().map(|b| b.sql.as_str()).collect();
    assert_eq!(texts, ["SELECT 1;\n", "SELECT 2;\n"]);
    assert_eq!(blocks[0].line, 2);
    assert_eq!(ignored, 1);
}

#[test]
#[should_panic(expected = "unknown fence")]
fn a_misspelt_marker_fails() {
    sql_blocks("```sql norun\nx\n```\n", Path::new("x.md"));
}
