//! Ordered consumer groups against the real Postgres and RabbitMQ: per-key order from the
//! partition queues (also across restarts of a RabbitMQ node of the test's own),
//! members sharing and taking over partitions, failures that hold their key only, blocked
//! keys with held events and their release, seq jumps, start-up refusals, the kit's
//! only-nacks rule, and the same rules driven from SQL alone.

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU16;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::runner::{ConsumerConfig, ConsumerDeps, ConsumerError, Context, OnDead};
use outbox_kit::consumer::{Handler, HandlerError, Message};
use outbox_testkit::rabbitmq::RabbitNodes;
use serde_json::json;
use tokio_postgres::Client;

use crate::support::kit::{
    self, DeadLetters, RawEvent, RawPublisher, Running, group_config, wait_group_ready,
};
use crate::support::process::run_to_end;
use crate::support::proxy::{Mode, TcpProxy};
use crate::support::{TestDb, amqp_url, rabbitmqctl, unique, wait_for, wait_for_explained};

const APPLIED: &str = "CREATE TABLE it_applied (
    n bigint GENERATED ALWAYS AS IDENTITY,
    event_id uuid NOT NULL,
    aggregate_id text NOT NULL,
    seq bigint,
    member text)";

/// Records every applied event; payload `{"poison": true}` fails for good, `{"stuck":
/// true}` fails transiently while `stuck` is set, `{"crash": true}` never returns.
#[derive(Default)]
struct Scripted {
    member: String,
    stuck: AtomicBool,
    stuck_attempts: AtomicUsize,
    /// `Message::attempt` when a stuck event was finally applied.
    applied_attempt: AtomicUsize,
    /// Runs of `{"crash": true}` events, which never return (as a handler that takes its
    /// process down never does).
    crash_runs: AtomicUsize,
}

impl Scripted {
    fn new(member: &str) -> Arc<Scripted> {
        Arc::new(Scripted {
            member: member.to_owned(),
            ..Scripted::default()
        })
    }
}

impl Handler for Scripted {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        let p = msg.payload()?;
        if p["poison"] == json!(true) {
            return Err(HandlerError::Terminal("poison".into()));
        }
        if p["panic"] == json!(true) {
            panic!("a bug in the handler");
        }
        if p["crash"] == json!(true) {
            self.crash_runs.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        if p["stuck"] == json!(true) && self.stuck.load(Ordering::SeqCst) {
            self.stuck_attempts.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::Transient("dependency down (503)".into()));
        }
        if p["stuck"] == json!(true) {
            self.applied_attempt
                .store(msg.attempt as usize, Ordering::SeqCst);
        }
        cx.tx()
            .execute(
                "INSERT INTO it_applied (event_id, aggregate_id, seq, member) VALUES ($1, $2, $3, $4)",
                &[&msg.event_id, &msg.aggregate_id, &msg.seq, &self.member],
            )
            .await?;
        Ok(())
    }
}

/// Applied seqs per key, in apply order.
async fn applied(client: &Client) -> BTreeMap<String, Vec<i64>> {
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in client
        .query("SELECT aggregate_id, seq FROM it_applied ORDER BY n", &[])
        .await
        .unwrap()
    {
        out.entry(r.get(0)).or_default().push(r.get(1));
    }
    out
}

async fn applied_count(client: &Client) -> usize {
    let n: i64 = client
        .query_one("SELECT count(*) FROM it_applied", &[])
        .await
        .unwrap()
        .get(0);
    n as usize
}

fn exchange() -> String {
    unique("it.ex").replace('_', ".")
}

fn member(cfg: &ConsumerConfig, name: &str) -> ConsumerConfig {
    let mut c = cfg.clone();
    c.connection_name = format!("{} {name}", cfg.connection_name);
    c
}

/// Starts one member to declare the group's topology, waits until it consumes, stops it.
async fn declare_group(db: &TestDb, cfg: &ConsumerConfig) {
    let r = Running::start(db, member(cfg, "declare"), Scripted::new("declare"));
    wait_group_ready(cfg).await;
    r.stop().await;
}

/// A backlog far longer than any kit timeout (handler_timeout 2 s, member lease 2 s) built
/// with no consumer running, then applied by two members: per key every seq once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_backlog_is_applied_in_seq_order_by_two_members() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 8);
    declare_group(&db, &cfg).await;
    let publisher = RawPublisher::new(&ex).await;
    let (keys, per_key) = (50, 40);
    for seq in 1..=per_key {
        for k in 0..keys {
            publisher
                .publish(&RawEvent::new(&format!("k{k}"), seq, json!({})))
                .await;
        }
    }
    let started = Instant::now();
    let a = Running::start(&db, member(&cfg, "a"), Scripted::new("a"));
    let b = Running::start(&db, member(&cfg, "b"), Scripted::new("b"));
    wait_for("2,000 events applied", Duration::from_secs(240), || async {
        (applied_count(&client).await >= 2000).then_some(())
    })
    .await;
    let took = started.elapsed();
    a.stop().await;
    b.stop().await;
    let rows = applied(&client).await;
    assert_eq!(rows.len(), keys);
    for (k, seqs) in &rows {
        assert_eq!(*seqs, (1..=per_key).collect::<Vec<_>>(), "key {k}");
    }
    let members: Vec<String> = client
        .query("SELECT DISTINCT member FROM it_applied ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(members, ["a", "b"], "both members applied events");
    let jumps: i64 = client
        .query_one("SELECT count(*) FROM outbox_inbox_gaps", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(jumps, 0);
    eprintln!("2,000 events applied in {took:?}");
    kit::delete_group_topology(&cfg).await;
}

/// Applies every event after 40 ms, so that a backlog stays in the partition queues.
struct Slow;

impl Handler for Slow {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        tokio::time::sleep(Duration::from_millis(40)).await;
        cx.tx()
            .execute(
                "INSERT INTO it_applied (event_id, aggregate_id, seq, member) VALUES ($1, $2, $3, 'slow')",
                &[&msg.event_id, &msg.aggregate_id, &msg.seq],
            )
            .await?;
        Ok(())
    }
}

/// A full restart of a RabbitMQ node rebuilds what the broker keeps in memory; a key's
/// partition must not change with it. The node (the test's own) is restarted twice while the
/// partition queues hold a backlog, and each time more of every key's events are published
/// after it: per key every seq is applied once, in order, and no jump is recorded. (The
/// consistent-hash exchange that earlier versions spread keys with came back with another
/// ring after 5 of 6 restarts of RabbitMQ 3.10.8, and moved keys.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_keep_their_partition_across_broker_restarts() {
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("outbox-it-restarts-{pid}"));
    let node = RabbitNodes::start(&format!("outbox-it-r{pid}"), 1, &dir, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = node.url(0);
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 8);
    cfg.prefetch = NonZeroU16::new(4).unwrap();
    let deps = ConsumerDeps {
        pool: db.target.pool(&db.schema, "outbox-it-restarts", 32),
        amqp: AmqpTarget::parse(&url).unwrap(),
    };
    let running = Running::start_with(deps, member(&cfg, "a"), Arc::new(Slow));
    let intake = cfg.intake_queue();
    let (keys, per_round, rounds) = (40, 10, 3);
    let mut backlogs = Vec::new();
    for round in 0..rounds {
        if round > 0 {
            let mut backlog = 0;
            for p in 0..8 {
                backlog += queue_depth_on(&url, &cfg.partition_queue(p)).await;
            }
            backlogs.push(backlog);
            node.stop_node(0).await.unwrap_or_else(|e| panic!("{e}"));
            node.start_node(0).await.unwrap_or_else(|e| panic!("{e}"));
        }
        wait_for(
            "the group's intake consumed",
            Duration::from_secs(120),
            || async {
                passive_on(&url, &intake)
                    .await
                    .filter(|(_, consumers)| *consumers > 0)
                    .map(drop)
            },
        )
        .await;
        let publisher = RawPublisher::on(&url, &ex).await;
        for i in 1..=per_round {
            let seq = round * per_round + i;
            for k in 0..keys {
                publisher
                    .publish(&RawEvent::new(&format!("k{k}"), seq, json!({})))
                    .await;
            }
        }
        let _ = publisher.conn.close(200, "round published".into()).await;
        wait_for("the intake routed", Duration::from_secs(120), || async {
            (passive_on(&url, &intake).await?.0 == 0).then_some(())
        })
        .await;
    }
    // Applied, or acked as late (older than its key's last applied seq, never seen before):
    // the latter is what a key moved to another partition leads to.
    let total = (keys * per_round * rounds) as usize;
    wait_for(
        "every event applied or late",
        Duration::from_secs(300),
        || async {
            let late: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_inbox_gaps WHERE action = 'late'",
                    &[],
                )
                .await
                .ok()?
                .get(0);
            (applied_count(&client).await + late as usize >= total).then_some(())
        },
    )
    .await;
    running.stop().await;
    let rows = applied(&client).await;
    assert_eq!(rows.len(), keys as usize);
    for (k, seqs) in &rows {
        assert_eq!(
            *seqs,
            (1..=per_round * rounds).collect::<Vec<_>>(),
            "key {k}"
        );
    }
    let gaps: i64 = client
        .query_one("SELECT count(*) FROM outbox_inbox_gaps", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(gaps, 0, "jumps or late events recorded");
    assert!(
        backlogs.iter().all(|b| *b > 0),
        "each restart must find a backlog in the partition queues: {backlogs:?}"
    );
    eprintln!("partition backlogs at the restarts: {backlogs:?}");
}

