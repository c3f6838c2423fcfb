//! The relay against a three-node RabbitMQ cluster publishing to a quorum queue: the node
//! that leads the queue is stopped mid-stream, then a second node (the queue loses its
//! majority). After the nodes return, every event the relay marked dispatched is in the
//! queue (no confirmed message lost), nothing is lost overall, per-key order holds, and the
//! relay did all of it without an operator (one process, never restarted).
//!
//! The cluster is started by `deploy/cluster/rabbitmq-cluster.sh` (through the testkit's
//! `rabbitmq` module) with node names, ports and a data directory of this test's own, and
//! stopped (data deleted) by a guard, also when the test fails.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::ExchangeKind;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use outbox_kit::amqp::AmqpTarget;
use outbox_testkit::checker::{self, Delivery};
use outbox_testkit::rabbitmq::RabbitNodes;
use tokio_util::sync::CancellationToken;

use crate::support::process::RelayProcess;
use crate::support::{TestDb, declare_bound_queue, unique, wait_for, wait_for_explained};

/// Three extra RabbitMQ nodes of this test (the testkit's [`RabbitNodes`], which the soak
/// uses for its own node too); dropping it stops them and deletes their data.
struct Cluster(RabbitNodes);

impl Cluster {
    async fn start() -> Cluster {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("outbox-it-cluster-{pid}"));
        Cluster(
            RabbitNodes::start(&format!("outbox-it-{pid}"), 3, &dir, &[])
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    /// Runs the script; returns its stdout, panics with its stderr when it fails.
    async fn run(&self, args: &[&str]) -> String {
        self.0.run(args).await.unwrap_or_else(|e| panic!("{e}"))
    }

    fn url(&self, i: usize) -> String {
        self.0.url(i)
    }

    /// The relay's `--amqp-url`: the three nodes, tried in this order.
    async fn urls(&self) -> String {
        self.run(&["urls"]).await.trim().to_owned()
    }

    /// The node (full name) that leads `queue`, once there is one that is not `not`.
    async fn leader(&self, queue: &str, not: Option<&str>) -> String {
        wait_for(
            "the quorum queue to have a leader",
            Duration::from_secs(60),
            || async {
                let leader = self.run(&["leader", queue]).await.trim().to_owned();
                (!leader.is_empty() && Some(leader.as_str()) != not).then_some(leader)
            },
        )
        .await
    }

    fn index(&self, node: &str) -> usize {
        self.0
            .index(node)
            .unwrap_or_else(|| panic!("{node} is not a node of this cluster"))
    }
}

/// Inserts 10 events every 50 ms over 200 keys until `stop`; returns the committed ids.
fn produce(db: &TestDb, stop: CancellationToken) -> tokio::task::JoinHandle<Vec<uuid::Uuid>> {
    let (target, schema) = (db.target.clone(), db.schema.clone());
    tokio::spawn(async move {
        let client = target.connect(&schema, "outbox-it-producer").await.unwrap();
        let mut ids = Vec::new();
        let mut i = 0i32;
        while !stop.is_cancelled() {
            let rows = client
                .query(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'order', 'k' || ((g + $1) % 200), 'created', jsonb_build_object('n', g + $1)
                       FROM generate_series(1, 10) AS g RETURNING event_id",
                    &[&i],
                )
                .await
                .unwrap();
            ids.extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
            i += 10;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        ids
    })
}

async fn dispatched(client: &tokio_postgres::Client) -> HashSet<uuid::Uuid> {
    client
        .query(
            "SELECT event_id FROM outbox_events WHERE dispatched_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn dispatched_count(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits until at least `more` rows beyond `from` are dispatched; a timeout shows the
/// cluster's state and what the relay logged.
async fn dispatches_go_on(
    client: &tokio_postgres::Client,
    cluster: &Cluster,
    relay: &RelayProcess,
    exchange: &str,
    from: i64,
    more: i64,
    what: &str,
) {
    let wanted = from + more;
    let explain = || async {
        let mut fresh = String::new();
        for i in 0..3 {
            let outcome = fresh_publish(&cluster.url(i), exchange).await;
            fresh.push_str(&format!("node {i}: {outcome}\n"));
        }
        format!(
            ": {} dispatched, {wanted} wanted\n{}\none publish on a fresh connection to each node:\n{fresh}relay log (above debug):\n{}",
            dispatched_count(client).await,
            cluster.run(&["status"]).await,
            relay.log_tail(40)
        )
    };
    wait_for_explained(
        what,
        Duration::from_secs(120),
        || async { (dispatched_count(client).await >= wanted).then_some(()) },
        explain,
    )
    .await;
}

/// What the broker says to one publish with confirms on a new connection: whether the
/// queue takes messages at all, apart from the relay's own session.
async fn fresh_publish(url: &str, exchange: &str) -> String {
    let attempt = async {
        let conn = AmqpTarget::parse(url)
            .unwrap()
            .connect("outbox-it-cluster-probe")
            .await
            .map_err(|e| e.to_string())?;
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let confirm = ch
            .basic_publish(
                exchange.into(),
                "probe".into(),
                BasicPublishOptions::default(),
                b"probe",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let _ = conn.close(200, "probed".into()).await;
        Ok::<_, String>(if confirm.is_ack() { "acked" } else { "nacked" })
    };
    match tokio::time::timeout(Duration::from_secs(10), attempt).await {
        Ok(Ok(outcome)) => outcome.to_owned(),
        Ok(Err(e)) => format!("failed: {e}"),
        Err(_) => "no confirm within 10 s".to_owned(),
    }
}

/// Everything in `queue`, read through `url` until every id in `expect` has come.
async fn read_queue(url: &str, queue: &str, expect: &HashSet<String>) -> Vec<Delivery> {
    let conn = AmqpTarget::parse(url)
        .unwrap()
        .connect("outbox-it-cluster-reader")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "reader".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let sink = got.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            sink.lock()
                .unwrap()
                .push(Delivery::from_amqp(&d.properties));
            let _ = d.ack(BasicAckOptions::default()).await;
        }
    });
    // Until every committed event came, or a minute passed: then the checker says what is
    // missing.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        let seen: HashSet<String> = got
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.event_id.clone())
            .collect();
        if expect.is_subset(&seen) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    reader.abort();
    let _ = conn.close(200, "read".into()).await;
    got.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queue_keeps_every_confirmed_event_through_two_node_stops() {
    let cluster = Cluster::start().await;
    let db = TestDb::new().await;
    let client = db.client().await;
    let exchange = unique("it.cluster").replace('_', ".");
    let queue = format!("{exchange}.qq");

    // The exchange and a quorum queue bound to it, declared through the first node.
    let setup = AmqpTarget::parse(&cluster.url(0))
        .unwrap()
        .connect("outbox-it-cluster-setup")
        .await
        .unwrap();
    let ch = setup.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    declare_bound_queue(&ch, &queue, &exchange, "#", args).await;
    let _ = setup.close(200, "declared".into()).await;

    let urls = cluster.urls().await;
    assert_eq!(urls.split(',').count(), 3, "{urls}");
    let relay_args: Vec<String> = [
        "--database-url",
        &db.url(),
        "--amqp-url",
        &urls,
        "--exchange",
        &exchange,
        "--poll-interval",
        "200ms",
        "--lease",
        "3s",
        "--retry-min",
        "50ms",
        "--retry-max",
        "1s",
        "--confirm-timeout",
        "5s",
        "--http-listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut relay = RelayProcess::start(&unique("cluster"), &relay_args);
    let stop = CancellationToken::new();
    let producer = produce(&db, stop.clone());
    dispatches_go_on(
        &client,
        &cluster,
        &relay,
        &exchange,
        0,
        1_000,
        "the stream to flow through the cluster",
    )
    .await;

    // Stop the queue's leader mid-stream: a new leader is elected among the two others,
    // and the relay (connected to the first node that answers) fails over if it was there.
    let first = cluster.leader(&queue, None).await;
    cluster.run(&["stop-node", &first]).await;
    // The broker's part first: the two other nodes elect a new leader (a timeout here is
    // RabbitMQ's, not the relay's).
    cluster.leader(&queue, Some(&first)).await;
    let after_first = dispatched_count(&client).await;
    dispatches_go_on(
        &client,
        &cluster,
        &relay,
        &exchange,
        after_first,
        1_000,
        "the relay to go on publishing after the leader stopped",
    )
    .await;

    // Then stop the new leader: one node of three is left, the queue has no majority and
    // nothing can be confirmed. The relay keeps trying; this is how long the outage lasts.
    let second = cluster.leader(&queue, Some(&first)).await;
    cluster.run(&["stop-node", &second]).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let confirmed_before_return = dispatched(&client).await;

    // Both nodes come back; the relay must carry on by itself.
    cluster.run(&["start-node", &first]).await;
    cluster.run(&["start-node", &second]).await;
    dispatches_go_on(
        &client,
        &cluster,
        &relay,
        &exchange,
        confirmed_before_return.len() as i64,
        1_000,
        "the relay to go on after the nodes returned",
    )
    .await;
    stop.cancel();
    let committed = producer.await.unwrap();
    wait_for("every row dispatched", Duration::from_secs(120), || async {
        (db.count(&client, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay ran throughout, without a restart: {}",
        relay.log_text()
    );
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));

    // Read the queue through the node that never stopped.
    let survivor = (0..3)
        .find(|i| *i != cluster.index(&first) && *i != cluster.index(&second))
        .unwrap();
    let expect: HashSet<String> = committed.iter().map(|u| u.to_string()).collect();
    let deliveries = read_queue(&cluster.url(survivor), &queue, &expect).await;
    let in_queue: HashSet<&str> = deliveries.iter().map(|d| d.event_id.as_str()).collect();
    let confirmed_missing: Vec<&uuid::Uuid> = confirmed_before_return
        .iter()
        .filter(|id| !in_queue.contains(id.to_string().as_str()))
        .collect();
    assert!(
        confirmed_missing.is_empty(),
        "{} events the relay marked dispatched are not in the quorum queue, e.g. {:?}",
        confirmed_missing.len(),
        &confirmed_missing[..confirmed_missing.len().min(5)]
    );
    let report = checker::check(&committed, &deliveries);
    report.assert_clean();
    println!(
        "cluster: {} events, leader {first} then {second} stopped; {} marked dispatched before they returned, all in the queue; {} duplicates",
        committed.len(),
        confirmed_before_return.len(),
        report.duplicates
    );
}
