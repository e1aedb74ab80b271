//! The integration tests of the extension and the client over real connections, one module per
//! area, built as one test binary: one crate to compile and link instead of one per area.
//!
//! `scripts/test.sh` runs the modules one after another, each in its own run of this binary, as
//! when they were separate binaries: a module's load tests never run beside another module's
//! tests with a timing margin (the locks that keep them apart, such as `worker::LOAD`, are per
//! module). One module alone: `cargo test --workspace --exclude inbox --profile ci --test
//! integration -- worker::`. A new area of tests is a file here and a `mod` line below.

mod support;

mod browse;
mod cancel;
mod client_inbox;
mod client_port;
mod cron_conformance;
mod dead_letters;
mod docs_figures;
mod docs_sql;
mod extension_concurrency;
mod groups;
mod isolation;
mod limits;
mod observe;
mod outbox;
mod pause;
mod pooler;
mod priorities;
mod schedules;
mod snooze;
mod sql_conformance;
mod sql_input;
mod steps;
mod timeouts;
mod typed_jobs;
mod unique;
mod wakeups;
mod worker;
mod worker_resilience;
mod worker_smoke;
mod workflows;
