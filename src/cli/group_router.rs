//! `outbox-relay group-router`'s flags parsed into [`GroupRouterConfig`]: the connections,
//! the HTTP endpoint and the group ([`ConsumerConfig`] in ordered mode, checked by the kit's
//! own rules: bindings that take every event of a key, at most 1000 partitions).

use std::num::NonZeroU16;

use outbox_kit::consumer::runner::{ConsumerConfig, ConsumerError, GroupRouter, Ordered};
use outbox_kit::contract::ConfigError;
use outbox_relay::group_router::GroupRouterConfig;

use super::args::GroupRouterArgs;
use super::config::{Config, Database};
use super::values::{SecretFiles, http_listen, positive};

impl GroupRouterArgs {
    pub(super) fn parse(&self, files: &SecretFiles) -> Result<Config, ConfigError> {
        let Database { target: db, schema } = self.db.parse(files)?;
        let amqp = self.amqp.parse(files)?;
        let partitions: NonZeroU16 = positive("--partitions", &self.partitions)?;
        let name = self.consumer.as_deref().unwrap_or(&self.queue);
        let bindings: Vec<&str> = self
            .bindings
            .iter()
            .map(|b| b.trim())
            .filter(|b| !b.is_empty())
            .collect();
        let mut group = ConsumerConfig::new(name, &self.exchange, &bindings);
        group.queue = self.queue.clone();
        group.declare = !self.no_declare;
        group.ordered = Some(Ordered {
            partitions,
            ..Ordered::default()
        });
        group.connection_name = format!("outbox-relay group-router {}", self.queue);
        // The kit's checks, named by this command's flags.
        if let Err(e) = GroupRouter::new(group.clone(), amqp.clone()) {
            return Err(match e {
                ConsumerError::Config(c) => ConfigError::new(flag_of(c.flag), c.problem),
                other => ConfigError::new("--queue", other.to_string()),
            });
        }
        Ok(Config::GroupRouter(GroupRouterConfig {
            db,
            schema,
            amqp,
            group,
            http_listen: http_listen(&self.http_listen)?,
        }))
    }
}

/// The flag behind a field of the kit's [`ConsumerConfig`].
fn flag_of(field: &str) -> &'static str {
    match field {
        "name" => "--consumer",
        "exchange" => "--exchange",
        "bindings" => "--binding",
        "partitions" => "--partitions",
        _ => "--queue",
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Cli, Config, SecretFiles};
    use outbox_kit::contract::ConfigError;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["outbox-relay", "group-router"];
        argv.extend_from_slice(args);
        Cli::parse_args(argv)
            .expect("clap accepts")
            .into_config(&SecretFiles::default())
    }

    #[test]
    fn the_defaults_make_a_group_named_after_its_queue() {
        let Ok(Config::GroupRouter(c)) = parse(&["--queue", "billing"]) else {
            panic!("a group router expected")
        };
        assert_eq!(c.group.name, "billing");
        assert_eq!(c.group.intake_queue(), "billing.intake");
        assert_eq!(c.group.partition_queue(7), "billing.p07");
        assert_eq!(c.group.bindings, ["#"]);
        assert_eq!(c.group.exchange, "outbox.events");
        assert!(c.group.declare);
        assert_eq!(c.http_listen, Some("127.0.0.1:9465".parse().unwrap()));
        let _ = c.router();
    }

    #[test]
    fn bad_values_name_their_flag() {
        let flag = |args: &[&str]| parse(args).unwrap_err().flag;
        assert_eq!(
            flag(&["--queue", "billing", "--partitions", "0"]),
            "--partitions"
        );
        assert_eq!(
            flag(&["--queue", "billing", "--partitions", "1001"]),
            "--partitions"
        );
        assert_eq!(
            flag(&["--queue", "billing", "--binding", "order.created"]),
            "--binding"
        );
        assert_eq!(flag(&["--queue", "a b"]), "--queue");
        assert_eq!(
            flag(&["--queue", "billing", "--exchange", ""]),
            "--exchange"
        );
        assert_eq!(
            flag(&["--queue", "billing", "--http-listen", "nowhere"]),
            "--http-listen"
        );
    }

    #[test]
    fn bindings_and_the_name_come_from_flags() {
        let Ok(Config::GroupRouter(c)) = parse(&[
            "--queue",
            "billing",
            "--consumer",
            "billing-v2",
            "--binding",
            "order.#",
            "--binding",
            "invoice.*",
            "--no-declare",
        ]) else {
            panic!("a group router expected")
        };
        assert_eq!(c.group.name, "billing-v2");
        assert_eq!(c.group.queue, "billing");
        assert_eq!(c.group.bindings, ["order.#", "invoice.*"]);
        assert!(!c.group.declare);
    }
}
