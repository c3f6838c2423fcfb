//! The benchmark program in smoke mode (every section at tiny sizes), so it cannot rot:
//! it must exit 0, print its table, and write JSON with every section measured and a
//! sweep chart.
//!
//! No limit on the whole run: alone it takes about 25 s, on a machine busy with other
//! builds and tests several times that (a fixed 300 s was once exceeded). What it must not
//! do is hang: it reports every step on stderr, each of its waits has its own deadline, and
//! the test fails when it falls silent for [`SILENCE`].

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

/// The longest the bench may go without reporting a step. Its longest quiet step takes a
/// few seconds alone; its own waits give up after at most about 70 s.
const SILENCE: Duration = Duration::from_secs(240);

use outbox_testkit::services::{admin_url, amqp_url, built_relay_beside};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_smoke_measures_every_section() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench_smoke_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json_path = dir.join("bench.json");
    let svg_path = dir.join("sweep.svg");
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .arg("--smoke")
        .arg("--json")
        .arg(&json_path)
        .arg("--svg")
        .arg(&svg_path)
        .arg("--relay-bin")
        .arg(built_relay_beside(env!("CARGO_BIN_EXE_outbox-bench")))
        .arg("--work-dir")
        .arg(&dir)
        .args(["--database-url", &admin_url(), "--amqp-url", &amqp_url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start outbox-bench");
    let mut stdout_pipe = child.stdout.take().unwrap();
    let stdout_task = tokio::spawn(async move {
        let mut text = String::new();
        stdout_pipe.read_to_string(&mut text).await.map(|_| text)
    });
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut stderr = String::new();
    loop {
        match tokio::time::timeout(SILENCE, lines.next_line()).await {
            Ok(Ok(Some(line))) => {
                stderr.push_str(&line);
                stderr.push('\n');
            }
            Ok(Ok(None)) => break,
            Ok(Err(e)) => panic!("reading the bench's stderr: {e}"),
            Err(_) => panic!("outbox-bench --smoke said nothing for {SILENCE:?}:\n{stderr}"),
        }
    }
    let status = tokio::time::timeout(SILENCE, child.wait())
        .await
        .expect("the bench exits once its output ends")
        .unwrap();
    let stdout = stdout_task.await.unwrap().unwrap();
    assert!(
        status.success(),
        "outbox-bench --smoke failed ({status}):\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("| 1 | broker ceiling"), "{stdout}");
    assert!(stdout.contains("Targets:"), "{stdout}");
    assert!(
        stdout.contains("the wake-up's hop alone") && stdout.contains("floor: broker hop"),
        "the floor is printed in the latency section and the targets: {stdout}"
    );

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap())
        .expect("the JSON report parses");
    assert_eq!(report["mode"], "smoke");
    for section in [
        "broker_ceiling",
        "drain",
        "latency",
        "producer_cost",
        "growth",
        "relay_resources",
        "sweep",
        "scale_out",
        "consumer",
    ] {
        let v = &report[section];
        assert!(
            v.is_object() && v.get("error").is_none(),
            "section {section} missing or failed: {v}"
        );
    }
    assert!(report["broker_ceiling"]["rate"].as_f64().unwrap() > 0.0);
    assert!(report["drain"]["rate"].as_f64().unwrap() > 0.0);
    assert!(report["drain"]["ratio_to_ceiling"].as_f64().unwrap() > 0.0);
    let points = report["consumer"]["points"].as_array().unwrap();
    assert_eq!(points.len(), 3, "three modes at two instances");
    assert!(points.iter().all(|p| p["rate"].as_f64().unwrap() > 0.0));
    let runs = report["latency"]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "two rates, with and without LISTEN");
    for r in runs {
        assert_eq!(r["missing"], 0, "every latency event arrived: {r}");
        assert!(r["latency"]["samples"].as_u64().unwrap() > 0);
        if r["listen"] == true {
            let traced = r["stages"]["events"].as_u64().unwrap();
            assert!(traced > 0, "the stage trace covers events: {r}");
            // The floor beside it: the broker's hop and the wake-up's hop, each alone.
            for hop in ["broker_hop", "wakeup_hop"] {
                let f = &r["floor"][hop];
                assert!(f["samples"].as_u64().unwrap() > 0, "{hop} measured: {r}");
                assert!(f["p50_ms"].as_f64().unwrap() > 0.0, "{hop} measured: {r}");
            }
        } else {
            assert!(
                r["floor"].is_null(),
                "the floor is measured once per rate: {r}"
            );
        }
    }
    let yardstick = report["latency"]["yardstick_runs"].as_array().unwrap();
    assert_eq!(yardstick.len(), 2, "the yardstick at both rates");
    assert!(yardstick.iter().all(|r| r["missing"] == 0));
    assert_eq!(
        report["latency"]["no_relay_runs"].as_array().unwrap().len(),
        2
    );
    let producer = &report["producer_cost"];
    assert_eq!(producer["runs"].as_array().unwrap().len(), 7);
    assert!(producer["idle_wakeup"]["samples"].as_u64().unwrap() > 0);
    assert!(report["growth"]["ratio"].as_f64().unwrap() > 0.0);
    let scale = report["scale_out"]["points"].as_array().unwrap();
    assert_eq!(scale.len(), 2, "one and two relays: {scale:?}");
    assert!(scale.iter().all(|p| p["rate"].as_f64().unwrap() > 0.0));
    assert!(report["relay_resources"]["peak_rss_mib"].as_f64().unwrap() > 0.0);
    assert_eq!(report["sweep"]["points"].as_array().unwrap().len(), 4);
    let targets: Vec<&str> = report["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    // Six drain, producer, wake-up, growth and memory targets; latency at 500/s; four per
    // latency rate (the relay's own share beside the floor, against the yardstick twice, the
    // producers against no relay); the drain against the best ceiling of the sweep.
    assert_eq!(targets.len(), 16, "{targets:?}");
    for rate in ["200", "1,000"] {
        for what in [
            format!("relay's own share, commit → published, at {rate}/s (p50, p99)"),
            format!("latency at {rate}/s vs the yardstick's (p50, p99)"),
            format!("Postgres CPU per event at {rate}/s vs the yardstick's"),
            format!("producers' INSERT p50 at {rate}/s, relay running vs none"),
        ] {
            assert!(targets.contains(&what.as_str()), "{what} in {targets:?}");
        }
    }
    // Every target is measured but the one at 500/s, a rate the smoke run does not use.
    assert!(
        report["targets"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| (t["measured"] == "not measured")
                == (t["name"] == "latency at 500/s with LISTEN (p50, p99)")),
        "{}",
        report["targets"]
    );
    assert_eq!(report["errors"].as_array().unwrap().len(), 0);

    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
