//! `deploy/`: what can be checked without a container engine or a cluster.
//!
//! - Every YAML file parses (python3 with PyYAML turns it into JSON; no Rust YAML crate:
//!   the maintained ones are young or archived, and PyYAML is on this machine kind and CI).
//! - Every command line a deploy file gives the binary parses (`<args> --help` exits 0) and
//!   every variable it sets is one the binary reads.
//! - The Dockerfile builds with the command CI's build is checked against, from the locked
//!   dependencies, and its runtime stage runs as a non-root user.
//! - The container probe script answers for a real relay.
//! - The Kubernetes Job migrates, then applies sql/roles.sql from the image: its psql
//!   command runs as written against a test database.
//! - The systemd unit passes `systemd-analyze verify` without a single warning.
//! - The RabbitMQ definitions import into a throw-away vhost of the running broker
//!   (`rabbitmqctl import_definitions`, no management plugin needed), the relay publishes
//!   into that topology as the compose stack's broker user, and dead-lettering works:
//!   a rejected message and one past the policy's delivery limit reach the dead-letter queue;
//!   the compose stack's consumer user may declare what the consumer kit declares.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicNackOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use outbox_kit::amqp::AmqpTarget;
use serde_json::{Value, json};

use crate::support::process::{RelayProcess, binary, run_to_end};
use crate::support::{InProcessRelay, TestDb, amqp_url, rabbitmqctl, unique, wait_for};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn read(rel: &str) -> String {
    let path = deploy_dir().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The documents of a YAML file, as JSON.
pub(crate) fn yaml_docs(path: &Path) -> Vec<Value> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml\njson.dump(list(yaml.safe_load_all(open(sys.argv[1]))), sys.stdout)",
        ])
        .arg(path)
        .output()
        .expect("python3 runs (these checks need python3 with PyYAML: pip install pyyaml)");
    assert!(
        out.status.success(),
        "{} does not parse as YAML: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn yaml(rel: &str) -> Value {
    let mut docs = yaml_docs(&deploy_dir().join(rel));
    assert_eq!(docs.len(), 1, "{rel}: one document expected");
    docs.remove(0)
}

/// Every environment variable `outbox-relay <command>` reads, from its --help.
pub(crate) async fn known_env(command: &str) -> BTreeSet<String> {
    let (code, help, _) = run_to_end(&[command, "--help"], &[]).await;
    assert_eq!(code, 0);
    let mut names: BTreeSet<String> = BTreeSet::new();
    for word in help.split(|c: char| !(c.is_ascii_uppercase() || c == '_')) {
        let is_env = word.len() > 3 && word.contains('_') && !word.starts_with('_');
        if is_env && (help.contains(&format!("[env: {word}")) || word.ends_with("_FILE")) {
            names.insert(word.to_owned());
        }
    }
    names.insert("RUST_LOG".into());
    assert!(names.contains("DATABASE_URL") && names.contains("DATABASE_URL_FILE"));
    names
}

/// A command line from a deploy file is one the binary accepts.
pub(crate) async fn assert_args_parse(what: &str, args: &[String]) {
    let mut with_help: Vec<&str> = args.iter().map(String::as_str).collect();
    with_help.push("--help");
    let (code, out, err) = run_to_end(&with_help, &[]).await;
    assert_eq!(
        code,
        0,
        "{what}: `outbox-relay {}`: {out}{err}",
        args.join(" ")
    );
}

pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list expected: {v}"))
        .iter()
        .map(|s| s.as_str().expect("strings").to_owned())
        .collect()
}

fn duration(s: &str) -> Duration {
    humantime::parse_duration(s).unwrap_or_else(|e| panic!("'{s}' is not a duration: {e}"))
}

/// The relay refuses a shutdown timeout that does not outlast the confirm timeout (its
/// default unless `confirm` is set): a deployment's settings must pass.
fn assert_drain_outlasts_confirms(file: &str, drain: Duration, confirm: Option<Duration>) {
    let confirm =
        confirm.unwrap_or_else(|| outbox_relay::relay::RelayConfig::new("x").confirm_timeout);
    assert!(
        drain > confirm,
        "{file}: OUTBOX_SHUTDOWN_TIMEOUT {drain:?} must exceed the confirm timeout {confirm:?}"
    );
}

#[test]
fn every_yaml_file_parses() {
    let mut found = 0;
    let mut stack = vec![deploy_dir()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let docs = yaml_docs(&path);
                assert!(
                    docs.iter().all(|d| d.is_object()),
                    "{}: every document is a mapping",
                    path.display()
                );
                found += 1;
            }
        }
    }
    assert!(
        found >= 2,
        "compose.yaml and the Kubernetes example at least"
    );
}

