//! Test harness: a fresh database per test (created from a migrated template), random
//! exchange and queue names, a consumer that records what arrives, the relay in-process or
//! as a real process, and waits on conditions with deadlines.
//!
//! Services: Postgres at `IT_DATABASE_URL` (default postgres://postgres@127.0.0.1:5432/postgres)
//! and RabbitMQ at `IT_AMQP_URL` (default amqp://guest:guest@127.0.0.1:5672/%2f). The README's
//! test command starts them.

#![allow(dead_code)]

/// The checker (in the library, shared with `outbox-soak`), taking test deliveries.
pub mod checker {
    pub use outbox_testkit::checker::Report;

    pub fn check(committed: &[uuid::Uuid], received: &[super::Received]) -> Report {
        let deliveries: Vec<_> = received.iter().map(super::Received::delivery).collect();
        outbox_testkit::checker::check(committed, &deliveries)
    }
}

pub use outbox_testkit::proxy;

pub mod browser;
pub mod kit;
pub mod process;
pub mod tls;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_relay::relay::{Deps, Identity, RelayConfig};
use tokio::sync::OnceCell;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

pub use outbox_testkit::services::{admin_url, amqp_url};

/// One broker call of a test under the kit's deadline (15 s): a call on a gone connection
/// (a confirm that never comes, a close or a passive declare after a node restart) fails
/// the test saying which call it waited for, instead of hanging it.
pub async fn amqp<T>(what: &'static str, fut: impl Future<Output = lapin::Result<T>>) -> T {
    outbox_kit::internal::rpc(what, fut)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// [`amqp`] for best-effort calls (cleanup, a close): an error or no answer is ignored.
pub async fn amqp_best_effort<T>(what: &'static str, fut: impl Future<Output = lapin::Result<T>>) {
    let _ = outbox_kit::internal::rpc(what, fut).await;
}

/// Waits until `check` returns `Some`, polling every 20 ms; panics with `what` after `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_explained(what, limit, check, || async { String::new() }).await
}

