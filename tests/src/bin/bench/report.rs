//! The results: a fixed-width table on the terminal, and `target/bench/latest.json` with the
//! markdown table and the SVG chart drawn from it (`inbox_tests::results`).

use std::fmt::Write as _;
use std::path::Path;

use inbox_tests::results::{self, number};
use serde::Serialize;
use serde_json::Value;

use super::measure::Row;
use super::setup::Result;

/// What the run was measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Header {
    pub date: String,
    pub postgres: String,
    pub synchronous_commit: String,
    pub cpus: usize,
    pub mode: String,
    pub command: String,
}

const WIDTHS: [usize; 8] = [40, 5, 11, 11, 7, 9, 8, 4];

pub fn print_header(header: &Header) {
    println!("{}", results::header_lines(&serde_json::json!(header)));
    print_columns(&[
        "figure", "conns", "inbox", "raw", "ratio", "unit", "target", "met",
    ]);
    println!(
        "{}",
        "-".repeat(WIDTHS.iter().sum::<usize>() + WIDTHS.len() - 1)
    );
}

fn print_columns(cells: &[&str]) {
    let mut line = String::new();
    for (i, (cell, width)) in cells.iter().zip(WIDTHS).enumerate() {
        if i > 1 && i < 5 {
            let _ = write!(line, "{cell:>width$} ");
        } else {
            let _ = write!(line, "{cell:<width$} ");
        }
    }
    println!("{}", line.trim_end());
}

fn met(row: &Row) -> &'static str {
    match row.met {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    }
}

fn cells(row: &Row) -> [String; 8] {
    [
        row.name.clone(),
        row.connections.map_or("-".to_owned(), |n| n.to_string()),
        number(row.inbox),
        number(row.raw),
        row.ratio.map_or("-".to_owned(), |r| format!("{r:.2}")),
        row.unit.to_owned(),
        row.target.describe(),
        met(row).to_owned(),
    ]
}

pub fn print_row(row: &Row) {
    let cells = cells(row);
    print_columns(&cells.iter().map(String::as_str).collect::<Vec<_>>());
}

pub fn print_table(header: &Header, rows: &[Row]) {
    println!();
    print_header(header);
    for row in rows {
        print_row(row);
    }
    let notes: Vec<_> = rows.iter().filter(|r| r.note.is_some()).collect();
    if !notes.is_empty() {
        println!();
        for row in notes {
            let conns = row.connections.map_or(String::new(), |n| format!(" x{n}"));
            println!(
                "  {}{}: {}",
                row.name,
                conns,
                row.note.as_deref().unwrap_or("")
            );
        }
    }
}

/// The results as JSON: the header and every row.
pub fn to_json(header: &Header, rows: &[Row]) -> Result<Value> {
    Ok(serde_json::json!({ "header": header, "rows": rows }))
}

/// Writes the JSON, the markdown table and the chart under `dir`.
pub fn write_all(dir: &Path, json: &Value) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("latest.json"), serde_json::to_string_pretty(json)?)?;
    std::fs::write(dir.join("latest.md"), results::table(json))?;
    std::fs::write(dir.join("latest.svg"), results::svg(json))?;
    Ok(())
}