/// Which member (by connection name) is the active consumer of each partition queue, from
/// the broker's own listing.
async fn active_owners(cfg: &ConsumerConfig) -> HashMap<String, Vec<String>> {
    let conns = rabbitmqctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ])
    .await;
    let chans = rabbitmqctl(&[
        "list_channels",
        "-q",
        "--no-table-headers",
        "pid",
        "connection",
    ])
    .await;
    let consumers = rabbitmqctl(&[
        "list_consumers",
        "-q",
        "--no-table-headers",
        "queue_name",
        "channel_pid",
        "active",
    ])
    .await;
    let conn_of_chan: HashMap<&str, &str> = chans
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?, w.next()?))
        })
        .collect();
    let mut owners: HashMap<String, Vec<String>> = HashMap::new();
    for line in consumers.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() < 3 || w[2] != "true" || !w[0].starts_with(&format!("{}.p", cfg.queue)) {
            continue;
        }
        let Some(conn) = conn_of_chan.get(w[1]) else {
            continue;
        };
        let Some(props) = conns.lines().find(|l| l.starts_with(conn)) else {
            continue;
        };
        let name = ["m0", "m1", "m2"]
            .into_iter()
            .find(|m| props.contains(&format!("{} {m}", cfg.connection_name)))
            .unwrap_or("other");
        owners
            .entry(name.to_owned())
            .or_default()
            .push(w[0].to_owned());
    }
    owners
}

/// Three members share eight partitions (2 or 3 each, in the database and as the broker's
/// active consumers); one dies (its task aborted and its connection closed, as a crash
/// does) and the others take its partitions within the member lease plus a heartbeat;
/// every event is applied exactly once and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_members_share_partitions_and_take_over_a_dead_one() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 8);
    let mut members: Vec<Option<Running>> = (0..3)
        .map(|i| {
            let name = format!("m{i}");
            Some(Running::start(
                &db,
                member(&cfg, &name),
                Scripted::new(&name),
            ))
        })
        .collect();
    let shares = wait_for(
        "three members own 2-3 partitions each",
        Duration::from_secs(60),
        || async {
            let live: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_consumer_members WHERE consumer = $1",
                    &[&cfg.name],
                )
                .await
                .unwrap()
                .get(0);
            let owners = active_owners(&cfg).await;
            let mut counts: Vec<usize> = ["m0", "m1", "m2"]
                .iter()
                .map(|m| owners.get(*m).map_or(0, Vec::len))
                .collect();
            counts.sort_unstable();
            (live == 3 && counts == [2, 3, 3]).then_some(owners)
        },
    )
    .await;
    let publisher = RawPublisher::new(&ex).await;
    let keys = 24;
    for seq in 1..=5 {
        for k in 0..keys {
            publisher
                .publish(&RawEvent::new(&format!("k{k}"), seq, json!({})))
                .await;
        }
    }
    wait_for("120 events applied", Duration::from_secs(60), || async {
        (applied_count(&client).await >= 120).then_some(())
    })
    .await;

    // m0 dies: no graceful stop, its connection gone.
    let dead = members[0].take().unwrap();
    dead.handle.abort();
    let _ = dead.handle.await;
    crate::support::close_connections(&format!("{} m0", cfg.connection_name)).await;
    let died = Instant::now();
    for seq in 6..=10 {
        for k in 0..keys {
            publisher
                .publish(&RawEvent::new(&format!("k{k}"), seq, json!({})))
                .await;
        }
    }
    let owners = wait_for(
        "the survivors own all 8 partitions",
        Duration::from_secs(30),
        || async {
            let owners = active_owners(&cfg).await;
            let n: usize = ["m1", "m2"]
                .iter()
                .map(|m| owners.get(*m).map_or(0, Vec::len))
                .sum();
            (n == 8).then_some(owners)
        },
    )
    .await;
    let took_over = died.elapsed();
    wait_for("240 events applied", Duration::from_secs(60), || async {
        (applied_count(&client).await >= 240).then_some(())
    })
    .await;
    for m in members.into_iter().flatten() {
        m.stop().await;
    }
    // Bound: the dead member's lease (2 s) plus a heartbeat (2 s / 3), with room for this
    // busy machine.
    assert!(
        took_over < Duration::from_secs(15),
        "took over after {took_over:?}"
    );
    let rows = applied(&client).await;
    assert_eq!(rows.len(), keys);
    for (k, seqs) in &rows {
        assert_eq!(*seqs, (1..=10).collect::<Vec<_>>(), "key {k}");
    }
    eprintln!("before: {shares:?}; after: {owners:?}; taken over in {took_over:?}");
    kit::delete_group_topology(&cfg).await;
}

/// A member stalls (as under SIGSTOP: its Postgres and broker connections blackholed, so it
/// neither renews its lease nor answers AMQP heartbeats): its lease lapses, the other member
/// registers on its partitions and becomes their active consumer once the broker closed the
/// stalled connection, within `member_lease` + the broker's heartbeat timeout. When it comes
/// back it rejoins; every event is applied exactly once and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_member_loses_its_partitions_within_the_bound() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 4);
    let m0 = Running::start(&db, member(&cfg, "m0"), Scripted::new("m0"));
    let pg = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let mq = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let url = db.url().replace(":5432/", &format!(":{}/", pg.port()));
    let deps = ConsumerDeps {
        pool: outbox_kit::db::DbTarget::parse(&url).unwrap().pool(
            &db.schema,
            "outbox-it-stalled",
            32,
        ),
        amqp: AmqpTarget::parse(&amqp_url()).unwrap().with_port(mq.port()),
    };
    let m1 = Running::start_with(deps, member(&cfg, "m1"), Scripted::new("m1"));
    let owners = |want: &'static [(&'static str, usize)]| {
        let cfg = &cfg;
        move || async move {
            let owners = active_owners(cfg).await;
            want.iter()
                .all(|(m, n)| owners.get(*m).map_or(0, Vec::len) == *n)
                .then_some(())
        }
    };
    wait_for(
        "two members own 2 partitions each",
        Duration::from_secs(60),
        owners(&[("m0", 2), ("m1", 2)]),
    )
    .await;
    let publisher = RawPublisher::new(&ex).await;
    let keys = 16;
    for k in 0..keys {
        publisher
            .publish(&RawEvent::new(&format!("k{k}"), 1, json!({})))
            .await;
    }
    wait_for("16 events applied", Duration::from_secs(30), || async {
        (applied_count(&client).await >= 16).then_some(())
    })
    .await;

    pg.set(Mode::Blackhole);
    mq.set(Mode::Blackhole);
    let stalled = Instant::now();
    for k in 0..keys {
        publisher
            .publish(&RawEvent::new(&format!("k{k}"), 2, json!({})))
            .await;
    }
    wait_for(
        "m0 active on all 4 partitions",
        Duration::from_secs(90),
        owners(&[("m0", 4)]),
    )
    .await;
    let took_over = stalled.elapsed();
    wait_for("32 events applied", Duration::from_secs(30), || async {
        (applied_count(&client).await >= 32).then_some(())
    })
    .await;

    // Back from the stall: it reconnects and gets its share again.
    pg.set(Mode::Pass);
    mq.set(Mode::Pass);
    wait_for(
        "m1 back with 2 partitions",
        Duration::from_secs(90),
        owners(&[("m0", 2), ("m1", 2)]),
    )
    .await;
    for k in 0..keys {
        publisher
            .publish(&RawEvent::new(&format!("k{k}"), 3, json!({})))
            .await;
    }
    wait_for("48 events applied", Duration::from_secs(30), || async {
        (applied_count(&client).await >= 48).then_some(())
    })
    .await;
    m0.stop().await;
    m1.stop().await;
    // The stated bound: member_lease (2 s) + the broker's heartbeat timeout (about three
    // 10 s intervals; 29 s measured here), with room for this busy machine.
    assert!(
        took_over < Duration::from_secs(60),
        "took over after {took_over:?}"
    );
    let rows = applied(&client).await;
    assert_eq!(rows.len(), keys);
    for (k, seqs) in &rows {
        assert_eq!(*seqs, [1, 2, 3], "key {k}");
    }
    eprintln!("a stalled member's partitions moved after {took_over:?}");
    kit::delete_group_topology(&cfg).await;
}

