//! Tools for proving the guarantees, shared by the integration tests and the soak program
//! (`outbox-soak`): the delivery checker and a TCP proxy that injects network faults.
//! Not part of the relay's data path; nothing in `relay/` uses it.

pub mod checker;
pub mod proxy;
