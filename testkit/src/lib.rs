//! Tools for proving the guarantees, shared by the integration tests, the soak program
//! (`outbox-soak`) and the bench (`outbox-bench`): the delivery checker, a TCP proxy that
//! injects network faults, and which relay binary to run. Not part of the relay's data
//! path; nothing in `relay/` uses it.

pub mod checker;
pub mod proxy;
pub mod relay_binary;
pub mod services;
