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

use crate::db::DbTarget;
use crate::relay::publish::AmqpTarget;
use crate::relay::{OnPark, RelayConfig};

/// A flag whose value cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("{flag}: {problem}")]
pub struct ConfigError {
    /// The flag as the user spells it, for example `--batch-size`.
    pub flag: &'static str,
    /// What is wrong and what to do, lowercase, no trailing period.
    pub problem: String,
}

impl ConfigError {
    pub fn new(flag: &'static str, problem: impl Into<String>) -> Self {
        ConfigError {
            flag,
            problem: problem.into(),
        }
    }
}

/// A schema or other SQL identifier we interpolate: lowercase letters, digits and `_`,
/// starting with a letter or `_`, at most 63 bytes, so it never needs quoting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema(String);

impl Schema {
    pub fn parse(s: &str) -> Result<Schema, String> {
        let ok_start = s
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let ok_rest = s
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok_start || !ok_rest || s.len() > 63 {
            return Err(format!(
                "'{s}' is not a valid schema name: use lowercase letters, digits and '_', starting with a letter, at most 63 characters"
            ));
        }
        Ok(Schema(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Schema {
    fn default() -> Self {
        Schema("public".into())
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses durations such as `300ms`, `1s`, `7d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("'{s}' is not a duration ({e}); write it like 500ms, 10s, 5m or 7d"))
}

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
    /// Consumer kit: list effects stuck in `sending` for review and delete old ledger and
    /// inbox rows (resolving through lookups needs the library: consumer::reconcile).
    Reconcile(ReconcileArgs),
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
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d")]
    pub retention: String,

    /// Rows deleted per statement.
    #[arg(long, env = "OUTBOX_RECONCILE_BATCH_SIZE", default_value = "1000")]
    pub batch_size: String,

    /// Run again at this interval until SIGTERM (default: one pass, then exit).
    #[arg(long, env = "OUTBOX_RECONCILE_EVERY")]
    pub every: Option<String>,
}

#[derive(Debug, Args)]
pub struct DbArgs {
    /// Postgres connection string (URL or key=value form).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    pub database_url: String,

    /// Schema that holds outbox_events and the relay's tables.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = "public")]
    pub schema: String,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,

    /// RabbitMQ URL (amqp:// or amqps://).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub amqp_url: String,

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

    /// How long to wait for the broker's confirm of one message.
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
    },
    Migrate {
        db: DbTarget,
        schema: Schema,
    },
    Reconcile {
        db: DbTarget,
        schema: Schema,
        reconcile: crate::consumer::reconcile::ReconcileConfig,
        every: Option<Duration>,
    },
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
    fn parse(&self) -> Result<(DbTarget, Schema), ConfigError> {
        let db = DbTarget::parse(&self.database_url)
            .map_err(|e| ConfigError::new("--database-url", e))?;
        let schema = Schema::parse(&self.schema).map_err(|e| ConfigError::new("--schema", e))?;
        Ok((db, schema))
    }
}

impl Cli {
    /// Turns raw flags into a [`Config`], or the first flag that is wrong.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        match self.command {
            Command::Migrate(db) => {
                let (db, schema) = db.parse()?;
                Ok(Config::Migrate { db, schema })
            }
            Command::Reconcile(a) => {
                let (db, schema) = a.db.parse()?;
                let batch_size: NonZeroUsize = positive("--batch-size", &a.batch_size)?;
                let reconcile = crate::consumer::reconcile::ReconcileConfig::new(
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
            Command::Run(a) => {
                let (db, schema) = a.db.parse()?;
                let amqp = AmqpTarget::parse(&a.amqp_url)
                    .map_err(|e| ConfigError::new("--amqp-url", e))?;
                let exchange = crate::relay::publish::validate_exchange(&a.exchange)
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
                };
                Ok(Config::Run {
                    db,
                    amqp,
                    schema,
                    migrate: !a.no_migrate,
                    relay,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_config(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["outbox-relay", "run"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .expect("clap accepts")
            .into_config()
    }

    #[test]
    fn defaults_are_valid() {
        let Config::Run { relay, schema, .. } = run_config(&[]).unwrap() else {
            panic!("run expected")
        };
        assert_eq!(relay.batch_size.get(), 500);
        assert_eq!(relay.poll_interval, Duration::from_secs(1));
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
            .into_config()
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
