//! An ordered consumer group with no Rust member: `outbox-relay group-router` (the binary)
//! routes, and two members written in Python on the SQL functions
//! (examples/python/outbox_group_member.py) apply the events. One member is killed with
//! SIGKILL mid-stream, a third joins while events flow (partitions handed over with
//! deliveries in hand), and the router is replaced with SIGTERM while the intake has a
//! backlog; every event is still applied exactly once, in seq order per key.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_kit::amqp::AmqpTarget;

use outbox_kit::consumer::runner::{ConsumerConfig, Ordered};
use outbox_relay::relay::RelayConfig;
use tokio::process::Command;
use tokio_postgres::Client;

use crate::deploy::{assert_args_parse, known_env, strings, yaml_docs};
use crate::http_api::free_port;
use crate::support::kit::{DeadLetters, RawEvent, RawPublisher, delete_group_topology};
use crate::support::process::{RelayProcess, binary, run_to_end};
use crate::support::{InProcessRelay, TestDb, amqp_url, unique, wait_for, wait_for_explained};

const PARTITIONS: u16 = 4;
const KEYS: usize = 12;

fn need_python() {
    if std::process::Command::new("python3")
        .args(["-c", "import psycopg, pika"])
        .status()
        .map_or(true, |s| !s.success())
    {
        panic!(
            "python3 with psycopg and pika is needed: scripts/services.sh ensure_test_tools installs them"
        );
    }
}

/// Starts `program args`, its stdout and stderr appended to a log file under target/.
fn spawn_logged(name: &str, program: &str, args: &[String]) -> RelayProcess {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("relay-logs");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).unwrap();
    let child = Command::new(program)
        .args(args)
        .env("RUST_LOG", "info,lapin=error")
        .env("PYTHONUNBUFFERED", "1")
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    RelayProcess { child, log }
}

fn member_script() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/python/outbox_group_member.py")
        .display()
        .to_string()
}

/// The router's `/metrics`, or None while it does not answer.
async fn metrics(port: u16) -> Option<String> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let r = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .ok()?;
    r.text().await.ok()
}

