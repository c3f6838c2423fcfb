//! The raw flags, as clap parses them: one struct per command, strings where a value needs
//! checking (parsing them is `config.rs`'s job, so a bad value names its flag in our own
//! words). Every flag also reads an environment variable; these types never leave the binary.

use std::ffi::OsString;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Publishes committed outbox rows from Postgres to RabbitMQ, with publisher confirms"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log output format.
    #[arg(
        long,
        global = true,
        env = "OUTBOX_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

impl Cli {
    /// The command line with every boolean flag (`--no-declare`, `--cloudevents`, ...)
    /// reading its environment variable the usual ways: `1`/`0`, `true`/`false`,
    /// `yes`/`no`, `on`/`off` (clap's own parser takes only `true` and `false`, so
    /// `OUTBOX_NO_DECLARE=1` was refused). Done here, once, so a new flag gets it too.
    pub fn clap_command() -> clap::Command {
        fn boolish(cmd: clap::Command) -> clap::Command {
            cmd.mut_args(|arg| match arg.get_action() {
                ArgAction::SetTrue => arg.value_parser(BoolishValueParser::new()),
                _ => arg,
            })
            .mut_subcommands(boolish)
        }
        boolish(<Cli as CommandFactory>::command())
    }

    /// Parses `argv` (and the flags' environment variables) with [`Cli::clap_command`].
    pub fn parse_args<I, T>(argv: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = Cli::clap_command().try_get_matches_from(argv)?;
        Cli::from_arg_matches(&matches)
    }
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // built once per process
pub enum Command {
    /// Run the relay until SIGTERM or SIGINT (migrates first unless --no-migrate).
    Run(RunArgs),
    /// Apply the schema migrations in sql/ and exit.
    Migrate(DbArgs),
    /// Pending and parked counts, throughput, and the relays alive with what each owns.
    Status(StatusArgs),
    /// Rows the relay gave up on.
    Parked {
        #[command(subcommand)]
        command: ParkedCommand,
    },
    /// Put parked rows back to pending (attempts reset); they are published in per-key order.
    Redrive(RedriveArgs),
    /// Consumer kit: list effects stuck in `sending` for review and delete old ledger and
    /// inbox rows (resolving through lookups needs the library: consumer::reconcile).
    Reconcile(ReconcileArgs),
    /// Consumer kit: let a key of an ordered consumer group go on after one of its events
    /// was dead-lettered (block-key); its held events are applied in seq order.
    ConsumerRelease(ConsumerReleaseArgs),
    /// Consumer kit: the keys of ordered consumer groups blocked after a dead letter
    /// (block-key), longest blocked first, with how many later events each holds.
    ConsumerBlocked(ConsumerBlockedArgs),
    /// Re-publish retained, dispatched events to one queue (a consumer added late, or one
    /// whose database was restored); resumable under its --name.
    Replay(ReplayArgs),
    /// Consumer kit: route an ordered consumer group's events from its intake queue to its
    /// partition queues, for groups whose members are not Rust (they consume the partition
    /// queues and use the outbox_group_* SQL functions).
    GroupRouter(GroupRouterArgs),
    /// A first run on local services: creates a demo database, produces events at a rate,
    /// runs the relay and a consumer in this process, shows progress and a summary.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The Postgres server, through a database that exists (the demo database is created
    /// there) [default: postgres://postgres@127.0.0.1:5432/postgres]; or DATABASE_URL_FILE.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Schema of the outbox tables in the demo database.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public")]
    pub schema: String,

    /// RabbitMQ URL [default: amqp://guest:guest@127.0.0.1:5672/%2f]; or AMQP_URL_FILE.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,

    /// The demo database: dropped and re-created (only if an earlier demo created it).
    #[arg(long, env = "OUTBOX_DEMO_DATABASE", default_value = "outbox_demo")]
    pub database_name: String,

    /// Exchange the demo's relay publishes to.
    #[arg(long, env = "OUTBOX_DEMO_EXCHANGE", default_value = "outbox.demo")]
    pub exchange: String,

    /// Queue of the demo's consumer, bound to the exchange with "#".
    #[arg(long, env = "OUTBOX_DEMO_QUEUE", default_value = "outbox-demo")]
    pub queue: String,

    /// Events produced per second.
    #[arg(long, env = "OUTBOX_DEMO_RATE", default_value = "200")]
    pub rate: String,

