//! The flags' parsing: defaults are valid, and every bad value names its flag.

use std::time::Duration;

use clap::Parser;
use outbox_kit::contract::{ConfigError, Schema};

use super::{Cli, Config, SecretFiles};

fn run_config(args: &[&str]) -> Result<Config, ConfigError> {
    run_config_with(args, &SecretFiles::default())
}

fn run_config_with(args: &[&str], files: &SecretFiles) -> Result<Config, ConfigError> {
    let mut argv = vec!["outbox-relay", "run"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv)
        .expect("clap accepts")
        .into_config(files)
}

#[test]
fn secrets_come_from_files_but_not_from_both() {
    let dir = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = dir.join("db");
    std::fs::write(&url, "postgres://relay:pw@db.internal:5432/app\n").unwrap();
    let files = SecretFiles {
        database_url: Some(url.clone()),
        ..SecretFiles::default()
    };
    let Config::Run { db, .. } = run_config_with(&[], &files).unwrap() else {
        panic!("run expected")
    };
    assert_eq!(db.dbname(), Some("app"));
    assert!(
        !format!("{db:?}").contains("pw"),
        "the password is never printed"
    );
    let both = run_config_with(&["--database-url", "postgres://x@y/z"], &files).unwrap_err();
    assert_eq!(both.flag, "--database-url");
    let missing = SecretFiles {
        admin_token: Some(dir.join("nope")),
        ..SecretFiles::default()
    };
    let err = run_config_with(&[], &missing).unwrap_err();
    assert_eq!(err.flag, "--admin-token");
    assert!(
        err.problem.contains("cannot read OUTBOX_ADMIN_TOKEN_FILE"),
        "{}",
        err.problem
    );
}

#[test]
fn http_listen_and_retention_parse() {
    let Config::Run {
        http_listen, relay, ..
    } = run_config(&["--http-listen", "off", "--retention", "7d"]).unwrap()
    else {
        panic!("run expected")
    };
    assert_eq!(http_listen, None);
    assert_eq!(relay.retention, Some(Duration::from_secs(7 * 86400)));
    assert_eq!(
        run_config(&["--http-listen", "nowhere"]).unwrap_err().flag,
        "--http-listen"
    );
    assert_eq!(
        run_config(&["--retention", "0s"]).unwrap_err().flag,
        "--retention"
    );
}

#[test]
fn defaults_are_valid() {
    let Config::Run { relay, schema, .. } = run_config(&[]).unwrap() else {
        panic!("run expected")
    };
    assert_eq!(relay.batch_size.get(), 500);
    assert_eq!(relay.poll_interval, Duration::from_secs(1));
    assert_eq!(relay.late_commit_window, Duration::from_millis(100));
    assert_eq!(relay.max_attempts.get(), 10);
    assert_eq!(relay.max_message_bytes.get(), 1 << 20);
    assert_eq!(schema.as_str(), "public");
}

#[test]
fn zero_batch_size_names_the_flag() {
    let err = run_config(&["--batch-size", "0"]).unwrap_err();
    assert_eq!(err.flag, "--batch-size");
}

#[test]
fn bad_duration_names_the_flag() {
    let err = run_config(&["--poll-interval", "soon"]).unwrap_err();
    assert_eq!(err.flag, "--poll-interval");
    assert!(err.problem.contains("not a duration"), "{}", err.problem);
}

#[test]
fn schema_must_be_a_plain_identifier() {
    assert!(Schema::parse("outbox_1").is_ok());
    for bad in ["", "1abc", "Public", "a;drop", "a-b", &"x".repeat(64)] {
        assert!(Schema::parse(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn unparseable_urls_name_their_flags() {
    assert_eq!(
        run_config(&["--database-url", "postgres://[::1"])
            .unwrap_err()
            .flag,
        "--database-url"
    );
    assert_eq!(
        run_config(&["--amqp-url", "http://x"]).unwrap_err().flag,
        "--amqp-url"
    );
}

fn reconcile_config(args: &[&str]) -> Result<Config, ConfigError> {
    let mut argv = vec!["outbox-relay", "reconcile"];
    argv.extend_from_slice(args);
    Cli::try_parse_from(argv)
        .expect("clap accepts")
        .into_config(&SecretFiles::default())
}

#[test]
fn reconcile_defaults_are_valid() {
    let Config::Reconcile {
        reconcile, every, ..
    } = reconcile_config(&[]).unwrap()
    else {
        panic!("reconcile expected")
    };
    assert_eq!(reconcile.stuck_after, Duration::from_secs(600));
    assert_eq!(every, None);
}

#[test]
fn reconcile_thresholds_shorter_than_their_work_name_the_flag() {
    let err = reconcile_config(&["--stuck-after", "10s", "--send-timeout", "30s"]).unwrap_err();
    assert_eq!(err.flag, "--stuck-after");
    assert!(err.problem.contains("--send-timeout"), "{}", err.problem);
    let err = reconcile_config(&["--retention", "5m"]).unwrap_err();
    assert_eq!(err.flag, "--retention");
    assert_eq!(
        reconcile_config(&["--every", "often"]).unwrap_err().flag,
        "--every"
    );
}

#[test]
fn on_park_accepts_two_policies() {
    assert!(run_config(&["--on-park", "block-key"]).is_ok());
    assert_eq!(
        run_config(&["--on-park", "skip"]).unwrap_err().flag,
        "--on-park"
    );
}

fn release_config(key: &str) -> Result<Config, ConfigError> {
    Cli::try_parse_from([
        "outbox-relay",
        "consumer-release",
        "--consumer",
        "billing",
        "--key",
        key,
    ])
    .expect("clap accepts")
    .into_config(&SecretFiles::default())
}

#[test]
fn consumer_release_takes_a_type_and_an_id() {
    let Config::ConsumerRelease {
        aggregate_type,
        aggregate_id,
        ..
    } = release_config("order/eu/42").unwrap()
    else {
        panic!("consumer-release expected")
    };
    // The first slash separates: ids may hold slashes, aggregate types do not.
    assert_eq!(
        (aggregate_type.as_str(), aggregate_id.as_str()),
        ("order", "eu/42")
    );
    for bad in ["order", "/42", "order/"] {
        assert_eq!(release_config(bad).unwrap_err().flag, "--key", "{bad}");
    }
}