/// One partition, one key failing transiently: the other keys' events are applied while it
/// retries in place, and its own later event waits behind it; once the dependency is back
/// both are applied in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transient_failure_holds_only_its_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 1);
    cfg.max_attempts = std::num::NonZeroU32::new(200);
    let handler = Scripted::new("m");
    handler.stuck.store(true, Ordering::SeqCst);
    let running = Running::start(&db, cfg.clone(), handler.clone());
    wait_group_ready(&cfg).await;
    let publisher = RawPublisher::new(&ex).await;
    publisher
        .publish(&RawEvent::new("stuck", 1, json!({"stuck": true})))
        .await;
    publisher
        .publish(&RawEvent::new("stuck", 2, json!({})))
        .await;
    for k in 0..20 {
        publisher
            .publish(&RawEvent::new(&format!("free{k}"), 1, json!({})))
            .await;
    }
    wait_for(
        "the other keys applied while stuck/1 retries",
        Duration::from_secs(30),
        || async { (applied_count(&client).await >= 20).then_some(()) },
    )
    .await;
    wait_for("stuck/1 retried", Duration::from_secs(30), || async {
        (handler.stuck_attempts.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    assert!(
        !applied(&client).await.contains_key("stuck"),
        "stuck/2 waits behind stuck/1"
    );
    handler.stuck.store(false, Ordering::SeqCst);
    wait_for("the stuck key applied", Duration::from_secs(30), || async {
        (applied(&client).await.get("stuck") == Some(&vec![1, 2])).then_some(())
    })
    .await;
    let tries = handler.stuck_attempts.load(Ordering::SeqCst);
    assert_eq!(
        handler.applied_attempt.load(Ordering::SeqCst),
        tries,
        "the handler sees how many attempts failed before"
    );
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// The numbers of the report that found it: one partition, prefetch 8, key A's first event
/// failing transiently with 24 more of A's events queued behind it, then 20 events of key
/// B. A's later events must not fill the partition's window: B is applied while A/1 still
/// fails (before, none of B was applied in 30 s), A's parked events wait in the database,
/// and once A/1 goes through A is applied 1..25 in order, with no jump recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_key_with_more_events_queued_than_the_prefetch_holds_only_itself() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 1);
    assert_eq!(cfg.prefetch.get(), 8);
    cfg.max_attempts = std::num::NonZeroU32::new(200);
    let handler = Scripted::new("m");
    handler.stuck.store(true, Ordering::SeqCst);
    let running = Running::start(&db, cfg.clone(), handler.clone());
    wait_group_ready(&cfg).await;
    let publisher = RawPublisher::new(&ex).await;
    publisher
        .publish(&RawEvent::new("A", 1, json!({"stuck": true})))
        .await;
    for seq in 2..=25 {
        publisher.publish(&RawEvent::new("A", seq, json!({}))).await;
    }
    for seq in 1..=20 {
        publisher.publish(&RawEvent::new("B", seq, json!({}))).await;
    }
    wait_for(
        "B applied 1..20 while A/1 fails",
        Duration::from_secs(30),
        || async {
            (applied(&client).await.get("B") == Some(&(1..=20).collect::<Vec<i64>>())).then_some(())
        },
    )
    .await;
    assert!(
        handler.stuck_attempts.load(Ordering::SeqCst) >= 1,
        "A/1 was tried"
    );
    assert!(
        !applied(&client).await.contains_key("A"),
        "nothing of A goes before A/1"
    );
    let parked: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_inbox_held WHERE aggregate_id = 'A'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(parked > 0, "A's later events wait in the database");
    handler.stuck.store(false, Ordering::SeqCst);
    wait_for("A applied 1..25", Duration::from_secs(30), || async {
        (applied(&client).await.get("A") == Some(&(1..=25).collect::<Vec<i64>>())).then_some(())
    })
    .await;
    let (held, jumps): (i64, i64) = {
        let r = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_inbox_held),
                        (SELECT count(*) FROM outbox_inbox_gaps)",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!((held, jumps), (0, 0), "nothing left held, no jump");
    wait_for(
        "the partition queue empty",
        Duration::from_secs(20),
        || async { (queue_depth(&cfg.partition_queue(0)).await == 0).then_some(()) },
    )
    .await;
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// Parks that fail (here: the park function is gone for a while; in the soak, Postgres
/// restarting) must not reorder a key: parks finish in any order, and a failed one kept in
/// memory could run after a later event of its key (the soak saw seq 1472 applied after
/// 1470, 1471 late). The partition is given up instead and its unacked events come back in
/// order: once parks work again, A is applied 1..25 in order, with no jump and no late event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parks_that_fail_keep_the_key_in_order() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 1);
    cfg.max_attempts = std::num::NonZeroU32::new(200);
    let handler = Scripted::new("m");
    handler.stuck.store(true, Ordering::SeqCst);
    let running = Running::start(&db, cfg.clone(), handler.clone());
    wait_group_ready(&cfg).await;
    let park = "outbox_group_park(text, integer, uuid, text, text, bigint, text, text, jsonb, bytea, bigint)";
    within(
        "hide the park function",
        client.batch_execute(&format!("ALTER FUNCTION {park} RENAME TO it_hidden_park")),
    )
    .await
    .unwrap();
    let publisher = RawPublisher::new(&ex).await;
    publisher
        .publish(&RawEvent::new("A", 1, json!({"stuck": true})))
        .await;
    for seq in 2..=25 {
        publisher.publish(&RawEvent::new("A", seq, json!({}))).await;
    }
    wait_for("A/1 tried three times", Duration::from_secs(30), || async {
        (handler.stuck_attempts.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    let hidden = park.replace("outbox_group_park", "it_hidden_park");
    within(
        "bring the park function back",
        client.batch_execute(&format!(
            "ALTER FUNCTION {hidden} RENAME TO outbox_group_park"
        )),
    )
    .await
    .unwrap();
    handler.stuck.store(false, Ordering::SeqCst);
    wait_for_explained(
        "A applied 1..25",
        Duration::from_secs(60),
        || async { (applied(&client).await.get("A").map_or(0, Vec::len) >= 25).then_some(()) },
        || async {
            format!(
                "\n  applied {:?}{}",
                applied(&client).await,
                kit::group_state(&client, &cfg).await
            )
        },
    )
    .await;
    assert_eq!(
        applied(&client).await.get("A"),
        Some(&(1..=25).collect::<Vec<i64>>()),
        "in order"
    );
    let gaps: i64 = within(
        "the gaps",
        client.query_one("SELECT count(*) FROM outbox_inbox_gaps", &[]),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(gaps, 0, "no jump, no late event");
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// (last_seq, blocked_seq, held events) of key `order/<key>`; zeros before its first record.
async fn key_state(client: &Client, consumer: &str, key: &str) -> (i64, Option<i64>, i64) {
    let Some(r) = client
        .query_opt(
            "SELECT last_seq, blocked_seq,
                    (SELECT count(*) FROM outbox_inbox_held h
                      WHERE h.consumer = k.consumer AND h.aggregate_id = k.aggregate_id)
               FROM outbox_inbox_keys k WHERE consumer = $1 AND aggregate_id = $2",
            &[&consumer, &key],
        )
        .await
        .unwrap()
    else {
        return (0, None, 0);
    };
    (r.get(0), r.get(1), r.get(2))
}

/// A poison event with block-key: dead-lettered with a record, the key's later events held
/// in the database and acked (the partition queue empties), other keys flow; released by
/// the SQL function and by `outbox-relay consumer-release`, the held events are applied in
/// order before newer ones. With continue the key goes on by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_event_blocks_its_key_until_released() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 1);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&ex).await;
    let poison = RawEvent::new("p", 2, json!({"poison": true}));
    publisher.publish(&RawEvent::new("p", 1, json!({}))).await;
    publisher.publish(&poison).await;
    publisher.publish(&RawEvent::new("p", 3, json!({}))).await;
    publisher.publish(&RawEvent::new("p", 4, json!({}))).await;
    for k in 0..10 {
        publisher
            .publish(&RawEvent::new(&format!("free{k}"), 1, json!({})))
            .await;
    }
    let d = wait_for(
        "the poison dead-lettered",
        Duration::from_secs(30),
        || async { dead.all().into_iter().next() },
    )
    .await;
    assert_eq!(d.event_id, poison.event_id.to_string());
    assert!(d.reason.contains("poison"), "{}", d.reason);
    wait_for(
        "p blocked at 2 with 3 and 4 held; other keys applied",
        Duration::from_secs(30),
        || async {
            let other = applied(&client)
                .await
                .keys()
                .filter(|k| k.starts_with("free"))
                .count();
            (key_state(&client, &cfg.name, "p").await == (2, Some(2), 2) && other == 10)
                .then_some(())
        },
    )
    .await;
    let outcome: String = client
        .query_one(
            "SELECT outcome FROM outbox_inbox WHERE event_id = $1",
            &[&poison.event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outcome, "dead");
    wait_for("the held events acked", Duration::from_secs(20), || async {
        (queue_depth(&cfg.partition_queue(0)).await == 0).then_some(())
    })
    .await;
    // A newer event while blocked is held too, behind the others.
    publisher.publish(&RawEvent::new("p", 5, json!({}))).await;
    wait_for("p/5 held", Duration::from_secs(20), || async {
        (key_state(&client, &cfg.name, "p").await.2 == 3).then_some(())
    })
    .await;
    assert_eq!(applied(&client).await.get("p"), Some(&vec![1]));

    // Release through SQL.
    let held: Option<i64> = client
        .query_one(
            "SELECT outbox_consumer_release($1, 'order', 'p')",
            &[&cfg.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, Some(3));
    publisher.publish(&RawEvent::new("p", 6, json!({}))).await;
    wait_for(
        "p/3..6 applied in order",
        Duration::from_secs(30),
        || async { (applied(&client).await.get("p") == Some(&vec![1, 3, 4, 5, 6])).then_some(()) },
    )
    .await;
    assert_eq!(key_state(&client, &cfg.name, "p").await, (6, None, 0));

    // Blocked again, released through the command.
    publisher
        .publish(&RawEvent::new("p", 7, json!({"poison": true})))
        .await;
    publisher.publish(&RawEvent::new("p", 8, json!({}))).await;
    wait_for("p blocked at 7", Duration::from_secs(30), || async {
        (key_state(&client, &cfg.name, "p").await == (7, Some(7), 1)).then_some(())
    })
    .await;
    let key = "order/p".to_owned();
    let blocked = |json: bool| {
        let mut args = vec![
            "consumer-blocked".to_owned(),
            "--database-url".to_owned(),
            db.url(),
            "--schema".to_owned(),
            db.schema.to_string(),
            "--consumer".to_owned(),
            cfg.name.clone(),
        ];
        if json {
            args.push("--json".to_owned());
        }
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, err) = run_to_end(&args, &[]).await;
            assert_eq!(code, 0, "{out}{err}");
            out
        }
    };
    let out = blocked(false).await;
    assert!(
        out.contains(&format!("{} order/p blocked at seq 7", cfg.name))
            && out.contains("1 later event(s) held")
            && out.contains(&format!("--key {key}")),
        "{out}"
    );
    let listed: serde_json::Value = serde_json::from_str(&blocked(true).await).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["aggregate_id"], "p", "{listed}");
    assert_eq!(listed[0]["seq"], 7, "{listed}");
    assert_eq!(listed[0]["held"], 1, "{listed}");
    let (code, out, err) = run_to_end(
        &[
            "consumer-release",
            "--database-url",
            &db.url(),
            "--schema",
            &db.schema.to_string(),
            "--consumer",
            &cfg.name,
            "--key",
            &key,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("1 held event"), "{out}");
    wait_for("p/8 applied", Duration::from_secs(30), || async {
        (applied(&client).await.get("p") == Some(&vec![1, 3, 4, 5, 6, 8])).then_some(())
    })
    .await;
    let (code, out, _) = run_to_end(
        &[
            "consumer-release",
            "--database-url",
            &db.url(),
            "--schema",
            &db.schema.to_string(),
            "--consumer",
            &cfg.name,
            "--key",
            &key,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0);
    assert!(out.contains("not blocked"), "{out}");
    assert!(blocked(false).await.contains("no blocked keys"));
    running.stop().await;
    kit::delete_group_topology(&cfg).await;

    // Continue: the key goes on without an operator.
    let mut cfg = group_config(&exchange(), 1);
    cfg.ordered.as_mut().unwrap().on_dead = OnDead::Continue;
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let publisher = RawPublisher::new(&cfg.exchange).await;
    publisher
        .publish(&RawEvent::new("c", 1, json!({"poison": true})))
        .await;
    publisher.publish(&RawEvent::new("c", 2, json!({}))).await;
    wait_for(
        "c/2 applied after the dead c/1",
        Duration::from_secs(30),
        || async { (applied(&client).await.get("c") == Some(&vec![2])).then_some(()) },
    )
    .await;
    assert_eq!(key_state(&client, &cfg.name, "c").await, (2, None, 0));
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// A handler that panics: its event is dead-lettered and its key blocked like a terminal
/// failure, and the partition goes on (the panic does not unwind the partition's consumer,
/// whose drop would cancel it while it still holds unacked events).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_dead_letters_its_event_and_the_partition_goes_on() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 1);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&ex).await;
    let bug = RawEvent::new("b", 1, json!({"panic": true}));
    publisher.publish(&bug).await;
    publisher.publish(&RawEvent::new("b", 2, json!({}))).await;
    publisher
        .publish(&RawEvent::new("other", 1, json!({})))
        .await;
    let d = wait_for(
        "the panicking event dead-lettered",
        Duration::from_secs(30),
        || async { dead.all().into_iter().next() },
    )
    .await;
    assert_eq!(d.event_id, bug.event_id.to_string());
    assert!(d.reason.contains("panicked"), "{}", d.reason);
    wait_for(
        "b blocked with 2 held, other applied",
        Duration::from_secs(30),
        || async {
            (key_state(&client, &cfg.name, "b").await == (1, Some(1), 1)
                && applied(&client).await.contains_key("other"))
            .then_some(())
        },
    )
    .await;
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

async fn queue_depth(queue: &str) -> u32 {
    queue_depth_on(&amqp_url(), queue).await
}

/// Messages ready in `queue` on the broker at `url`, and its consumers; None when it cannot
/// be read within 10 s (a connection made while the node restarts can hang).
async fn passive_on(url: &str, queue: &str) -> Option<(u32, u32)> {
    tokio::time::timeout(Duration::from_secs(10), passive_once(url, queue))
        .await
        .ok()
        .flatten()
}

async fn passive_once(url: &str, queue: &str) -> Option<(u32, u32)> {
    let conn = AmqpTarget::parse(url)
        .ok()?
        .connect("outbox-it-depth")
        .await
        .ok()?;
    let q = async {
        let ch = conn.create_channel().await.ok()?;
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok()
    }
    .await;
    let _ = conn.close(200, "ok".into()).await;
    q.map(|q| (q.message_count(), q.consumer_count()))
}

/// Messages ready in `queue` on the broker at `url`. A read that fails (a busy machine can
/// let one passive declare miss its 10 s) is tried again, for 45 s in all.
async fn queue_depth_on(url: &str, queue: &str) -> u32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    loop {
        if let Some((ready, _)) = passive_on(url, queue).await {
            return ready;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queue {queue} could not be read for 45 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A seq jump (seq 2 parked upstream with --on-park continue, or routed elsewhere) is
/// applied at once and recorded; seq 2 arriving later is older than the key: acked, not
/// applied, and recorded as late (it was never seen, so it is no duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_seq_jump_is_applied_at_once_and_recorded() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 2);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let publisher = RawPublisher::new(&ex).await;
    publisher.publish(&RawEvent::new("j", 1, json!({}))).await;
    publisher.publish(&RawEvent::new("j", 3, json!({}))).await;
    wait_for("1 and 3 applied", Duration::from_secs(20), || async {
        (applied(&client).await.get("j") == Some(&vec![1, 3])).then_some(())
    })
    .await;
    let (expected, got, action): (i64, i64, String) = {
        let r = client
            .query_one(
                "SELECT expected_seq, got_seq, action FROM outbox_inbox_gaps WHERE aggregate_id = 'j'",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!((expected, got, action.as_str()), (2, 3, "jumped"));
    publisher.publish(&RawEvent::new("j", 2, json!({}))).await;
    publisher.publish(&RawEvent::new("j", 4, json!({}))).await;
    wait_for("4 applied, late 2 not", Duration::from_secs(20), || async {
        (applied(&client).await.get("j") == Some(&vec![1, 3, 4])).then_some(())
    })
    .await;
    let late: Vec<(i64, i64)> = client
        .query(
            "SELECT expected_seq, got_seq FROM outbox_inbox_gaps
              WHERE aggregate_id = 'j' AND action = 'late'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        late,
        [(4, 2)],
        "the late 2 is recorded, not dropped silently"
    );
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// A partition queue that is gone: the router's copies for it come back (`mandatory`)
/// and are retried, never acked away into the dead-letter queue (before, the route
/// exchange's alternate exchange took them and the intake was acked); and the other
/// partition goes on meanwhile (before, any failed copy ended the router for every key).
/// Once the queue is back, the held key is applied in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_for_a_missing_partition_queue_are_retried_while_the_others_flow() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 2);
    declare_group(&db, &cfg).await;
    // A member that declares nothing, so that the queue stays gone until the test says.
    cfg.declare = false;
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let key_in = |p: u16| {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| cfg.partition_of("order", k) == p)
            .unwrap()
    };
    let (live, gone) = (key_in(0), key_in(1));
    let conn = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-missing")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let rpc = Duration::from_secs(15);
    let p1 = cfg.partition_queue(1);
    tokio::time::timeout(rpc, ch.queue_delete(p1.as_str().into(), Default::default()))
        .await
        .unwrap()
        .unwrap();
    let publisher = RawPublisher::new(&ex).await;
    for seq in 1..=3 {
        publisher
            .publish(&RawEvent::new(&gone, seq, json!({})))
            .await;
    }
    for seq in 1..=3 {
        publisher
            .publish(&RawEvent::new(&live, seq, json!({})))
            .await;
    }
    wait_for_explained(
        "the other partition's key applied",
        Duration::from_secs(30),
        || async { (applied(&client).await.get(&live) == Some(&vec![1, 2, 3])).then_some(()) },
        || async {
            format!(
                "\n  applied {:?}{}",
                applied(&client).await,
                kit::group_state(&client, &cfg).await
            )
        },
    )
    .await;
    // Long enough for the router to have tried the gone partition's copies several times.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!applied(&client).await.contains_key(&gone));
    assert!(
        dead.all().is_empty(),
        "no copy went to the dead-letter queue: {:?}",
        dead.all()
    );
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("classic".into()),
    );
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(format!("{}.dlx", cfg.queue).into()),
    );
    tokio::time::timeout(
        rpc,
        ch.queue_declare(
            p1.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        ),
    )
    .await
    .unwrap()
    .unwrap();
    let _ = tokio::time::timeout(rpc, conn.close(200, "ok".into())).await;
    wait_for(
        "the held key applied once its queue is back",
        Duration::from_secs(30),
        || async { (applied(&client).await.get(&gone) == Some(&vec![1, 2, 3])).then_some(()) },
    )
    .await;
    assert!(dead.all().is_empty(), "{:?}", dead.all());
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// `rabbitmqctl` with a deadline.
async fn ctl(args: &[&str]) -> String {
    tokio::time::timeout(Duration::from_secs(60), rabbitmqctl(args))
        .await
        .unwrap_or_else(|_| panic!("rabbitmqctl {args:?} within 60 s"))
}

/// A vhost of the test's own, deleted when dropped.
struct Vhost(String);

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["-t", "30", "delete_vhost", &self.0])
            .output();
    }
}

/// (name, type, consumers) of the queues of `vhost` whose name starts with `prefix`.
async fn queue_types(vhost: &str, prefix: &str) -> Vec<(String, String, u32)> {
    let listing = ctl(&[
        "list_queues",
        "-q",
        "--no-table-headers",
        "-p",
        vhost,
        "name",
        "type",
        "consumers",
    ])
    .await;
    let mut queues: Vec<(String, String, u32)> = listing
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (name, kind, consumers) = (f.next()?, f.next()?, f.next()?);
            name.starts_with(prefix).then(|| {
                (
                    name.to_owned(),
                    kind.to_owned(),
                    consumers.parse().unwrap_or(0),
                )
            })
        })
        .collect();
    queues.sort();
    queues
}

/// On a vhost whose default queue type is quorum (`rabbitmqctl add_vhost NAME
/// --default-queue-type quorum`), a group's intake and partition queues are still classic
/// (before, they silently became quorum queues: a delivery limit, returns to the tail) and
/// the group works. A partition queue an earlier version left there as a quorum queue is
/// refused at start-up, naming the argument, instead of being used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_queues_stay_classic_on_a_vhost_whose_default_is_quorum() {
    let vhost = unique("it.quorum").replace('_', ".");
    ctl(&["add_vhost", &vhost, "--default-queue-type", "quorum"]).await;
    let _gone = Vhost(vhost.clone());
    ctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]).await;
    let base = amqp_url();
    let url = format!("{}/{vhost}", &base[..base.rfind('/').unwrap()]);
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 2);
    let deps = || ConsumerDeps {
        pool: db.target.pool(&db.schema, "outbox-it-consumer", 32),
        amqp: AmqpTarget::parse(&url).unwrap(),
    };
    let running = Running::start_with(deps(), cfg.clone(), Scripted::new("m"));
    let queues = wait_for(
        "the group consumes its intake and partitions",
        Duration::from_secs(60),
        || async {
            let q = queue_types(&vhost, &cfg.queue).await;
            let consumed = q
                .iter()
                .filter(|(name, _, consumers)| !name.ends_with(".dlq") && *consumers > 0)
                .count();
            (consumed == 3).then_some(q)
        },
    )
    .await;
    let group: Vec<(&str, &str)> = queues
        .iter()
        .filter(|(name, _, _)| !name.ends_with(".dlq"))
        .map(|(name, kind, _)| (name.as_str(), kind.as_str()))
        .collect();
    let (intake, p0, p1) = (
        cfg.intake_queue(),
        cfg.partition_queue(0),
        cfg.partition_queue(1),
    );
    assert_eq!(
        group,
        [
            (intake.as_str(), "classic"),
            (p0.as_str(), "classic"),
            (p1.as_str(), "classic")
        ]
    );
    let publisher = RawPublisher::on(&url, &ex).await;
    publisher.publish(&RawEvent::new("q", 1, json!({}))).await;
    wait_for("the event applied", Duration::from_secs(30), || async {
        (applied(&client).await.get("q") == Some(&vec![1])).then_some(())
    })
    .await;
    running.stop().await;

    // An earlier version's partition queue, made quorum by the vhost's default.
    let conn = AmqpTarget::parse(&url)
        .unwrap()
        .connect("outbox-it-quorum")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let rpc = Duration::from_secs(15);
    // The arguments an earlier version declared it with: no x-queue-type.
    let mut earlier = FieldTable::default();
    earlier.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    earlier.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(format!("{}.dlx", cfg.queue).into()),
    );
    tokio::time::timeout(rpc, ch.queue_delete(p1.as_str().into(), Default::default()))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(
        rpc,
        ch.queue_declare(
            p1.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            earlier,
        ),
    )
    .await
    .unwrap()
    .unwrap();
    let _ = tokio::time::timeout(rpc, conn.close(200, "ok".into())).await;
    let r = Running::start_with(deps(), cfg.clone(), Scripted::new("m"));
    let err = tokio::time::timeout(Duration::from_secs(30), r.handle)
        .await
        .expect("refused within 30 s")
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, ConsumerError::Topology(_)), "{err}");
    assert!(err.to_string().contains("x-queue-type"), "{err}");
}

