//! The relay as a real process (for SIGKILL, SIGTERM and SIGSTOP tests).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

pub struct RelayProcess {
    pub child: Child,
    pub log: PathBuf,
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_outbox-relay")
}

impl RelayProcess {
    /// Starts `outbox-relay run` with `args`; stderr goes to a log file under target/.
    pub fn start(name: &str, args: &[String]) -> RelayProcess {
        Self::start_with_env(
            name,
            args,
            &[("RUST_LOG", "info,outbox_relay=debug,lapin=error")],
        )
    }

    /// As [`RelayProcess::start`], with these environment variables.
    pub fn start_with_env(name: &str, args: &[String], env: &[(&str, &str)]) -> RelayProcess {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("relay-logs");
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(binary())
            .arg("run")
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn outbox-relay");
        RelayProcess { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    pub fn signal(&self, sig: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{sig}");
    }

    /// Waits for the process to exit; returns its exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        let status = tokio::time::timeout(limit, self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "relay did not exit within {limit:?}; log: {}",
                    self.log.display()
                )
            })
            .unwrap();
        status.code()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log above debug level, for a failure message.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.contains(" DEBUG ") && !l.contains(" TRACE "))
            .collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Runs the binary to completion with `args`; returns (exit code, stdout, stderr).
pub async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(binary())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run outbox-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `outbox-relay run` arguments for tests: fast polls, short leases and retries, the HTTP
/// endpoint on a free port; `extra` last (later flags win).
pub fn test_relay_args(database_url: &str, exchange: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--database-url",
        database_url,
        "--amqp-url",
        &super::amqp_url(),
        "--exchange",
        exchange,
        "--poll-interval",
        "200ms",
        "--lease",
        "3s",
        "--retry-min",
        "50ms",
        "--retry-max",
        "500ms",
        "--confirm-timeout",
        "5s",
        "--http-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}
