//! Table names given as text to the `inbox_create_*` functions, and the extension's own tables
//! and schema.
//!
//! A name is one identifier or `schema.identifier`, each part either unquoted (folded to lower
//! case, as PostgreSQL does) or double-quoted (`""` for a quote). Anything else is refused rather
//! than guessed at, and so is a part PostgreSQL would silently truncate.

use std::cell::RefCell;

use pgrx::pg_sys::Oid;

use crate::error::*;

/// PostgreSQL's NAMEDATALEN - 1: the longest identifier it keeps whole.
const MAX_IDENTIFIER_BYTES: usize = 63;

/// A parsed, possibly schema-qualified table name.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct QualifiedName {
    pub schema: Option<String>,
    pub name: String,
}

impl QualifiedName {
    /// The name as SQL, each part quoted as an identifier.
    pub fn quoted(&self) -> String {
        match &self.schema {
            Some(schema) => format!(
                "{}.{}",
                quote_identifier(schema),
                quote_identifier(&self.name)
            ),
            None => quote_identifier(&self.name),
        }
    }
}

/// Always double-quotes, so the text can never be read as anything but one identifier.
pub(crate) fn quote_identifier(identifier: &str) -> String {
    format!("\"{}\"", identifier.replace('"', "\"\""))
}

/// Quotes `text` as a SQL string literal.
pub(crate) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Parses `text` as `[schema.]name`, raising `42602 invalid_name` or `42622 name_too_long`.
pub(crate) fn parse_qualified_name(text: &str) -> QualifiedName {
    match split_identifiers(text) {
        Ok(mut parts) => {
            if let Some(long) = parts.iter().find(|part| part.len() > MAX_IDENTIFIER_BYTES) {
                raise(
                    ERRCODE_NAME_TOO_LONG,
                    format!(
                        "identifier \"{long}\" is {} bytes long; at most {MAX_IDENTIFIER_BYTES} are allowed",
                        long.len()
                    ),
                );
            }
            let name = parts.pop().unwrap_or_default();
            QualifiedName {
                schema: parts.pop(),
                name,
            }
        }
        Err(reason) => raise(
            ERRCODE_INVALID_NAME,
            format!("invalid table name {}: {reason}", quote_literal(text)),
        ),
    }
}

/// Splits `text` into one or two identifiers, or says why it cannot.
fn split_identifiers(text: &str) -> Result<Vec<String>, &'static str> {
    let mut parts = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let mut part = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        part.push('"');
                    }
                    Some('"') => break,
                    Some(c) => part.push(c),
                    None => return Err("unterminated quoted identifier"),
                }
            }
            if part.is_empty() {
                return Err("zero-length quoted identifier");
            }
        } else {
            while let Some(&c) = chars.peek() {
                let allowed = c == '_'
                    || c.is_alphabetic()
                    || (!part.is_empty() && (c.is_ascii_digit() || c == '$'));
                if !allowed {
                    break;
                }
                part.push(c.to_ascii_lowercase());
                chars.next();
            }
            if part.is_empty() {
                return Err("expected an identifier");
            }
        }
        parts.push(part);
        match chars.next() {
            None => break,
            Some('.') if parts.len() < 2 => continue,
            Some('.') => return Err("at most schema.name"),
            Some(_) => return Err("unexpected character (quote the name to use it)"),
        }
    }
    Ok(parts)
}

/// The extension's own table `name` as SQL, quoted and schema-qualified, and its oid; `42P01`
/// when it is missing.
pub(crate) fn extension_table(client: &pgrx::spi::SpiClient<'_>, name: &str) -> (String, Oid) {
    let row = client
        .select(
            "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname), c.oid \
               FROM pg_catalog.pg_extension e \
               JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) e.extnamespace \
                                         AND c.relname OPERATOR(pg_catalog.=) $1 \
               JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
              WHERE e.extname OPERATOR(pg_catalog.=) 'inbox'",
            None,
            &[name.into()],
        )
        .unwrap_or_else(|e| internal(e))
        .first();
    match row.get_two::<String, Oid>() {
        Ok((Some(table), Some(oid))) => (table, oid),
        _ => raise(
            ERRCODE_UNDEFINED_TABLE,
            format!("the extension's table {name} is missing"),
        ),
    }
}

/// The extension's table whose schema [`schema`] reads (any of the extension's tables would do).
const SCHEMA_TABLE: &str = "inbox_queue_controls";

thread_local! {
    /// The extension's schema, quoted, once looked up.
    static SCHEMA: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// The extension's schema, quoted.
pub(crate) fn schema(client: &pgrx::spi::SpiClient<'_>) -> String {
    SCHEMA.with(|cached| {
        cached
            .borrow_mut()
            .get_or_insert_with(|| {
                let (table, _) = extension_table(client, SCHEMA_TABLE);
                // The table's name is quoted and qualified: the schema is what precedes its dot.
                table
                    .strip_suffix(&format!(".{SCHEMA_TABLE}"))
                    .unwrap_or_else(|| {
                        raise(ERRCODE_INTERNAL_ERROR, format!("unexpected name {table}"))
                    })
                    .to_owned()
            })
            .clone()
    })
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn splits_plain_qualified_and_quoted_names() {
        assert_eq!(split_identifiers("Jobs"), Ok(vec!["jobs".to_string()]));
        assert_eq!(
            split_identifiers("app.jobs"),
            Ok(vec!["app".into(), "jobs".into()])
        );
        assert_eq!(
            split_identifiers("\"My \"\"Q\"\"\".x_1$"),
            Ok(vec!["My \"Q\"".into(), "x_1$".into()])
        );
    }

    #[test]
    fn refuses_what_is_not_an_identifier() {
        for hostile in [
            "x; DROP TABLE y",
            "",
            "a.b.c",
            "\"open",
            "1abc",
            "a b",
            "a'b",
            "\"\"",
            "a.",
        ] {
            assert!(
                split_identifiers(hostile).is_err(),
                "{hostile:?} should be refused"
            );
        }
    }

    #[test]
    fn quotes_never_leave_an_identifier() {
        assert_eq!(quote_identifier("a\"; DROP"), "\"a\"\"; DROP\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
