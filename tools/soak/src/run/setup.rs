//! Around one run: the upstream addresses behind the proxies, one proxy per process and
//! service, the relay and consumer processes (slots) with their flags, the destination and
//! the tap; afterwards every process is killed and the broker's names deleted.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_testkit::proxy::TcpProxy;
use tokio::sync::Notify;

use crate::consumer;
use crate::destination;
use crate::procs::Slot;
use crate::schedule::{Planned, Shape, Target};
use crate::tap::Tap;

use super::drive::drive;
use super::faults::World;
use super::wiring::{Proxies, app_name};
use super::{Own, RunArgs};

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Postgres and RabbitMQ addresses and credentials from the URLs, for the proxied URLs.
pub(super) struct Upstreams {
    pg: SocketAddr,
    pg_user: String,
    pg_password: Option<String>,
    amqp: SocketAddr,
    amqp_user: String,
    amqp_password: String,
    vhost: String,
}

pub(super) async fn upstreams(args: &RunArgs) -> anyhow::Result<Upstreams> {
    let pg = tokio_postgres::Config::from_str(&args.database_url)?;
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => anyhow::bail!("--database-url must name a TCP host"),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let pg_addr = tokio::net::lookup_host((host.as_str(), port))
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{host} does not resolve"))?;
    let first = args.amqp_url.split(',').next().unwrap_or_default();
    let uri = lapin::uri::AMQPUri::from_str(first).map_err(anyhow::Error::msg)?;
    let a = &uri.authority;
    let amqp_addr = tokio::net::lookup_host((a.host.as_str(), a.port))
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{} does not resolve", a.host))?;
    Ok(Upstreams {
        pg: pg_addr,
        pg_user: pg.get_user().unwrap_or("postgres").to_owned(),
        pg_password: pg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned()),
        amqp: amqp_addr,
        amqp_user: a.userinfo.username.clone(),
        amqp_password: a.userinfo.password.clone(),
        vhost: uri.vhost.clone(),
    })
}

impl Upstreams {
    fn pg_url(&self, port: u16, db: &str) -> String {
        let password = self
            .pg_password
            .as_ref()
            .map(|p| format!(":{p}"))
            .unwrap_or_default();
        format!(
            "postgres://{}{password}@127.0.0.1:{port}/{db}",
            self.pg_user
        )
    }