    /// How long to produce [default: 10s]; or give --events.
    #[arg(long, env = "OUTBOX_DEMO_DURATION")]
    pub duration: Option<String>,

    /// How many events to produce (instead of --duration).
    #[arg(long, env = "OUTBOX_DEMO_EVENTS")]
    pub events: Option<String>,

    /// Distinct keys (aggregate ids) the events are spread over.
    #[arg(long, env = "OUTBOX_DEMO_KEYS", default_value = "100")]
    pub keys: String,

    /// After producing, how long to wait for the last events to arrive.
    #[arg(long, env = "OUTBOX_DEMO_DRAIN_TIMEOUT", default_value = "30s")]
    pub drain_timeout: String,

    /// Serve the relay's dashboard and metrics here while the demo runs (e.g. 127.0.0.1:9464), or "off".
    #[arg(long, env = "OUTBOX_DEMO_HTTP_LISTEN", default_value = "off")]
    pub http_listen: String,
}

#[derive(Debug, Args)]
pub struct ReconcileArgs {
    #[command(flatten)]
    pub db: DbArgs,

    /// An effect in `sending` this long after its claim (and past its lease) is stuck.
    #[arg(long, env = "OUTBOX_STUCK_AFTER", default_value = "10m")]
    pub stuck_after: String,

    /// The longest send any consumer allows; --stuck-after must be longer.
    #[arg(long, env = "OUTBOX_SEND_TIMEOUT", default_value = "30s")]
    pub send_timeout: String,

    /// Finished effects and inbox rows older than this are deleted.
    #[arg(long, env = "OUTBOX_RECONCILE_RETENTION", default_value = "7d")]
    pub retention: String,

    /// Rows deleted per statement.
    #[arg(long, env = "OUTBOX_RECONCILE_BATCH_SIZE", default_value = "1000")]
    pub batch_size: String,

    /// Run again at this interval until SIGTERM (default: one pass, then exit).
    #[arg(long, env = "OUTBOX_RECONCILE_EVERY")]
    pub every: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// List parked rows with their reason and attempts.
    List(ParkedListArgs),
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Accepted for symmetry with the other operator commands; status never writes.
    #[arg(long)]
    pub dry_run: bool,
}

/// Filters shared by `parked list` and `redrive`.
#[derive(Debug, Args)]
pub struct FilterArgs {
    /// Only rows of this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Only rows of this aggregate type.
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// Only rows of this aggregate id.
    #[arg(long)]
    pub aggregate_id: Option<String>,
    /// Only rows parked since then: a duration ago (`1h`, `2d`) or an RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
}

#[derive(Debug, Args)]
pub struct ParkedListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Most rows to show.
    #[arg(long, default_value = "100")]
    pub limit: String,
    #[command(flatten)]
    pub output: OutputArgs,
    /// Accepted for symmetry with the other operator commands; listing never writes.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct ConsumerReleaseArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The consumer group's name (its inbox key).
    #[arg(long, env = "OUTBOX_CONSUMER")]
    pub consumer: String,
    /// The blocked key, as AGGREGATE_TYPE/AGGREGATE_ID.
    #[arg(long, env = "OUTBOX_CONSUMER_KEY")]
    pub key: String,
}

