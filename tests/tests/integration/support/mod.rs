//! Helpers that several modules of the integration tests share.

pub mod explain;
