//! Which `outbox-relay` binary a tool (the bench, the soak) runs as a child process.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `explicit` when given. Otherwise the `outbox-relay` next to this program, built first
/// when the program runs under `cargo run` (Cargo sets CARGO and CARGO_MANIFEST_DIR):
/// `cargo run --bin outbox-bench` builds only the bench, and a run must never use a
/// missing or stale relay. The build uses the profile this program was built with.
/// `tool` prefixes the progress line on stderr. Errors are one line for the user.
pub fn relay_binary(explicit: Option<&Path>, tool: &str) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return Ok(p.to_owned());
    }
    let me = std::env::current_exe().map_err(|e| format!("where is this binary: {e}"))?;
    let bin = me.with_file_name("outbox-relay");
    if let (Ok(cargo), Ok(dir)) = (std::env::var("CARGO"), std::env::var("CARGO_MANIFEST_DIR")) {
        let profile = me
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("debug");
        let mut cmd = Command::new(cargo);
        cmd.current_dir(dir)
            .args(["build", "-p", "outbox-relay", "--bin", "outbox-relay"]);
        match profile {
            "debug" => {}
            "release" => {
                cmd.arg("--release");
            }
            other => {
                cmd.args(["--profile", other]);
            }
        }
        // Cargo gives the programs it runs their package's own variables. Build scripts
        // (ring's) watch some of them with rerun-if-env-changed, so passing them on would
        // rebuild dependencies here and again at the next plain `cargo build`.
        for (name, _) in std::env::vars_os() {
            let Some(name) = name.to_str() else { continue };
            if name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_MANIFEST_")
                || [
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                ]
                .contains(&name)
            {
                cmd.env_remove(name);
            }
        }
        eprintln!("{tool}: building outbox-relay ({profile})");
        let status = cmd.status().map_err(|e| format!("run cargo build: {e}"))?;
        if !status.success() {
            return Err("cargo build --bin outbox-relay failed".into());
        }
    }
    if !bin.exists() {
        return Err(format!(
            "{} not found: build it (cargo build --release --bins) or pass --relay-bin",
            bin.display()
        ));
    }
    Ok(bin)
}
