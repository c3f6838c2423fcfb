//! A private Postgres server on this machine: `initdb` into a directory of its own, `pg_ctl`
//! on a free port, stopped and started again at will (the soak restarts it under load), and
//! stopped with its data deleted when dropped. The machine's own server (5432) is shared
//! with every other test run and is never touched.
//!
//! The binaries come from `PG_BIN` or the newest `/usr/lib/postgresql/*/bin`. Postgres
//! refuses to run as root, so as root every command runs as the `postgres` OS user
//! (`runuser`), which then owns the directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::rabbitmq::free_ports;

/// How a restart stops the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `pg_ctl stop -m fast`: sessions are terminated, a checkpoint is written.
    Fast,
    /// `pg_ctl stop -m immediate`: the server quits at once, as in a crash; the next start
    /// recovers from the WAL.
    Immediate,
}

pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

fn bin_dir() -> Result<PathBuf, String> {
    if let Ok(b) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(b));
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("/usr/lib/postgresql: {e}; install Postgres or set PG_BIN"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, b)| b)
        .ok_or_else(|| "no /usr/lib/postgresql/*/bin/initdb: install Postgres or set PG_BIN".into())
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

impl PrivatePostgres {
    /// Creates a cluster in `dir` (which must not hold one) and starts it on a free port;
    /// returns once it accepts connections. User `postgres`, trust on 127.0.0.1 only.
    pub async fn start(dir: &Path) -> Result<PrivatePostgres, String> {
        let pg = PrivatePostgres {
            bin: bin_dir()?,
            dir: dir.to_owned(),
            port: free_ports(1)[0],
            as_postgres: running_as_root(),
        };
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if pg.as_postgres {
            pg.command(
                "chown",
                &["-R", "postgres", &dir.display().to_string()],
                false,
            )
            .await?;
        }
        let data = pg.data().display().to_string();
        pg.tool(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )
        .await?;
        let conf = format!(
            "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nmax_connections = 200\n",
            pg.port,
            dir.display()
        );
        let conf_path = pg.data().join("postgresql.auto.conf");
        let mut text = std::fs::read_to_string(&conf_path).unwrap_or_default();
        text.push_str(&conf);
        std::fs::write(&conf_path, text).map_err(|e| format!("{}: {e}", conf_path.display()))?;
        pg.start_again().await?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A superuser URL (database `postgres`).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server; returns once it is down.
    pub async fn stop(&self, how: Stop) -> Result<(), String> {
        let mode = match how {
            Stop::Fast => "fast",
            Stop::Immediate => "immediate",
        };
        let data = self.data().display().to_string();
        self.tool(
            "pg_ctl",
            &["-D", &data, "-m", mode, "-w", "-t", "60", "stop"],
        )
        .await
    }

    /// Starts the (stopped) server; returns once it accepts connections.
    pub async fn start_again(&self) -> Result<(), String> {
        let data = self.data().display().to_string();
        let log = self.dir.join("postgres.log").display().to_string();
        self.tool(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-w", "-t", "120", "start"],
        )
        .await
    }

    async fn tool(&self, name: &str, args: &[&str]) -> Result<(), String> {
        let program = self.bin.join(name).display().to_string();
        self.command(&program, args, self.as_postgres).await
    }

    async fn command(&self, program: &str, args: &[&str], as_postgres: bool) -> Result<(), String> {
        let mut cmd = if as_postgres {
            let mut c = tokio::process::Command::new("runuser");
            c.args(["-u", "postgres", "--", program]);
            c
        } else {
            tokio::process::Command::new(program)
        };
        let out = tokio::time::timeout(
            Duration::from_secs(180),
            cmd.args(args).current_dir("/").kill_on_drop(true).output(),
        )
        .await
        .map_err(|_| format!("{program} {args:?} took over 180 s"))?
        .map_err(|e| format!("{program}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{program} {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Synchronous: this runs on panics too, possibly outside the runtime.
        let pg_ctl = self.bin.join("pg_ctl").display().to_string();
        let data = self.data().display().to_string();
        let args = ["-D", &data, "-m", "immediate", "-w", "stop"];
        let _ = if self.as_postgres {
            std::process::Command::new("runuser")
                .args(["-u", "postgres", "--", &pg_ctl])
                .args(args)
                .current_dir("/")
                .output()
        } else {
            std::process::Command::new(&pg_ctl)
                .args(args)
                .current_dir("/")
                .output()
        };
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