#[derive(Debug, Args)]
pub struct ConsumerBlockedArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Only this consumer group (all groups when not given).
    #[arg(long, env = "OUTBOX_CONSUMER")]
    pub consumer: Option<String>,
    /// Most keys to show.
    #[arg(long, default_value = "100")]
    pub limit: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct RedriveArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Parked row id (repeat for several).
    #[arg(long = "id")]
    pub ids: Vec<String>,
    /// Parked row event id (repeat for several).
    #[arg(long = "event-id")]
    pub event_ids: Vec<String>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Every parked row.
    #[arg(long)]
    pub all_parked: bool,
    /// Report what would be re-driven and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub amqp: AmqpArgs,

    /// The replay's name: its selection and progress are kept under it, and the same
    /// command run again resumes it.
    #[arg(long, env = "OUTBOX_REPLAY_NAME")]
    pub name: String,

    /// The queue that receives the events, through the default exchange (no other queue
    /// sees them); it must exist.
    #[arg(long, env = "OUTBOX_REPLAY_QUEUE")]
    pub queue: String,

    /// Only events of this aggregate type.
    #[arg(long)]
    pub aggregate_type: Option<String>,

    /// Only events of this aggregate id.
    #[arg(long)]
    pub aggregate_id: Option<String>,

    /// Only events of this event type.
    #[arg(long)]
    pub event_type: Option<String>,

    /// Only events created at or after then: a duration ago (`2h`, `3d`) or an RFC 3339
    /// time; fixed when the replay starts.
    #[arg(long)]
    pub since: Option<String>,

    /// Only events created before then: a duration ago or an RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,

    /// Only rows with this id or higher.
    #[arg(long)]
    pub from_id: Option<String>,

    /// Only rows with this id or lower.
    #[arg(long)]
    pub to_id: Option<String>,

    /// Most events published per second [default: unlimited].
    #[arg(long, env = "OUTBOX_REPLAY_RATE")]
    pub rate: Option<String>,

    /// Events published and confirmed before the progress is recorded.
    #[arg(long, env = "OUTBOX_REPLAY_BATCH_SIZE", default_value = "500")]
    pub batch_size: String,

    /// How long to wait for the broker's confirm of one message.
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", default_value = "15s")]
    pub confirm_timeout: String,

    /// (Messages are built as the relay's: give the --cloudevents flags it runs with.)
    #[command(flatten)]
    pub cloudevents: CloudEventsArgs,

    /// Count the events the replay would re-publish; publish and record nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct DbArgs {
    /// Postgres connection string, URL or key=value form [default:
    /// postgres://postgres@127.0.0.1:5432/postgres]; or DATABASE_URL_FILE names a file holding it.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Schema that holds outbox_events and the relay's tables.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public")]
    pub schema: String,
}

/// `--json`, for the commands that can print for scripts.
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// Print JSON (for scripts).
    #[arg(long)]
    pub json: bool,
}

/// How messages are built beyond the contract: `run` publishes with them, `replay`
/// re-publishes with the same.
#[derive(Debug, Args)]
pub struct CloudEventsArgs {
    /// Add the CloudEvents AMQP binding headers (cloudEvents:id, :type, :source, :time, ...).
    #[arg(long, env = "OUTBOX_CLOUDEVENTS")]
    pub cloudevents: bool,

    /// The CloudEvents `source` attribute, with --cloudevents.
    #[arg(
        long,
        env = "OUTBOX_CLOUDEVENTS_SOURCE",
        default_value = "/outbox-relay"
    )]
    pub cloudevents_source: String,
}

/// The broker connection, shared by the commands that publish.
#[derive(Debug, Args)]
pub struct AmqpArgs {
    /// RabbitMQ URL, amqp:// or amqps:// [default: amqp://guest:guest@127.0.0.1:5672/%2f];
    /// or AMQP_URL_FILE names a file holding it.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,

    /// PEM file of the CA that signed the broker's certificate (for amqps://).
    #[arg(long, env = "AMQP_CA_FILE")]
    pub amqp_ca_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub amqp: AmqpArgs,

    /// Where to serve /livez, /readyz, /metrics and the dashboard, or "off".
    #[arg(long, env = "OUTBOX_HTTP_LISTEN", default_value = "127.0.0.1:9464")]
    pub http_listen: String,

    /// Token that allows re-driving from the dashboard (without one it is read-only); or
    /// OUTBOX_ADMIN_TOKEN_FILE names a file holding it.
    #[arg(long, env = "OUTBOX_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    #[command(flatten)]
    pub cloudevents: CloudEventsArgs,

