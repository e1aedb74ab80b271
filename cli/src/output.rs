//! How results are printed: a table for people, JSON for scripts.

use std::io::Write;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, ContentArrangement, Table};
use serde_json::Value;

/// Where a command's result goes, and in which form.
pub struct Output {
    json: bool,
}

impl Output {
    pub fn new(json: bool) -> Output {
        Output { json }
    }

    pub fn json(&self) -> bool {
        self.json
    }

    /// Prints `value` as one line of JSON, or else `human()`.
    pub fn emit(&self, value: Value, human: impl FnOnce() -> String) {
        if self.json {
            line(&value.to_string());
        } else {
            line(&human());
        }
    }
}

/// Prints `text` and a newline on standard output. When the reader has gone (`inbox jobs q |
/// head`), the tool stops quietly, as Unix tools do, instead of failing on every later line.
pub fn line(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(error) = writeln!(out, "{text}").and_then(|()| out.flush()) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write the output: {error}");
        std::process::exit(crate::error::Exit::Io as i32);
    }
}

/// A table of `rows` under `header`; columns listed in `numeric` are right-aligned.
pub fn table(header: &[&str], rows: Vec<Vec<String>>, numeric: &[usize]) -> String {
    if rows.is_empty() {
        return "(none)".to_owned();
    }
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.iter().copied());
    for row in rows {
        table.add_row(row);
    }
    for &column in numeric {
        if let Some(column) = table.column_mut(column) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table.to_string()
}

/// An age in seconds for people: `-` when there is none, else the two largest units.
pub fn age(seconds: Option<f64>) -> String {
    let Some(seconds) = seconds else {
        return "-".to_owned();
    };
    if seconds < 1.0 {
        return format!("{}ms", (seconds * 1000.0).round() as i64);
    }
    let total = seconds.round() as i64;
    let (days, hours, minutes, secs) = (
        total / 86_400,
        total / 3_600 % 24,
        total / 60 % 60,
        total % 60,
    );
    match (days, hours, minutes) {
        (0, 0, 0) => format!("{secs}s"),
        (0, 0, _) => format!("{minutes}m{secs:02}s"),
        (0, _, _) => format!("{hours}h{minutes:02}m"),
        _ => format!("{days}d{hours:02}h"),
    }
}

/// The start of a payload, on one line, for a table cell.
pub fn preview(payload: &str, width: usize) -> String {
    let flat: String = payload
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= width {
        flat
    } else {
        let mut cut: String = flat.chars().take(width.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(None), "-");
        assert_eq!(age(Some(0.0042)), "4ms");
        assert_eq!(age(Some(59.4)), "59s");
        assert_eq!(age(Some(61.0)), "1m01s");
        assert_eq!(age(Some(3_600.0 * 5.0 + 120.0)), "5h02m");
        assert_eq!(age(Some(86_400.0 * 3.0 + 3_600.0)), "3d01h");
    }

    #[test]
    fn previews_are_one_line_and_bounded() {
        assert_eq!(preview("{\"a\":\n1}", 20), "{\"a\": 1}");
        assert_eq!(preview("abcdefghij", 5), "abcd…");
        assert_eq!(preview("abcde", 5), "abcde");
    }
}
