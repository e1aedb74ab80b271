//! What can go wrong, how it is printed, and the exit code each kind maps to.

use std::io::Write;
use std::process::ExitCode;

/// The exit codes, documented in `inbox --help` and docs/guide.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// The database refused a statement.
    Database = 1,
    /// Bad usage or input (clap uses 2 for its own usage errors too).
    Usage = 2,
    /// The database cannot be reached (or refused the connection).
    Connect = 3,
    /// Some of the given job ids were not found in the state the command acts on.
    NotFound = 4,
    /// Anything else: I/O, the metrics server.
    Io = 5,
}

/// A failure of a subcommand. Messages never contain the connection string's password
/// (see [`crate::db::Secret`]).
#[derive(Debug)]
pub enum CliError {
    /// A statement failed with `sqlstate`.
    Database {
        sqlstate: String,
        message: String,
    },
    Usage(String),
    Connect(String),
    NotFound(String),
    Io(String),
}

impl CliError {
    fn exit(&self) -> Exit {
        match self {
            CliError::Database { .. } => Exit::Database,
            CliError::Usage(_) => Exit::Usage,
            CliError::Connect(_) => Exit::Connect,
            CliError::NotFound(_) => Exit::NotFound,
            CliError::Io(_) => Exit::Io,
        }
    }

    fn message(&self) -> &str {
        match self {
            CliError::Database { message, .. }
            | CliError::Usage(message)
            | CliError::Connect(message)
            | CliError::NotFound(message)
            | CliError::Io(message) => message,
        }
    }

    /// Prints the error on standard error (as one JSON object with `json`) and returns its code.
    pub fn report(self, json: bool) -> ExitCode {
        let exit = self.exit();
        let sqlstate = match &self {
            CliError::Database { sqlstate, .. } => Some(sqlstate.as_str()),
            _ => None,
        };
        let text = if json {
            serde_json::json!({
                "error": self.message(),
                "sqlstate": sqlstate,
                "exit": exit as u8,
            })
            .to_string()
        } else {
            match sqlstate {
                Some(code) => format!("error: {} (SQLSTATE {code})", self.message()),
                None => format!("error: {}", self.message()),
            }
        };
        // Nothing more can be done if standard error is closed; the exit code still says it.
        let _ = writeln!(std::io::stderr(), "{text}");
        ExitCode::from(exit as u8)
    }
}

impl From<std::io::Error> for CliError {
    fn from(error: std::io::Error) -> Self {
        CliError::Io(error.to_string())
    }
}
