//! The processes the soak runs (relays and consumers), one slot each, and the outside
//! tools it uses on them: signals, `rabbitmqctl close_connection`, `pg_terminate_backend`.
//!
//! A slot keeps its proxies and its arguments across restarts; each start is a new
//! incarnation with a new pid. Children run under `setpriv --pdeathsig KILL` when it is
//! there, so a soak that is itself killed does not leave relays running behind it.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::Mutex;

pub struct Slot {
    pub name: String,
    program: PathBuf,
    /// The arguments of incarnation `n`.
    args: Box<dyn Fn(u32) -> Vec<String> + Send + Sync>,
    env: Vec<(String, String)>,
    log: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    child: Option<Child>,
    pid: Option<u32>,
    incarnation: u32,
    /// Set while a fault holds the process down or stopped: exits are expected then.
    faulted: bool,
    /// Exits nobody asked for (crashes), with their status.
    unexpected_exits: Vec<String>,
}

fn setpriv() -> Option<&'static str> {
    ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

impl Slot {
    pub fn new(
        name: &str,
        program: PathBuf,
        args: impl Fn(u32) -> Vec<String> + Send + Sync + 'static,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Slot {
        Slot {
            name: name.to_owned(),
            program,
            args: Box::new(args),
            env,
            log,
            state: Mutex::new(State::default()),
        }
    }

    /// Starts the next incarnation; returns its pid.
    pub async fn start(&self) -> anyhow::Result<u32> {
        let mut st = self.state.lock().await;
        st.incarnation += 1;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let args = (self.args)(st.incarnation);
        let mut cmd = match setpriv() {
            Some(sp) => {
                let mut c = Command::new(sp);
                c.args(["--pdeathsig", "KILL", "--"]).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        cmd.args(&args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true);
        let child = cmd.spawn()?;
        let pid = child.id().unwrap_or_default();
        st.child = Some(child);
        st.pid = Some(pid);
        st.faulted = false;
        Ok(pid)
    }

    pub async fn pid(&self) -> Option<u32> {
        self.state.lock().await.pid
    }

    pub async fn incarnation(&self) -> u32 {
        self.state.lock().await.incarnation
    }

    /// Marks the process as held by a fault (its exit is expected) or released.
    pub async fn set_faulted(&self, faulted: bool) {
        self.state.lock().await.faulted = faulted;
    }

    pub async fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let pid = self
            .pid()
            .await
            .ok_or_else(|| anyhow::anyhow!("{} is not running", self.name))?;
        let status = Command::new("kill")
            .args([format!("-{sig}"), pid.to_string()])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "kill -{sig} {pid} failed");
        Ok(())
    }

    /// Waits for the process to exit; returns its exit code (None: killed by a signal).
    pub async fn wait_exit(&self, limit: Duration) -> anyhow::Result<Option<i32>> {
        let mut st = self.state.lock().await;
        let Some(child) = st.child.as_mut() else {
            return Ok(None);
        };
        let status = tokio::time::timeout(limit, child.wait())
            .await
            .map_err(|_| anyhow::anyhow!("{} did not exit within {limit:?}", self.name))??;
        st.child = None;
        st.pid = None;
        Ok(status.code())
    }

    /// Kills the process if it runs (the end of a run, or cleanup after a failure).
    pub async fn kill(&self) {
        let mut st = self.state.lock().await;
        if let Some(mut child) = st.child.take() {
            let _ = child.kill().await;
        }
        st.pid = None;
    }

    /// Checks for an exit nobody asked for; restarts the process and records it.
    pub async fn check_alive(&self) -> anyhow::Result<()> {
        let exited = {
            let mut st = self.state.lock().await;
            if st.faulted {
                return Ok(());
            }
            match st.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => {
                    let what = format!("{} exited by itself: {status}", self.name);
                    st.unexpected_exits.push(what.clone());
                    st.child = None;
                    st.pid = None;
                    Some(what)
                }
                _ => None,
            }
        };
        if let Some(what) = exited {
            eprintln!(
                "soak: {what}; starting it again (see {})",
                self.log.display()
            );
            self.start().await?;
        }
        Ok(())
    }

    pub async fn unexpected_exits(&self) -> Vec<String> {
        self.state.lock().await.unexpected_exits.clone()
    }
}

/// Runs `rabbitmqctl` with `args` (node `node` when given); returns stdout.
pub async fn rabbitmqctl(node: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("rabbitmqctl");
    if let Some(n) = node {
        cmd.args(["-n", n]);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.args(args).output())
        .await
        .map_err(|_| anyhow::anyhow!("rabbitmqctl {args:?} took over 60 s"))??;
    anyhow::ensure!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Closes, from the broker's side (`node`, else the machine's), every connection whose
/// client properties contain `needle` (a connection name); returns how many.
pub async fn close_connections(node: Option<&str>, needle: &str) -> anyhow::Result<usize> {
    let listing = rabbitmqctl(
        node,
        &[
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ],
    )
    .await?;
    let mut closed = 0;
    for line in listing.lines().filter(|l| l.contains(needle)) {
        let pid = line.split_whitespace().next().unwrap_or_default();
        // The connection may have gone meanwhile: that is not a failure of the fault.
        if rabbitmqctl(node, &["close_connection", pid, "closed by outbox-soak"])
            .await
            .is_ok()
        {
            closed += 1;
        }
    }
    Ok(closed)
}

/// Waits until `check` returns true, polling every `every`; false after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, every: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}
