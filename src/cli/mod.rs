//! Command-line flags (clap's raw `Args`) parsed once into validated domain types.
//!
//! Every flag also reads an environment variable. Only the parsed types (`RelayConfig`,
//! `DbTarget`, `AmqpTarget`, `Schema`, ...) cross into the library; nothing below `main`
//! reads argv or the environment. A problem with a flag becomes a [`ConfigError`] naming
//! the flag, which `main` prints as one line before exiting with status 2.

use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use std::time::SystemTime;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::{
    ConfigError, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, Schema, Secret, parse_duration,
    validate_exchange,
};
use outbox_kit::db::DbTarget;
use outbox_relay::operator::ParkedFilter;
use outbox_relay::relay::{OnPark, RelayConfig};

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
    /// Print JSON (for scripts).
    #[arg(long)]
    pub json: bool,
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
    /// Print JSON (for scripts).
    #[arg(long)]
    pub json: bool,
    /// Accepted for symmetry with the other operator commands; listing never writes.
    #[arg(long)]
    pub dry_run: bool,
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

/// Secrets that may come from files (`DATABASE_URL_FILE` and so on, as container
/// platforms mount them). `main` reads the variables; parsing reads the files.
#[derive(Clone, Debug, Default)]
pub struct SecretFiles {
    pub database_url: Option<std::path::PathBuf>,
    pub amqp_url: Option<std::path::PathBuf>,
    pub admin_token: Option<std::path::PathBuf>,
}

/// The value of a secret flag: from the flag or its variable, else from `<VAR>_FILE`, else
/// the default. Both set is ambiguous and refused.
fn secret_value(
    flag: &'static str,
    var: &str,
    given: Option<&str>,
    file: Option<&std::path::Path>,
    default: Option<&str>,
) -> Result<Option<String>, ConfigError> {
    match (given, file) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            flag,
            format!("both {flag} (or {var}) and {var}_FILE are set; use one"),
        )),
        (Some(v), None) => Ok(Some(v.to_owned())),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map(|s| Some(s.trim().to_owned()))
            .map_err(|e| {
                ConfigError::new(
                    flag,
                    format!("cannot read {var}_FILE {}: {e}", path.display()),
                )
            }),
        (None, None) => Ok(default.map(str::to_owned)),
    }
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

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,

    /// RabbitMQ URL, amqp:// or amqps:// [default: amqp://guest:guest@127.0.0.1:5672/%2f];
    /// or AMQP_URL_FILE names a file holding it.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,

    /// PEM file of the CA that signed the broker's certificate (for amqps://).
    #[arg(long, env = "AMQP_CA_FILE")]
    pub amqp_ca_file: Option<std::path::PathBuf>,

    /// Where to serve /livez, /readyz, /metrics and the dashboard, or "off".
    #[arg(long, env = "OUTBOX_HTTP_LISTEN", default_value = "127.0.0.1:9464")]
    pub http_listen: String,

    /// Token that allows re-driving from the dashboard (without one it is read-only); or
    /// OUTBOX_ADMIN_TOKEN_FILE names a file holding it.
    #[arg(long, env = "OUTBOX_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

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

    /// How long a SIGTERM waits for in-flight confirms before exiting.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "10s")]
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
}

/// What `main` runs, fully validated.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // built once per process
pub enum Config {
    Run {
        db: DbTarget,
        amqp: AmqpTarget,
        schema: Schema,
        migrate: bool,
        relay: RelayConfig,
        http_listen: Option<std::net::SocketAddr>,
        admin_token: Option<Secret>,
    },
    Migrate {
        db: DbTarget,
        schema: Schema,
    },
    Status {
        db: DbTarget,
        schema: Schema,
        json: bool,
    },
    ParkedList {
        db: DbTarget,
        schema: Schema,
        filter: ParkedFilter,
        limit: i64,
        json: bool,
    },
    Redrive {
        db: DbTarget,
        schema: Schema,
        filter: ParkedFilter,
        dry_run: bool,
    },
    Reconcile {
        db: DbTarget,
        schema: Schema,
        reconcile: outbox_kit::consumer::reconcile::ReconcileConfig,
        every: Option<Duration>,
    },
    Demo(outbox_relay::demo::DemoConfig),
}