    fn amqp_url(&self, port: u16) -> String {
        let vhost = if self.vhost == "/" {
            "%2f".to_owned()
        } else {
            self.vhost.clone()
        };
        format!(
            "amqp://{}:{}@127.0.0.1:{port}/{vhost}",
            self.amqp_user, self.amqp_password
        )
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn soak(
    args: &RunArgs,
    shape: &Shape,
    plan: Vec<Planned>,
    up: &Upstreams,
    target: &DbTarget,
    db_name: &str,
    work: &std::path::Path,
    relay_bin: &std::path::Path,
    exe: &std::path::Path,
    own: Option<Arc<Own>>,
) -> anyhow::Result<bool> {
    let schema = Schema::default();
    let mut client = target.connect(&schema, "outbox-soak").await?;
    // (`client` goes to `drive`, which connects again after the faults: a restart of
    // Postgres ends this one.)
    outbox_kit::schema::migrate(&mut client, &schema).await?;
    client.batch_execute(consumer::SOAK_TABLES).await?;

    let tag = db_name.trim_start_matches("soak_").replace('_', ".");
    let exchange = format!("soak.{tag}");
    let queue = format!("soak.{tag}.apply");
    let amqp = AmqpTarget::parse(&args.amqp_url).map_err(anyhow::Error::msg)?;

    let mut proxies = Proxies {
        relay_pg: Vec::new(),
        relay_amqp: Vec::new(),
        consumer_pg: Vec::new(),
        consumer_amqp: Vec::new(),
    };
    for _ in 0..args.relays {
        proxies.relay_pg.push(TcpProxy::start(up.pg).await);
        proxies.relay_amqp.push(TcpProxy::start(up.amqp).await);
    }
    for _ in 0..args.consumers {
        proxies.consumer_pg.push(TcpProxy::start(up.pg).await);
        proxies.consumer_amqp.push(TcpProxy::start(up.amqp).await);
    }
    let (dest_addr, book, mut crashed) = destination::start().await;
    let tap_queue = format!("soak.{tag}.tap");
    let tap = Tap::start(&amqp, &exchange, &tap_queue).await?;

    let lease = humantime::format_duration(args.lease).to_string();
    let relays: Vec<Slot> = (0..args.relays)
        .map(|i| {
            let db_url = format!(
                "{}?application_name={}",
                up.pg_url(proxies.relay_pg[i].port(), db_name),
                app_name(Target::Relay(i))
            );
            let amqp_url = up.amqp_url(proxies.relay_amqp[i].port());
            let exchange = exchange.clone();
            let lease = lease.clone();
            Slot::new(
                &format!("relay {i}"),
                relay_bin.to_owned(),
                move |_| {
                    [
                        "run",
                        "--database-url",
                        &db_url,
                        "--amqp-url",
                        &amqp_url,
                        "--exchange",
                        &exchange,
                        "--no-migrate",
                        "--poll-interval",
                        "200ms",
                        "--lease",
                        &lease,
                        "--retry-min",
                        "50ms",
                        "--retry-max",
                        "1s",
                        "--confirm-timeout",
                        "5s",
                        "--batch-size",
                        "200",
                        "--confirm-window",
                        "256",
                        "--shutdown-timeout",
                        "10s",
                        "--http-listen",
                        "127.0.0.1:0",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect()
                },
                vec![
                    ("RUST_LOG".into(), "info,lapin=error".into()),
                    ("NO_COLOR".into(), "1".into()),
                ],
                work.join(format!("relay-{i}.log")),
            )
        })
        .collect();
    let consumers: Vec<Slot> = (0..args.consumers)
        .map(|i| {
            let db_url = up.pg_url(proxies.consumer_pg[i].port(), db_name);
            let amqp_url = up.amqp_url(proxies.consumer_amqp[i].port());
            let (exchange, queue) = (exchange.clone(), queue.clone());
            let prefetch = args.prefetch.max(1).to_string();
            Slot::new(
                &format!("consumer {i}"),
                exe.to_owned(),
                move |incarnation| {
                    vec![
                        "consumer".into(),
                        "--database-url".into(),
                        db_url.clone(),
                        "--amqp-url".into(),
                        amqp_url.clone(),
                        "--exchange".into(),
                        exchange.clone(),
                        "--queue".into(),
                        queue.clone(),
                        "--destination".into(),
                        dest_addr.to_string(),
                        "--worker".into(),
                        destination::worker_name(i, incarnation),
                        "--application-name".into(),
                        app_name(Target::Consumer(i)),
                        "--prefetch".into(),
                        prefetch.clone(),
                    ]
                },
                vec![
                    (
                        "RUST_LOG".into(),
                        "warn,outbox_relay=info,lapin=error".into(),
                    ),
                    ("NO_COLOR".into(), "1".into()),
                ],
                work.join(format!("consumer-{i}.log")),
            )
        })
        .collect();
    let world = Arc::new(World {
        db_name: db_name.to_owned(),
        exchange: exchange.clone(),
        queue: queue.clone(),
        amqp: amqp.clone(),
        target: target.clone(),
        relays,
        consumers,
        proxies,
        book: book.clone(),
        crash_points: (0..args.consumers).map(|_| Notify::new()).collect(),
        host: hostname(),
        injected_copies: Mutex::new(0),
        rabbit_node: own.as_ref().map(|o| o.rabbit.node(0)),
        own,
        tap,
        ack_not_marked: Mutex::default(),
        gates: Default::default(),
    });
    {
        let w = world.clone();
        tokio::spawn(async move {
            while let Some(slot) = crashed.recv().await {
                if let Some(n) = w.crash_points.get(slot) {
                    n.notify_one();
                }
            }
        });
    }
    let result = drive(args, shape, plan, &world, client, &queue, work).await;
    // Whatever happened, nothing of ours keeps running.
    for slot in world.relays.iter().chain(&world.consumers) {
        slot.kill().await;
    }
    world.tap.stop().await;
    if !args.keep && world.own.is_none() {
        cleanup_broker(&amqp, &exchange, &queue, &tap_queue).await;
    }
    result
}

async fn cleanup_broker(amqp: &AmqpTarget, exchange: &str, queue: &str, tap: &str) {
    let Ok(conn) = amqp.connect("outbox-soak-cleanup").await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        let mut queues = vec![queue.to_owned(), format!("{queue}.dlq"), tap.to_owned()];
        queues.extend(consumer::group_queues(queue, exchange));
        for ms in [100, 200, 400, 800, 1000] {
            queues.push(format!("{queue}.retry.{ms}ms"));
        }
        for q in queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        for x in [
            format!("{queue}.dlx"),
            format!("{queue}.route"),
            exchange.to_owned(),
        ] {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = conn.close(200, "cleanup".into()).await;
}
