//! `inbox`: the operator's command-line tool for the `inbox` PostgreSQL extension.
//!
//! Every subcommand calls the extension's SQL functions (the statements are in [`sql`]) on one
//! connection, prints a table or, with `--json`, JSON, and exits with a code a script can test
//! (see [`error::Exit`]).

mod commands;
mod db;
mod error;
mod metrics;
mod outboxes;
mod output;
mod relay;
mod sql;
mod ui;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::error::CliError;

/// Operate the job queues, dedup ledgers and outboxes of the `inbox` PostgreSQL extension.
///
/// Exit codes: 0 success; 1 the database refused a statement (its SQLSTATE is printed);
/// 2 bad usage or input; 3 the database cannot be reached; 4 some of the given job ids were
/// not found in the state the command acts on; 5 any other failure (I/O, the metrics server).
/// `inbox relay` exits 3 too when the NATS server cannot be reached at its start.
#[derive(Debug, Parser)]
#[command(name = "inbox", version, propagate_version = true)]
struct Cli {
    /// The database to connect to, as a libpq URL or key=value string.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    /// Print JSON for scripts instead of tables (errors too, on standard error).
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List every queue in the database with its ready, delayed, leased and dead jobs, ages, and
    /// whether it is paused.
    Queues,
    /// Pause a queue: its leases and locks hand out nothing until it is resumed (running jobs
    /// finish and settle; enqueues go on).
    Pause {
        /// The queue table (optionally schema-qualified).
        queue: String,
    },
    /// Cancel jobs, waiting or running: each becomes a dead job marked cancelled, and a running
    /// delivery's settlement is refused (its writes roll back).
    Cancel {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// The ids of the jobs to cancel.
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
    /// Resume a paused queue and wake its sleeping workers.
    Resume {
        /// The queue table (optionally schema-qualified).
        queue: String,
    },
    /// Show a queue's concurrency and rate limits and how much of them is in use; with options,
    /// set them first (each takes hold when it commits; `none` removes one).
    Limits {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// At most N of the queue's jobs run at once, across all workers.
        #[arg(long, value_name = "N|none")]
        concurrency: Option<commands::Limit>,
        /// At most N jobs of one key run at once, a job's key being its payload's field
        /// --per-key.
        #[arg(long, value_name = "N|none", requires = "per_key")]
        key_concurrency: Option<commands::Limit>,
        /// The payload's field whose value is a job's key, for --key-concurrency.
        #[arg(long, value_name = "FIELD", requires = "key_concurrency")]
        per_key: Option<String>,
        /// At most N jobs start in any window of --per.
        #[arg(long, value_name = "N|none")]
        rate: Option<commands::Limit>,
        /// The rate limit's window, a PostgreSQL interval.
        #[arg(long, value_name = "INTERVAL", default_value = "1 second")]
        per: String,
    },
    /// Show until when a queue's job keys stay unique; with --until, set it first (it replaces
    /// the queue's unique index on key, as its owner).
    Unique {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// acked (the default: while the job exists), finished (until acked or dead-lettered)
        /// or started (until its first delivery).
        #[arg(long, value_enum)]
        until: Option<UniqueUntil>,
    },
    /// Show one queue's job counts and oldest ready age, once or every few seconds.
    Stats {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// Print a new line every SECONDS seconds until interrupted.
        #[arg(long, value_name = "SECONDS")]
        watch: Option<f64>,
    },
    /// List a queue's jobs (all, or those in one state) by due time, with their last error.
    Jobs {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// Only jobs in this state.
        #[arg(long, value_enum)]
        state: Option<JobState>,
        /// At most this many jobs.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i32).range(1..))]
        limit: i32,
    },
    /// List a queue's dead-lettered jobs with their last error.
    Dead {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// At most this many jobs.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i32).range(1..))]
        limit: i32,
    },
    /// Put dead-lettered jobs back in the queue, due now.
    Requeue(RequeueArgs),
    /// Delete dead-lettered jobs for good.
    Discard {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// The ids of the dead jobs to delete.
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
    /// Enqueue one JSON job, or one job per line of standard input, in batches.
    Enqueue(EnqueueArgs),
    /// Delete a ledger's keys older than a duration, in bounded batches, each its own transaction.
    Purge {
        /// The ledger table (optionally schema-qualified).
        ledger: String,
        /// Keys seen longer ago than this go (a PostgreSQL interval: '30 days', '12h', ...).
        #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
        older_than: String,
        /// Most keys deleted per transaction.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(i64).range(1..))]
        batch: i64,
    },
    /// List a queue's schedules with their last and next tick, or run one now.
    Schedules {
        /// The queue table (optionally schema-qualified).
        queue: String,
        /// Enqueue this schedule's job now, outside its timetable (its ticks go on as before).
        #[arg(long, value_name = "NAME")]
        run: Option<String>,
    },
    /// List every outbox with its pending, sending, retrying and dead messages, relay and ages.
    Outboxes,
    /// Look at one outbox's messages, and requeue or discard its dead ones.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Relay an outbox's messages into NATS JetStream until interrupted (Ctrl-C or SIGTERM).
    Relay(RelayArgs),
    /// Serve a web dashboard of the queues and outboxes until interrupted: jobs by filter, one
    /// job in full, dead letters by error, and actions (requeue, discard, cancel, pause, resume,
    /// enqueue) unless --read-only.
    Ui {
        /// The address to listen on (port 0 picks a free one; the address is printed). An
        /// address other machines can reach needs --token.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9634")]
        listen: String,
        /// The path a reverse proxy serves the dashboard under, such as /inbox.
        #[arg(long, value_name = "PATH", default_value = "")]
        base_path: String,
        /// Show everything and change nothing: the server refuses every action with 403.
        #[arg(long)]
        read_only: bool,
        /// Ask for this token: as the password of HTTP basic auth (any user name) or as
        /// `Authorization: Bearer TOKEN`.
        #[arg(long, env = "INBOX_UI_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Serve every queue's and outbox's gauges at /metrics in the Prometheus text format.
    Metrics {
        /// The address to listen on (port 0 picks a free one; the address is printed).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9633")]
        listen: String,
    },
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all"]))]
struct RequeueArgs {
    /// The queue table (optionally schema-qualified).
    queue: String,
    /// The ids of the dead jobs to requeue.
    #[arg(num_args = 1..)]
    ids: Vec<i64>,
    /// Requeue every dead job of the queue (in batches, each its own transaction).
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// List an outbox's messages (all, or those in one state) in id order, with their last error.
    Messages {
        /// The outbox table (optionally schema-qualified).
        outbox: String,
        /// Only messages in this state.
        #[arg(long, value_enum)]
        state: Option<MessageState>,
        /// At most this many messages.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i32).range(1..))]
        limit: i32,
    },
    /// List an outbox's dead-lettered messages with their last error.
    Dead {
        /// The outbox table (optionally schema-qualified).
        outbox: String,
        /// At most this many messages.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i32).range(1..))]
        limit: i32,
    },
    /// Send dead-lettered messages again (their attempts counted from zero).
    Requeue(OutboxRequeueArgs),
    /// Delete dead-lettered messages for good.
    Discard {
        /// The outbox table (optionally schema-qualified).
        outbox: String,
        /// The ids of the dead messages to delete.
        #[arg(required = true, num_args = 1..)]
        ids: Vec<i64>,
    },
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all"]))]
struct OutboxRequeueArgs {
    /// The outbox table (optionally schema-qualified).
    outbox: String,
    /// The ids of the dead messages to requeue.
    #[arg(num_args = 1..)]
    ids: Vec<i64>,
    /// Requeue every dead message of the outbox (in batches, each its own transaction).
    #[arg(long)]
    all: bool,
}

/// The states `inbox outbox messages --state` filters on.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum MessageState {
    Pending,
    Sending,
    Retrying,
    Dead,
}

impl MessageState {
    fn as_str(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::Sending => "sending",
            MessageState::Retrying => "retrying",
            MessageState::Dead => "dead",
        }
    }
}

#[derive(Debug, Args)]
struct RelayArgs {
    /// The outbox table (optionally schema-qualified).
    #[arg(long)]
    outbox: String,
    /// The NATS server(s) to publish to (nats://host:4222; comma-separated for a cluster). The
    /// subjects must belong to a JetStream stream.
    #[arg(long, value_name = "URL")]
    nats: String,
    /// The relay's name in `inbox outboxes` (unique among the outbox's relays); default
    /// host-pid-random.
    #[arg(long, value_name = "N")]
    name: Option<String>,
    /// At most this many messages a round (one claim, one batch of publishes).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i32).range(1..=100_000))]
    batch: i32,
    /// How long a claim holds the outbox: a relay that dies is replaced this long after its
    /// last claim at most (500ms, 30s, 2m, ...; at least 1s).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = relay::parse_duration)]
    lease: std::time::Duration,
    /// Attempts before a message is dead-lettered.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..))]
    max_attempts: i32,
    /// A direct connection to the server for the relay's LISTEN session, when the database URL
    /// is a pooler's in transaction mode (default: the database URL itself).
    #[arg(
        long,
        value_name = "URL",
        env = "INBOX_LISTEN_URL",
        hide_env_values = true
    )]
    listen_url: Option<String>,
}

#[derive(Debug, Args)]
struct EnqueueArgs {
    /// The queue table (optionally schema-qualified).
    queue: String,
    /// The job's payload; without it (or with `-`), one JSON payload per line of standard input.
    #[arg(value_name = "JSON")]
    payload: Option<String>,
    /// When the job is due (any PostgreSQL timestamptz, e.g. '2030-01-01 09:00+00'); default now.
    #[arg(long, value_name = "TIME")]
    at: Option<String>,
    /// A dedup key: nothing is enqueued while a job with this key is queued.
    #[arg(long, value_name = "K")]
    key: Option<String>,
    /// The jobs' priority: higher runs first (default 0).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    priority: Option<i32>,
    /// An ordered group: the jobs of one group run one at a time, in enqueue order.
    #[arg(long, value_name = "G")]
    group: Option<String>,
    /// Jobs per transaction when reading standard input.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
}

/// Until when a job's key stays unique (`inbox unique --until`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum UniqueUntil {
    Acked,
    Finished,
    Started,
}

