//! `outbox-relay demo`'s flags parsed into the library's [`DemoConfig`].

use std::num::NonZeroU32;
use std::time::Duration;

use outbox_kit::contract::{ConfigError, Schema, validate_exchange};
use outbox_relay::demo::{DemoConfig, Stop};

use super::args::{AmqpArgs, DbArgs, DemoArgs};
use super::config::Database;
use super::values::{SecretFiles, duration, http_listen, positive};

impl DemoArgs {
    /// The demo's connections, names, rate and stop condition.
    pub(super) fn parse(&self, files: &SecretFiles) -> Result<DemoConfig, ConfigError> {
        let db = DbArgs {
            database_url: self.database_url.clone(),
            schema: self.schema.clone(),
        };
        let Database {
            target: server,
            schema,
        } = db.parse(files)?;
        let amqp = AmqpArgs {
            amqp_url: self.amqp_url.clone(),
            amqp_ca_file: None,
        }
        .parse(files)?;
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
