//! Private RabbitMQ nodes on this machine, started by `deploy/cluster/rabbitmq-cluster.sh`
//! with node names, ports and a data directory of their own: a three-node cluster for the
//! cluster test, or one node the soak restarts at will. The machine's own broker (5672) is
//! shared with every other test run and is never touched.
//!
//! Dropping [`RabbitNodes`] stops the nodes and deletes their data, also when a test
//! panics (the drop is synchronous for that reason).

use std::path::PathBuf;
use std::time::Duration;

/// One to three private RabbitMQ nodes, clustered when more than one.
pub struct RabbitNodes {
    script: PathBuf,
    env: Vec<(String, String)>,
    ports: Vec<u16>,
    names: Vec<String>,
}

/// `n` free TCP ports on 127.0.0.1, distinct (bound together, released before use).
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound").port())
        .collect()
}

impl RabbitNodes {
    /// Starts `count` nodes named `<prefix>-a`, `<prefix>-b`, ... with their data under
    /// `dir`, each with `plugins` enabled, and clusters them. Returns once every node
    /// accepts connections.
    pub async fn start(
        prefix: &str,
        count: usize,
        dir: &std::path::Path,
        plugins: &[&str],
    ) -> Result<RabbitNodes, String> {
        assert!((1..=3).contains(&count), "one to three nodes");
        let ports = free_ports(2 * count);
        let names: Vec<String> = ["a", "b", "c"][..count]
            .iter()
            .map(|n| format!("{prefix}-{n}"))
            .collect();
        let join = |p: &[u16]| {
            p.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let env = vec![
            ("CLUSTER_DIR".to_owned(), dir.display().to_string()),
            ("CLUSTER_NODES".to_owned(), names.join(" ")),
            ("CLUSTER_PORTS".to_owned(), join(&ports[..count])),
            ("CLUSTER_DIST_PORTS".to_owned(), join(&ports[count..])),
            ("CLUSTER_PLUGINS".to_owned(), plugins.join(" ")),
        ];
        // Built before the start, so a start that fails half-way is stopped by the drop.
        let nodes = RabbitNodes {
            script: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/cluster/rabbitmq-cluster.sh"),
            env,
            ports: ports[..count].to_vec(),
            names,
        };
        nodes.run(&["start"]).await?;
        Ok(nodes)
    }

    /// Runs the script with `args`; its stdout, or its stderr as the error.
    pub async fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::time::timeout(
            Duration::from_secs(300),
            tokio::process::Command::new("bash")
                .arg(&self.script)
                .args(args)
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .kill_on_drop(true)
                .output(),
        )
        .await
        .map_err(|_| format!("rabbitmq-cluster.sh {args:?} took over 300 s"))?
        .map_err(|e| format!("bash: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "rabbitmq-cluster.sh {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The AMQP URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.ports[i])
    }

    /// The full node name of node `i` (for `rabbitmqctl -n`).
    pub fn node(&self, i: usize) -> String {
        format!("{}@localhost", self.names[i])
    }

    /// The index of a node given by its full name.
    pub fn index(&self, node: &str) -> Option<usize> {
        self.names
            .iter()
            .position(|n| node.starts_with(&format!("{n}@")))
    }

    /// Stops node `i`; returns once its OS process is gone.
    pub async fn stop_node(&self, i: usize) -> Result<(), String> {
        self.run(&["stop-node", &self.node(i)]).await.map(drop)
    }

    /// Starts node `i` again; returns once it accepts connections.
    pub async fn start_node(&self, i: usize) -> Result<(), String> {
        self.run(&["start-node", &self.node(i)]).await.map(drop)
    }
}

impl Drop for RabbitNodes {
    fn drop(&mut self) {
        // Synchronous: this runs on panics too, possibly outside the runtime.
        let _ = std::process::Command::new("bash")
            .arg(&self.script)
            .args(["stop", "--purge"])
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .status();
    }
}