/// The value of a metric without labels in an OpenMetrics text.
fn metric(text: &str, name: &str) -> Option<i64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// What the members applied, in the order they committed: (event_id, key, seq).
async fn applied(client: &Client) -> Option<Vec<(uuid::Uuid, String, i64)>> {
    let rows = client
        .query(
            "SELECT event_id, aggregate_id, seq FROM example_applied ORDER BY n",
            &[],
        )
        .await
        .ok()?;
    Some(
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_members_apply_every_event_once_in_order_through_the_group_router() {
    need_python();
    let db = TestDb::new().await;
    let client = db.client().await;
    let exchange = unique("it_pyx");
    let queue = unique("it_pyq");
    let mut port = free_port();
    // The group's names, as the router derives them.
    let mut group = ConsumerConfig::new(&queue, &exchange, &["#"]);
    group.ordered = Some(Ordered {
        partitions: std::num::NonZeroU16::new(PARTITIONS).unwrap(),
        ..Ordered::default()
    });
    let partitions = PARTITIONS.to_string();
    let router_args = |port: u16| -> Vec<String> {
        vec![
            "group-router".into(),
            "--database-url".into(),
            db.url(),
            "--amqp-url".into(),
            amqp_url(),
            "--exchange".into(),
            exchange.clone(),
            "--queue".into(),
            queue.clone(),
            "--partitions".into(),
            partitions.clone(),
            "--http-listen".into(),
            format!("127.0.0.1:{port}"),
        ]
    };
    let mut router = spawn_logged(&format!("{queue}-router"), binary(), &router_args(port));
    let member_args = |name: &str| -> Vec<String> {
        vec![
            member_script(),
            "--database-url".into(),
            db.url(),
            "--amqp-url".into(),
            amqp_url(),
            "--queue".into(),
            queue.clone(),
            "--partitions".into(),
            partitions.clone(),
            "--member-lease".into(),
            "2".into(),
            "--name".into(),
            name.into(),
        ]
    };
    // Members start once the router declared the partition queues (ready), and each
    // then owns some: no partition queue is left without a consumer.
    wait_for_explained(
        "the group router ready",
        Duration::from_secs(30),
        || async {
            let r = reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
                .await
                .ok()?;
            (r.status() == 200).then_some(())
        },
        || async { format!("; router log:\n{}", router.log_tail(20)) },
    )
    .await;
    let first = spawn_logged(&format!("{queue}-m1"), "python3", &member_args("m1"));
    let mut second = spawn_logged(&format!("{queue}-m2"), "python3", &member_args("m2"));
    wait_for_explained(
        "two live members consuming every partition",
        Duration::from_secs(30),
        || async {
            let m = metrics(port).await?;
            (metric(&m, "outbox_group_members") == Some(2)
                && metric(&m, "outbox_group_partitions_unconsumed") == Some(0)
                && metric(&m, "outbox_group_intake_consumers") == Some(1))
            .then_some(())
        },
        || async {
            format!(
                "; metrics:\n{}\nm1:\n{}\nm2:\n{}",
                metrics(port).await.unwrap_or_default(),
                first.log_tail(10),
                second.log_tail(10)
            )
        },
    )
    .await;
    // The assignment settled: every partition queue has one consumer (a handover shows two,
    // the old owner's and the waiting new one's), for three heartbeats in a row. Events
    // inserted before that would all go to whichever member held the partitions first.
    let probe = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-probe")
        .await
        .unwrap();
    let settled_since = std::cell::Cell::new(None::<Instant>);
    wait_for(
        "one consumer on every partition queue",
        Duration::from_secs(30),
        || async {
            let ch = probe.create_channel().await.ok()?;
            let mut single = true;
            for p in 0..PARTITIONS {
                let q = ch
                    .queue_declare(
                        group.partition_queue(p).as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .ok()?;
                single &= q.consumer_count() == 1;
            }
            let _ = ch.close(200, "probed".into()).await;
            if !single {
                settled_since.set(None);
                return None;
            }
            let since = settled_since.get().unwrap_or_else(Instant::now);
            settled_since.set(Some(since));
            (since.elapsed() >= Duration::from_secs(2)).then_some(())
        },
    )
    .await;
    let _ = probe.close(200, "probed".into()).await;

    let mut relay_config = RelayConfig::new(&exchange);
    relay_config.poll_interval = Duration::from_millis(200);
    relay_config.lease = Duration::from_secs(3);
    let relay = InProcessRelay::start(&db, relay_config);
    let mut ids = db.insert_in(&client, 200, KEYS, "k").await;

    // Mid-stream: both members applying; then the first dies at once, and the second batch
    // comes after.
    wait_for(
        "both members applying events",
        Duration::from_secs(30),
        || async {
            let row = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE member LIKE 'm1#%'),
                        count(*) FILTER (WHERE member LIKE 'm2#%')
                   FROM example_applied",
                    &[],
                )
                .await
                .ok()?;
            let (m1, m2): (i64, i64) = (row.get(0), row.get(1));
            (m1 > 0 && m2 > 0 && m1 + m2 >= 40).then_some(())
        },
    )
    .await;
    first.signal("KILL");
    // A third member joins while events flow: the second gives partitions up with
    // deliveries in hand (closing their channels), the third takes them. Events keep coming
    // until the third has applied some.
    let mut third = spawn_logged(&format!("{queue}-m3"), "python3", &member_args("m3"));
    let joined = Instant::now();
    loop {
        ids.extend(db.insert_in(&client, 20, KEYS, "k").await);
        let by_third: i64 = client
            .query_one(
                "SELECT count(*) FROM example_applied WHERE member LIKE 'm3#%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if by_third > 0 {
            break;
        }
        assert!(
            joined.elapsed() < Duration::from_secs(30),
            "the third member applied nothing within 30 s:\n{}",
            third.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    ids.extend(db.insert_in(&client, 200, KEYS, "k").await);

    // The router is replaced while the intake has a backlog: SIGTERM finishes the copies in
    // flight and exits 0; what it had not acked is routed by the next one, in order.
    router.signal("TERM");
    assert_eq!(
        router.wait(Duration::from_secs(30)).await,
        Some(0),
        "router log:\n{}",
        router.log_tail(20)
    );
    port = free_port();
    router = spawn_logged(&format!("{queue}-router2"), binary(), &router_args(port));

    let done = wait_for_explained(
        "every event applied",
        Duration::from_secs(45),
        || async {
            let a = applied(&client).await?;
            let seen: HashSet<uuid::Uuid> = a.iter().map(|(id, _, _)| *id).collect();
            ids.iter().all(|id| seen.contains(id)).then_some(a)
        },
        || async {
            format!(
                "; applied {:?} of {}; metrics:\n{}\nrouter:\n{}\nm2:\n{}\nm3:\n{}",
                applied(&client).await.map(|a| a.len()),
                ids.len(),
                metrics(port).await.unwrap_or_default(),
                router.log_tail(10),
                second.log_tail(20),
                third.log_tail(20)
            )
        },
    )
    .await;

    // Once each, and per key in seq order: 1, 2, 3, ... with nothing skipped.
    assert_eq!(done.len(), ids.len(), "an event was applied more than once");
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (_, key, seq) in &done {
        per_key.entry(key.clone()).or_default().push(*seq);
    }
    assert_eq!(per_key.len(), KEYS);
    for (key, seqs) in &per_key {
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, &expected, "key {key} applied out of seq order");
    }
    let m = metrics(port).await.expect("router metrics");
    assert_eq!(metric(&m, "outbox_group_router_running"), Some(1), "{m}");

    // SIGTERM: the router and the surviving members stop cleanly.
    router.signal("TERM");
    second.signal("TERM");
    third.signal("TERM");
    assert_eq!(
        router.wait(Duration::from_secs(30)).await,
        Some(0),
        "router log:\n{}",
        router.log_tail(20)
    );
    assert_eq!(
        second.wait(Duration::from_secs(30)).await,
        Some(0),
        "member log:\n{}",
        second.log_tail(20)
    );
    assert_eq!(
        third.wait(Duration::from_secs(30)).await,
        Some(0),
        "member log:\n{}",
        third.log_tail(20)
    );
    relay.stop().await;

    // The group keeps its partition count: a router asking for another one exits 1 saying so.
    let other = [
        "group-router",
        "--database-url",
        &db.url(),
        "--amqp-url",
        &amqp_url(),
        "--exchange",
        &exchange,
        "--queue",
        &queue,
        "--partitions",
        "5",
        "--http-listen",
        "off",
    ];
    let (code, _, err) = tokio::time::timeout(Duration::from_secs(30), run_to_end(&other, &[]))
        .await
        .expect("group-router exits within 30 s");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("has 4 partitions, not 5"), "{err}");

    delete_group_topology(&group).await;
}

/// deploy/kubernetes/group-router.yaml: the router's command line and variables are the
/// binary's, its probes and metrics port are the ones it serves, its grace period outlasts
/// a confirm; the members' variables are ones the Python member reads.
#[tokio::test]
async fn group_router_deploy_example_is_consistent() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/group-router.yaml");
    let docs = yaml_docs(&path);
    let deployments: Vec<&serde_json::Value> =
        docs.iter().filter(|d| d["kind"] == "Deployment").collect();
    let pod_of = |container: &str| {
        deployments
            .iter()
            .map(|d| &d["spec"]["template"]["spec"])
            .find(|p| p["containers"][0]["name"] == container)
            .unwrap_or_else(|| panic!("no Deployment with container {container}"))
    };
    let env_names = |c: &serde_json::Value| -> Vec<String> {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_owned())
            .collect()
    };

    let pod = pod_of("group-router");
    let router = &pod["containers"][0];
    let args = strings(&router["args"]);
    assert_eq!(args, ["group-router"]);
    let known = known_env("group-router").await;
    for name in env_names(router) {
        assert!(known.contains(&name), "{name} is not read by group-router");
    }
    assert_args_parse("group-router Deployment", &args).await;
    let listen = router["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "OUTBOX_GROUP_ROUTER_HTTP_LISTEN")
        .expect("the endpoint listens beyond loopback")["value"]
        .clone();
    let port = router["ports"][0]["containerPort"].as_u64().unwrap();
    assert_eq!(listen, format!("0.0.0.0:{port}"));
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        assert_eq!(router[probe]["httpGet"]["path"], path);
        assert_eq!(router[probe]["httpGet"]["port"], router["ports"][0]["name"]);
    }
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace > 15, "the grace period must outlast a confirm (15 s)");

    let member = &pod_of("billing")["containers"][0];
    let script = std::fs::read_to_string(member_script()).unwrap();
    for name in env_names(member) {
        assert!(
            script.contains(&format!("\"{name}\"")),
            "{name} is not read by the Python member"
        );
    }
    let command = strings(&member["command"]);
    assert!(command.last().unwrap().ends_with("outbox_group_member.py"));
}

