//! `outbox-relay group-router`: an ordered consumer group's router as a process of its own,
//! so that a group whose members are Python, Go or Node services on the SQL functions
//! (docs/consumer-kit.md, "Ordered groups in any language") has per-key order too. The
//! routing is the kit's ([`GroupRouter`]): one unconfirmed copy per key, an intake delivery
//! acked only after its copy was confirmed and not returned (copies go to the partition
//! queue by name with `mandatory`), a connection of its own. This module runs it, starts it again after a failure, samples
//! the group (queue depths, live members) for `/metrics`, and says whether it is ready.
//!
//! Invariants: nothing is routed before the group's partition count is recorded and its
//! topology declared ([`GroupRouter::prepare`]). A SIGTERM stops taking intake deliveries,
//! waits for the copies in flight and acks those confirmed; what is unacked goes back to
//! the intake in its order for the next router. Ready (`/readyz`) only while the group is
//! prepared, the last sample reached Postgres and RabbitMQ, and it is not shutting down.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use deadpool_postgres::Pool;
use outbox_kit::consumer::runner::{ConsumerError, DepthProbe, GroupDepths, GroupRouter};
use outbox_kit::internal::Down;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// What `outbox-relay group-router` runs, validated.
#[derive(Debug)]
pub struct GroupRouterConfig {
    pub db: outbox_kit::db::DbTarget,
    pub schema: outbox_kit::contract::Schema,
    pub amqp: outbox_kit::amqp::AmqpTarget,
    pub group: outbox_kit::consumer::runner::ConsumerConfig,
    pub http_listen: Option<std::net::SocketAddr>,
}

impl GroupRouterConfig {
    /// The kit's router of this group.
    pub fn router(&self) -> GroupRouter {
        GroupRouter::new(self.group.clone(), self.amqp.clone())
            .expect("checked when the flags were parsed")
    }
}

/// The live members of a group (their lease not run out), by the database's clock.
const MEMBERS: &str = "SELECT count(*) FROM outbox_consumer_members
                        WHERE consumer = $1 AND lease_until > clock_timestamp()";
/// How often the group is sampled for the metrics and readiness.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How long a router that ended waits before it starts again (as inside a Rust member).
const RESTART_AFTER: Duration = Duration::from_secs(1);
/// The deadline of one sample's database round trip.
const DB_DEADLINE: Duration = Duration::from_secs(5);

/// The router's metrics and readiness, shared with the HTTP endpoint.
#[derive(Debug)]
pub struct RouterTelemetry {
    registry: Registry,
    consumer: String,
    running: Gauge,
    restarts: Counter,
    intake: Gauge,
    intake_consumers: Gauge,
    partitions: Gauge,
    partitions_unconsumed: Gauge,
    members: Gauge,
    prepared: AtomicBool,
    postgres_up: AtomicBool,
    amqp_up: AtomicBool,
    stopping: AtomicBool,
}

impl RouterTelemetry {
    /// The metrics of the router of group `consumer`.
    pub fn new(consumer: &str) -> RouterTelemetry {
        let mut t = RouterTelemetry {
            registry: Registry::default(),
            consumer: consumer.to_owned(),
            running: Gauge::default(),
            restarts: Counter::default(),
            intake: Gauge::default(),
            intake_consumers: Gauge::default(),
            partitions: Gauge::default(),
            partitions_unconsumed: Gauge::default(),
            members: Gauge::default(),
            prepared: AtomicBool::new(false),
            postgres_up: AtomicBool::new(false),
            amqp_up: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        };
        let r = &mut t.registry;
        r.register(
            "outbox_group_router_running",
            "1 while this process's router runs (connecting, routing, or waiting its turn on the intake); 0 between a failure and its restart",
            t.running.clone(),
        );
        r.register(
            "outbox_group_router_restarts",
            "Times the router ended on a failure and started again",
            t.restarts.clone(),
        );
        r.register(
            "outbox_group_intake_messages",
            "Events ready in the group's intake queue (not routed yet)",
            t.intake.clone(),
        );
        r.register(
            "outbox_group_intake_consumers",
            "Routers consuming the intake queue (one active, the others waiting)",
            t.intake_consumers.clone(),
        );
        r.register(
            "outbox_group_partition_messages",
            "Events ready in all partition queues together (not taken by a member yet)",
            t.partitions.clone(),
        );
        r.register(
            "outbox_group_partitions_unconsumed",
            "Partition queues without a consumer",
            t.partitions_unconsumed.clone(),
        );
        r.register(
            "outbox_group_members",
            "Members of the group whose heartbeat lease is live",
            t.members.clone(),
        );
        t
    }

    /// Whether `/readyz` says ready.
    pub fn ready(&self) -> bool {
        self.prepared.load(Ordering::Relaxed)
            && self.postgres_up.load(Ordering::Relaxed)
            && self.amqp_up.load(Ordering::Relaxed)
            && !self.stopping.load(Ordering::Relaxed)
    }

    /// Why not ready, for the response body.
    pub fn describe(&self) -> String {
        let up = |b: &AtomicBool| {
            if b.load(Ordering::Relaxed) {
                "up"
            } else {
                "down"
            }
        };
        format!(
            "group {}: {}, postgres {}, rabbitmq {}{}",
            self.consumer,
            if self.prepared.load(Ordering::Relaxed) {
                "topology declared"
            } else {
                "topology not declared yet"
            },
            up(&self.postgres_up),
            up(&self.amqp_up),
            if self.stopping.load(Ordering::Relaxed) {
                ", shutting down"
            } else {
                ""
            }
        )
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }

