//! Parsers of single flag values shared by the commands: secrets (from a flag, its variable
//! or a `<VAR>_FILE`), positive numbers, durations, listen addresses, `--since`, and the
//! connection and filter flags every operator command takes. Each error names its flag.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::{
    ConfigError, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, Schema, parse_duration,
};
use outbox_kit::db::DbTarget;
use outbox_relay::operator::ParkedFilter;

use super::args::{AmqpArgs, CloudEventsArgs, DbArgs, FilterArgs, OutputArgs};

/// `--database-url` and `--schema`: where every command finds the outbox tables.
#[derive(Clone, Debug)]
pub struct Database {
    pub target: DbTarget,
    pub schema: Schema,
}

/// How a command prints its result: `--json` for scripts, text otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
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
pub(super) fn secret_value(
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

/// `--http-listen`: an address, or "off".
pub(super) fn http_listen(raw: &str) -> Result<Option<std::net::SocketAddr>, ConfigError> {
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

/// `--since` (and `--until`): a duration ago or an RFC 3339 time.
pub(super) fn parse_time(flag: &'static str, raw: &str) -> Result<SystemTime, ConfigError> {
    if let Ok(d) = humantime::parse_duration(raw) {
        return SystemTime::now()
            .checked_sub(d)
            .ok_or_else(|| ConfigError::new(flag, "that is too long ago"));
    }
    humantime::parse_rfc3339_weak(raw).map_err(|_| {
        ConfigError::new(
            flag,
            format!(
                "'{raw}' is neither a duration (1h, 2d) nor an RFC 3339 time (2026-11-30T12:00:00Z)"
            ),
        )
    })
}

impl FilterArgs {
    pub(super) fn parse(&self) -> Result<ParkedFilter, ConfigError> {
        Ok(ParkedFilter {
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            since: self
                .since
                .as_deref()
                .map(|raw| parse_time("--since", raw))
                .transpose()?,
            ..ParkedFilter::default()
        })
    }
}

pub(super) fn positive<T: FromStr>(flag: &'static str, raw: &str) -> Result<T, ConfigError>
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

pub(super) fn duration(flag: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(raw.trim()).map_err(|e| ConfigError::new(flag, e))?;
    if d.is_zero() {
        return Err(ConfigError::new(flag, "must be longer than zero"));
    }
    Ok(d)
}

impl DbArgs {
    pub(super) fn parse(&self, files: &SecretFiles) -> Result<Database, ConfigError> {
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
        Ok(Database { target: db, schema })
    }
}

impl AmqpArgs {
    pub(super) fn parse(&self, files: &SecretFiles) -> Result<AmqpTarget, ConfigError> {
        let url = secret_value(
            "--amqp-url",
            "AMQP_URL",
            self.amqp_url.as_deref(),
            files.amqp_url.as_deref(),
            Some(DEFAULT_AMQP_URL),
        )?
        .unwrap_or_default();
        let amqp = AmqpTarget::parse(&url).map_err(|e| ConfigError::new("--amqp-url", e))?;
        match &self.amqp_ca_file {
            Some(ca) => amqp
                .with_ca_file(ca)
                .map_err(|e| ConfigError::new("--amqp-ca-file", e)),
            None => Ok(amqp),
        }
    }
}

impl CloudEventsArgs {
    /// The CloudEvents `source` when `--cloudevents` is on.
    pub(super) fn parse(&self) -> Result<Option<String>, ConfigError> {
        if !self.cloudevents {
            return Ok(None);
        }
        if self.cloudevents_source.trim().is_empty() {
            return Err(ConfigError::new(
                "--cloudevents-source",
                "must not be empty",
            ));
        }
        Ok(Some(self.cloudevents_source.clone()))
    }
}

impl OutputArgs {
    pub(super) fn parse(&self) -> Output {
        if self.json {
            Output::Json
        } else {
            Output::Text
        }
    }
}
