//! outbox-relay: a transactional outbox relay and consumer kit for Postgres and RabbitMQ.
//!
//! Services write event rows into `outbox_events` in the same transaction as their
//! change ([`producer`], or plain SQL). The relay ([`relay::run`]) publishes committed
//! rows to a RabbitMQ exchange with publisher confirms and marks them dispatched only
//! after the broker's ack.
//!
//! Architecture invariant: the library never reads the environment or argv; `main` parses
//! flags into [`config::Config`] and passes connections and a shutdown token in.

pub mod config;
pub mod consumer;
pub mod db;
pub mod demo;
pub mod http;
pub mod operator;
pub mod producer;
pub mod relay;
pub mod schema;
pub mod telemetry;
pub mod testkit;
pub mod tls;