/// `--http-listen`: an address, or "off".
fn http_listen(raw: &str) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    match raw.trim() {
        "off" => Ok(None),
        addr => addr.parse::<std::net::SocketAddr>().map(Some).map_err(|_| {
            ConfigError::new(
                "--http-listen",
                format!("'{addr}' is not an address like 127.0.0.1:9464 (or \"off\")"),
            )
        }),
    }
}

impl DemoArgs {
    fn parse(&self, files: &SecretFiles) -> Result<outbox_relay::demo::DemoConfig, ConfigError> {
        use outbox_relay::demo::{DemoConfig, Stop};
        let db = DbArgs {
            database_url: self.database_url.clone(),
            schema: self.schema.clone(),
        };
        let (server, schema) = db.parse(files)?;
        let amqp_url = secret_value(
            "--amqp-url",
            "AMQP_URL",
            self.amqp_url.as_deref(),
            files.amqp_url.as_deref(),
            Some(DEFAULT_AMQP_URL),
        )?
        .unwrap_or_default();
        let amqp = AmqpTarget::parse(&amqp_url).map_err(|e| ConfigError::new("--amqp-url", e))?;
        let database = Schema::parse(&self.database_name)
            .map_err(|e| {
                ConfigError::new("--database-name", e.replace("schema name", "database name"))
            })?
            .as_str()
            .to_owned();
        if server.dbname() == Some(database.as_str()) {
            return Err(ConfigError::new(
                "--database-name",
                format!(
                    "'{database}' is the database --database-url connects to; the demo creates its own database from there, so name another"
                ),
            ));
        }
        let exchange =
            validate_exchange(&self.exchange).map_err(|e| ConfigError::new("--exchange", e))?;
        let queue = validate_exchange(&self.queue).map_err(|e| ConfigError::new("--queue", e))?;
        let rate: NonZeroU32 = positive("--rate", &self.rate)?;
        if rate.get() > 100_000 {
            return Err(ConfigError::new(
                "--rate",
                "must be at most 100000 events/s",
            ));
        }
        let stop = match (&self.duration, &self.events) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "--events",
                    "give --duration or --events, not both",
                ));
            }
            (None, Some(n)) => Stop::Events(positive("--events", n)?),
            (Some(d), None) => Stop::After(duration("--duration", d)?),
            (None, None) => Stop::After(Duration::from_secs(10)),
        };
        Ok(DemoConfig {
            server,
            database,
            schema,
            amqp,
            exchange,
            queue,
            rate,
            stop,
            keys: positive("--keys", &self.keys)?,
            drain_timeout: duration("--drain-timeout", &self.drain_timeout)?,
            http_listen: http_listen(&self.http_listen)?,
        })
    }
}

/// `--since`: a duration ago or an RFC 3339 time.
fn parse_since(raw: &str) -> Result<SystemTime, ConfigError> {
    if let Ok(d) = humantime::parse_duration(raw) {
        return SystemTime::now()
            .checked_sub(d)
            .ok_or_else(|| ConfigError::new("--since", "that is too long ago"));
    }
    humantime::parse_rfc3339_weak(raw).map_err(|_| {
        ConfigError::new(
            "--since",
            format!(
                "'{raw}' is neither a duration (1h, 2d) nor an RFC 3339 time (2026-11-30T12:00:00Z)"
            ),
        )
    })
}

impl FilterArgs {
    fn parse(&self) -> Result<ParkedFilter, ConfigError> {
        Ok(ParkedFilter {
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            since: self.since.as_deref().map(parse_since).transpose()?,
            ..ParkedFilter::default()
        })
    }
}