impl UniqueUntil {
    fn as_str(self) -> &'static str {
        match self {
            UniqueUntil::Acked => "acked",
            UniqueUntil::Finished => "finished",
            UniqueUntil::Started => "started",
        }
    }
}

/// The states `inbox jobs --state` filters on.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum JobState {
    Ready,
    Delayed,
    Leased,
    Dead,
}

impl JobState {
    fn as_str(self) -> &'static str {
        match self {
            JobState::Ready => "ready",
            JobState::Delayed => "delayed",
            JobState::Leased => "leased",
            JobState::Dead => "dead",
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return CliError::Io(format!("cannot start the runtime: {e}")).report(json),
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => error.report(json),
    }
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let url = cli.database_url.ok_or_else(|| {
        CliError::Usage("no database given: set DATABASE_URL or pass --database-url".into())
    })?;
    let out = output::Output::new(cli.json);
    match cli.command {
        Command::Metrics { listen } => metrics::serve(&url, &listen).await,
        Command::Ui {
            listen,
            base_path,
            read_only,
            token,
        } => {
            ui::serve(
                &url,
                ui::UiOptions {
                    listen,
                    base_path,
                    read_only,
                    token,
                },
            )
            .await
        }
        Command::Relay(args) => {
            relay::run(
                &url,
                &out,
                relay::RelayRequest {
                    outbox: &args.outbox,
                    nats: &args.nats,
                    name: args.name.as_deref(),
                    batch: args.batch,
                    lease: args.lease,
                    max_attempts: args.max_attempts,
                    listen_url: args.listen_url.as_deref(),
                },
            )
            .await
        }
        command => {
            let db = db::Db::connect(&url).await?;
            match command {
                Command::Queues => commands::queues(&db, &out).await,
                Command::Pause { queue } => commands::pause(&db, &out, &queue, true).await,
                Command::Resume { queue } => commands::pause(&db, &out, &queue, false).await,
                Command::Cancel { queue, ids } => commands::cancel(&db, &out, &queue, &ids).await,
                Command::Stats { queue, watch } => commands::stats(&db, &out, &queue, watch).await,
                Command::Limits {
                    queue,
                    concurrency,
                    key_concurrency,
                    per_key,
                    rate,
                    per,
                } => {
                    let change = commands::LimitChange {
                        concurrency,
                        per_key: per_key.zip(key_concurrency),
                        rate: rate.map(|rate| (rate, per)),
                    };
                    commands::limits(&db, &out, &queue, change).await
                }
                Command::Unique { queue, until } => {
                    commands::unique(&db, &out, &queue, until.map(UniqueUntil::as_str)).await
                }
                Command::Jobs {
                    queue,
                    state,
                    limit,
                } => commands::jobs(&db, &out, &queue, state.map(JobState::as_str), limit).await,
                Command::Dead { queue, limit } => commands::dead(&db, &out, &queue, limit).await,
                Command::Requeue(args) => {
                    commands::requeue(&db, &out, &args.queue, &args.ids, args.all).await
                }
                Command::Discard { queue, ids } => commands::discard(&db, &out, &queue, &ids).await,
                Command::Enqueue(args) => {
                    commands::enqueue(
                        &db,
                        &out,
                        commands::EnqueueRequest {
                            queue: &args.queue,
                            payload: args.payload.as_deref(),
                            key: args.key.as_deref(),
                            placement: commands::Placement {
                                at: args.at.as_deref(),
                                priority: args.priority,
                                group: args.group.as_deref(),
                            },
                            batch: args.batch as usize,
                        },
                    )
                    .await
                }
                Command::Purge {
                    ledger,
                    older_than,
                    batch,
                } => commands::purge(&db, &out, &ledger, &older_than, batch).await,
                Command::Schedules { queue, run: None } => {
                    commands::schedules(&db, &out, &queue).await
                }
                Command::Schedules {
                    queue,
                    run: Some(name),
                } => commands::run_schedule(&db, &out, &queue, &name).await,
                Command::Outboxes => outboxes::outboxes(&db, &out).await,
                Command::Outbox(command) => match command {
                    OutboxCommand::Messages {
                        outbox,
                        state,
                        limit,
                    } => {
                        outboxes::messages(
                            &db,
                            &out,
                            &outbox,
                            state.map(MessageState::as_str),
                            limit,
                        )
                        .await
                    }
                    OutboxCommand::Dead { outbox, limit } => {
                        outboxes::messages(&db, &out, &outbox, Some("dead"), limit).await
                    }
                    OutboxCommand::Requeue(args) => {
                        outboxes::requeue(&db, &out, &args.outbox, &args.ids, args.all).await
                    }
                    OutboxCommand::Discard { outbox, ids } => {
                        outboxes::discard(&db, &out, &outbox, &ids).await
                    }
                },
                Command::Metrics { .. } | Command::Ui { .. } | Command::Relay(_) => {
                    unreachable!("handled above")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
