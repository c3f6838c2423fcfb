//! Operating the relay: metrics and health over HTTP, retention, trace headers, TLS,
//! passwords kept out of logs.

use std::net::SocketAddr;
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::{Schema, Secret};
use outbox_kit::db::DbTarget;
use outbox_relay::http::{self, HttpState};
use outbox_relay::relay::{Deps, RelayConfig};
use outbox_relay::telemetry::Telemetry;
use tokio_util::sync::CancellationToken;

use crate::support::checker::check;
use crate::support::process::{RelayProcess, run_to_end};
use crate::support::proxy::{Mode, TcpProxy};
use crate::support::tls::{Preamble, TestCa, tls_proxy};
use crate::support::{
    Broker, InProcessRelay, TestDb, admin_url, amqp_url, test_config, unique, wait_for,
};

/// A relay in-process with its HTTP endpoint on a free port.
struct Served {
    relay: InProcessRelay,
    base: String,
    stop_http: CancellationToken,
}

impl Served {
    async fn start(
        db: &TestDb,
        amqp: AmqpTarget,
        config: RelayConfig,
        token: Option<&str>,
    ) -> Served {
        let telemetry = Telemetry::default();
        let pool = db.pool();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let stop_http = CancellationToken::new();
        let state = HttpState::new(
            telemetry.clone(),
            &db.target,
            &db.schema,
            token.map(Secret::new),
        );
        tokio::spawn(http::serve(listener, state, stop_http.clone()));
        let deps = Deps {
            pool,
            db: db.target.clone(),
            schema: db.schema.clone(),
            amqp,
            telemetry,
        };
        let relay = InProcessRelay::start_with(deps, config, &unique("served"));
        Served {
            relay,
            base: format!("http://{addr}"),
            stop_http,
        }
    }

    async fn get(&self, path: &str) -> (u16, String) {
        let r = reqwest::get(format!("{}{path}", self.base)).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// One sample's value from /metrics (`name` with its labels, as printed).
    async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }

    async fn stop(self) {
        self.relay.stop().await;
        self.stop_http.cancel();
    }
}

fn local_amqp() -> AmqpTarget {
    AmqpTarget::parse(&amqp_url()).unwrap()
}

