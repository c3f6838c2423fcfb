//! Command-line flags (clap's raw `Args`) parsed once into validated domain types.
//!
//! Every flag also reads an environment variable. Only the parsed types (`RelayConfig`,
//! `DbTarget`, `AmqpTarget`, `Schema`, ...) cross into the library; nothing below `main`
//! reads argv or the environment. A problem with a flag becomes a `ConfigError` naming
//! the flag, which `main` prints as one line before exiting with status 2.
//!
//! Layout: `args.rs` (the raw clap types), `config.rs` ([`Config`]: `run`, `demo`, and the
//! operator commands in one shape, a [`Database`] and an [`Operator`] command), `run.rs`,
//! `demo.rs` and `replay.rs` (the commands with many flags),
//! `values.rs` (parsers of single values shared by the commands), `logging.rs` (the log
//! subscriber, with lapin's body-printing targets capped), `tests.rs`.

mod args;
mod config;
mod demo;
pub mod group_router;
pub mod logging;
mod replay;
mod run;
#[cfg(test)]
mod tests;
mod values;

pub use args::{Cli, Command, LogFormat};
pub use config::{Config, Database, Operator, Output};
pub use values::SecretFiles;