/// A Python member killed by its event (the example handler's `--exit-on-type`, as out of
/// memory would) does not kill every next owner: the redelivered event's attempts are
/// counted in Postgres (`outbox_inbox_attempt`), and after max-attempts runs the next member
/// dead-letters it without running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_python_member_killed_by_its_event_dead_letters_it_after_max_attempts() {
    need_python();
    let db = TestDb::new().await;
    let client = db.client().await;
    let exchange = unique("it_pyx");
    let queue = unique("it_pyq");
    let port = free_port();
    let mut group = ConsumerConfig::new(&queue, &exchange, &["#"]);
    group.ordered = Some(Ordered {
        partitions: std::num::NonZeroU16::new(1).unwrap(),
        ..Ordered::default()
    });
    let router_args: Vec<String> = vec![
        "group-router".into(),
        "--database-url".into(),
        db.url(),
        "--amqp-url".into(),
        amqp_url(),
        "--exchange".into(),
        exchange.clone(),
        "--queue".into(),
        queue.clone(),
        "--partitions".into(),
        "1".into(),
        "--http-listen".into(),
        format!("127.0.0.1:{port}"),
    ];
    let router = spawn_logged(&format!("{queue}-router"), binary(), &router_args);
    wait_for_explained(
        "the group router ready",
        Duration::from_secs(30),
        || async {
            let r = reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
                .await
                .ok()?;
            (r.status() == 200).then_some(())
        },
        || async { format!("; router log:\n{}", router.log_tail(20)) },
    )
    .await;
    let dead = DeadLetters::watch(&group.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&exchange).await;
    let event = RawEvent::new("k", 1, serde_json::json!({}));
    publisher.publish(&event).await;
    let id = event.event_id.to_string();
    let mut exits = 0;
    loop {
        assert!(
            exits < 6,
            "the event killed {exits} members and was never dead-lettered"
        );
        let m = std::sync::Mutex::new(spawn_logged(
            &format!("{queue}-life{exits}"),
            "python3",
            &[
                member_script(),
                "--database-url".into(),
                db.url(),
                "--amqp-url".into(),
                amqp_url(),
                "--queue".into(),
                queue.clone(),
                "--partitions".into(),
                "1".into(),
                "--member-lease".into(),
                "2".into(),
                "--max-attempts".into(),
                "3".into(),
                "--exit-on-type".into(),
                "created".into(),
                "--name".into(),
                format!("life{exits}"),
            ],
        ));
        // The member dies of the event, or dead-letters it.
        let exited = wait_for_explained(
            "the member exits at the event, or dead-letters it",
            Duration::from_secs(60),
            || async {
                if dead.all().iter().any(|d| d.event_id == id) {
                    return Some(false);
                }
                let exit = m.lock().unwrap().child.try_wait();
                exit.ok().flatten().map(|_| true)
            },
            || async { format!("; member log:\n{}", m.lock().unwrap().log_tail(20)) },
        )
        .await;
        let mut m = m.into_inner().unwrap();
        if !exited {
            m.signal("TERM");
            let _ = m.wait(Duration::from_secs(30)).await;
            break;
        }
        exits += 1;
    }
    let d = dead
        .all()
        .into_iter()
        .find(|d| d.event_id == id)
        .expect("dead-lettered");
    assert_eq!(exits, 3, "three runs, then dead: {}", d.reason);
    assert!(d.reason.contains("3 attempts"), "{}", d.reason);
    let outcome: String = tokio::time::timeout(
        Duration::from_secs(10),
        client.query_one(
            "SELECT outcome FROM outbox_inbox WHERE event_id = $1",
            &[&event.event_id],
        ),
    )
    .await
    .expect("the inbox answers within 10 s")
    .unwrap()
    .get(0);
    assert_eq!(outcome, "dead");
    router.signal("TERM");
    delete_group_topology(&group).await;
}