/// The metrics move with the events: published, acked, dispatched, latencies, pending
/// rows, LISTEN up, partitions held; and rows no NOTIFY announced are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_the_events() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let served = Served::start(&db, local_amqp(), test_config(&broker), None).await;
    assert_eq!(served.get("/livez").await.0, 200);
    wait_for("ready", Duration::from_secs(20), || async {
        (served.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    let client = db.client().await;
    wait_for(
        "listening and holding all partitions",
        Duration::from_secs(20),
        || async {
            let listening = served.metric("outbox_listen_connected").await == 1.0;
            let held = served.metric("outbox_leased_partitions").await == 64.0;
            let hint: Option<bool> = client
                .query_one("SELECT bool_and(wants_wakeup) FROM outbox_relays", &[])
                .await
                .unwrap()
                .get(0);
            (listening && held && hint == Some(true)).then_some(())
        },
    )
    .await;
    let committed = db.insert(&client, 100, 10).await;
    broker.wait_count(100, Duration::from_secs(30)).await;
    wait_for("100 rows marked", Duration::from_secs(10), || async {
        (served.metric("outbox_rows_dispatched_total").await == 100.0).then_some(())
    })
    .await;
    assert_eq!(
        served.metric("outbox_messages_published_total").await,
        100.0
    );
    assert_eq!(served.metric("outbox_messages_acked_total").await, 100.0);
    assert_eq!(served.metric("outbox_messages_returned_total").await, 0.0);
    assert_eq!(
        served
            .metric("outbox_commit_to_confirm_seconds_count")
            .await,
        100.0
    );
    assert_eq!(
        served.metric("outbox_confirm_latency_seconds_count").await,
        100.0
    );
    assert_eq!(
        served.metric("outbox_rows_unannounced_total").await,
        0.0,
        "the NOTIFY announced them"
    );
    wait_for(
        "the sampler sees the backlog gone",
        Duration::from_secs(10),
        || async { (served.metric("outbox_pending_rows").await == 0.0).then_some(()) },
    )
    .await;

    // Without the trigger no NOTIFY comes: polling finds the rows and says so. (Wait for the
    // relay to be idle again, hint on: while busy it polls by design and counts nothing.)
    wait_for(
        "idle again, wake-up hint on",
        Duration::from_secs(10),
        || async {
            let hint: Option<bool> = client
                .query_one("SELECT bool_and(wants_wakeup) FROM outbox_relays", &[])
                .await
                .unwrap()
                .get(0);
            (hint == Some(true)).then_some(())
        },
    )
    .await;
    client
        .batch_execute("ALTER TABLE outbox_events DISABLE TRIGGER outbox_events_wakeup")
        .await
        .unwrap();
    let more = db.insert(&client, 5, 5).await;
    broker.wait_count(105, Duration::from_secs(10)).await;
    wait_for(
        "unannounced rows counted",
        Duration::from_secs(10),
        || async { (served.metric("outbox_rows_unannounced_total").await == 5.0).then_some(()) },
    )
    .await;
    served.stop().await;
    let mut all = committed;
    all.extend(more);
    check(&all, &broker.received()).assert_clean();
}

/// /readyz turns 503 when the broker connection goes (cut by a proxy that also refuses
/// reconnects) and 200 again once it can reconnect; nothing is lost meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_broker_connection() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let amqp = local_amqp().with_port(proxy.port());
    let served = Served::start(&db, amqp, test_config(&broker), None).await;
    let ready = |want: u16| {
        let served = &served;
        async move { (served.get("/readyz").await.0 == want).then_some(()) }
    };
    wait_for("ready", Duration::from_secs(20), || ready(200)).await;
    proxy.set(Mode::Cut);
    wait_for(
        "not ready once the broker is gone",
        Duration::from_secs(20),
        || ready(503),
    )
    .await;
    let (_, body) = served.get("/readyz").await;
    assert!(body.contains("rabbitmq down"), "{body}");
    let client = db.client().await;
    let committed = db.insert(&client, 50, 5).await;
    proxy.set(Mode::Pass);
    wait_for("ready again", Duration::from_secs(30), || ready(200)).await;
    broker.wait_all(&committed, Duration::from_secs(30)).await;
    assert!(
        served
            .metric("outbox_reconnects_total{target=\"rabbitmq\"}")
            .await
            >= 1.0
    );
    served.stop().await;
    check(&committed, &broker.received()).assert_clean();
}

/// --retention deletes dispatched rows older than the retention age, and nothing else:
/// not recent dispatched rows, not parked rows, not pending rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_old_dispatched_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, dispatched_at, parked_at, available_at)
             SELECT 'old', g::text, 'e', '{}', now() - interval '2 days', NULL, now() FROM generate_series(1, 12000) g;
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, dispatched_at)
             SELECT 'recent', g::text, 'e', '{}', now() - interval '1 hour' FROM generate_series(1, 10) g;
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, parked_at, created_at)
             SELECT 'parked', g::text, 'e', '{}', now() - interval '3 days', now() - interval '3 days' FROM generate_series(1, 10) g;
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, available_at, created_at)
             SELECT 'later', g::text, 'e', '{}', now() + interval '1 day', now() - interval '3 days' FROM generate_series(1, 10) g;",
        )
        .await
        .unwrap();
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.retention = Some(Duration::from_secs(86_400));
    let served = Served::start(&db, local_amqp(), config, None).await;
    wait_for(
        "old dispatched rows deleted",
        Duration::from_secs(30),
        || async { (db.count(&client, "aggregate_type = 'old'").await == 0).then_some(()) },
    )
    .await;
    assert_eq!(
        served.metric("outbox_retention_deleted_rows_total").await,
        12_000.0
    );
    served.stop().await;
    for (kind, n) in [("recent", 10), ("parked", 10), ("later", 10)] {
        assert_eq!(
            db.count(&client, &format!("aggregate_type = '{kind}'"))
                .await,
            n,
            "{kind} rows kept"
        );
    }
}

