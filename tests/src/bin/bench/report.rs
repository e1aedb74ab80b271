//! The results: a fixed-width table, `target/bench/latest.json`, a markdown table and an SVG
//! chart of the ratios (drawn here from the JSON, no plotting dependency).

use std::fmt::Write as _;
use std::path::Path;

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
    println!("inbox-bench ({} run), {}", header.mode, header.date);
    println!("  {}", header.postgres);
    println!(
        "  synchronous_commit = {}, {} CPUs, command: {}",
        header.synchronous_commit, header.cpus, header.command
    );
    println!();
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

/// A value as the table shows it: thousands grouped, two decimals below 10.
pub fn number(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) if !v.is_finite() => "n/a".to_owned(),
        Some(v) if v.abs() >= 1000.0 => {
            let digits = format!("{:.0}", v.abs());
            let mut grouped = String::new();
            for (i, c) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i) % 3 == 0 {
                    grouped.push(',');
                }
                grouped.push(c);
            }
            if v < 0.0 {
                grouped.insert(0, '-');
            }
            grouped
        }
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
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

/// The table as markdown, for `docs/benchmarks.md`.
pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::from(
        "| figure | conns | inbox | raw SQL | ratio | unit | target | met |\n\
         |---|--:|--:|--:|--:|---|---|---|\n",
    );
    for row in rows {
        let _ = writeln!(out, "| {} |", cells(row).join(" | "));
    }
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A horizontal bar per row of the ratio inbox / raw SQL, coloured by its target (green met, red
/// missed, grey none), with each ratio target drawn as a red tick and the raw SQL at 1.0.
pub fn svg(json: &Value) -> String {
    let rows: Vec<&Value> = json["rows"]
        .as_array()
        .map(|rows| rows.iter().collect())
        .unwrap_or_default();
    let header = &json["header"];
    let (label_w, bar_x, bar_w, row_h, top) = (330.0, 340.0, 460.0, 17.0, 70.0);
    let ratios = rows.iter().filter_map(|r| r["ratio"].as_f64());
    let max = ratios.fold(1.5_f64, f64::max).min(3.0);
    let max = (max * 2.0).ceil() / 2.0;
    let x = |ratio: f64| bar_x + bar_w * ratio.min(max) / max;
    let mut figures = 0;
    let mut previous = None;
    for row in &rows {
        if previous != Some(row["figure"].as_u64()) {
            figures += 1;
            previous = Some(row["figure"].as_u64());
        }
    }
    let height = top + row_h * (rows.len() + figures) as f64 + 40.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\" height=\"{height:.0}\" \
         font-family=\"sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(
        out,
        "<rect width=\"960\" height=\"{height:.0}\" fill=\"white\"/>"
    );
    let _ = writeln!(
        out,
        "<text x=\"10\" y=\"20\" font-size=\"15\" font-weight=\"bold\">inbox / raw SQL, same run \
         (throughput: higher is better; latency, size, memory: lower is better)</text>"
    );
    let _ = writeln!(
        out,
        "<text x=\"10\" y=\"38\" fill=\"#555\">{} | {} | synchronous_commit={} | {} CPUs | {} run</text>",
        escape(header["date"].as_str().unwrap_or("")),
        escape(header["postgres"].as_str().unwrap_or("").split(" on ").next().unwrap_or("")),
        escape(header["synchronous_commit"].as_str().unwrap_or("")),
        header["cpus"],
        escape(header["mode"].as_str().unwrap_or("")),
    );
    let _ = writeln!(
        out,
        "<text x=\"10\" y=\"54\" fill=\"#555\">green: target met, red: missed, grey: no target; \
         red ticks: ratio targets; the dashed line is raw SQL (1.0)</text>"
    );
    let mut y = top;
    let mut previous = None;
    for row in &rows {
        let figure = row["figure"].as_u64();
        if previous != Some(figure) {
            previous = Some(figure);
            y += row_h;
        }
        let conns = row["connections"]
            .as_u64()
            .map_or(String::new(), |n| format!(" ×{n}"));
        let label = format!("{}{conns}", row["name"].as_str().unwrap_or(""));
        let _ = writeln!(
            out,
            "<text x=\"{label_w}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            y + 12.0,
            escape(&label)
        );
        let colour = match row["met"].as_bool() {
            Some(true) => "#2e7d32",
            Some(false) => "#c62828",
            None => "#90a4ae",
        };
        let unit = row["unit"].as_str().unwrap_or("");
        let value = |key: &str| number(row[key].as_f64());
        match row["ratio"].as_f64() {
            Some(ratio) => {
                let end = x(ratio);
                let _ = writeln!(
                    out,
                    "<rect x=\"{bar_x}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{colour}\"/>",
                    y + 2.0,
                    end - bar_x,
                    row_h - 4.0
                );
                let clipped = if ratio > max { "»" } else { "" };
                let _ = writeln!(
                    out,
                    "<text x=\"{:.1}\" y=\"{:.1}\">{ratio:.2}{clipped} ({} vs {} {})</text>",
                    end + 4.0,
                    y + 12.0,
                    value("inbox"),
                    value("raw"),
                    escape(unit)
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "<text x=\"{bar_x}\" y=\"{:.1}\" fill=\"#555\">reference: {} {}</text>",
                    y + 12.0,
                    value("raw"),
                    escape(unit)
                );
            }
        }
        if row["target"]["kind"] == "ratio_at_least" {
            if let Some(target) = row["target"]["value"].as_f64() {
                let _ = writeln!(
                    out,
                    "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{1:.1}\" y2=\"{2:.1}\" stroke=\"#b71c1c\" stroke-width=\"2\"/>",
                    x(target),
                    y,
                    y + row_h
                );
            }
        }
        y += row_h;
    }
    let _ = writeln!(
        out,
        "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{top}\" y2=\"{y:.1}\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>",
        x(1.0)
    );
    for tick in 0..=((max * 2.0) as usize) {
        let ratio = tick as f64 / 2.0;
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{ratio:.1}</text>",
            x(ratio),
            y + 14.0
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Writes the JSON, the markdown table and the chart under `dir`.
pub fn write_all(dir: &Path, json: &Value, rows: &[Row]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("latest.json"), serde_json::to_string_pretty(json)?)?;
    std::fs::write(dir.join("latest.md"), markdown(rows))?;
    std::fs::write(dir.join("latest.svg"), svg(json))?;
    Ok(())
}
