//! What the run's phases share (setup builds, drive and faults and the verdict use): the
//! proxy in front of each process's connection to each service, the names processes
//! show the services, and a queue's depth. A file of its own, so that `setup` (which
//! runs `drive`) is imported by none of the phases it starts.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_kit::amqp::AmqpTarget;
use outbox_testkit::proxy::TcpProxy;

use crate::schedule::{Service, Target};

pub(super) struct Proxies {
    pub(super) relay_pg: Vec<TcpProxy>,
    pub(super) relay_amqp: Vec<TcpProxy>,
    pub(super) consumer_pg: Vec<TcpProxy>,
    pub(super) consumer_amqp: Vec<TcpProxy>,
}

impl Proxies {
    pub(super) fn get(&self, target: Target, service: Service) -> &TcpProxy {
        match (target, service) {
            (Target::Relay(i), Service::Postgres) => &self.relay_pg[i],
            (Target::Relay(i), Service::Rabbitmq) => &self.relay_amqp[i],
            (Target::Consumer(i), Service::Postgres) => &self.consumer_pg[i],
            (Target::Consumer(i), Service::Rabbitmq) => &self.consumer_amqp[i],
        }
    }

    pub(super) fn all(&self) -> impl Iterator<Item = &TcpProxy> {
        self.relay_pg
            .iter()
            .chain(&self.relay_amqp)
            .chain(&self.consumer_pg)
            .chain(&self.consumer_amqp)
    }
}

pub(super) fn app_name(target: Target) -> String {
    match target {
        Target::Relay(i) => format!("soak_relay_{i}"),
        Target::Consumer(i) => format!("soak_consumer_{i}"),
    }
}

/// How many messages wait in `queue`; None when it does not exist.
/// Bounded: a connection made while the node restarts can hang.
pub(super) async fn queue_depth(amqp: &AmqpTarget, queue: &str) -> Option<(u32, u32)> {
    tokio::time::timeout(Duration::from_secs(15), queue_depth_once(amqp, queue))
        .await
        .ok()
        .flatten()
}

async fn queue_depth_once(amqp: &AmqpTarget, queue: &str) -> Option<(u32, u32)> {
    let conn = amqp.connect("outbox-soak-check").await.ok()?;
    let ch = conn.create_channel().await.ok()?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok();
    let _ = conn.close(200, "checked".into()).await;
    q.map(|q| (q.message_count(), q.consumer_count()))
}