/// Retention on a table with a big history: the relay stops promptly when asked in the
/// middle of a sweep (it does not finish deleting first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_of_a_big_history_does_not_hold_up_shutdown() {
    const OLD: i64 = 600_000;
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, dispatched_at)
             SELECT 'old', (g % 1000)::text, 'e', '{{}}', now() - interval '2 days'
               FROM generate_series(1, {OLD}) g;
             ANALYZE outbox_events;"
        ))
        .await
        .unwrap();
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.retention = Some(Duration::from_secs(86_400));
    let relay = InProcessRelay::start(&db, config);
    wait_for("the sweep under way", Duration::from_secs(30), || async {
        (db.count(&client, "aggregate_type = 'old'").await < OLD).then_some(())
    })
    .await;
    let asked = std::time::Instant::now();
    relay.stop().await;
    let took = asked.elapsed();
    let left = db.count(&client, "aggregate_type = 'old'").await;
    assert!(
        left > 0,
        "the sweep was stopped, not finished ({left} left)"
    );
    assert!(took < Duration::from_secs(5), "stopped in {took:?}");
}

/// traceparent/tracestate columns arrive as AMQP headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_arrives_as_headers() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let client = db.client().await;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, traceparent, tracestate)
             VALUES ('order', '1', 'placed', '{}', $1, 'vendor=abc')",
            &[&tp],
        )
        .await
        .unwrap();
    broker.wait_count(1, Duration::from_secs(20)).await;
    relay.stop().await;
    let m = &broker.received()[0];
    assert_eq!(m.header_str("traceparent").as_deref(), Some(tp));
    assert_eq!(m.header_str("tracestate").as_deref(), Some("vendor=abc"));
}

/// The database and broker passwords never appear in the logs, even at debug level and
/// when connections fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_appear_in_logs() {
    let db = TestDb::new().await;
    let pg_secret = "PgSecret-6b1f";
    let amqp_secret = "AmqpSecret-93c2";
    let admin = admin_url();
    let (prefix, _) = admin.rsplit_once('/').unwrap();
    let with_password = prefix.replacen("postgres@", &format!("postgres:{pg_secret}@"), 1);
    let name = unique("secrets");
    let args: Vec<String> = [
        "--database-url",
        &format!("{with_password}/{}", db.name),
        "--amqp-url",
        &format!("amqp://guest:{amqp_secret}@127.0.0.1:5672/%2f"),
        "--exchange",
        "it.secrets",
        "--http-listen",
        "127.0.0.1:0",
        "--lease",
        "3s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut relay = RelayProcess::start_with_env(&name, &args, &[("RUST_LOG", "debug")]);
    // The broker refuses the password: wait until the relay has said so.
    wait_for(
        "the relay logged the refused login",
        Duration::from_secs(30),
        || async {
            let log = relay.log_text();
            log.contains("rabbitmq failing").then_some(())
        },
    )
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let log = relay.log_text();
    assert!(log.contains("relay started"), "{log}");
    assert!(!log.contains(pg_secret), "the postgres password was logged");
    assert!(!log.contains(amqp_secret), "the broker password was logged");
    // stderr is a file here, not a terminal: plain lines, no colour codes.
    assert!(!log.contains('\x1b'), "escape codes in a log file: {log}");
}

