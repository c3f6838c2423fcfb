//! The bounded soak, as CI runs it: the `outbox-soak` binary (real relay and consumer
//! processes, the seeded fault schedule, the checker) with fixed seeds and short durations
//! must give a PASS; the same seed must give the same schedule; and a planted stray event
//! must make the verdict, and the exit status, fail. The long run is in docs/guarantees.md ("Soak").

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::Mutex;

use outbox_testkit::services::{admin_url, amqp_url, built_relay_beside};

/// One soak at a time: each runs five processes; two at once on a 2-core CI machine
/// would measure the machine, not the relay.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

fn soak_bin() -> &'static str {
    env!("CARGO_BIN_EXE_outbox-soak")
}

struct Outcome {
    code: Option<i32>,
    stdout: String,
    report: serde_json::Value,
}

async fn soak(seed: u64, duration: &str, extra: &[&str]) -> Outcome {
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("soak")
        .join(format!("seed-{seed}-{}", std::process::id()));
    let mut args = vec![
        "--seed".to_owned(),
        seed.to_string(),
        "--duration".to_owned(),
        duration.to_owned(),
        // Low enough for debug builds sharing two cores with the rest of the suite.
        "--rate".to_owned(),
        "60".to_owned(),
        "--keys".to_owned(),
        "120".to_owned(),
        // Two pools of 8 connections: the suite's other tests share the database server.
        "--prefetch".to_owned(),
        "4".to_owned(),
        "--drain-timeout".to_owned(),
        "120s".to_owned(),
        // Every consumer instance stopped for 5-10 s: a backlog that fits 45 s.
        "--backlog".to_owned(),
        "10s".to_owned(),
        "--work-dir".to_owned(),
        work.display().to_string(),
        // The relay cargo built for this test binary (the soak would otherwise look next
        // to itself, and build it when it sees cargo's variables).
        "--relay-bin".to_owned(),
        built_relay_beside(env!("CARGO_BIN_EXE_outbox-soak"))
            .display()
            .to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = tokio::time::timeout(
        Duration::from_secs(400),
        tokio::process::Command::new(soak_bin())
            .args(&args)
            .env("DATABASE_URL", admin_url())
            .env("AMQP_URL", amqp_url())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the soak ends within 400 s")
    .expect("outbox-soak runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = std::fs::read_to_string(work.join("report.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| {
            panic!(
                "no report from seed {seed}; stdout:\n{stdout}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    Outcome {
        code: out.status.code(),
        stdout,
        report,
    }
}

fn verdict_line(stdout: &str) -> &str {
    stdout
        .lines()
        .rfind(|l| l.starts_with("outbox-soak seed="))
        .unwrap_or("")
}

#[tokio::test]
async fn the_same_seed_draws_the_same_fault_schedule() {
    async fn schedule(seed: &str) -> String {
        let out = tokio::process::Command::new(soak_bin())
            .args([
                "--schedule-only",
                "--seed",
                seed,
                "--duration",
                "90s",
                "--backlog",
                "10s",
            ])
            .output()
            .await
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    }
    let a = schedule("13").await;
    assert_eq!(a, schedule("13").await);
    assert_ne!(a, schedule("14").await);
    for kind in [
        "SIGKILL relay",
        "SIGSTOP relay",
        "close_connection of relay",
        "close_connection of consumer",
        "blackhole",
        "delay",
        "reset",
        "pg_terminate_backend",
        "SIGKILL consumer",
        "publish copies",
        "between the broker's ack and its mark",
        "restart Postgres",
        "restart the RabbitMQ node",
        "SIGSTOP consumer",
        "(a backlog)",
    ] {
        assert!(a.contains(kind), "90 s of seed 13 injects '{kind}':\n{a}");
    }
}

/// Two fixed seeds, 45 s of faults each, then the quiet period and the checker, each on a
/// private Postgres server and RabbitMQ node of its own, with three instances of one
/// ordered consumer group: both restart Postgres, kill a relay between the broker's ack and
/// its mark and stop every consumer instance for a while (a backlog); seed 21 SIGSTOPs an
/// instance past its member lease, seed 38 restarts the RabbitMQ node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_soak_with_fixed_seeds_passes() {
    let _one = ONE_AT_A_TIME.lock().await;
    for seed in [21, 38] {
        let o = soak(seed, "45s", &[]).await;
        let line = verdict_line(&o.stdout);
        println!("{line}");
        let r = &o.report;
        assert_eq!(r["verdict"], "PASS", "{line}\n{}", r["failures"]);
        assert_eq!(o.code, Some(0), "{line}");
        assert_eq!(r["delivery"]["lost"], 0);
        assert_eq!(r["delivery"]["unexpected"], 0);
        assert_eq!(r["delivery"]["order_violations"], 0);
        assert_eq!(r["effects"]["performed_twice"], 0);
        assert_eq!(r["effects"]["missing"], 0);
        assert_eq!(r["applied"]["gaps"], 0);
        assert_eq!(r["applied"]["not_increasing"], 0);
        assert!(r["events"]["committed"].as_u64().unwrap() > 1_000, "{line}");
        assert!(r["events"]["rolled_back"].as_u64().unwrap() > 0, "{line}");
        assert!(
            r["events"]["committed_late"].as_u64().unwrap() > 0,
            "{line}"
        );
        let faults = r["faults"].as_array().unwrap();
        let injected = faults.iter().filter(|f| f["injected"] == true).count();
        assert!(
            injected >= 8 && injected * 10 >= faults.len() * 8,
            "most scheduled faults were injected ({injected} of {}): {line}",
            faults.len()
        );
        assert!(
            faults
                .iter()
                .filter(|f| f["injected"] == true)
                .all(|f| f["recovery_ms"].is_i64()),
            "a recovery time for every injected fault"
        );
        for kind in [
            "restart_postgres",
            "kill_between_ack_and_mark",
            "stop_consumers",
        ]
        .iter()
        .chain(if seed == 38 {
            &["restart_rabbitmq"][..]
        } else {
            &["pause_consumer"][..]
        }) {
            assert!(
                faults
                    .iter()
                    .any(|f| f["kind"] == *kind && f["injected"] == true),
                "seed {seed} injects {kind}: {line}"
            );
        }
        let caught = &r["between_ack_and_mark"];
        assert!(caught["rows"].as_u64().unwrap() > 0, "{line}");
        assert_eq!(caught["published_again"], caught["rows"], "{line}");
        let group = &r["groups"][0];
        assert_eq!(group["instances"], 3, "{line}");
        assert_eq!(group["gaps_given_up"], 0, "{line}");
        assert_eq!(group["held_at_the_end"], 0, "{line}");
        assert_eq!(
            group["seqs_strictly_increasing_none_skipped"], true,
            "{line}"
        );
        assert_eq!(
            group["applied_once"].as_u64().unwrap()
                + group["dead_lettered_with_record"].as_u64().unwrap(),
            group["routed"].as_u64().unwrap(),
            "every event routed to the group applied once or dead-lettered with a record: {line}"
        );
    }
}

/// The verdict can fail: one stray event (never committed) published to the exchange is
/// reported as unexpected, at the broker, in the applies and at the destination, and the
/// soak exits non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_stray_event_fails_the_verdict() {
    let _one = ONE_AT_A_TIME.lock().await;
    let o = soak(13, "8s", &["--plant-unexpected"]).await;
    let line = verdict_line(&o.stdout);
    assert_eq!(o.report["verdict"], "FAIL", "{line}");
    assert_eq!(o.code, Some(1), "{line}");
    assert!(
        line.contains("FAIL") && line.contains("unexpected 1"),
        "{line}"
    );
    assert_eq!(o.report["delivery"]["unexpected"], 1);
    assert_eq!(o.report["applied"]["unexpected"], 1);
    assert_eq!(o.report["effects"]["unexpected"], 1);
    assert_eq!(o.report["delivery"]["lost"], 0, "only the plant is wrong");
}