/// As [`wait_for`]; a timeout's panic adds what `explain` then says (the state of things).
pub async fn wait_for_explained<T, F, Fut, E, EFut>(
    what: &str,
    limit: Duration,
    mut check: F,
    explain: E,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
    E: FnOnce() -> EFut,
    EFut: Future<Output = String>,
{
    let start = Instant::now();
    loop {
        // A check that hangs (a connection to a broker that is restarting) must not outlive
        // the deadline: it is cut off there and counts as not yet.
        let left = limit.saturating_sub(start.elapsed()) + Duration::from_secs(1);
        if let Ok(Some(v)) = tokio::time::timeout(left, check()).await {
            return v;
        }
        if start.elapsed() > limit {
            panic!(
                "timed out after {limit:?} waiting for {what}{}",
                explain().await
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A name unique to this test run: `<prefix>_<pid>_<n>`.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

static TEMPLATE: OnceCell<String> = OnceCell::const_new();

async fn admin() -> Client {
    let target = DbTarget::parse(&admin_url()).unwrap();
    target
        .connect(&Schema::default(), "outbox-it-admin")
        .await
        .expect("postgres reachable")
}

/// The migrated template database, built once per test process.
async fn template() -> &'static str {
    TEMPLATE
        .get_or_init(|| async {
            let admin = admin().await;
            // Another test process may be building it too: serialize on an advisory lock.
            // Building it can take longer than the kit's statement timeout on a busy
            // machine, so this wait has none.
            admin
                .batch_execute("SET statement_timeout = 0; SELECT pg_advisory_lock(4242)")
                .await
                .unwrap();
            let checksum: String = outbox_kit::schema::MIGRATIONS
                .iter()
                .map(|m| m.sql)
                .chain(outbox_kit::schema::REPEATABLE.iter().map(|f| f.sql))
                .collect();
            let hash = admin
                .query_one("SELECT substr(md5($1), 1, 12)", &[&checksum])
                .await
                .unwrap()
                .get::<_, String>(0);
            let name = format!("outbox_it_tpl_{hash}");
            let exists = admin
                .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
                .await
                .unwrap()
                .is_some();
            if !exists {
                admin
                    .batch_execute(&format!("CREATE DATABASE {name}"))
                    .await
                    .unwrap();
                let target = DbTarget::parse(&admin_url()).unwrap().with_dbname(&name);
                let mut c = target
                    .connect(&Schema::default(), "outbox-it-admin")
                    .await
                    .unwrap();
                outbox_kit::schema::migrate(&mut c, &Schema::default())
                    .await
                    .unwrap();
                drop(c);
                // Stale test databases of earlier runs whose process is gone.
                let rows = admin
                    .query(
                        "SELECT datname FROM pg_database WHERE datname LIKE 'it\\_%'",
                        &[],
                    )
                    .await
                    .unwrap();
                for row in rows {
                    let db: String = row.get(0);
                    let pid: Option<u32> = db.split('_').nth(1).and_then(|p| p.parse().ok());
                    if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
                        let _ = admin
                            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                            .await;
                    }
                }
            }
            admin
                .execute("SELECT pg_advisory_unlock(4242)", &[])
                .await
                .unwrap();
            name
        })
        .await
}

/// Waits (30 s at most) until some relay holds every one of the 64 partitions.
pub async fn wait_leased(client: &Client) {
    wait_for("partitions leased", Duration::from_secs(30), || async {
        let owned: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_partitions WHERE owner IS NOT NULL",
                &[],
            )
            .await
            .ok()?
            .get(0);
        (owned == 64).then_some(())
    })
    .await;
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    pub name: String,
    pub target: DbTarget,
    pub schema: Schema,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let template = template().await;
        let name = unique("it");
        let admin = admin().await;
        let mut tries = 0;
        loop {
            match admin
                .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
                .await
            {
                Ok(()) => break,
                // "source database is being accessed by other users": another test is copying.
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50 + tries * 10)).await;
                }
                Err(e) => panic!("create test database: {e}"),
            }
        }
        let target = DbTarget::parse(&admin_url()).unwrap().with_dbname(&name);
        TestDb {
            name,
            target,
            schema: Schema::default(),
        }
    }

    /// A fresh database made by `CREATE DATABASE <name> <options>` (another encoding, say)
    /// instead of from the template, then migrated.
    pub async fn created_with(options: &str) -> TestDb {
        let name = unique("it");
        admin()
            .await
            .batch_execute(&format!("CREATE DATABASE {name} {options}"))
            .await
            .expect("create test database");
        let target = DbTarget::parse(&admin_url()).unwrap().with_dbname(&name);
        let mut client = target
            .connect(&Schema::default(), "outbox-it-admin")
            .await
            .unwrap();
        outbox_kit::schema::migrate(&mut client, &Schema::default())
            .await
            .unwrap();
        TestDb {
            name,
            target,
            schema: Schema::default(),
        }
    }

    pub fn url(&self) -> String {
        let base = admin_url();
        let (prefix, _) = base.rsplit_once('/').expect("url with a database");
        format!("{prefix}/{}", self.name)
    }

    /// The test's own connection. Its statements (bulk inserts of a test's setup) have no
    /// statement timeout: on a busy machine they can outlast the kit's 25 s.
    pub async fn client(&self) -> Client {
        let client = self
            .target
            .connect(&self.schema, "outbox-it")
            .await
            .expect("connect test db");
        client
            .batch_execute("SET statement_timeout = 0")
            .await
            .expect("unset the statement timeout");
        client
    }

    pub fn pool(&self) -> deadpool_postgres::Pool {
        self.target.pool(&self.schema, "outbox-relay", 8)
    }

    /// Inserts `n` events for `keys` keys with a plain INSERT; returns their event ids.
    pub async fn insert(&self, client: &Client, n: usize, keys: usize) -> Vec<uuid::Uuid> {
        let rows = client
            .query(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', 'k' || (g % $2), 'created', jsonb_build_object('n', g)
                   FROM generate_series(1, $1::int) AS g
                 RETURNING event_id",
                &[&(n as i32), &(keys as i32)],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Inserts `n` events for `keys` keys (ids prefixed with `prefix`) through `client`,
    /// which may be a transaction.
    pub async fn insert_in(
        &self,
        client: &impl tokio_postgres::GenericClient,
        n: usize,
        keys: usize,
        prefix: &str,
    ) -> Vec<uuid::Uuid> {
        let rows = client
            .query(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', $3 || (g % $2), 'created', jsonb_build_object('n', g)
                   FROM generate_series(1, $1::int) AS g
                 RETURNING event_id",
                &[&(n as i32), &(keys as i32), &prefix],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    }

    pub async fn count(&self, client: &Client, condition: &str) -> i64 {
        client
            .query_one(
                &format!("SELECT count(*) FROM outbox_events WHERE {condition}"),
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Terminates every connection of the relay (pool and LISTEN) to this database.
    pub async fn terminate_relay_connections(&self, like: &str) -> i64 {
        let admin = admin().await;
        admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE datname = $1 AND application_name LIKE $2",
                &[&self.name, &like],
            )
            .await
            .unwrap()
            .get(0)
    }
}

/// One message as the test consumer received it.
#[derive(Clone, Debug)]
pub struct Received {
    pub message_id: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub headers: HashMap<String, AMQPValue>,
    pub content_type: Option<String>,
    pub kind: Option<String>,
    pub timestamp: Option<u64>,
    pub delivery_mode: Option<u8>,
    pub at: Instant,
}

impl Received {
    pub fn delivery(&self) -> outbox_testkit::checker::Delivery {
        outbox_testkit::checker::Delivery {
            event_id: self.message_id.clone(),
            key: self.key(),
            seq: self.seq(),
        }
    }

    pub fn header_str(&self, name: &str) -> Option<String> {
        match self.headers.get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }

    pub fn seq(&self) -> Option<i64> {
        match self.headers.get("x-outbox-seq")? {
            AMQPValue::LongLongInt(n) => Some(*n),
            AMQPValue::LongInt(n) => Some(*n as i64),
            _ => None,
        }
    }

    pub fn key(&self) -> (String, String) {
        (
            self.header_str("x-outbox-aggregate-type")
                .unwrap_or_default(),
            self.header_str("x-outbox-aggregate-id").unwrap_or_default(),
        )
    }
}

/// Declares a durable queue with `args` and binds it to `exchange` with `binding` (`#` for
/// every routing key; empty: not bound).
pub async fn declare_bound_queue(
    ch: &lapin::Channel,
    queue: &str,
    exchange: &str,
    binding: &str,
    args: FieldTable,
) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    amqp(
        "queue.declare",
        ch.queue_declare(queue.into(), durable, args),
    )
    .await;
    if !binding.is_empty() {
        amqp(
            "queue.bind",
            ch.queue_bind(
                queue.into(),
                exchange.into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await;
    }
}

/// An exchange and a queue bound to it, with everything received recorded in order.
pub struct Broker {
    pub exchange: String,
    pub queue: String,
    pub conn: Arc<Connection>,
    pub received: Arc<Mutex<Vec<Received>>>,
    stop: CancellationToken,
}

impl Broker {
    /// Declares a topic exchange and a queue bound with `binding` (`#` for everything).
    pub async fn new(binding: &str) -> Broker {
        Broker::with_queue_args(binding, FieldTable::default()).await
    }

    pub async fn with_queue_args(binding: &str, args: FieldTable) -> Broker {
        let exchange = unique("it.ex").replace('_', ".");
        let queue = format!("{exchange}.q");
        let target = AmqpTarget::parse(&amqp_url()).unwrap();
        let conn = target
            .connect(&format!("outbox-it-consumer {exchange}"))
            .await
            .expect("rabbitmq reachable");
        let ch = amqp("channel.open", conn.create_channel()).await;
        amqp(
            "exchange.declare",
            ch.exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    auto_delete: false,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await;
        declare_bound_queue(&ch, &queue, &exchange, binding, args).await;
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let mut consumer = amqp(
            "basic.consume",
            ch.basic_consume(
                queue.as_str().into(),
                "it".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await;
        let sink = received.clone();
        let s = stop.clone();
        tokio::spawn(async move {
            loop {
                let d = tokio::select! {
                    _ = s.cancelled() => return,
                    d = consumer.next() => d,
                };
                let Some(Ok(d)) = d else { return };
                let p = &d.properties;
                let headers = p
                    .headers()
                    .as_ref()
                    .map(|h| {
                        h.inner()
                            .iter()
                            .map(|(k, v)| (k.as_str().to_owned(), v.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                sink.lock().unwrap().push(Received {
                    message_id: p
                        .message_id()
                        .as_ref()
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_default(),
                    routing_key: d.routing_key.as_str().to_owned(),
                    body: d.data.clone(),
                    headers,
                    content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
                    kind: p.kind().as_ref().map(|s| s.as_str().to_owned()),
                    timestamp: *p.timestamp(),
                    delivery_mode: *p.delivery_mode(),
                    at: Instant::now(),
                });
                amqp_best_effort("basic.ack", d.ack(BasicAckOptions::default())).await;
            }
        });
        Broker {
            exchange,
            queue,
            conn: Arc::new(conn),
            received,
            stop,
        }
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    /// A second queue bound to everything that refuses every message (x-max-length 0,
    /// overflow reject-publish), so the broker nacks each publish; deleting it (through the
    /// returned channel) ends the nacks. Returns the channel and the queue's name.
    pub async fn refusing_queue(&self) -> (lapin::Channel, String) {
        let full = format!("{}.full", self.exchange);
        let ch = amqp("channel.open", self.conn.create_channel()).await;
        let mut args = FieldTable::default();
        args.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(0));
        args.insert(
            ShortString::from("x-overflow"),
            AMQPValue::LongString(LongString::from("reject-publish")),
        );
        declare_bound_queue(&ch, &full, &self.exchange, "#", args).await;
        (ch, full)
    }

    /// Binds another routing key to the test queue.
    pub async fn bind(&self, binding: &str) {
        let ch = amqp("channel.open", self.conn.create_channel()).await;
        amqp(
            "queue.bind",
            ch.queue_bind(
                self.queue.as_str().into(),
                self.exchange.as_str().into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await;
    }

    /// Waits until every one of `ids` arrived at least once. Under faults redeliveries
    /// make the raw count overshoot, so a count is no proof that nothing is missing.
    pub async fn wait_all(&self, ids: &[uuid::Uuid], limit: Duration) {
        let wanted: std::collections::HashSet<String> = ids.iter().map(|u| u.to_string()).collect();
        wait_for(
            &format!("all {} committed events in {}", wanted.len(), self.queue),
            limit,
            || async {
                let got = self.received.lock().unwrap();
                let seen: std::collections::HashSet<&str> =
                    got.iter().map(|r| r.message_id.as_str()).collect();
                wanted
                    .iter()
                    .all(|id| seen.contains(id.as_str()))
                    .then_some(())
            },
        )
        .await;
    }

    /// Waits until at least `n` messages arrived.
    pub async fn wait_count(&self, n: usize, limit: Duration) {
        wait_for(
            &format!("{n} messages in {}", self.queue),
            limit,
            || async {
                let c = self.count();
                (c >= n).then_some(())
            },
        )
        .await;
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop.cancel();
        let conn = self.conn.clone();
        let (exchange, queue) = (self.exchange.clone(), self.queue.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let rpc = outbox_kit::internal::rpc;
                if let Ok(ch) = rpc("channel.open", conn.create_channel()).await {
                    amqp_best_effort(
                        "queue.delete",
                        ch.queue_delete(queue.as_str().into(), Default::default()),
                    )
                    .await;
                    amqp_best_effort(
                        "exchange.delete",
                        ch.exchange_delete(exchange.as_str().into(), Default::default()),
                    )
                    .await;
                }
                amqp_best_effort("connection.close", conn.close(200, "test done".into())).await;
            });
        }
    }
}

/// A relay running inside the test process.
pub struct InProcessRelay {
    pub stop: CancellationToken,
    pub handle: tokio::task::JoinHandle<Result<(), outbox_relay::relay::RelayError>>,
    pub identity: Identity,
}

impl InProcessRelay {
    pub fn start(db: &TestDb, config: RelayConfig) -> InProcessRelay {
        Self::start_named(db, config, &unique("relay"))
    }

    pub fn start_named(db: &TestDb, config: RelayConfig, name: &str) -> InProcessRelay {
        let deps = Deps {
            pool: db.pool(),
            db: db.target.clone(),
            schema: db.schema.clone(),
            amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
            telemetry: Default::default(),
        };
        Self::start_with(deps, config, name)
    }

    pub fn start_with(deps: Deps, config: RelayConfig, name: &str) -> InProcessRelay {
        let identity = Identity {
            relay_id: name.to_owned(),
            host: "test".into(),
            pid: std::process::id() as i32,
            connection_name: format!("outbox-relay-it {name}"),
        };
        let stop = CancellationToken::new();
        let handle = tokio::spawn(outbox_relay::relay::run_as(
            deps,
            config,
            identity.clone(),
            stop.clone(),
        ));
        InProcessRelay {
            stop,
            handle,
            identity,
        }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("relay stops within 30 s")
            .expect("relay task")
            .expect("relay ran without error");
    }
}

/// A relay config for tests: fast polling, short timeouts.
pub fn test_config(broker: &Broker) -> RelayConfig {
    let mut c = RelayConfig::new(&broker.exchange);
    c.poll_interval = Duration::from_millis(200);
    c.retry_min = Duration::from_millis(50);
    c.retry_max = Duration::from_millis(500);
    c.lease = Duration::from_secs(3);
    c.confirm_timeout = Duration::from_secs(5);
    c.shutdown_timeout = Duration::from_secs(10);
    c
}

/// Runs `rabbitmqctl` with `args`; returns stdout.
pub async fn rabbitmqctl(args: &[&str]) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .await
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Closes, from the broker side, every connection whose name contains `needle`.
pub async fn close_connections(needle: &str) -> usize {
    let listing = rabbitmqctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ])
    .await;
    let mut closed = 0;
    for line in listing.lines() {
        if line.contains(needle) {
            let pid = line.split_whitespace().next().unwrap_or_default();
            rabbitmqctl(&["close_connection", pid, "closed by test"]).await;
            closed += 1;
        }
    }
    closed
}