/// With `RUST_LOG=info`, rows the broker returns (no queue bound) leave no trace of their
/// body in the relay's log: lapin's returned-message line (which prints the body, as bytes)
/// stays quiet. Named in `RUST_LOG`, the target logs again, so the check can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_payloads_never_appear_in_logs_at_info() {
    let marker = "card-4111-1111-1111-1111";
    // lapin prints the body as a byte list: look for the marker's bytes too.
    let marker_bytes = format!("{:?}", marker.as_bytes());
    let marker_bytes = marker_bytes.trim_matches(['[', ']']).to_owned();
    for (rust_log, logged) in [
        ("info", false),
        ("info,lapin::returned_messages=warn", true),
    ] {
        let db = TestDb::new().await;
        let client = db.client().await;
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'it', 'k' || g, 'secret', jsonb_build_object('card', $1::text)
                   FROM generate_series(1, 3) g",
                &[&marker],
            )
            .await
            .unwrap();
        let args: Vec<String> = [
            "--database-url",
            &db.url(),
            "--exchange",
            &unique("it.payloads"),
            "--http-listen",
            "off",
            "--retry-min",
            "50ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut relay =
            RelayProcess::start_with_env(&unique("payloads"), &args, &[("RUST_LOG", rust_log)]);
        wait_for(
            "every row returned at least twice",
            Duration::from_secs(60),
            || async {
                let returned = db
                    .count(&client, "attempts >= 2 AND last_error LIKE 'unroutable%'")
                    .await;
                (returned == 3).then_some(())
            },
        )
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
        let log = relay.log_text();
        assert!(log.contains("relay started"), "{log}");
        let found = log.contains(marker) || log.contains(&marker_bytes);
        assert_eq!(
            found, logged,
            "RUST_LOG={rust_log}: payload in the log: {found}\n{log}"
        );
    }
}

/// The lag counts from when a row became due: a row delayed into the future is not late
/// however old it is, and a due row counts from its `available_at`, not its `created_at`.
/// Checked in `outbox_oldest_pending_age_seconds` and in what `status` and the dashboard show
/// (no relay runs, so the rows stay pending).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_counts_from_when_rows_became_due() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let state = HttpState::new(Telemetry::default(), &db.target, &db.schema, None);
    tokio::spawn(http::serve(listener, state, stop.clone()));
    let insert = |created: &'static str, available: &'static str| {
        let client = &client;
        async move {
            client
                .execute(
                    &format!(
                        "INSERT INTO outbox_events
                           (aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
                         VALUES ('it', 'lag', 'x', '{{}}', now() - interval '{created}',
                                 now() + interval '{available}')"
                    ),
                    &[],
                )
                .await
                .unwrap();
        }
    };
    // Created 3 hours ago, due 10 minutes ago: 600 s late. Created 5 hours ago, due in an
    // hour: not late at all.
    insert("3 hours", "-10 minutes").await;
    insert("5 hours", "1 hour").await;
    let lags = || async {
        let metrics = reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let gauge: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("outbox_oldest_pending_age_seconds "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no lag gauge in /metrics:\n{metrics}"));
        // What `status`, the dashboard and /api/overview show.
        let status = outbox_relay::operator::status(&client).await.unwrap();
        (gauge, status["oldest_pending_seconds"].as_f64().unwrap())
    };
    let (gauge, api) = wait_for(
        "the sampler's first look",
        Duration::from_secs(20),
        || async {
            let (gauge, api) = lags().await;
            (gauge > 0.0).then_some((gauge, api))
        },
    )
    .await;
    for lag in [gauge, api] {
        assert!(
            (590.0..3600.0).contains(&lag),
            "due 10 minutes ago, created hours ago: lag {lag}"
        );
    }
    // Only the delayed row left: nothing is late.
    client
        .execute("DELETE FROM outbox_events WHERE available_at <= now()", &[])
        .await
        .unwrap();
    wait_for("the lag back to zero", Duration::from_secs(20), || async {
        let (gauge, api) = lags().await;
        (gauge == 0.0 && api == 0.0).then_some(())
    })
    .await;
    stop.cancel();
}

/// sslmode=require encrypts (pg_stat_ssl says so); verify-full accepts a server whose
/// certificate the given root vouches for; against a certificate it does not vouch for the
/// relay stops with a clear error instead of retrying or falling back to plain text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_modes_are_honoured() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let base = db.url();

    // require: encrypted.
    let target = DbTarget::parse(&format!("{base}?sslmode=require")).unwrap();
    let client = target
        .connect(&Schema::default(), "tls-require")
        .await
        .unwrap();
    let ssl: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "sslmode=require gives an encrypted session");

    // verify-full through a TLS proxy with a certificate our test CA signed.
    let ca = TestCa::new(&unique("pgca"));
    let proxy = tls_proxy(
        &ca,
        "127.0.0.1:5432".parse().unwrap(),
        Preamble::PostgresSslRequest,
    )
    .await;
    let verified = format!(
        "postgres://postgres@localhost:{}/{}?sslmode=verify-full&sslrootcert={}",
        proxy.port(),
        db.name,
        ca.ca_pem_file.display()
    );
    let target = DbTarget::parse(&verified).unwrap();
    let deps = Deps {
        pool: target.pool(&Schema::default(), "outbox-relay", 4),
        db: target.clone(),
        schema: Schema::default(),
        amqp: local_amqp(),
        telemetry: Telemetry::default(),
    };
    let relay = InProcessRelay::start_with(deps, test_config(&broker), &unique("tls"));
    let committed = db.insert(&db.client().await, 20, 2).await;
    broker.wait_count(20, Duration::from_secs(30)).await;
    relay.stop().await;
    check(&committed, &broker.received()).assert_clean();

    // verify-full against the server's own certificate, which that CA did not sign:
    // exit 1 with the reason, quickly, not a retry loop.
    let wrong = format!(
        "postgres://postgres@localhost:5432/{}?sslmode=verify-full&sslrootcert={}",
        db.name,
        ca.ca_pem_file.display()
    );
    let (code, _, err) = tokio::time::timeout(
        Duration::from_secs(30),
        run_to_end(
            &["run", "--database-url", &wrong, "--http-listen", "off"],
            &[],
        ),
    )
    .await
    .expect("gives up rather than retrying forever");
    assert_eq!(code, 1, "{err}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
}

