//! Where the tests' Postgres and RabbitMQ are: `IT_DATABASE_URL` and `IT_AMQP_URL`, else the
//! local services that `scripts/services.sh` starts.

use std::path::PathBuf;

/// A superuser connection to the tests' Postgres (each test creates its own database).
pub fn admin_url() -> String {
    std::env::var("IT_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The tests' RabbitMQ.
pub fn amqp_url() -> String {
    std::env::var("IT_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The `outbox-relay` binary that the workspace's `cargo test` built beside `sibling` (a
/// tool's own binary, from `env!("CARGO_BIN_EXE_...")`). A tool's tests run it as a child;
/// they do not build it themselves, so a missing one is a clear failure.
pub fn built_relay_beside(sibling: &str) -> PathBuf {
    let bin = PathBuf::from(sibling).with_file_name("outbox-relay");
    assert!(
        bin.exists(),
        "{} is missing: run the workspace's tests (cargo test at the top), which build it",
        bin.display()
    );
    bin
}