    fn prepared(&self, exchange: &str, intake: &str, partitions: u16) {
        self.prepared.store(true, Ordering::Relaxed);
        info!(target: "outbox_relay", consumer = %self.consumer, exchange, intake, partitions, "group prepared: partition count recorded, topology in place");
    }

    fn router_started(&self) {
        self.running.set(1);
    }

    fn router_ended(&self, why: &str) {
        self.running.set(0);
        self.restarts.inc();
        warn!(target: "outbox_relay", consumer = %self.consumer, why, "group router ended; its unacked intake messages went back to the intake, starting again");
    }

    fn stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        info!(target: "outbox_relay", consumer = %self.consumer, "shutting down: finishing the copies in flight");
    }

    fn stopped(&self) {
        self.running.set(0);
        info!(target: "outbox_relay", consumer = %self.consumer, "group router stopped");
    }

    fn sampled_broker(&self, d: GroupDepths) {
        self.amqp_up.store(true, Ordering::Relaxed);
        let set = |g: &Gauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
        set(&self.intake, d.intake);
        set(&self.intake_consumers, d.intake_consumers);
        set(&self.partitions, d.partitions);
        set(&self.partitions_unconsumed, d.partitions_unconsumed);
    }

    fn sampled_members(&self, n: i64) {
        self.postgres_up.store(true, Ordering::Relaxed);
        self.members.set(n);
    }
}

/// Prepares the group, then routes until `shutdown`, starting the router again after each
/// failure; samples the group for the metrics meanwhile. Returns an error only for what a
/// restart cannot fix (another partition count recorded, a topology the broker refuses).
pub async fn run(
    router: GroupRouter,
    pool: Pool,
    telemetry: Arc<RouterTelemetry>,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    if !router.prepare(&pool, &shutdown).await? {
        return Ok(());
    }
    let cfg = router.config();
    telemetry.prepared(
        &cfg.exchange,
        &cfg.intake_queue(),
        cfg.ordered.as_ref().map_or(0, |o| o.partitions.get()),
    );
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn(sample(
        router.probe(),
        pool,
        cfg.name.clone(),
        telemetry.clone(),
        sampling.clone(),
    ));
    let watch = {
        let (shutdown, telemetry) = (shutdown.clone(), telemetry.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            telemetry.stopping();
        })
    };
    route(&router, &telemetry, &shutdown).await;
    watch.abort();
    sampling.cancel();
    let _ = sampler.await;
    Ok(())
}

/// Routes until `shutdown`, starting the router again a second after each failure.
async fn route(router: &GroupRouter, telemetry: &RouterTelemetry, shutdown: &CancellationToken) {
    loop {
        telemetry.router_started();
        // The router watches the shutdown itself: it stops taking, finishes its copies in
        // flight, acks those confirmed, and only then closes its channels.
        let ended = router.route(shutdown.clone()).await;
        match ended {
            Ok(()) => break,
            Err(why) if shutdown.is_cancelled() => {
                warn!(target: "outbox_relay", why, "group router ended while shutting down");
                break;
            }
            Err(why) => {
                telemetry.router_ended(&why);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(RESTART_AFTER) => {}
                }
            }
        }
    }
    telemetry.stopped();
}

/// Samples the group's queues and live members every [`SAMPLE_EVERY`] until `stop`.
async fn sample(
    mut probe: DepthProbe,
    pool: Pool,
    consumer: String,
    telemetry: Arc<RouterTelemetry>,
    stop: CancellationToken,
) {
    let mut broker_down = Down::new("rabbitmq (group router probe)");
    let mut db_down = Down::new("postgres (group router)");
    loop {
        match probe.sample().await {
            Ok(d) => {
                broker_down.recovered();
                telemetry.sampled_broker(d);
            }
            Err(e) => {
                telemetry.amqp_up.store(false, Ordering::Relaxed);
                broker_down.failed(&e, SAMPLE_EVERY);
            }
        }
        let members = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            let row = client
                .query_one(MEMBERS, &[&consumer])
                .await
                .map_err(|e| e.to_string())?;
            Ok::<i64, String>(row.get(0))
        };
        match tokio::time::timeout(DB_DEADLINE, members).await {
            Ok(Ok(n)) => {
                db_down.recovered();
                telemetry.sampled_members(n);
            }
            Ok(Err(e)) => {
                telemetry.postgres_up.store(false, Ordering::Relaxed);
                db_down.failed(&e, SAMPLE_EVERY);
            }
            Err(_) => {
                telemetry.postgres_up.store(false, Ordering::Relaxed);
                db_down.failed(&"no answer in time", SAMPLE_EVERY);
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    }
}

/// The router's HTTP endpoint: `/livez`, `/readyz`, `/metrics`.
pub fn app(telemetry: Arc<RouterTelemetry>) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(telemetry)
}

async fn readyz(State(t): State<Arc<RouterTelemetry>>) -> Response {
    crate::http::readiness(t.ready(), || t.describe())
}

async fn metrics(State(t): State<Arc<RouterTelemetry>>) -> Response {
    crate::http::openmetrics(t.encode())
}