/// amqps:// with the CA given by --amqp-ca-file: the relay publishes through a TLS proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_custom_ca() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let ca = TestCa::new(&unique("amqpca"));
    let proxy = tls_proxy(&ca, "127.0.0.1:5672".parse().unwrap(), Preamble::None).await;
    let amqp = AmqpTarget::parse(&format!(
        "amqps://guest:guest@localhost:{}/%2f",
        proxy.port()
    ))
    .unwrap()
    .with_ca_file(&ca.ca_pem_file)
    .unwrap();
    if let Err(e) = amqp.connect("tls-probe").await {
        panic!("amqps connect through the proxy: {e}");
    }
    let served = Served::start(&db, amqp, test_config(&broker), None).await;
    let committed = db.insert(&db.client().await, 20, 2).await;
    broker.wait_count(20, Duration::from_secs(30)).await;
    served.stop().await;
    check(&committed, &broker.received()).assert_clean();
}

/// Bad TLS settings exit 2 with one line naming the flag.
#[tokio::test]
async fn bad_tls_settings_exit_2() {
    let missing = "/nonexistent/ca.pem";
    let not_pem = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    for (args, flag, says) in [
        (
            vec!["--database-url", "postgres://h/db?sslmode=sometimes"],
            "--database-url",
            "sslmode",
        ),
        (
            vec!["--database-url", "postgres://h/db?sslmode=verify-full"],
            "--database-url",
            "sslrootcert",
        ),
        (
            vec![
                "--database-url",
                &format!("postgres://h/db?sslmode=verify-ca&sslrootcert={missing}"),
            ],
            "--database-url",
            "cannot read",
        ),
        (
            vec!["--amqp-url", "amqps://h/%2f", "--amqp-ca-file", missing],
            "--amqp-ca-file",
            "cannot read",
        ),
        (
            vec!["--amqp-url", "amqps://h/%2f", "--amqp-ca-file", not_pem],
            "--amqp-ca-file",
            "no PEM",
        ),
        (
            vec!["--amqp-ca-file", not_pem],
            "--amqp-ca-file",
            "amqps://",
        ),
    ] {
        let mut all = vec!["run"];
        all.extend(args.iter().copied());
        let (code, _, err) = run_to_end(&all, &[]).await;
        assert_eq!(code, 2, "{all:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{all:?}: {err}");
        assert!(err.contains(flag) && err.contains(says), "{all:?}: {err}");
    }
}