/// The compose stack: healthchecks, the start-up order (migrate as owner → roles.sql →
/// relay under its role), credentials that match across services, files that exist.
#[tokio::test]
async fn compose_stack_is_consistent() {
    let compose = yaml("compose.yaml");
    let services = &compose["services"];
    let health = |name: &str| strings(&services[name]["healthcheck"]["test"]).join(" ");
    assert!(health("postgres").contains("pg_isready"));
    assert!(
        health("rabbitmq").contains("rabbitmq-diagnostics") && health("rabbitmq").contains("ping")
    );
    assert_eq!(health("relay"), "CMD outbox-relay-probe /readyz");
    assert!(
        services["rabbitmq"]["image"]
            .as_str()
            .unwrap()
            .contains("management"),
        "RabbitMQ with the management plugin"
    );

    let relay = &services["relay"];
    assert_eq!(relay["build"]["context"], "..");
    let dockerfile = relay["build"]["dockerfile"].as_str().unwrap();
    assert!(
        deploy_dir().join("..").join(dockerfile).is_file(),
        "{dockerfile}"
    );
    let command = strings(&relay["command"]);
    assert!(command.contains(&"--no-migrate".to_owned()), "{command:?}");
    assert_args_parse("compose relay", &command).await;
    assert_args_parse("compose migrate", &strings(&services["migrate"]["command"])).await;

    let env = relay["environment"].as_object().unwrap();
    let known = known_env("run").await;
    for name in env.keys() {
        assert!(
            known.contains(name),
            "compose relay sets {name}, which the relay does not read"
        );
    }
    assert_eq!(env["OUTBOX_HTTP_LISTEN"], "0.0.0.0:9464");
    assert!(
        strings(&relay["ports"])
            .iter()
            .any(|p| p.ends_with(":9464")),
        "the endpoint is published"
    );
    let grace = duration(relay["stop_grace_period"].as_str().unwrap());
    let drain = duration(env["OUTBOX_SHUTDOWN_TIMEOUT"].as_str().unwrap());
    let confirm = env
        .get("OUTBOX_CONFIRM_TIMEOUT")
        .map(|v| duration(v.as_str().unwrap()));
    assert_drain_outlasts_confirms("compose.yaml", drain, confirm);
    assert!(
        grace > drain,
        "stop_grace_period {grace:?} must exceed the drain {drain:?}"
    );

    // Start-up order.
    let after = |svc: &str, dep: &str| services[svc]["depends_on"][dep]["condition"].clone();
    assert_eq!(after("relay", "roles"), "service_completed_successfully");
    assert_eq!(after("relay", "rabbitmq"), "service_healthy");
    assert_eq!(after("roles", "migrate"), "service_completed_successfully");
    assert_eq!(after("migrate", "postgres"), "service_healthy");

    // The relay connects as the role roles.sql creates, with the password it was given.
    let roles_cmd = strings(&services["roles"]["command"]);
    assert!(roles_cmd.contains(&"/sql/roles.sql".to_owned()));
    let var = |name: &str| {
        roles_cmd
            .iter()
            .find_map(|a| a.strip_prefix(&format!("{name}=")))
            .map(str::to_owned)
    };
    let relay_password = var("relay_password").expect("roles gets relay_password");
    let db_url = env["DATABASE_URL"].as_str().unwrap();
    let default_role = "outbox_relay"; // roles.sql's default relay_role
    assert!(var("relay_role").is_none());
    assert!(
        db_url.starts_with(&format!(
            "postgres://{default_role}:{relay_password}@postgres:5432/"
        )),
        "{db_url}"
    );
    assert!(
        read("../sql/roles.sql").contains(&format!("\\set relay_role {default_role}")),
        "roles.sql's default relay role"
    );
    // The migration runs as the owner of the same database.
    let owner_url = services["migrate"]["environment"]["DATABASE_URL"]
        .as_str()
        .unwrap();
    assert_eq!(
        owner_url.rsplit('/').next(),
        db_url.rsplit('/').next(),
        "same database"
    );
    assert!(roles_cmd.iter().any(|a| a.as_str() == owner_url));

    // Mounted files exist.
    for svc in ["rabbitmq", "roles"] {
        for volume in strings(&services[svc]["volumes"]) {
            let host = volume.split(':').next().unwrap();
            if host.starts_with('.') {
                assert!(deploy_dir().join(host).exists(), "{svc} mounts {host}");
            }
        }
    }
}

