//! Tools for proving the guarantees, shared by the integration tests, the soak program
//! (`outbox-soak`) and the bench (`outbox-bench`): the delivery checker, a TCP proxy that
//! injects network faults, which relay binary to run, and private Postgres servers and
//! RabbitMQ nodes that a test may stop and restart (the machine's own are shared). Not
//! part of the relay's data path; nothing in `relay/` uses it.

pub mod checker;
pub mod postgres;
pub mod proxy;
pub mod rabbitmq;
pub mod relay_binary;
pub mod services;
