//! `outbox-relay run`'s flags parsed into [`Config::Run`]: the connections, the HTTP
//! endpoint and the relay's [`RelayConfig`], with the bounds the relay relies on (batch size,
//! message size, channels, lease, retry delays) checked here, once.

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use outbox_kit::contract::{ConfigError, Secret, validate_exchange};
use outbox_relay::relay::{OnPark, RelayConfig};

use super::args::RunArgs;
use super::config::Config;
use super::values::{SecretFiles, amqp_target, duration, http_listen, positive, secret_value};

impl RunArgs {
    /// `outbox-relay run`: the connections, the HTTP endpoint and the relay's [`RelayConfig`].
    pub(super) fn parse(&self, files: &SecretFiles) -> Result<Config, ConfigError> {
        let a = self;
        let (db, schema) = a.db.parse(files)?;
        let amqp = amqp_target(a.amqp_url.as_deref(), a.amqp_ca_file.as_deref(), files)?;
        let admin_token = secret_value(
            "--admin-token",
            "OUTBOX_ADMIN_TOKEN",
            a.admin_token.as_deref(),
            files.admin_token.as_deref(),
            None,
        )?
        .filter(|t| !t.is_empty())
        .map(Secret::new);
        let http_listen = http_listen(&a.http_listen)?;
        let retention = match a.retention.trim() {
            "off" => None,
            raw => Some(duration("--retention", raw)?),
        };
        let exchange =
            validate_exchange(&a.exchange).map_err(|e| ConfigError::new("--exchange", e))?;
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
        let shutdown_timeout = duration("--shutdown-timeout", &a.shutdown_timeout)?;
        // A SIGTERM waits this long for the confirms in flight, then marks what was acked: a
        // shorter wait than one confirm may take leaves acked rows unmarked, to be
        // published again by the next holder.
        if shutdown_timeout <= confirm_timeout {
            return Err(ConfigError::new(
                "--shutdown-timeout",
                format!(
                    "must be longer than --confirm-timeout ({}): a shutdown waits for the confirms in flight, then marks them",
                    humantime::format_duration(confirm_timeout)
                ),
            ));
        }
        let relay = RelayConfig {
            exchange,
            declare_exchange: !a.no_declare,
            batch_size,
            poll_interval: duration("--poll-interval", &a.poll_interval)?,
            late_commit_window: duration("--late-commit-window", &a.late_commit_window)?,
            listen: !a.no_listen,
            max_attempts,
            max_message_bytes,
            shutdown_timeout,
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
            stage_trace: a.stage_trace.clone(),
        })
    }
}