/// Starts a member that must end at once with an error; the error.
async fn refused(db: &TestDb, cfg: &ConsumerConfig) -> ConsumerError {
    let r = Running::start(db, cfg.clone(), Scripted::new("m"));
    tokio::time::timeout(Duration::from_secs(10), r.handle)
        .await
        .expect("refused within 10 s")
        .unwrap()
        .unwrap_err()
}

/// Bindings that take only some event types of a key, a partition count other than the one
/// recorded, and a group that still has an earlier version's consistent-hash exchange are
/// refused at start-up with errors that say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_bindings_and_a_changed_partition_count_are_refused() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut cfg = group_config(&exchange(), 4);
    cfg.bindings = vec!["order.created".into()];
    let err = refused(&db, &cfg).await;
    let ConsumerError::Config(e) = &err else {
        panic!("{err}")
    };
    assert_eq!(e.flag, "bindings");
    assert!(e.problem.contains("'order.created'"), "{err}");

    let cfg = group_config(&exchange(), 4);
    client
        .query_one("SELECT outbox_group_join($1, 8)", &[&cfg.name])
        .await
        .unwrap();
    let err = refused(&db, &cfg).await;
    assert!(matches!(err, ConsumerError::Group(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("has 8 partitions, not 4") && text.contains("drain the group"),
        "{text}"
    );

    // A group that still has the consistent-hash exchange of an earlier version.
    let cfg = group_config(&exchange(), 4);
    let conn = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-legacy")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    outbox_kit::amqp::declare_exchange(
        &ch,
        &format!("{}.hash", cfg.queue),
        lapin::ExchangeKind::Fanout,
        false,
    )
    .await
    .unwrap();
    let err = refused(&db, &cfg).await;
    let text = err.to_string();
    assert!(matches!(err, ConsumerError::Topology(_)), "{text}");
    assert!(
        text.contains("consistent-hash exchange") && text.contains("delete_exchange"),
        "{text}"
    );
    let _ = ch
        .exchange_delete(
            format!("{}.hash", cfg.queue).as_str().into(),
            Default::default(),
        )
        .await;
    let _ = conn.close(200, "ok".into()).await;
    kit::delete_group_topology(&cfg).await;
}

