//! The relay under test, run as the real binary in a child process (`outbox-relay run`),
//! so its memory and CPU are its own and read from `/proc/<pid>`; stopped with SIGTERM as
//! an operator would. Its log goes to a file under the work directory.
//!
//! An optional wrapper command (for example `valgrind --tool=callgrind`) is put in front
//! of the binary; valgrind keeps the pid, so the same accounting applies (to valgrind).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procfs;

/// How the relay is configured for one run (flags of `outbox-relay run`).
#[derive(Clone, Debug)]
pub struct RelaySettings {
    pub batch_size: usize,
    pub channels: usize,
    pub confirm_window: usize,
    pub poll_interval: String,
    pub listen: bool,
    /// The relay's --retention, when set.
    pub retention: Option<String>,
    /// The relay's (hidden) --stage-trace file, when set: per-stage timestamps.
    pub stage_trace: Option<PathBuf>,
}

impl RelaySettings {
    pub fn describe(&self) -> String {
        format!(
            "batch {}, channels {}, confirm window {}, poll {}, {}",
            self.batch_size,
            self.channels,
            self.confirm_window,
            self.poll_interval,
            if self.listen { "LISTEN" } else { "--no-listen" }
        ) + &self
            .retention
            .as_ref()
            .map_or(String::new(), |r| format!(", retention {r}"))
    }
}

/// Where the binary is and how to start it.
#[derive(Clone, Debug)]
pub struct Launcher {
    pub bin: PathBuf,
    pub wrapper: Option<String>,
    pub amqp_url: String,
    pub log_dir: PathBuf,
}

/// CPU and memory the relay used, from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu_s: f64,
    pub peak_rss_kib: u64,
    pub rss_kib: u64,
}

pub struct RelayProcess {
    child: Child,
    pub pid: u32,
    pub log: PathBuf,
    stopped: bool,
}

impl Launcher {
    pub fn start(
        &self,
        name: &str,
        db_url: &str,
        exchange: &str,
        s: &RelaySettings,
    ) -> Result<RelayProcess> {
        let log = self.log_file(name)?;
        let mut args: Vec<String> = vec![
            "run".into(),
            "--database-url".into(),
            db_url.into(),
            "--amqp-url".into(),
            self.amqp_url.clone(),
            "--exchange".into(),
            exchange.into(),
            "--batch-size".into(),
            s.batch_size.to_string(),
            "--channels".into(),
            s.channels.to_string(),
            "--confirm-window".into(),
            s.confirm_window.to_string(),
            "--poll-interval".into(),
            s.poll_interval.clone(),
            // Any free port: several bench relays (scale-out) or a relay already running
            // on this machine must not collide on the default one.
            "--http-listen".into(),
            "127.0.0.1:0".into(),
        ];
        if !s.listen {
            args.push("--no-listen".into());
        }
        if let Some(r) = &s.retention {
            args.extend(["--retention".into(), r.clone()]);
        }
        if let Some(t) = &s.stage_trace {
            args.extend(["--stage-trace".into(), t.display().to_string()]);
        }
        let cmd = match &self.wrapper {
            Some(w) => {
                let mut parts = w.split_whitespace();
                let program = parts.next().context("--relay-wrapper is empty")?;
                let mut c = Command::new(program);
                c.args(parts).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        spawn(cmd, &args, &log)
    }

    /// Starts the yardstick (this very program's hidden `yardstick` command, see
    /// `yardstick.rs`) on the same database and exchange, with the same batch size and poll
    /// interval as `s`; it stops on SIGTERM as the relay does.
    pub fn start_yardstick(
        &self,
        name: &str,
        db_url: &str,
        exchange: &str,
        s: &RelaySettings,
    ) -> Result<RelayProcess> {
        let me = std::env::current_exe().context("where is this binary")?;
        let args = crate::yardstick::YardstickArgs::command_line(
            db_url,
            &self.amqp_url,
            exchange,
            s.batch_size,
            &s.poll_interval,
        );
        spawn(Command::new(me), &args, &self.log_file(name)?)
    }

    fn log_file(&self, name: &str) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.log_dir)?;
        Ok(self.log_dir.join(format!("{name}.log")))
    }
}

/// Starts `cmd` with `args`, its stderr to `log`.
fn spawn(mut cmd: Command, args: &[String], log: &Path) -> Result<RelayProcess> {
    let file = std::fs::File::create(log)
        .with_context(|| format!("create relay log {}", log.display()))?;
    // The relay's own environment variables would override nothing (flags win), but
    // a stray RUST_LOG=debug from the caller would slow it down: use its default.
    cmd.args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file);
    let child = cmd
        .spawn()
        .with_context(|| format!("start {:?}", cmd.get_program()))?;
    Ok(RelayProcess {
        pid: child.id(),
        child,
        log: log.to_owned(),
        stopped: false,
    })
}

impl RelayProcess {
    /// Fails (with the end of its log) if the relay has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            self.stopped = true;
            bail!(
                "the relay exited early ({status}); its log {} ends with:\n{}",
                self.log.display(),
                log_tail(&self.log)
            );
        }
        Ok(())
    }

    pub fn usage(&self) -> Usage {
        Usage {
            cpu_s: procfs::proc_stat(self.pid).map_or(0.0, |s| s.cpu),
            peak_rss_kib: procfs::vm_hwm_kib(self.pid).unwrap_or(0),
            rss_kib: procfs::vm_rss_kib(self.pid).unwrap_or(0),
        }
    }

    /// SIGTERM, then waits for a clean exit (SIGKILL after 60 s). Returns the usage read
    /// just before the signal (a reaped process has no /proc entry).
    pub fn stop(mut self) -> Result<Usage> {
        let usage = self.usage();
        signal(self.pid, "TERM");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.stopped = true;
                if !status.success() {
                    bail!(
                        "the relay exited with {status} after SIGTERM; log {}:\n{}",
                        self.log.display(),
                        log_tail(&self.log)
                    );
                }
                return Ok(usage);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                self.stopped = true;
                bail!("the relay did not stop within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        // A measurement that failed half-way must not leave a relay publishing behind it.
        if !self.stopped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends `sig` (a name such as TERM or INT) to `pid` with kill(1): no libc binding needed.
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status();
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// A profiler command (such as `perf record -a -g -o FILE`) run around one drain, ended
/// with SIGINT so it writes its data.
pub struct Profiler {
    child: Child,
}

impl Profiler {
    pub fn start(command: &str) -> Result<Profiler> {
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("start the profiler: {command}"))?;
        Ok(Profiler { child })
    }

    pub fn stop(mut self) {
        signal(self.child.id(), "INT");
        let _ = self.child.wait();
    }
}