    /// Delete dispatched rows older than this (for example 7d), or "off" to keep them.
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "off")]
    pub retention: String,

    /// Exchange the relay publishes to (a durable topic exchange).
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    pub exchange: String,

    /// Do not declare the exchange; it must exist.
    #[arg(long, env = "OUTBOX_NO_DECLARE")]
    pub no_declare: bool,

    /// Do not apply migrations at start-up.
    #[arg(long, env = "OUTBOX_NO_MIGRATE")]
    pub no_migrate: bool,

    /// Rows claimed per poll (one chunk).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value = "500")]
    pub batch_size: String,

    /// Poll interval when nothing wakes the relay; polling is the source of truth.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "1s")]
    pub poll_interval: String,

    /// How long after a claim passed a row's id the next claims still look for it (a row
    /// that committed a little after higher ids); later ones wait for the next poll's sweep.
    #[arg(long, env = "OUTBOX_LATE_COMMIT_WINDOW", default_value = "100ms")]
    pub late_commit_window: String,

    /// Do not LISTEN for the insert wake-up; rely on polling alone.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,

    /// Attempts before a row the broker returns as unroutable is parked.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value = "10")]
    pub max_attempts: String,

    /// Largest message (body and headers) the relay publishes; larger rows are parked.
    #[arg(long, env = "OUTBOX_MAX_MESSAGE_BYTES", default_value = "1048576")]
    pub max_message_bytes: String,

    /// How long a SIGTERM waits for in-flight confirms and their marks before exiting;
    /// must be longer than --confirm-timeout.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "20s")]
    pub shutdown_timeout: String,

    /// How long to wait for the broker's confirm of one message (and how long a session
    /// may get nothing but nacks before it is replaced).
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", default_value = "15s")]
    pub confirm_timeout: String,

    /// Most messages published and not yet confirmed, over all channels.
    #[arg(long, env = "OUTBOX_CONFIRM_WINDOW", default_value = "1024")]
    pub confirm_window: String,

    /// AMQP channels to publish on in parallel.
    #[arg(long, env = "OUTBOX_CHANNELS", default_value = "2")]
    pub channels: String,

    /// Partition lease; a relay that dies or stalls is taken over within about 1.3 leases.
    #[arg(long, env = "OUTBOX_LEASE", default_value = "15s")]
    pub lease: String,

    /// What a parked row does to the later rows of its key: continue or block-key.
    #[arg(long, env = "OUTBOX_ON_PARK", default_value = "continue")]
    pub on_park: String,

    /// First retry delay after a failed publish (doubles up to --retry-max, with jitter).
    #[arg(long, env = "OUTBOX_RETRY_MIN", default_value = "500ms")]
    pub retry_min: String,

    /// Longest retry delay after failed publishes.
    #[arg(long, env = "OUTBOX_RETRY_MAX", default_value = "60s")]
    pub retry_max: String,

    /// Payload bytes the relay holds in memory at most (claimed and not yet dispatched).
    #[arg(long, env = "OUTBOX_MAX_IN_MEMORY_BYTES", default_value = "67108864")]
    pub max_in_memory_bytes: String,

    /// Write per-stage timestamps of every claim, publish, ack and mark to this file (for
    /// the benchmark's latency breakdown; hidden: not an operator's setting).
    #[arg(long, env = "OUTBOX_STAGE_TRACE", hide = true)]
    pub stage_trace: Option<std::path::PathBuf>,
}

/// `group-router`: an ordered group's router as a process of its own (parsed in
/// `group_router.rs`).
#[derive(Debug, Args)]
pub struct GroupRouterArgs {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub amqp: AmqpArgs,

    /// The group's queue name: its intake is <queue>.intake, its partition queues
    /// <queue>.p00, <queue>.p01, ..., its dead letters <queue>.dlq.
    #[arg(long, env = "OUTBOX_GROUP_QUEUE")]
    pub queue: String,

    /// How many partition queues the group has; fixed for the life of the group (another
    /// count than the one recorded is refused).
    #[arg(long, env = "OUTBOX_GROUP_PARTITIONS", default_value = "8")]
    pub partitions: String,

    /// The group's name, the inbox key its members pass to the outbox_group_* functions
    /// [default: the queue].
    #[arg(long, env = "OUTBOX_CONSUMER")]
    pub consumer: Option<String>,

    /// Exchange the relay publishes to.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    pub exchange: String,

    /// Binding of the intake queue at the exchange: '#' or '<aggregate_type>.#' (repeat,
    /// or separate with commas in the variable).
    #[arg(
        long = "binding",
        env = "OUTBOX_GROUP_BINDINGS",
        value_delimiter = ',',
        default_value = "#"
    )]
    pub bindings: Vec<String>,

    /// Do not declare the exchange, queues and bindings; they must exist as described.
    #[arg(long, env = "OUTBOX_NO_DECLARE")]
    pub no_declare: bool,

    /// Where to serve /livez, /readyz and /metrics, or "off".
    #[arg(
        long,
        env = "OUTBOX_GROUP_ROUTER_HTTP_LISTEN",
        default_value = "127.0.0.1:9465"
    )]
    pub http_listen: String,
}