/// The channel numbers the broker lists for the connection named `name`.
async fn channel_numbers(name: &str) -> Vec<u32> {
    channels(name).await.into_iter().map(|(n, _)| n).collect()
}

/// (number, in confirm mode) of each channel of the connection named exactly `name`.
async fn channels(name: &str) -> Vec<(u32, bool)> {
    let conns = ctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ])
    .await;
    let named = format!("{{\"connection_name\",\"{name}\"}}");
    let Some(pid) = conns
        .lines()
        .find(|l| l.contains(&named))
        .and_then(|l| l.split_whitespace().next())
    else {
        return Vec::new();
    };
    let chans = ctl(&[
        "list_channels",
        "-q",
        "--no-table-headers",
        "connection",
        "number",
        "confirm",
    ])
    .await;
    chans
        .lines()
        .filter(|l| l.starts_with(pid))
        .filter_map(|l| {
            let mut f = l.split_whitespace().skip(1);
            Some((f.next()?.parse().ok()?, f.next()? == "true"))
        })
        .collect()
}

/// An ordered group's dead letters go out on a connection of their own, not on the one
/// its partition consumers ack on: a broker under a memory or disk alarm blocks a
/// connection that publishes, and with it those acks. The member's own connection has no
/// confirm-mode channel; its dead-letter connection has one, and a poison event is
/// dead-lettered through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_go_out_on_a_connection_of_their_own() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 1);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let poison = RawEvent::new("x", 1, json!({"poison": true}));
    RawPublisher::new(&ex).await.publish(&poison).await;
    wait_for(
        "the poison dead-lettered",
        Duration::from_secs(30),
        || async { dead.all().into_iter().next() },
    )
    .await;
    let own = channels(&cfg.connection_name).await;
    assert!(!own.is_empty(), "the member's connection is listed");
    assert!(
        own.iter().all(|(_, confirm)| !confirm),
        "no publishing channel beside the partition consumers: {own:?}"
    );
    let letters = channels(&format!("{} dead letters", cfg.connection_name)).await;
    assert_eq!(
        letters.iter().filter(|(_, confirm)| *confirm).count(),
        1,
        "{letters:?}"
    );
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// The broker nacks every dead-letter copy (a queue bound to the dead-letter exchange
/// rejects publishes): after nacks alone for `retry_max` the kit opens a new publish
/// channel, as the relay does with a session that only gets nacks; once the broker takes
/// copies again the event is dead-lettered and its key blocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_channel_that_only_nacks_is_replaced() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 1);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let letters = format!("{} dead letters", cfg.connection_name);
    let before = channel_numbers(&letters).await;
    assert!(!before.is_empty(), "no channels listed for the runner");

    let conn = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-reject")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let reject = format!("{}.reject", cfg.queue);
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        outbox_kit::amqp::long_string("reject-publish"),
    );
    ch.queue_declare(reject.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    ch.queue_bind(
        reject.as_str().into(),
        format!("{}.dlx", cfg.queue).as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    RawPublisher::new(&ex)
        .await
        .publish(&RawEvent::new("n", 1, json!({"poison": true})))
        .await;
    let max_before = before.iter().copied().max().unwrap();
    wait_for(
        "a new publish channel after nacks only",
        Duration::from_secs(30),
        || async {
            let now = channel_numbers(&letters).await;
            now.iter().any(|n| *n > max_before).then_some(())
        },
    )
    .await;
    assert_eq!(
        key_state(&client, &cfg.name, "n").await.1,
        None,
        "not dead yet"
    );
    ch.queue_delete(reject.as_str().into(), Default::default())
        .await
        .unwrap();
    wait_for(
        "n/1 dead-lettered and blocked",
        Duration::from_secs(30),
        || async { (key_state(&client, &cfg.name, "n").await.1 == Some(1)).then_some(()) },
    )
    .await;
    let _ = conn.close(200, "ok".into()).await;
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// A consumer in another language drives a group from SQL alone: membership, apply, jump,
/// duplicate, dead with block, hold, release and the drain of held events in seq order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_functions_alone_give_the_group_rules() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let one = |sql: &'static str| {
        let c = &c;
        async move { c.query_one(sql, &[]).await.unwrap() }
    };
    assert_eq!(
        one("SELECT outbox_group_join('g', 4)")
            .await
            .get::<_, i32>(0),
        4
    );
    let err = c
        .query_one("SELECT outbox_group_join('g', 2)", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code().unwrap().code(), "OB002");
    let members: Vec<String> = c
        .query("SELECT * FROM outbox_group_beat('g', 'b', 3000)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(members, ["b"]);
    c.query("SELECT * FROM outbox_group_beat('g', 'a', 3000)", &[])
        .await
        .unwrap();
    let members: Vec<String> = c
        .query("SELECT * FROM outbox_group_beat('g', 'b', 3000)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(members, ["a", "b"], "sorted: a owns even partitions, b odd");

    let record = |seq: i64, id: uuid::Uuid| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT outcome FROM outbox_group_record('g', 1, $1, 'order', 'k', $2, 'created', 'order.created', '{}', '\\x7b7d')",
                &[&id, &seq],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
        }
    };
    let ids: Vec<uuid::Uuid> = (0..8).map(|_| kit::fresh_uuid()).collect();
    assert_eq!(record(1, ids[1]).await, "apply");
    assert_eq!(record(1, ids[1]).await, "duplicate");
    assert_eq!(record(3, ids[3]).await, "jumped");
    assert_eq!(record(2, ids[2]).await, "duplicate", "older than the key");
    assert_eq!(record(2, ids[2]).await, "duplicate", "and again");
    let late: i64 =
        one("SELECT count(*) FROM outbox_inbox_gaps WHERE action = 'late' AND got_seq = 2")
            .await
            .get(0);
    assert_eq!(late, 1, "an event older than its key is recorded once");
    assert_eq!(record(1, ids[1]).await, "duplicate");
    let late: i64 = one("SELECT count(*) FROM outbox_inbox_gaps WHERE action = 'late'")
        .await
        .get(0);
    assert_eq!(late, 1, "a true duplicate is not late");
    c.execute(
        "SELECT outbox_group_dead('g', $1, 'order', 'k', 4, 'poison', true)",
        &[&ids[4]],
    )
    .await
    .unwrap();
    assert_eq!(record(4, ids[4]).await, "duplicate", "the dead one's copy");
    assert_eq!(record(6, ids[6]).await, "held");
    assert_eq!(record(5, ids[5]).await, "held");
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_group_releasable('g', ARRAY[1])",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "blocked: nothing to drain");
    let held: Option<i64> = one("SELECT outbox_consumer_release('g', 'order', 'k')")
        .await
        .get(0);
    assert_eq!(held, Some(2));
    assert_eq!(
        record(7, ids[7]).await,
        "held",
        "queues behind the held ones"
    );
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_group_releasable('g', ARRAY[1])",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let mut drained = Vec::new();
    loop {
        let row = c
            .query_opt(
                "SELECT outcome, seq FROM outbox_group_take_held('g', 'order', 'k')",
                &[],
            )
            .await
            .unwrap();
        let Some(row) = row else { break };
        drained.push((row.get::<_, String>(0), row.get::<_, i64>(1)));
    }
    assert_eq!(
        drained,
        [
            ("apply".to_owned(), 5),
            ("apply".to_owned(), 6),
            ("apply".to_owned(), 7)
        ]
    );
    assert_eq!(record(8, kit::fresh_uuid()).await, "apply");
    let outcomes: Vec<(i64, String)> = c
        .query(
            "SELECT seq, outcome FROM outbox_inbox WHERE consumer = 'g' ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let seqs: Vec<i64> = outcomes.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, [1, 3, 4, 5, 6, 7, 8]);
    assert_eq!(outcomes[2].1, "dead");
}

/// A held event its key went past meanwhile (a later event of the key dead-lettered with
/// continue while it was held) is recorded as late when it is taken, as the inbox check
/// records such an event (before, it was taken for a duplicate without a record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_event_its_key_went_past_is_recorded_late() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let ids: Vec<uuid::Uuid> = (0..6).map(|_| kit::fresh_uuid()).collect();
    let record = |seq: i64, id: uuid::Uuid| {
        let c = &c;
        async move {
            c.query_one(
                "SELECT outcome FROM outbox_group_record('g', 0, $1, 'order', 'k', $2, 'created', 'order.created', '{}', '\\x7b7d')",
                &[&id, &seq],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
        }
    };
    let dead = |seq: i64, id: uuid::Uuid, block: bool| {
        let c = &c;
        async move {
            c.execute(
                "SELECT outbox_group_dead('g', $1, 'order', 'k', $2, 'poison', $3)",
                &[&id, &seq, &block],
            )
            .await
            .unwrap();
        }
    };
    assert_eq!(record(1, ids[1]).await, "apply");
    dead(2, ids[2], true).await;
    assert_eq!(record(4, ids[4]).await, "held");
    dead(5, ids[5], false).await;
    c.execute("SELECT outbox_consumer_release('g', 'order', 'k')", &[])
        .await
        .unwrap();
    let taken: (String, i64) = {
        let r = c
            .query_one(
                "SELECT outcome, seq FROM outbox_group_take_held('g', 'order', 'k')",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(taken, ("duplicate".to_owned(), 4));
    let late: Vec<(i64, i64)> = c
        .query(
            "SELECT expected_seq, got_seq FROM outbox_inbox_gaps WHERE action = 'late'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        late,
        [(6, 4)],
        "the held 4 is recorded late, not dropped silently"
    );
}

/// A database call of these tests, under a deadline that names it.
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 20 s"))
}

/// An event with its id and key but a seq header that is no integer is dead-lettered and
/// recorded dead, and with block-key its key is blocked at its next seq: the key's later
/// event is held, not applied as a jump past an event nobody recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_seq_cannot_be_read_is_recorded_and_blocks_its_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let cfg = group_config(&ex, 1);
    let running = Running::start(&db, cfg.clone(), Scripted::new("m"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&ex).await;
    publisher.publish(&RawEvent::new("p", 1, json!({}))).await;
    let bad = RawEvent::new("p", 2, json!({}));
    publisher
        .publish_with_seq(&bad, AMQPValue::LongString("two".into()))
        .await;
    publisher.publish(&RawEvent::new("p", 3, json!({}))).await;
    let d = wait_for(
        "the event with the bad seq dead-lettered",
        Duration::from_secs(30),
        || async { dead.all().into_iter().next() },
    )
    .await;
    assert_eq!(d.event_id, bad.event_id.to_string());
    assert!(d.reason.contains("x-outbox-seq"), "{}", d.reason);
    wait_for(
        "p blocked at 2 with 3 held",
        Duration::from_secs(30),
        || async { (key_state(&client, &cfg.name, "p").await == (1, Some(2), 1)).then_some(()) },
    )
    .await;
    assert_eq!(inbox_outcome(&client, bad.event_id).await, "dead");
    assert_eq!(applied(&client).await.get("p"), Some(&vec![1]));
    running.stop().await;
    kit::delete_group_topology(&cfg).await;
}

/// A group restarted with fewer partitions while a key had held events (its row in
/// outbox_consumer_groups deleted, as the documented procedure does): the held rows of a
/// partition the group no longer has are re-homed at join, so a member draining its
/// partitions finds the key.
#[tokio::test]
async fn held_events_of_a_partition_the_group_no_longer_has_are_drained() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let q = |sql: &'static str| {
        let c = &c;
        async move { within(sql, c.query(sql, &[])).await.unwrap() }
    };
    q("SELECT outbox_group_join('g9', 4)").await;
    let dead = kit::fresh_uuid();
    let held = kit::fresh_uuid();
    within(
        "the dead event, blocking k",
        c.execute(
            "SELECT outbox_group_dead('g9', $1, 'order', 'k', 1, 'poison', true)",
            &[&dead],
        ),
    )
    .await
    .unwrap();
    let outcome: String = within(
        "k's next event, from partition 3",
        c.query_one(
            "SELECT outcome FROM outbox_group_record('g9', 3, $1, 'order', 'k', 2, 'created', 'order.created', '{}', '\\x7b7d')",
            &[&held],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(outcome, "held");
    q("SELECT outbox_consumer_release('g9', 'order', 'k')").await;
    q("DELETE FROM outbox_consumer_groups WHERE consumer = 'g9'").await;
    q("SELECT outbox_group_join('g9', 2)").await;
    let releasable: Vec<(String, String)> =
        q("SELECT * FROM outbox_group_releasable('g9', ARRAY[0, 1])")
            .await
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
    assert_eq!(releasable, [("order".to_owned(), "k".to_owned())]);
    let taken: Vec<(String, uuid::Uuid)> =
        q("SELECT outcome, event_id FROM outbox_group_take_held('g9', 'order', 'k')")
            .await
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
    assert_eq!(taken, [("apply".to_owned(), held)]);
}

/// An event that kills each member it runs in (the member's task aborted and its connection
/// closed mid-handler, as a crash does) is dead-lettered after max_attempts runs: its
/// attempts are counted in the database, not in the memory that dies with the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_that_kills_its_member_is_dead_lettered_after_max_attempts() {
    killed_by_its_event(true).await;
}

/// The same for an unordered consumer, whose redelivered event's attempts are counted in
/// the database too (a retry queue's copy carries its count in a header).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_that_kills_its_unordered_consumer_is_dead_lettered_after_max_attempts() {
    killed_by_its_event(false).await;
}

