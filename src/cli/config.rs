//! What `main` runs, fully validated: [`Config`], built from the raw flags by
//! [`Cli::into_config`]. `run` and `demo`, with many flags each, are parsed in their own
//! files; the operator commands here, into one shape: the [`Database`] they connect to and
//! an [`Operator`] command, so `main` connects once, in one place, for all of them.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::{ConfigError, Schema, Secret};
use outbox_kit::db::DbTarget;
use outbox_relay::operator::ParkedFilter;
use outbox_relay::relay::RelayConfig;
use outbox_relay::replay::ReplayConfig;

use super::args::{Cli, Command, ParkedCommand};
pub use super::values::{Database, Output};
use super::values::{SecretFiles, duration, positive};

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
        /// `--stage-trace`: where to write stage timestamps (the benchmark's breakdown).
        stage_trace: Option<std::path::PathBuf>,
    },
    Demo(outbox_relay::demo::DemoConfig),
    GroupRouter(outbox_relay::group_router::GroupRouterConfig),
    /// A command that connects to the database, does one job and exits.
    Operator {
        db: Database,
        command: Operator,
    },
}

/// The operator commands, each with its own settings (the connection is [`Database`]).
#[derive(Debug)]
pub enum Operator {
    Migrate,
    Status {
        output: Output,
    },
    ParkedList {
        filter: ParkedFilter,
        limit: i64,
        output: Output,
    },
    Redrive {
        filter: ParkedFilter,
        dry_run: bool,
    },
    Reconcile {
        reconcile: outbox_kit::consumer::reconcile::ReconcileConfig,
        every: Option<Duration>,
    },
    ConsumerRelease {
        consumer: String,
        aggregate_type: String,
        aggregate_id: String,
    },
    ConsumerBlocked {
        consumer: Option<String>,
        limit: i64,
        output: Output,
    },
    Replay {
        amqp: AmqpTarget,
        replay: ReplayConfig,
    },
}

impl Operator {
    /// The command's name as Postgres shows it (`application_name`: outbox-relay-<name>).
    pub fn name(&self) -> &'static str {
        match self {
            Operator::Migrate => "migrate",
            Operator::Status { .. } => "status",
            Operator::ParkedList { .. } => "parked",
            Operator::Redrive { .. } => "redrive",
            Operator::Reconcile { .. } => "reconcile",
            Operator::ConsumerRelease { .. } => "consumer-release",
            Operator::ConsumerBlocked { .. } => "consumer-blocked",
            Operator::Replay { .. } => "replay",
        }
    }
}

impl Cli {
    /// Turns raw flags into a [`Config`], or the first flag that is wrong.
    pub fn into_config(self, files: &SecretFiles) -> Result<Config, ConfigError> {
        let (db, command) = match self.command {
            Command::Run(a) => return a.parse(files),
            Command::Demo(a) => return Ok(Config::Demo(a.parse(files)?)),
            Command::GroupRouter(a) => return a.parse(files),
            Command::Migrate(db) => (db, Operator::Migrate),
            Command::Status(a) => (
                a.db,
                Operator::Status {
                    output: a.output.parse(),
                },
            ),
            Command::Parked {
                command: ParkedCommand::List(a),
            } => {
                let limit: NonZeroU32 = positive("--limit", &a.limit)?;
                let command = Operator::ParkedList {
                    filter: a.filter.parse()?,
                    limit: i64::from(limit.get()),
                    output: a.output.parse(),
                };
                (a.db, command)
            }
            Command::Redrive(a) => {
                let command = Operator::Redrive {
                    filter: redrive_filter(&a)?,
                    dry_run: a.dry_run,
                };
                (a.db, command)
            }
            Command::Reconcile(a) => {
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
                (a.db, Operator::Reconcile { reconcile, every })
            }
            Command::ConsumerRelease(a) => {
                let (aggregate_type, aggregate_id) = a
                    .key
                    .split_once('/')
                    .filter(|(t, id)| !t.is_empty() && !id.is_empty())
                    .ok_or_else(|| {
                        ConfigError::new(
                            "--key",
                            format!("'{}' is not AGGREGATE_TYPE/AGGREGATE_ID", a.key),
                        )
                    })?;
                if a.consumer.is_empty() {
                    return Err(ConfigError::new("--consumer", "must not be empty"));
                }
                let command = Operator::ConsumerRelease {
                    consumer: a.consumer.clone(),
                    aggregate_type: aggregate_type.to_owned(),
                    aggregate_id: aggregate_id.to_owned(),
                };
                (a.db, command)
            }
            Command::ConsumerBlocked(a) => {
                let limit: NonZeroU32 = positive("--limit", &a.limit)?;
                if a.consumer.as_deref() == Some("") {
                    return Err(ConfigError::new("--consumer", "must not be empty"));
                }
                let command = Operator::ConsumerBlocked {
                    consumer: a.consumer,
                    limit: i64::from(limit.get()),
                    output: a.output.parse(),
                };
                (a.db, command)
            }
            Command::Replay(a) => {
                let command = Operator::Replay {
                    amqp: a.amqp.parse(files)?,
                    replay: a.parse()?,
                };
                (a.db, command)
            }
        };
        Ok(Config::Operator {
            db: db.parse(files)?,
            command,
        })
    }
}

/// `redrive`: which parked rows, from ids, event ids and filters (or `--all-parked`).
fn redrive_filter(a: &super::args::RedriveArgs) -> Result<ParkedFilter, ConfigError> {
    let mut filter = a.filter.parse()?;
    for raw in &a.ids {
        let id: i64 = raw.trim().parse().map_err(|_| {
            ConfigError::new("--id", format!("'{raw}' is not a row id (a whole number)"))
        })?;
        filter.ids.push(id);
    }
    for raw in &a.event_ids {
        let id = uuid::Uuid::parse_str(raw.trim())
            .map_err(|_| ConfigError::new("--event-id", format!("'{raw}' is not a uuid")))?;
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
    Ok(filter)
}
