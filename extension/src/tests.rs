//! In-database tests; see below.