async fn killed_by_its_event(ordered: bool) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = if ordered {
        group_config(&ex, 1)
    } else {
        kit::consumer_config(&ex)
    };
    cfg.max_attempts = std::num::NonZeroU32::new(3);
    cfg.handler_timeout = Duration::from_secs(30);
    if ordered {
        declare_group(&db, &cfg).await;
    } else {
        let r = Running::start(&db, member(&cfg, "declare"), Scripted::new("declare"));
        kit::wait_queue_ready(&cfg.queue).await;
        r.stop().await;
    }
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&ex).await;
    let crash = RawEvent::new("c", 1, json!({"crash": true}));
    publisher.publish(&crash).await;
    publisher
        .publish(&RawEvent::new("free", 1, json!({})))
        .await;
    let handler = Scripted::new("m");
    let lives = kill_members_until_dead(&db, &client, &cfg, &handler, &dead, crash.event_id).await;
    let d = dead_one(&dead, crash.event_id);
    assert_eq!(
        handler.crash_runs.load(Ordering::SeqCst),
        3,
        "three runs, then dead; {lives} lives; dead-lettered for: {}",
        d.reason
    );
    assert_eq!(d.event_id, crash.event_id.to_string());
    assert!(d.reason.contains("3 attempts"), "{}", d.reason);
    assert_eq!(inbox_outcome(&client, crash.event_id).await, "dead");
    delete_any_topology(&cfg).await;
}

