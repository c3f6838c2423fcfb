//! outbox-relay: the relay of a transactional outbox on Postgres and RabbitMQ, run as a
//! sidecar. It publishes committed `outbox_events` rows to a RabbitMQ exchange with publisher
//! confirms and marks them dispatched only after the broker's ack ([`relay::run`]); it also
//! holds the operator commands ([`operator`], [`replay`]), the HTTP endpoint ([`http`]), the relay's
//! telemetry ([`telemetry`]) and the demo ([`demo`]).
//!
//! Services do not link this crate: the producer API, the consumer kit and the contract are
//! in `outbox-kit`.
//!
//! Architecture invariant: the library never reads the environment or argv; the binary
//! parses flags (src/cli/) and passes connections and a shutdown token in.

pub mod demo;
pub mod group_router;
pub mod http;
pub mod operator;
pub mod relay;
pub mod replay;
pub mod telemetry;
pub mod trace;
