//! The figures the docs quote come from one full run of the benchmark, kept in `docs/bench.json`
//! (written by `./scripts/bench.sh --docs`, or `inbox-bench docs` after a run):
//!
//! - the results table of `docs/benchmarks.md` and the chart `docs/bench.svg` are drawn from it
//!   as they stand;
//! - every figure that `README.md` or a `docs/*.md` quotes as `inbox / raw (ratio)` is one of its
//!   rows, as the table prints it;
//! - in a table whose last column is `figure` (`docs/scaling.md`), every number is a value the
//!   project reached in that figure of the run.
//!
//! Figures measured otherwise (profiles, `pgbench`, Citus) are quoted with their own command and
//! date, never as `inbox / raw (ratio)`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use inbox_tests::results;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn run() -> Value {
    serde_json::from_str(&read(&root().join("docs/bench.json"))).expect("docs/bench.json")
}

/// A page's text with its generated results blanked (they are drawn from the run, and checked
/// as a whole), its lines where they were.
fn prose(page: &Path) -> String {
    let text = read(page);
    match results::block_of(&text) {
        Some(block) => text.replace(block, &"\n".repeat(block.matches('\n').count())),
        None => text,
    }
}

/// `README.md` and every `docs/*.md`.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let path = entry.expect("a file of docs/").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

const REDRAW: &str =
    "redraw them with `cargo run --release -p inbox-tests --bin inbox-bench -- docs \
                      docs/bench.json`";

#[test]
fn the_results_table_and_the_chart_are_drawn_from_the_run() {
    let json = run();
    assert_eq!(
        json["header"]["mode"], "full",
        "docs/bench.json must be a full run"
    );
    let page = read(&root().join("docs/benchmarks.md"));
    let block = results::block_of(&page).expect("docs/benchmarks.md has the generated results");
    assert!(
        block == results::docs_block(&json).trim_end(),
        "the results in docs/benchmarks.md are not those of docs/bench.json: {REDRAW}"
    );
    assert!(
        read(&root().join("docs/bench.svg")) == results::svg(&json),
        "docs/bench.svg is not drawn from docs/bench.json: {REDRAW}"
    );
}

#[test]
fn every_figure_the_docs_quote_is_in_the_run() {
    let json = run();
    let rows = json["rows"].as_array().expect("rows");
    let cells: BTreeSet<String> = rows.iter().map(results::cell).collect();
    let mut missing = Vec::new();
    for page in pages() {
        for (line, quoted) in results::quoted_figures(&prose(&page)) {
            if !cells.contains(&quoted) {
                missing.push(format!("{}:{line}: {quoted}", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "figures quoted as `inbox / raw (ratio)` that docs/bench.json does not hold:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_number_of_a_table_by_figure_is_in_the_run() {
    let json = run();
    let rows = json["rows"].as_array().expect("rows");
    let reached = |figure: u64| -> BTreeSet<String> {
        rows.iter()
            .filter(|row| row["figure"].as_u64() == Some(figure))
            .map(|row| results::number(row["inbox"].as_f64()))
            .collect()
    };
    let is_number = |cell: &str| {
        cell.starts_with(|c: char| c.is_ascii_digit())
            && cell
                .chars()
                .all(|c| c.is_ascii_digit() || c == ',' || c == '.')
    };
    let mut checked = 0;
    let mut wrong = Vec::new();
    for page in pages() {
        let text = prose(&page);
        let mut by_figure = false;
        let mut previous_was_table = false;
        for (index, line) in text.lines().enumerate() {
            let is_table = line.starts_with('|');
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            if is_table && !previous_was_table {
                by_figure = cells.last() == Some(&"figure");
            }
            previous_was_table = is_table;
            let figure = cells.last().and_then(|cell| cell.parse::<u64>().ok());
            let (true, true, Some(figure)) = (is_table, by_figure, figure) else {
                continue;
            };
            let values = reached(figure);
            for cell in &cells[..cells.len() - 1] {
                if is_number(cell) {
                    checked += 1;
                    if !values.contains(*cell) {
                        wrong.push(format!(
                            "{}:{}: {cell} is not a value of figure {figure}",
                            page.display(),
                            index + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(
        checked > 0,
        "no table by figure found (docs/scaling.md has one)"
    );
    assert!(
        wrong.is_empty(),
        "numbers in tables by figure that docs/bench.json does not hold:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn quoted_figures_are_found_as_written() {
    let text = "ran 32,970 / 38,422 (0.86) and 1.4 / 0.6 (2.33); not 1 / 4 / 16 (x) nor (0.86)";
    let found: Vec<String> = results::quoted_figures(text)
        .into_iter()
        .map(|(_, quoted)| quoted)
        .collect();
    assert_eq!(found, ["32,970 / 38,422 (0.86)", "1.4 / 0.6 (2.33)"]);
}