/// A database that takes no new connections (at its connection limit, restarting, out of
/// reach) is not the event's fault: the attempts it fails spend none of `max_attempts`,
/// and the event is applied once connections come back, not dead-lettered. (Before, a
/// busy suite's "too many clients" dead-lettered events after five pool errors.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_met_by_a_database_that_takes_no_connections_waits_for_it() {
    refused_connections(true).await;
}

/// The same for an unordered consumer, whose retry copies keep their attempt count.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unordered_event_met_by_a_database_that_takes_no_connections_waits_for_it() {
    refused_connections(false).await;
}

async fn refused_connections(ordered: bool) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = if ordered {
        let mut c = group_config(&ex, 1);
        // Long enough that the member keeps its partition through the outage.
        c.ordered.as_mut().unwrap().member_lease = Duration::from_secs(60);
        c
    } else {
        kit::consumer_config(&ex)
    };
    cfg.max_attempts = std::num::NonZeroU32::new(3);
    cfg.retry_min = Duration::from_millis(20);
    cfg.retry_max = Duration::from_millis(100);
    let pg = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let url = db.url().replace(":5432/", &format!(":{}/", pg.port()));
    let deps = ConsumerDeps {
        pool: outbox_kit::db::DbTarget::parse(&url).unwrap().pool(
            &db.schema,
            "outbox-it-refused",
            32,
        ),
        amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
    };
    let running = Running::start_with(deps, cfg.clone(), Scripted::new("m"));
    if ordered {
        wait_group_ready(&cfg).await;
    } else {
        kit::wait_queue_ready(&cfg.queue).await;
    }
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    // Every pooled connection closed, and each new one closed as it opens.
    pg.set(Mode::Cut);
    let before = pg.stats().accepted;
    let publisher = RawPublisher::new(&ex).await;
    let event = RawEvent::new("k", 1, json!({}));
    publisher.publish(&event).await;
    // Three times as many connection attempts as the event has attempts: before, it was
    // dead-lettered after the third.
    wait_for(
        "the consumer tries 10 connections while the database refuses them",
        Duration::from_secs(60),
        || async { (pg.stats().accepted >= before + 10).then_some(()) },
    )
    .await;
    pg.set(Mode::Pass);
    wait_for_explained(
        "the event applied once connections come back",
        Duration::from_secs(60),
        || async { (applied_count(&client).await == 1).then_some(()) },
        || async {
            format!(
                "\n  dead letters {:?}{}",
                dead.all(),
                kit::group_state(&client, &cfg).await
            )
        },
    )
    .await;
    assert!(dead.all().is_empty(), "dead-lettered: {:?}", dead.all());
    assert_eq!(inbox_outcome(&client, event.event_id).await, "applied");
    running.stop().await;
    delete_any_topology(&cfg).await;
}

