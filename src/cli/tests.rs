//! The flags' parsing: defaults are valid, and every bad value names its flag.

use std::time::Duration;

use clap::ArgAction;
use outbox_kit::contract::{ConfigError, Schema};

use super::{Cli, Config, Operator, Output, SecretFiles};

fn run_config(args: &[&str]) -> Result<Config, ConfigError> {
    run_config_with(args, &SecretFiles::default())
}

fn run_config_with(args: &[&str], files: &SecretFiles) -> Result<Config, ConfigError> {
    let mut argv = vec!["outbox-relay", "run"];
    argv.extend_from_slice(args);
    Cli::parse_args(argv)
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
    assert!(relay.shutdown_timeout > relay.confirm_timeout);
    assert_eq!(schema.as_str(), "public");
}

/// A shutdown that waits less than one confirm may take leaves acked rows unmarked (they are
/// published again): the pair is checked, and the defaults pass.
#[test]
fn shutdown_timeout_must_outlast_the_confirm_timeout() {
    for args in [
        &["--shutdown-timeout", "10s"][..],
        &["--shutdown-timeout", "15s"],
        &["--confirm-timeout", "30s"],
        &["--shutdown-timeout", "5s", "--confirm-timeout", "5s"],
    ] {
        let err = run_config(args).unwrap_err();
        assert_eq!(err.flag, "--shutdown-timeout", "{args:?}");
        assert!(err.problem.contains("--confirm-timeout"), "{}", err.problem);
    }
    for args in [
        &["--shutdown-timeout", "16s"][..],
        &["--shutdown-timeout", "6s", "--confirm-timeout", "5s"],
        &["--shutdown-timeout", "1m", "--confirm-timeout", "30s"],
    ] {
        assert!(run_config(args).is_ok(), "{args:?}");
    }
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
    Cli::parse_args(argv)
        .expect("clap accepts")
        .into_config(&SecretFiles::default())
}

#[test]
fn reconcile_defaults_are_valid() {
    let Config::Operator {
        command: Operator::Reconcile { reconcile, every },
        ..
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

/// Every boolean flag of every command takes 1/0, true/false, yes/no and on/off (from its
/// environment variable; the parser is the same one clap uses for the variable's value).
#[test]
fn boolean_flags_take_the_usual_spellings() {
    fn bool_flags(cmd: &clap::Command, out: &mut Vec<clap::Arg>) {
        out.extend(
            cmd.get_arguments()
                .filter(|a| matches!(a.get_action(), ArgAction::SetTrue))
                .cloned(),
        );
        for sub in cmd.get_subcommands() {
            bool_flags(sub, out);
        }
    }
    let mut flags = Vec::new();
    bool_flags(&Cli::clap_command(), &mut flags);
    let names: Vec<String> = flags.iter().map(|a| a.get_id().to_string()).collect();
    for expected in ["no_declare", "no_migrate", "no_listen", "cloudevents"] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    for flag in flags {
        let id = flag.get_id().to_string();
        let long = format!("--{}", flag.get_long().expect("a long flag"));
        // The flag's own value parser, given a value the way its variable would give it.
        let probe = clap::Command::new("probe").arg(flag.action(ArgAction::Set).env(None::<&str>));
        let parse = |value: &str| {
            probe
                .clone()
                .try_get_matches_from(["probe", long.as_str(), value])
                .map(|m| m.get_one::<bool>(&id).copied())
        };
        for yes in ["1", "true", "yes", "on", "TRUE", "Yes"] {
            assert_eq!(parse(yes).unwrap(), Some(true), "--{id} {yes}");
        }
        for no in ["0", "false", "no", "off"] {
            assert_eq!(parse(no).unwrap(), Some(false), "--{id} {no}");
        }
        assert!(parse("maybe").is_err(), "--{id} maybe");
    }
}

fn release_config(key: &str) -> Result<Config, ConfigError> {
    Cli::parse_args([
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
    let Config::Operator {
        command:
            Operator::ConsumerRelease {
                aggregate_type,
                aggregate_id,
                ..
            },
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

fn operator_config(args: &[&str]) -> Result<Config, ConfigError> {
    let mut argv = vec!["outbox-relay"];
    argv.extend_from_slice(args);
    Cli::parse_args(argv)
        .expect("clap accepts")
        .into_config(&SecretFiles::default())
}

/// Every operator command takes the same connection flags, and `--json` the same way.
#[test]
fn operator_commands_share_the_connection_and_output_flags() {
    for command in [
        vec!["migrate"],
        vec!["status", "--json"],
        vec!["parked", "list", "--json"],
        vec!["redrive", "--all-parked"],
        vec!["reconcile"],
        vec!["consumer-release", "--consumer", "c", "--key", "t/1"],
        vec!["consumer-blocked", "--json"],
        vec!["replay", "--name", "r", "--queue", "q"],
    ] {
        let mut args = command.clone();
        args.extend(["--database-url", "postgres://h/shop", "--schema", "outbox"]);
        let Config::Operator { db, command: op } = operator_config(&args).unwrap() else {
            panic!("{command:?}: an operator command");
        };
        assert_eq!(db.target.dbname(), Some("shop"), "{command:?}");
        assert_eq!(db.schema.as_str(), "outbox", "{command:?}");
        if let Operator::Status { output }
        | Operator::ParkedList { output, .. }
        | Operator::ConsumerBlocked { output, .. } = op
        {
            assert_eq!(output, Output::Json, "{command:?}");
        }
        let mut bad = command.clone();
        bad.extend(["--schema", "no such"]);
        assert_eq!(operator_config(&bad).unwrap_err().flag, "--schema");
    }
}

#[test]
fn replay_flags_name_themselves() {
    let replay = |extra: &[&str]| {
        let mut args = vec!["replay"];
        args.extend_from_slice(extra);
        for (flag, value) in [("--name", "late-billing"), ("--queue", "billing")] {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        operator_config(&args)
    };
    let Config::Operator {
        command: Operator::Replay { replay: config, .. },
        ..
    } = replay(&[
        "--aggregate-type",
        "order",
        "--from-id",
        "10",
        "--rate",
        "50",
    ])
    .unwrap()
    else {
        panic!("replay expected")
    };
    assert_eq!(config.selection.from_id, Some(10));
    assert_eq!(config.selection.aggregate_type.as_deref(), Some("order"));
    assert_eq!(config.rate.map(|r| r.get()), Some(50));
    assert!(!config.dry_run);
    for (args, flag) in [
        (vec!["--from-id", "ten"], "--from-id"),
        (vec!["--from-id", "0"], "--from-id"),
        (vec!["--from-id", "9", "--to-id", "3"], "--to-id"),
        (vec!["--since", "1h", "--until", "2h"], "--until"),
        (vec!["--since", "yesterday"], "--since"),
        (vec!["--rate", "0"], "--rate"),
        (vec!["--batch-size", "0"], "--batch-size"),
        (vec!["--queue", "amq.direct"], "--queue"),
        (vec!["--name", " "], "--name"),
    ] {
        assert_eq!(replay(&args).unwrap_err().flag, flag, "{args:?}");
    }
}
