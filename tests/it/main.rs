//! The one integration test binary (links once). Every test gets its own database and
//! its own exchange and queue, so tests run in parallel against the real services.

mod support;

mod claim_limits;
mod cluster;
mod consumer;
mod contract;
mod dashboard;
mod demo;
mod deploy;
mod docs;
mod effects;
mod groups;
mod http_api;
mod layout;
mod migrate;
mod notifications;
mod operability;
mod python_group;
mod relay_core;
mod relay_faults;
mod relay_state;
mod replay;
mod roles;
mod scale_out;
mod schema_file;