/// The Dockerfile builds the binary with the command CI's build uses, from Cargo.lock, on a
/// toolchain at least the crate's rust-version, and runs it as a non-root user.
#[tokio::test]
async fn dockerfile_builds_what_ci_builds_and_runs_as_non_root() {
    let text = read("Dockerfile");
    // Instructions, continuation lines joined, comments dropped.
    let mut instructions: Vec<String> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        let (body, continued) = match trimmed.strip_suffix('\\') {
            Some(b) => (b.trim(), true),
            None => (trimmed, false),
        };
        current.push_str(body);
        current.push(' ');
        if !continued {
            instructions.push(current.trim().to_owned());
            current.clear();
        }
    }
    let stages: Vec<usize> = instructions
        .iter()
        .enumerate()
        .filter(|(_, i)| i.starts_with("FROM "))
        .map(|(n, _)| n)
        .collect();
    assert!(stages.len() >= 2, "a multi-stage build");
    let build_stage = &instructions[stages[0]..stages[1]];
    let runtime = &instructions[*stages.last().unwrap()..];

    // Builder: pinned Rust, at least Cargo.toml's rust-version.
    let rust_version = instructions
        .iter()
        .find_map(|i| i.strip_prefix("ARG RUST_VERSION="))
        .expect("ARG RUST_VERSION=x.y.z");
    assert!(
        build_stage[0].starts_with("FROM rust:${RUST_VERSION}-slim-bookworm"),
        "{}",
        build_stage[0]
    );
    let parse = |v: &str| -> Vec<u32> { v.split('.').map(|p| p.parse().unwrap()).collect() };
    assert_eq!(parse(rust_version).len(), 3, "pinned to a patch release");
    let manifest =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let msrv = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"');
    assert!(
        parse(rust_version) >= parse(msrv),
        "Dockerfile's Rust {rust_version} is older than rust-version {msrv}"
    );
    let rustc = std::process::Command::new("rustc")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    if !rustc.contains(rust_version) {
        println!("note: the Dockerfile pins Rust {rust_version}; this machine builds with {rustc}");
    }

    // The build command, exactly.
    let run = build_stage
        .iter()
        .find(|i| i.starts_with("RUN ") && i.contains("cargo "))
        .expect("a RUN with cargo");
    let cargo = run[run.find("cargo ").unwrap()..]
        .split("&&")
        .next()
        .unwrap()
        .trim();
    assert_eq!(cargo, "cargo build --release --locked --bin outbox-relay");
    assert!(
        run.contains("target/release/outbox-relay /out/outbox-relay"),
        "the binary leaves the cache mount: {run}"
    );
    // `--locked` fails when Cargo.lock is not current; the binary target exists.
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--locked",
            "--format-version",
            "1",
            "--manifest-path",
        ])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata --locked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let has_bin = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] == "outbox-relay")
        .flat_map(|p| p["targets"].as_array().unwrap())
        .any(|t| t["name"] == "outbox-relay" && t["kind"] == json!(["bin"]));
    assert!(has_bin);

    // Runtime: small base, the binary and the probe, a non-root numeric user.
    assert!(
        runtime[0].starts_with("FROM debian:bookworm-slim")
            || runtime[0].starts_with("FROM gcr.io/distroless/cc"),
        "{}",
        runtime[0]
    );
    assert!(
        runtime.contains(
            &"COPY --from=build /out/outbox-relay /usr/local/bin/outbox-relay".to_owned()
        )
    );
    assert!(runtime.iter().any(|i| i.starts_with("COPY")
        && i.contains("deploy/probe.sh /usr/local/bin/outbox-relay-probe")));
    let user = runtime
        .iter()
        .find_map(|i| i.strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "USER must be a numeric non-root uid, not {user}"
    );
    assert!(runtime.iter().any(|i| i == "EXPOSE 9464"));
    assert!(
        runtime
            .iter()
            .any(|i| i.starts_with("ENV ") && i.contains("OUTBOX_HTTP_LISTEN=0.0.0.0:9464"))
    );
    assert!(
        runtime
            .iter()
            .any(|i| i.starts_with("HEALTHCHECK ") && i.contains("outbox-relay-probe"))
    );
    assert!(runtime.contains(&r#"ENTRYPOINT ["outbox-relay"]"#.to_owned()));
    let known = known_env("run").await;
    for i in runtime.iter().filter(|i| i.starts_with("ENV ")) {
        for pair in i["ENV ".len()..].split_whitespace() {
            let name = pair.split('=').next().unwrap();
            assert!(
                known.contains(name),
                "the image sets {name}, which the relay does not read"
            );
        }
    }

    // The build context keeps what the build needs.
    let ignore = read("Dockerfile.dockerignore");
    let ignored: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(
        ignored.contains(&"target"),
        "target/ stays out of the context"
    );
    for needed in [
        "src",
        "sql",
        "Cargo.toml",
        "Cargo.lock",
        "deploy",
        "tests",
        "examples",
    ] {
        assert!(
            !ignored.iter().any(|i| i.trim_end_matches('/') == needed),
            "{needed} is needed"
        );
    }
}

/// The probe the image and compose use, against a real relay: 0 while it answers 200,
/// 1 for another status and when nothing listens.
#[tokio::test]
async fn probe_script_answers_for_a_real_relay() {
    let db = TestDb::new().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exchange = unique("it.probe").replace('_', ".");
    let mut relay = RelayProcess::start(
        &unique("probe"),
        &[
            "--database-url".into(),
            db.url(),
            "--amqp-url".into(),
            amqp_url(),
            "--exchange".into(),
            exchange,
            "--http-listen".into(),
            format!("127.0.0.1:{port}"),
        ],
    );
    let probe = |path: &'static str| {
        let listen = format!("0.0.0.0:{port}"); // as the image sets it
        async move {
            let out = tokio::process::Command::new(deploy_dir().join("probe.sh"))
                .arg(path)
                .env("OUTBOX_HTTP_LISTEN", listen)
                .output()
                .await
                .expect("run deploy/probe.sh");
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    wait_for("/readyz answers 200", Duration::from_secs(30), || async {
        (probe("/readyz").await.0 == Some(0)).then_some(())
    })
    .await;
    assert_eq!(probe("/livez").await.0, Some(0));
    let (code, err) = probe("/no-such-page").await;
    assert_eq!(code, Some(1));
    assert!(err.contains("404"), "{err}");

    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
    let (code, err) = probe("/livez").await;
    assert_eq!(code, Some(1));
    assert!(err.contains("nothing listens"), "{err}");
}

/// The systemd unit: `systemd-analyze verify` without a warning, and the settings the relay
/// depends on.
#[tokio::test]
async fn systemd_unit_verifies_and_outlasts_the_drain() {
    let unit = read("systemd/outbox-relay.service");
    let mut settings: HashMap<String, Vec<String>> = HashMap::new();
    for line in unit.lines().map(str::trim) {
        if let Some((k, v)) = line.split_once('=')
            && !line.starts_with('#')
        {
            settings.entry(k.to_owned()).or_default().push(v.to_owned());
        }
    }
    let one = |k: &str| -> &str {
        settings
            .get(k)
            .and_then(|v| v.first())
            .unwrap_or_else(|| panic!("{k}= missing"))
    };
    assert_eq!(one("Type"), "simple");
    assert_eq!(one("Restart"), "on-failure");
    assert_eq!(one("KillSignal"), "SIGTERM");
    assert_eq!(one("RestartPreventExitStatus"), "2");
    assert_eq!(one("DynamicUser"), "yes");
    assert_eq!(one("NoNewPrivileges"), "yes");
    assert_eq!(one("ProtectSystem"), "strict");
    assert!(one("EnvironmentFile").starts_with("/etc/outbox-relay/"));
    let env: HashMap<&str, &str> = settings["Environment"]
        .iter()
        .filter_map(|e| e.split_once('='))
        .collect();
    let drain = duration(env["OUTBOX_SHUTDOWN_TIMEOUT"]);
    let confirm = env.get("OUTBOX_CONFIRM_TIMEOUT").map(|v| duration(v));
    assert_drain_outlasts_confirms("outbox-relay.service", drain, confirm);
    let stop = duration(one("TimeoutStopSec"));
    assert!(
        stop > drain,
        "TimeoutStopSec {stop:?} must exceed the drain {drain:?}"
    );

    let exec = one("ExecStart");
    let mut words = exec.split_whitespace();
    let program = words.next().unwrap();
    assert_eq!(program, "/usr/local/bin/outbox-relay");
    let args: Vec<String> = words.map(str::to_owned).collect();
    assert!(args.contains(&"--no-migrate".to_owned()));
    assert_args_parse("systemd ExecStart", &args).await;

    let known = known_env("run").await;
    let example = read("systemd/outbox-relay.env.example");
    let mut named = env.keys().map(|k| k.to_string()).collect::<Vec<_>>();
    for line in example.lines() {
        let line = line.trim_start_matches('#');
        if let Some((k, _)) = line.split_once('=')
            && k.chars().all(|c| c.is_ascii_uppercase() || c == '_')
        {
            named.push(k.to_owned());
        }
    }
    assert!(named.len() > 5);
    for name in named {
        assert!(
            known.contains(&name),
            "the unit or its env file sets {name}, which the relay does not read"
        );
    }

    // verify checks that ExecStart's program exists: point it at the binary under test.
    let Ok(version) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        println!("skipped: systemd-analyze verify (systemd-analyze is not installed here)");
        return;
    };
    assert!(version.status.success());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("systemd"));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("outbox-relay.service");
    std::fs::write(&copy, unit.replace(program, binary())).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {stderr}"
    );
}