/// --cloudevents adds the CloudEvents AMQP binding headers from the row's columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_headers_arrive() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.cloudevents_source = Some("/shop/orders".into());
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    let id: uuid::Uuid = client
        .query_one(
            "SELECT outbox_enqueue('order', '7', 'order.placed', '{}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    broker.wait_count(1, Duration::from_secs(20)).await;
    relay.stop().await;
    let m = &broker.received()[0];
    assert_eq!(
        m.header_str("cloudEvents:specversion").as_deref(),
        Some("1.0")
    );
    assert_eq!(m.header_str("cloudEvents:id"), Some(id.to_string()));
    assert_eq!(
        m.header_str("cloudEvents:type").as_deref(),
        Some("order.placed")
    );
    assert_eq!(
        m.header_str("cloudEvents:source").as_deref(),
        Some("/shop/orders")
    );
    assert_eq!(
        m.header_str("cloudEvents:subject").as_deref(),
        Some("order/7")
    );
    assert_eq!(
        m.header_str("cloudEvents:time"),
        m.header_str("x-outbox-created-at")
    );
}

/// With the `otel` feature, the producer API takes traceparent/tracestate from the
/// current span, and they arrive as headers.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "current_thread")]
async fn the_producer_takes_the_current_span_trace_context() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider};
    use outbox_kit::producer::{NewEvent, Outbox};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("it")));
    let _default = tracing::subscriber::set_default(subscriber);

    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let client = db.client().await;
    let outbox = Outbox::new("public").unwrap();
    let span = tracing::info_span!("place order");
    let trace_id = span.context().span().span_context().trace_id().to_string();
    let event = NewEvent::new("order", "9", "placed", serde_json::json!({}));
    outbox
        .enqueue(&client, &event)
        .instrument(span)
        .await
        .unwrap();
    broker.wait_count(1, Duration::from_secs(20)).await;
    relay.stop().await;
    let tp = broker.received()[0]
        .header_str("traceparent")
        .expect("traceparent header");
    assert!(
        tp.starts_with(&format!("00-{trace_id}-")),
        "{tp} carries trace {trace_id}"
    );
}

/// Several broker URLs: when the node in use goes away, the relay goes on through the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_fails_over_to_the_next_broker_url() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let first = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let second = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let urls = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f,amqp://guest:guest@127.0.0.1:{}/%2f",
        first.port(),
        second.port()
    );
    let amqp = AmqpTarget::parse(&urls).unwrap();
    assert_eq!(amqp.to_string().matches("guest@").count(), 2, "{amqp}");
    let served = Served::start(&db, amqp, test_config(&broker), None).await;
    let client = db.client().await;
    let mut committed = db.insert(&client, 20, 2).await;
    broker.wait_all(&committed, Duration::from_secs(30)).await;
    first.set(Mode::Cut);
    committed.extend(db.insert(&client, 20, 2).await);
    broker.wait_all(&committed, Duration::from_secs(30)).await;
    assert!(
        served
            .metric("outbox_reconnects_total{target=\"rabbitmq\"}")
            .await
            >= 1.0
    );
    served.stop().await;
    check(&committed, &broker.received()).assert_clean();
}