/// The dead letter of `event_id`.
fn dead_one(dead: &DeadLetters, event_id: uuid::Uuid) -> kit::Dead {
    let id = event_id.to_string();
    dead.all()
        .into_iter()
        .find(|d| d.event_id == id)
        .expect("dead-lettered")
}

/// Starts members one after another, each killed (its task aborted, its broker connection
/// and database sessions closed, as a crash does) as soon as the crash event runs in it,
/// until the event is dead-lettered; returns how many were killed.
async fn kill_members_until_dead(
    db: &TestDb,
    client: &Client,
    cfg: &ConsumerConfig,
    handler: &Arc<Scripted>,
    dead: &DeadLetters,
    event_id: uuid::Uuid,
) -> usize {
    let id = event_id.to_string();
    let mut lives = 0;
    loop {
        assert!(
            lives < 6,
            "the event ran {} times and was never dead-lettered",
            handler.crash_runs.load(Ordering::SeqCst)
        );
        let name = format!("life{lives}");
        let member_cfg = member(cfg, &name);
        let app = unique("it.crash");
        let deps = ConsumerDeps {
            pool: db.target.pool(&db.schema, &app, 32),
            amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
        };
        let m = Running::start_with(deps, member_cfg.clone(), handler.clone());
        let ran_before = handler.crash_runs.load(Ordering::SeqCst);
        let crashed = wait_for(
            "the crash event runs again, or is dead-lettered",
            Duration::from_secs(60),
            || async {
                if handler.crash_runs.load(Ordering::SeqCst) > ran_before {
                    Some(true)
                } else {
                    dead.all().iter().any(|d| d.event_id == id).then_some(false)
                }
            },
        )
        .await;
        if !crashed {
            m.stop().await;
            return lives;
        }
        m.handle.abort();
        let _ = m.handle.await;
        crate::support::close_connections(&member_cfg.connection_name).await;
        within(
            "end the dead member's database sessions",
            client.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            ),
        )
        .await
        .unwrap();
        lives += 1;
    }
}

/// A held event that kills each member it runs in (taken from `outbox_inbox_held` by the
/// drain of its released key, its take rolled back with the crash) is dead-lettered after
/// max_attempts runs: each drain's first run is counted in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_event_that_kills_its_member_is_dead_lettered_after_max_attempts() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let ex = exchange();
    let mut cfg = group_config(&ex, 1);
    cfg.max_attempts = std::num::NonZeroU32::new(3);
    cfg.handler_timeout = Duration::from_secs(30);
    // A poison event blocks the key; the crash event behind it is held.
    let setup = Running::start(&db, member(&cfg, "setup"), Scripted::new("setup"));
    wait_group_ready(&cfg).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let publisher = RawPublisher::new(&ex).await;
    let poison = RawEvent::new("c", 1, json!({"poison": true}));
    let crash = RawEvent::new("c", 2, json!({"crash": true}));
    publisher.publish(&poison).await;
    publisher.publish(&crash).await;
    wait_for_explained(
        "c/1 dead and c/2 held",
        Duration::from_secs(30),
        || async { (key_state(&client, &cfg.name, "c").await == (1, Some(1), 1)).then_some(()) },
        || kit::group_state(&client, &cfg),
    )
    .await;
    setup.stop().await;
    let held: Option<i64> = within(
        "release c",
        client.query_one(
            "SELECT outbox_consumer_release($1, 'order', 'c')",
            &[&cfg.name],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert_eq!(held, Some(1));
    let handler = Scripted::new("m");
    let lives = kill_members_until_dead(&db, &client, &cfg, &handler, &dead, crash.event_id).await;
    let d = dead_one(&dead, crash.event_id);
    assert_eq!(
        handler.crash_runs.load(Ordering::SeqCst),
        3,
        "three runs, then dead; {lives} lives; dead-lettered for: {}",
        d.reason
    );
    assert!(d.reason.contains("3 attempts"), "{}", d.reason);
    assert_eq!(inbox_outcome(&client, crash.event_id).await, "dead");
    kit::delete_group_topology(&cfg).await;
}

/// The inbox outcome of `event_id` (with the test's deadline).
async fn inbox_outcome(client: &Client, event_id: uuid::Uuid) -> String {
    within(
        "the event's inbox row",
        client.query_one(
            "SELECT outcome FROM outbox_inbox WHERE event_id = $1",
            &[&event_id],
        ),
    )
    .await
    .unwrap()
    .get(0)
}

/// Deletes a group's or an unordered consumer's topology, whichever `cfg` is.
async fn delete_any_topology(cfg: &ConsumerConfig) {
    if cfg.ordered.is_some() {
        kit::delete_group_topology(cfg).await;
    } else {
        kit::delete_topology(cfg).await;
    }
}