/// The Kubernetes example: probes, secrets that resolve, limits, non-root, a grace period
/// longer than the drain, and command lines and variables the binary knows.
#[tokio::test]
async fn kubernetes_sidecar_example_is_consistent() {
    let docs = yaml_docs(&deploy_dir().join("kubernetes/relay-sidecar.yaml"));
    let by_kind = |kind: &str| -> &Value {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let secret = by_kind("Secret");
    let secret_name = secret["metadata"]["name"].as_str().unwrap();
    let secret_keys: BTreeSet<&str> = secret["stringData"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let known_run = known_env("run").await;
    let known_migrate = known_env("migrate").await;

    let check_env = |container: &Value, known: &BTreeSet<String>| -> HashMap<String, Value> {
        let mut env = HashMap::new();
        for e in container["env"].as_array().unwrap() {
            let name = e["name"].as_str().unwrap().to_owned();
            assert!(known.contains(&name), "{name} is not read by the relay");
            if let Some(r) = e["valueFrom"].get("secretKeyRef") {
                assert_eq!(r["name"], secret_name);
                let key = r["key"].as_str().unwrap();
                assert!(secret_keys.contains(key), "secret key {key} missing");
            }
            env.insert(name, e.clone());
        }
        for name in env.keys() {
            if let Some(base) = name.strip_suffix("_FILE") {
                assert!(!env.contains_key(base), "{base} and {name} both set");
            }
        }
        env
    };

    let job = by_kind("Job");
    let migrate = &job["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(strings(&migrate["args"]), ["migrate"]);
    assert_args_parse("kubernetes Job", &strings(&migrate["args"])).await;
    check_env(migrate, &known_migrate);

    let pod = &by_kind("Deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let relay = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "outbox-relay")
        .expect("the outbox-relay container");
    assert!(
        pod["containers"].as_array().unwrap().len() >= 2,
        "a sidecar next to the app"
    );
    let args = strings(&relay["args"]);
    assert!(args.contains(&"--no-migrate".to_owned()));
    assert_args_parse("kubernetes sidecar", &args).await;
    let env = check_env(relay, &known_run);
    assert_eq!(env["OUTBOX_HTTP_LISTEN"]["value"], "0.0.0.0:9464");

    // Files named by *_FILE come from a mounted secret volume that holds them.
    let volumes = pod["volumes"].as_array().unwrap();
    for (name, e) in &env {
        if !name.ends_with("_FILE") {
            continue;
        }
        let path = Path::new(e["value"].as_str().unwrap());
        let mount = relay["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| path.starts_with(m["mountPath"].as_str().unwrap()))
            .unwrap_or_else(|| panic!("{name}: {} is not under a volume mount", path.display()));
        let volume = volumes.iter().find(|v| v["name"] == mount["name"]).unwrap();
        assert_eq!(volume["secret"]["secretName"], secret_name);
        let file = path.file_name().unwrap().to_str().unwrap();
        let item = volume["secret"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["path"] == file)
            .unwrap_or_else(|| panic!("{file} is not in the volume"));
        assert!(secret_keys.contains(item["key"].as_str().unwrap()));
    }

    let port = relay["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["containerPort"] == 9464)
        .expect("containerPort 9464");
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        assert_eq!(relay[probe]["httpGet"]["path"], path);
        assert_eq!(relay[probe]["httpGet"]["port"], port["name"]);
    }
    assert!(relay["resources"]["limits"]["memory"].is_string());
    assert!(relay["resources"]["requests"]["cpu"].is_string());
    assert_eq!(relay["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(relay["securityContext"]["readOnlyRootFilesystem"], true);
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
    let drain = duration(env["OUTBOX_SHUTDOWN_TIMEOUT"]["value"].as_str().unwrap());
    let confirm = env
        .get("OUTBOX_CONFIRM_TIMEOUT")
        .map(|v| duration(v["value"].as_str().unwrap()));
    assert_drain_outlasts_confirms("relay-sidecar.yaml", drain, confirm);
    assert!(
        grace > drain,
        "terminationGracePeriodSeconds {grace:?} must exceed {drain:?}"
    );
}

/// The Kubernetes example's Job migrates, then applies sql/roles.sql from the same
/// release's image: the image carries the file (the Dockerfile copies it), an init
/// container copies it to a volume the psql container reads, and that container's command,
/// run here as written against a test database, grants the three roles.
#[tokio::test]
async fn kubernetes_job_migrates_then_applies_roles_sql() {
    let docs = yaml_docs(&deploy_dir().join("kubernetes/relay-sidecar.yaml"));
    let job = docs.iter().find(|d| d["kind"] == "Job").expect("the Job");
    let pod = &job["spec"]["template"]["spec"];
    let init = pod["initContainers"].as_array().expect("init containers");
    assert_eq!(strings(&init[0]["args"]), ["migrate"], "migrations first");
    let copy = strings(&init[1]["command"]);
    assert_eq!(
        copy[0], "cp",
        "then roles.sql copied out of the image: {copy:?}"
    );
    let (image_path, shared_path) = (&copy[1], &copy[2]);
    assert_eq!(init[1]["image"], init[0]["image"], "from the same image");

    // The image has the file where the Job looks for it.
    let dockerfile = read("Dockerfile");
    assert!(
        dockerfile
            .lines()
            .any(|l| l.trim() == format!("COPY sql/roles.sql {image_path}")),
        "the Dockerfile copies sql/roles.sql to {image_path}"
    );
    // The copy lands on a volume the psql container mounts at the same place.
    let mount_of = |c: &Value| -> (String, String) {
        let m = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| Path::new(shared_path).starts_with(m["mountPath"].as_str().unwrap()))
            .unwrap_or_else(|| panic!("{shared_path} is not on a volume of {}", c["name"]));
        (
            m["name"].as_str().unwrap().to_owned(),
            m["mountPath"].as_str().unwrap().to_owned(),
        )
    };
    let roles = &pod["containers"][0];
    assert_eq!(mount_of(&init[1]), mount_of(roles));
    let volume = mount_of(roles).0;
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == volume.as_str() && v.get("emptyDir").is_some()),
        "{volume} is an emptyDir of the Job's pod"
    );

    // Run the psql container's command as written: the secret's values are the test's, the
    // file is the repository's, and the role names are the test's own (through PSQLRC,
    // which psql reads before the script: the manifest leaves them at their defaults).
    let command = strings(&roles["command"]);
    assert_eq!(&command[..2], ["sh", "-c"]);
    let script = command[2].replace(
        shared_path.as_str(),
        concat!(env!("CARGO_MANIFEST_DIR"), "/sql/roles.sql"),
    );
    assert!(
        script.contains("roles.sql") && script.contains("psql "),
        "{script}"
    );
    let db = TestDb::new().await;
    let names = ["relay", "producer", "consumer"].map(|r| format!("outbox_it_k8s_{r}"));
    let rc = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}.psqlrc", db.name));
    std::fs::write(
        &rc,
        format!(
            "\\set relay_role {}\n\\set producer_role {}\n\\set consumer_role {}\n",
            names[0], names[1], names[2]
        ),
    )
    .unwrap();
    let mut env: Vec<(String, String)> = vec![("PSQLRC".into(), rc.display().to_string())];
    for e in roles["env"].as_array().unwrap() {
        let key = e["valueFrom"]["secretKeyRef"]["key"].as_str().unwrap();
        let value = match key {
            "owner-database-url" => db.url(),
            k if k.ends_with("-password") => "outbox-it-role".to_owned(),
            k => panic!("the psql container reads secret key {k}, which this test does not know"),
        };
        env.push((e["name"].as_str().unwrap().to_owned(), value));
    }
    let run = || async {
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new("sh")
                .args(["-c", &script])
                .envs(env.iter().cloned())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("psql within 60 s")
        .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (mut code, mut stderr) = run().await;
    if code != Some(0) && stderr.contains("already exists") {
        // Another test run created the same role between roles.sql's check and its CREATE.
        (code, stderr) = run().await;
    }
    assert_eq!(code, Some(0), "the Job's psql command failed: {stderr}");
    let client = db.client().await;
    for (role, privilege, table) in [
        (&names[0], "UPDATE", "outbox_key_seq"),
        (&names[1], "INSERT", "outbox_events"),
        (&names[2], "SELECT", "outbox_inbox"),
    ] {
        let granted: bool = tokio::time::timeout(
            Duration::from_secs(30),
            client.query_one(
                "SELECT has_any_column_privilege($1, $2, $3)",
                &[role, &table, &privilege],
            ),
        )
        .await
        .unwrap()
        .unwrap()
        .get(0);
        assert!(granted, "{role} may not {privilege} {table}");
    }
}

fn definitions() -> Value {
    serde_json::from_str(&read("rabbitmq/definitions.json")).expect("definitions.json parses")
}

/// The definitions name only things that exist: every dead-letter exchange of a queue
/// argument, every binding's source and destination; quorum queues; no alternate exchange on
/// the relay's exchange (the relay relies on mandatory returns to notice unroutable events).
#[test]
fn rabbitmq_definitions_are_consistent() {
    let d = definitions();
    let exchanges: HashMap<&str, &Value> = d["exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect();
    let queues: HashMap<&str, &Value> = d["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["name"].as_str().unwrap(), q))
        .collect();
    let relay_exchange = exchanges["outbox.events"];
    assert_eq!(relay_exchange["type"], "topic");
    assert_eq!(relay_exchange["durable"], true);
    assert!(
        relay_exchange["arguments"]
            .get("alternate-exchange")
            .is_none()
    );
    let mut dead_lettered = 0;
    for (name, q) in &queues {
        assert_eq!(q["durable"], true, "{name}");
        assert_eq!(q["arguments"]["x-queue-type"], "quorum", "{name}");
        if let Some(dlx) = q["arguments"].get("x-dead-letter-exchange") {
            let dlx = dlx.as_str().unwrap();
            assert!(
                exchanges.contains_key(dlx),
                "{name}: dead-letter exchange {dlx} is not defined"
            );
            // Its dead-letter routing key reaches a queue.
            let key = q["arguments"]["x-dead-letter-routing-key"]
                .as_str()
                .unwrap_or("");
            assert!(
                d["bindings"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|b| b["source"] == dlx
                        && (b["routing_key"] == key || exchanges[dlx]["type"] == "fanout")
                        && queues.contains_key(b["destination"].as_str().unwrap())),
                "{name}: nothing bound to {dlx} takes routing key {key:?}"
            );
            dead_lettered += 1;
        }
    }
    assert!(dead_lettered >= 1);
    for b in d["bindings"].as_array().unwrap() {
        assert!(exchanges.contains_key(b["source"].as_str().unwrap()), "{b}");
        assert_eq!(b["destination_type"], "queue");
        assert!(
            queues.contains_key(b["destination"].as_str().unwrap()),
            "{b}"
        );
    }
    let policy = &d["policies"][0];
    assert_eq!(policy["apply-to"], "queues");
    assert!(policy["definition"]["delivery-limit"].as_u64().unwrap() > 0);
    // At-least-once dead-lettering needs overflow reject-publish (else it falls back to at-most-once).
    assert_eq!(
        policy["definition"]["dead-letter-strategy"],
        "at-least-once"
    );
    assert_eq!(policy["definition"]["overflow"], "reject-publish");
    // rabbitmq.conf loads the directory compose mounts the files into.
    let conf = read("rabbitmq/rabbitmq.conf");
    assert!(conf.contains("load_definitions = /etc/rabbitmq/definitions.d"));
    let compose = read("compose.yaml");
    assert!(compose.contains("./rabbitmq/definitions.json:/etc/rabbitmq/definitions.d/"));
}

/// Moves a definitions document into `vhost` (and renames users with `suffix`).
fn into_vhost(doc: &Value, vhost: &str, suffix: &str) -> Value {
    let mut out = serde_json::Map::new();
    for (key, items) in doc.as_object().unwrap() {
        let moved: Vec<Value> = items
            .as_array()
            .unwrap()
            .iter()
            .map(|item| {
                let mut item = item.clone();
                let obj = item.as_object_mut().unwrap();
                if key == "vhosts" {
                    obj.insert("name".into(), json!(vhost));
                }
                if obj.contains_key("vhost") {
                    obj.insert("vhost".into(), json!(vhost));
                }
                if key == "users" || key == "permissions" {
                    let field = if key == "users" { "name" } else { "user" };
                    let name = obj[field].as_str().unwrap().to_owned();
                    obj.insert(field.into(), json!(format!("{name}{suffix}")));
                }
                item
            })
            .collect();
        out.insert(key.clone(), Value::Array(moved));
    }
    Value::Object(out)
}

/// Removes a throw-away vhost and user however the test ends (a vhost takes its queues and
/// permissions with it).
struct Cleanup(String, String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for args in [["delete_vhost", &self.0], ["delete_user", &self.1]] {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(args)
                .output();
        }
    }
}

/// Imports the definitions into `vhost` with the compose stack's broker `user` (its
/// password hash and permissions, renamed with `suffix`); guest may do anything there.
async fn import_with_compose_user(vhost: &str, suffix: &str, user: &str) -> Cleanup {
    let topology = into_vhost(&definitions(), vhost, suffix);
    let users: Value = serde_json::from_str(&read("rabbitmq/compose-users.json")).unwrap();
    let users = into_vhost(&users, vhost, suffix);
    let mut import = topology.as_object().unwrap().clone();
    let only = |key: &str, field: &str| -> Vec<Value> {
        users[key]
            .as_array()
            .unwrap()
            .iter()
            .filter(|u| u[field] == format!("{user}{suffix}"))
            .cloned()
            .collect()
    };
    let mut permissions = only("permissions", "user");
    assert_eq!(permissions.len(), 1, "compose-users.json defines {user}");
    // The test itself reads the queues as guest.
    permissions.push(
        json!({"user": "guest", "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}),
    );
    import.insert("users".into(), Value::Array(only("users", "name")));
    import.insert("permissions".into(), Value::Array(permissions));
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{vhost}.json"));
    std::fs::write(
        &file,
        serde_json::to_vec_pretty(&Value::Object(import)).unwrap(),
    )
    .unwrap();
    let cleanup = Cleanup(vhost.to_owned(), format!("{user}{suffix}"));
    rabbitmqctl(&["import_definitions", file.to_str().unwrap()]).await;
    cleanup
}

/// The broker's host and port as the tests reach it.
fn amqp_host() -> String {
    amqp_url()
        .strip_prefix("amqp://")
        .and_then(|r| r.split_once('@'))
        .map(|(_, h)| h.split('/').next().unwrap().to_owned())
        .unwrap()
}

/// The compose stack's consumer user (`app` / `app-dev`, docs/operating.md) may declare
/// what the consumer kit declares at start-up for its queue `app.billing`: the source
/// exchange `outbox.events` (topic, durable, as the definitions have it) and its
/// dead-letter exchange `app.billing.dlx`.
#[tokio::test]
async fn compose_app_user_declares_what_the_kit_declares() {
    let vhost = unique("it-app").replace('_', "-");
    let suffix = format!("-{vhost}");
    let _cleanup = import_with_compose_user(&vhost, &suffix, "app").await;
    let app = AmqpTarget::parse(&format!(
        "amqp://app{suffix}:app-dev@{}/{vhost}",
        amqp_host()
    ))
    .unwrap()
    .connect("outbox-it-app")
    .await
    .expect("connect as the compose stack's app user");
    for (exchange, kind) in [
        ("outbox.events", lapin::ExchangeKind::Topic),
        ("app.billing.dlx", lapin::ExchangeKind::Fanout),
    ] {
        // A refused declare closes its channel: one channel each.
        let ch = tokio::time::timeout(Duration::from_secs(15), app.create_channel())
            .await
            .unwrap()
            .unwrap();
        outbox_kit::amqp::declare_exchange(&ch, exchange, kind, false)
            .await
            .unwrap_or_else(|e| panic!("app may not declare {exchange}: {e}"));
    }
    let _ = tokio::time::timeout(Duration::from_secs(15), app.close(200, "done".into())).await;
}

/// The definitions (and the compose stack's relay user, its password hash and permissions)
/// imported into a throw-away vhost: the relay publishes into that topology as that user, the
/// policy applies, and dead-lettering reaches the dead-letter queue both on reject and past
/// the delivery limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_definitions_import_and_carry_events() {
    let vhost = unique("it-defs").replace('_', "-");
    let suffix = format!("-{vhost}");
    // The relay's broker user and password, as the compose stack has them.
    let compose = yaml("compose.yaml");
    let amqp = compose["services"]["relay"]["environment"]["AMQP_URL"]
        .as_str()
        .unwrap()
        .to_owned();
    let creds = amqp
        .strip_prefix("amqp://")
        .and_then(|r| r.split_once('@'))
        .map(|(c, _)| c.to_owned())
        .unwrap();
    let (user, password) = creds.split_once(':').unwrap();

    let _cleanup = import_with_compose_user(&vhost, &suffix, user).await;

    {
        let host = amqp_host();
        let relay_amqp =
            AmqpTarget::parse(&format!("amqp://{user}{suffix}:{password}@{host}/{vhost}")).unwrap();
        let guest = AmqpTarget::parse(&format!("amqp://guest:guest@{host}/{vhost}"))
            .unwrap()
            .connect("outbox-it-defs")
            .await
            .unwrap();
        let ch = guest.create_channel().await.unwrap();
        let count = |queue: &'static str| {
            let ch = ch.clone();
            async move {
                ch.queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap()
                .message_count()
            }
        };

        // The relay, as the compose stack's broker user (it declares outbox.events, which
        // the definitions made already, with the same arguments).
        let db = TestDb::new().await;
        let config = test_config_for("outbox.events");
        let deps = outbox_relay::relay::Deps {
            pool: db.pool(),
            db: db.target.clone(),
            schema: db.schema.clone(),
            amqp: relay_amqp,
            telemetry: Default::default(),
        };
        let relay = InProcessRelay::start_with(deps, config, &unique("defs"));
        let client = db.client().await;
        client
            .batch_execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', 'o' || g, 'created', jsonb_build_object('n', g)
                   FROM generate_series(1, 3) AS g",
            )
            .await
            .unwrap();
        wait_for(
            "3 events in app.billing",
            Duration::from_secs(30),
            || async { (count("app.billing").await == 3).then_some(()) },
        )
        .await;
        wait_for("3 rows dispatched", Duration::from_secs(30), || async {
            (db.count(&client, "dispatched_at IS NULL").await == 0).then_some(())
        })
        .await;
        relay.stop().await;

        let listing = rabbitmqctl(&[
            "list_queues",
            "-p",
            &vhost,
            "-q",
            "--no-table-headers",
            "name",
            "type",
            "policy",
        ])
        .await;
        let billing = listing
            .lines()
            .find(|l| l.starts_with("app.billing"))
            .unwrap_or_else(|| panic!("{listing}"));
        assert!(
            billing.contains("quorum") && billing.contains("app-queues"),
            "{billing}"
        );

        // A consumer rejects one event: dead-lettered at once.
        let msg = ch
            .basic_get("app.billing".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("a message");
        msg.reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
        wait_for(
            "the rejected event in the DLQ",
            Duration::from_secs(10),
            || async { (count("dlq.app.billing").await == 1).then_some(()) },
        )
        .await;
        // The others come back again and again: past the delivery limit they are
        // dead-lettered too.
        for _ in 0..200 {
            if count("dlq.app.billing").await == 3 {
                break;
            }
            if let Some(m) = ch
                .basic_get("app.billing".into(), BasicGetOptions::default())
                .await
                .unwrap()
            {
                m.nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await
                .unwrap();
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert_eq!(count("dlq.app.billing").await, 3, "past the delivery limit");
        assert_eq!(count("app.billing").await, 0);
        let _ = guest.close(200, "done".into()).await;
    }
}

/// A relay config for a fixed exchange (the definitions' own).
fn test_config_for(exchange: &str) -> outbox_relay::relay::RelayConfig {
    let mut c = outbox_relay::relay::RelayConfig::new(exchange);
    c.poll_interval = Duration::from_millis(200);
    c.retry_min = Duration::from_millis(50);
    c.retry_max = Duration::from_millis(500);
    c.lease = Duration::from_secs(3);
    c.confirm_timeout = Duration::from_secs(5);
    c
}
