//! `outbox-relay replay`'s flags parsed into the library's [`ReplayConfig`].

use std::num::{NonZeroU32, NonZeroUsize};

use outbox_kit::contract::ConfigError;
use outbox_relay::replay::{ReplayConfig, Selection};

use super::args::ReplayArgs;
use super::values::{duration, parse_time, positive};

impl ReplayArgs {
    pub(super) fn parse(&self) -> Result<ReplayConfig, ConfigError> {
        let name = self.name.trim();
        if name.is_empty() || name.len() > 200 {
            return Err(ConfigError::new("--name", "must be 1 to 200 bytes"));
        }
        let queue = self.queue.trim();
        if queue.is_empty() || queue.len() > 255 || queue.starts_with("amq.") {
            return Err(ConfigError::new(
                "--queue",
                "must be a queue name of 1 to 255 bytes, not amq.*",
            ));
        }
        let id = |flag: &'static str, raw: &Option<String>| {
            raw.as_deref()
                .map(|raw| positive::<RowId>(flag, raw).map(|n| n.0))
                .transpose()
        };
        let time = |flag: &'static str, raw: &Option<String>| {
            raw.as_deref().map(|raw| parse_time(flag, raw)).transpose()
        };
        let selection = Selection {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            event_type: self.event_type.clone(),
            since: time("--since", &self.since)?,
            until: time("--until", &self.until)?,
            from_id: id("--from-id", &self.from_id)?,
            to_id: id("--to-id", &self.to_id)?,
        };
        if let (Some(from), Some(to)) = (selection.from_id, selection.to_id)
            && to < from
        {
            return Err(ConfigError::new("--to-id", "must not be below --from-id"));
        }
        if let (Some(since), Some(until)) = (selection.since, selection.until)
            && until <= since
        {
            return Err(ConfigError::new("--until", "must be later than --since"));
        }
        let rate = self
            .rate
            .as_deref()
            .map(|raw| positive::<NonZeroU32>("--rate", raw))
            .transpose()?;
        let batch_size: NonZeroUsize = positive("--batch-size", &self.batch_size)?;
        if batch_size.get() > 10_000 {
            return Err(ConfigError::new("--batch-size", "must be at most 10000"));
        }
        Ok(ReplayConfig {
            name: name.to_owned(),
            queue: queue.to_owned(),
            selection,
            rate,
            batch_size,
            confirm_timeout: duration("--confirm-timeout", &self.confirm_timeout)?,
            cloudevents_source: self.cloudevents.parse()?,
            dry_run: self.dry_run,
        })
    }
}

/// A row id: a positive whole number that fits a Postgres bigint.
struct RowId(i64);

impl std::str::FromStr for RowId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.parse::<i64>() {
            Ok(n) if n > 0 => Ok(RowId(n)),
            _ => Err("a row id is 1 or more".into()),
        }
    }
}
