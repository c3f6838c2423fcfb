//! What `main` runs, fully validated: [`Config`], one variant per command, built from the
//! raw flags by [`Cli::into_config`]. The operator commands are parsed here; `run` and
//! `demo`, with many flags each, in their own files.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::{ConfigError, Schema, Secret};
use outbox_kit::db::DbTarget;
use outbox_relay::operator::ParkedFilter;
use outbox_relay::relay::RelayConfig;

use super::args::{Cli, Command, ParkedCommand};
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
    ConsumerRelease {
        db: DbTarget,
        schema: Schema,
        consumer: String,
        aggregate_type: String,
        aggregate_id: String,
    },
    ConsumerBlocked {
        db: DbTarget,
        schema: Schema,
        consumer: Option<String>,
        limit: i64,
        json: bool,
    },
    Demo(outbox_relay::demo::DemoConfig),
    GroupRouter(super::group_router::GroupRouterConfig),
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
            Command::ConsumerRelease(a) => {
                let (db, schema) = a.db.parse(files)?;
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
                Ok(Config::ConsumerRelease {
                    db,
                    schema,
                    consumer: a.consumer,
                    aggregate_type: aggregate_type.to_owned(),
                    aggregate_id: aggregate_id.to_owned(),
                })
            }
            Command::ConsumerBlocked(a) => {
                let (db, schema) = a.db.parse(files)?;
                let limit: NonZeroU32 = positive("--limit", &a.limit)?;
                if a.consumer.as_deref() == Some("") {
                    return Err(ConfigError::new("--consumer", "must not be empty"));
                }
                Ok(Config::ConsumerBlocked {
                    db,
                    schema,
                    consumer: a.consumer,
                    limit: i64::from(limit.get()),
                    json: a.json,
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
            Command::Run(a) => a.parse(files),
            Command::GroupRouter(a) => a.parse(files),
        }
    }
}