fn positive<T: FromStr>(flag: &'static str, raw: &str) -> Result<T, ConfigError>
where
    T::Err: fmt::Display,
{
    raw.trim().parse::<T>().map_err(|e| {
        ConfigError::new(
            flag,
            format!("'{raw}' is not a positive whole number ({e})"),
        )
    })
}

fn duration(flag: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(raw.trim()).map_err(|e| ConfigError::new(flag, e))?;
    if d.is_zero() {
        return Err(ConfigError::new(flag, "must be longer than zero"));
    }
    Ok(d)
}

impl DbArgs {
    fn parse(&self, files: &SecretFiles) -> Result<(DbTarget, Schema), ConfigError> {
        let url = secret_value(
            "--database-url",
            "DATABASE_URL",
            self.database_url.as_deref(),
            files.database_url.as_deref(),
            Some(DEFAULT_DATABASE_URL),
        )?
        .unwrap_or_default();
        let db = DbTarget::parse(&url).map_err(|e| ConfigError::new("--database-url", e))?;
        let schema = Schema::parse(&self.schema).map_err(|e| ConfigError::new("--schema", e))?;
        Ok((db, schema))
    }
}

impl Cli {
    /// Turns raw flags into a [`Config`], or the first flag that is wrong.
    pub fn into_config(self, files: &SecretFiles) -> Result<Config, ConfigError> {
        match self.command {
            Command::Migrate(db) => {
                let (db, schema) = db.parse(files)?;
                Ok(Config::Migrate { db, schema })
            }
            Command::Reconcile(a) => {
                let (db, schema) = a.db.parse(files)?;
                let batch_size: NonZeroUsize = positive("--batch-size", &a.batch_size)?;
                let reconcile = outbox_kit::consumer::reconcile::ReconcileConfig::new(
                    duration("--stuck-after", &a.stuck_after)?,
                    duration("--retention", &a.retention)?,
                    batch_size,
                    duration("--send-timeout", &a.send_timeout)?,
                )?;
                let every = a
                    .every
                    .as_deref()
                    .map(|raw| duration("--every", raw))
                    .transpose()?;
                Ok(Config::Reconcile {
                    db,
                    schema,
                    reconcile,
                    every,
                })
            }
            Command::Demo(a) => Ok(Config::Demo(a.parse(files)?)),
            Command::Status(a) => {
                let (db, schema) = a.db.parse(files)?;
                Ok(Config::Status {
                    db,
                    schema,
                    json: a.json,
                })
            }
            Command::Parked {
                command: ParkedCommand::List(a),
            } => {
                let (db, schema) = a.db.parse(files)?;
                let limit: NonZeroU32 = positive("--limit", &a.limit)?;
                Ok(Config::ParkedList {
                    db,
                    schema,
                    filter: a.filter.parse()?,
                    limit: i64::from(limit.get()),
                    json: a.json,
                })
            }
            Command::Redrive(a) => {
                let (db, schema) = a.db.parse(files)?;
                let mut filter = a.filter.parse()?;
                for raw in &a.ids {
                    let id: i64 = raw.trim().parse().map_err(|_| {
                        ConfigError::new(
                            "--id",
                            format!("'{raw}' is not a row id (a whole number)"),
                        )
                    })?;
                    filter.ids.push(id);
                }
                for raw in &a.event_ids {
                    let id = uuid::Uuid::parse_str(raw.trim()).map_err(|_| {
                        ConfigError::new("--event-id", format!("'{raw}' is not a uuid"))
                    })?;
                    filter.event_ids.push(id);
                }
                if a.all_parked && !filter.is_empty() {
                    return Err(ConfigError::new(
                        "--all-parked",
                        "cannot be combined with --id, --event-id or filters",
                    ));
                }
                if !a.all_parked && filter.is_empty() {
                    return Err(ConfigError::new(
                        "--all-parked",
                        "say which rows to re-drive: --id, --event-id, a filter (--event-type, --aggregate-type, --aggregate-id, --since) or --all-parked",
                    ));
                }
                Ok(Config::Redrive {
                    db,
                    schema,
                    filter,
                    dry_run: a.dry_run,
                })
            }
            Command::Run(a) => {
                let (db, schema) = a.db.parse(files)?;
                let amqp_url = secret_value(
                    "--amqp-url",
                    "AMQP_URL",
                    a.amqp_url.as_deref(),
                    files.amqp_url.as_deref(),
                    Some(DEFAULT_AMQP_URL),
                )?
                .unwrap_or_default();
                let mut amqp =
                    AmqpTarget::parse(&amqp_url).map_err(|e| ConfigError::new("--amqp-url", e))?;
                if let Some(ca) = &a.amqp_ca_file {
                    amqp = amqp
                        .with_ca_file(ca)
                        .map_err(|e| ConfigError::new("--amqp-ca-file", e))?;
                }
                let admin_token = secret_value(
                    "--admin-token",
                    "OUTBOX_ADMIN_TOKEN",
                    a.admin_token.as_deref(),
                    files.admin_token.as_deref(),
                    None,
                )?
                .filter(|t| !t.is_empty())
                .map(Secret::new);
                let http_listen = match a.http_listen.trim() {
                    "off" => None,
                    addr => Some(addr.parse::<std::net::SocketAddr>().map_err(|_| {
                        ConfigError::new(
                            "--http-listen",
                            format!("'{addr}' is not an address like 127.0.0.1:9464 (or \"off\")"),
                        )
                    })?),
                };
                let retention = match a.retention.trim() {
                    "off" => None,
                    raw => Some(duration("--retention", raw)?),
                };
                let exchange = validate_exchange(&a.exchange)
                    .map_err(|e| ConfigError::new("--exchange", e))?;
                let batch_size: NonZeroUsize = positive("--batch-size", &a.batch_size)?;
                if batch_size.get() > 10_000 {
                    return Err(ConfigError::new("--batch-size", "must be at most 10000"));
                }
                let max_attempts: NonZeroU32 = positive("--max-attempts", &a.max_attempts)?;
                let max_message_bytes: NonZeroUsize =
                    positive("--max-message-bytes", &a.max_message_bytes)?;
                if max_message_bytes.get() > 512 * 1024 * 1024 {
                    return Err(ConfigError::new(
                        "--max-message-bytes",
                        "must be at most 536870912 (RabbitMQ's own limit)",
                    ));
                }
                let confirm_window: NonZeroUsize = positive("--confirm-window", &a.confirm_window)?;
                let channels: NonZeroUsize = positive("--channels", &a.channels)?;
                if channels.get() > 64 {
                    return Err(ConfigError::new("--channels", "must be at most 64"));
                }
                let max_in_memory_bytes: NonZeroUsize =
                    positive("--max-in-memory-bytes", &a.max_in_memory_bytes)?;
                let on_park = match a.on_park.as_str() {
                    "continue" => OnPark::Continue,
                    "block-key" => OnPark::BlockKey,
                    other => {
                        return Err(ConfigError::new(
                            "--on-park",
                            format!("'{other}' is not one of: continue, block-key"),
                        ));
                    }
                };
                let retry_min = duration("--retry-min", &a.retry_min)?;
                let retry_max = duration("--retry-max", &a.retry_max)?;
                if retry_max < retry_min {
                    return Err(ConfigError::new(
                        "--retry-max",
                        "must not be shorter than --retry-min",
                    ));
                }
                let lease = duration("--lease", &a.lease)?;
                if lease < Duration::from_secs(1) {
                    return Err(ConfigError::new("--lease", "must be at least 1s"));
                }
                let confirm_timeout = duration("--confirm-timeout", &a.confirm_timeout)?;
                let relay = RelayConfig {
                    exchange,
                    declare_exchange: !a.no_declare,
                    batch_size,
                    poll_interval: duration("--poll-interval", &a.poll_interval)?,
                    late_commit_window: duration("--late-commit-window", &a.late_commit_window)?,
                    listen: !a.no_listen,
                    max_attempts,
                    max_message_bytes,
                    shutdown_timeout: duration("--shutdown-timeout", &a.shutdown_timeout)?,
                    confirm_timeout,
                    confirm_window,
                    channels,
                    lease,
                    on_park,
                    retry_min,
                    retry_max,
                    max_in_memory_bytes,
                    retention,
                    cloudevents_source: a.cloudevents.then(|| a.cloudevents_source.clone()),
                };
                if a.cloudevents && a.cloudevents_source.trim().is_empty() {
                    return Err(ConfigError::new(
                        "--cloudevents-source",
                        "must not be empty",
                    ));
                }
                Ok(Config::Run {
                    db,
                    amqp,
                    schema,
                    migrate: !a.no_migrate,
                    relay,
                    http_listen,
                    admin_token,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_config(args: &[&str]) -> Result<Config, ConfigError> {
        run_config_with(args, &SecretFiles::default())
    }

    fn run_config_with(args: &[&str], files: &SecretFiles) -> Result<Config, ConfigError> {
        let mut argv = vec!["outbox-relay", "run"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .expect("clap accepts")
            .into_config(files)
    }

    #[test]
    fn secrets_come_from_files_but_not_from_both() {
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = dir.join("db");
        std::fs::write(&url, "postgres://relay:pw@db.internal:5432/app\n").unwrap();
        let files = SecretFiles {
            database_url: Some(url.clone()),
            ..SecretFiles::default()
        };
        let Config::Run { db, .. } = run_config_with(&[], &files).unwrap() else {
            panic!("run expected")
        };
        assert_eq!(db.dbname(), Some("app"));
        assert!(
            !format!("{db:?}").contains("pw"),
            "the password is never printed"
        );
        let both = run_config_with(&["--database-url", "postgres://x@y/z"], &files).unwrap_err();
        assert_eq!(both.flag, "--database-url");
        let missing = SecretFiles {
            admin_token: Some(dir.join("nope")),
            ..SecretFiles::default()
        };
        let err = run_config_with(&[], &missing).unwrap_err();
        assert_eq!(err.flag, "--admin-token");
        assert!(
            err.problem.contains("cannot read OUTBOX_ADMIN_TOKEN_FILE"),
            "{}",
            err.problem
        );
    }

    #[test]
    fn http_listen_and_retention_parse() {
        let Config::Run {
            http_listen, relay, ..
        } = run_config(&["--http-listen", "off", "--retention", "7d"]).unwrap()
        else {
            panic!("run expected")
        };
        assert_eq!(http_listen, None);
        assert_eq!(relay.retention, Some(Duration::from_secs(7 * 86400)));
        assert_eq!(
            run_config(&["--http-listen", "nowhere"]).unwrap_err().flag,
            "--http-listen"
        );
        assert_eq!(
            run_config(&["--retention", "0s"]).unwrap_err().flag,
            "--retention"
        );
    }

    #[test]
    fn defaults_are_valid() {
        let Config::Run { relay, schema, .. } = run_config(&[]).unwrap() else {
            panic!("run expected")
        };
        assert_eq!(relay.batch_size.get(), 500);
        assert_eq!(relay.poll_interval, Duration::from_secs(1));
        assert_eq!(relay.late_commit_window, Duration::from_millis(100));
        assert_eq!(relay.max_attempts.get(), 10);
        assert_eq!(relay.max_message_bytes.get(), 1 << 20);
        assert_eq!(schema.as_str(), "public");
    }

    #[test]
    fn zero_batch_size_names_the_flag() {
        let err = run_config(&["--batch-size", "0"]).unwrap_err();
        assert_eq!(err.flag, "--batch-size");
    }

    #[test]
    fn bad_duration_names_the_flag() {
        let err = run_config(&["--poll-interval", "soon"]).unwrap_err();
        assert_eq!(err.flag, "--poll-interval");
        assert!(err.problem.contains("not a duration"), "{}", err.problem);
    }

    #[test]
    fn schema_must_be_a_plain_identifier() {
        assert!(Schema::parse("outbox_1").is_ok());
        for bad in ["", "1abc", "Public", "a;drop", "a-b", &"x".repeat(64)] {
            assert!(Schema::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn unparseable_urls_name_their_flags() {
        assert_eq!(
            run_config(&["--database-url", "postgres://[::1"])
                .unwrap_err()
                .flag,
            "--database-url"
        );
        assert_eq!(
            run_config(&["--amqp-url", "http://x"]).unwrap_err().flag,
            "--amqp-url"
        );
    }

    fn reconcile_config(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["outbox-relay", "reconcile"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .expect("clap accepts")
            .into_config(&SecretFiles::default())
    }

    #[test]
    fn reconcile_defaults_are_valid() {
        let Config::Reconcile {
            reconcile, every, ..
        } = reconcile_config(&[]).unwrap()
        else {
            panic!("reconcile expected")
        };
        assert_eq!(reconcile.stuck_after, Duration::from_secs(600));
        assert_eq!(every, None);
    }

    #[test]
    fn reconcile_thresholds_shorter_than_their_work_name_the_flag() {
        let err = reconcile_config(&["--stuck-after", "10s", "--send-timeout", "30s"]).unwrap_err();
        assert_eq!(err.flag, "--stuck-after");
        assert!(err.problem.contains("--send-timeout"), "{}", err.problem);
        let err = reconcile_config(&["--retention", "5m"]).unwrap_err();
        assert_eq!(err.flag, "--retention");
        assert_eq!(
            reconcile_config(&["--every", "often"]).unwrap_err().flag,
            "--every"
        );
    }

    #[test]
    fn on_park_accepts_two_policies() {
        assert!(run_config(&["--on-park", "block-key"]).is_ok());
        assert_eq!(
            run_config(&["--on-park", "skip"]).unwrap_err().flag,
            "--on-park"
        );
    }
}
