//! The HTTP endpoint's JSON API under load and abuse: the admin token, slow clients, a full
//! house of requests, database errors; and what it (and `status`) says about pending rows
//! that do not move. The page itself is tested in a browser by `dashboard.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Secret;
use outbox_relay::http::{self, HttpState, Limits};
use outbox_relay::relay::{Deps, RelayConfig};
use outbox_relay::telemetry::Telemetry;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::support::process::{RelayProcess, run_to_end, test_relay_args};
use crate::support::{Broker, InProcessRelay, TestDb, amqp_url, test_config, unique, wait_for};

const TOKEN: &str = "api-test-token";

/// The endpoint alone (and, with `relay`, an in-process relay sharing its telemetry).
struct Endpoint {
    base: String,
    stop: CancellationToken,
    relay: Option<InProcessRelay>,
}

impl Endpoint {
    async fn start(db: &TestDb, token: Option<&str>, limits: Limits) -> Endpoint {
        Self::start_on(db, &db.target, token, limits, None).await
    }

    async fn with_relay(db: &TestDb, config: RelayConfig, token: Option<&str>) -> Endpoint {
        Self::start_on(db, &db.target, token, Limits::default(), Some(config)).await
    }

    async fn start_on(
        db: &TestDb,
        target: &outbox_kit::db::DbTarget,
        token: Option<&str>,
        limits: Limits,
        relay: Option<RelayConfig>,
    ) -> Endpoint {
        let telemetry = Telemetry::default();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let state = HttpState::with_limits(
            telemetry.clone(),
            target,
            &db.schema,
            token.map(Secret::new),
            limits,
        );
        tokio::spawn(http::serve(listener, state, stop.clone()));
        let relay = relay.map(|config| {
            let deps = Deps {
                pool: db.pool(),
                db: db.target.clone(),
                schema: db.schema.clone(),
                amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
                telemetry,
            };
            InProcessRelay::start_with(deps, config, &unique("api-relay"))
        });
        Endpoint { base, stop, relay }
    }

    fn addr(&self) -> &str {
        self.base.strip_prefix("http://").unwrap()
    }

    async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let mut req = reqwest::Client::new().get(format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.unwrap()
    }

    async fn json(&self, path: &str, token: Option<&str>) -> Value {
        let r = self.get(path, token).await;
        assert_eq!(r.status(), 200, "{path}");
        r.json().await.unwrap()
    }

    /// One sample's value from /metrics (`name` with its labels, as printed).
    async fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics", None).await.text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }

    async fn stop(self) {
        if let Some(relay) = self.relay {
            relay.stop().await;
        }
        self.stop.cancel();
    }
}

/// With an admin token configured, every `/api/*` request needs it (401 without or with a
/// wrong one); the page, `/metrics` and the probes stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_wants_the_admin_token_when_one_is_set() {
    let db = TestDb::new().await;
    let ep = Endpoint::start(&db, Some(TOKEN), Limits::default()).await;
    for path in ["/api/overview", "/api/parked"] {
        for token in [None, Some("wrong")] {
            let r = ep.get(path, token).await;
            assert_eq!(r.status(), 401, "{path} with {token:?}");
            assert_eq!(r.headers()["www-authenticate"], "Bearer");
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"], "wrong or missing admin token");
        }
        ep.json(path, Some(TOKEN)).await;
    }
    let r = reqwest::Client::new()
        .post(format!("{}/api/redrive", ep.base))
        .json(&serde_json::json!({ "ids": [1] }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    for path in ["/", "/livez", "/metrics"] {
        assert_eq!(ep.get(path, None).await.status(), 200, "{path}");
    }
    ep.stop().await;
}

/// Waits until the server closes `stream` (read returns 0 or an error), failing after
/// `limit`; returns what it sent before closing.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the server kept the connection open for {limit:?}; it sent {:?}",
        String::from_utf8_lossy(&got)
    );
    String::from_utf8_lossy(&got).into_owned()
}

/// A client that never finishes its headers is disconnected after the header-read
/// timeout; one that never finishes its body gets 503 after the request timeout; a
/// connection over the limit of open ones is closed at once; and one more API request than
/// the limit allows gets 503 at once (with Retry-After) instead of a place in a queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_excess_requests_refused() {
    let db = TestDb::new().await;
    let quick = Limits {
        header_read: Duration::from_secs(1),
        request: Duration::from_secs(1),
        ..Limits::default()
    };
    let ep = Endpoint::start(&db, None, quick).await;
    let mut slow = TcpStream::connect(ep.addr()).await.unwrap();
    slow.write_all(b"GET /api/overview HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    read_until_closed(&mut slow, Duration::from_secs(30)).await;

    let mut slow_body = TcpStream::connect(ep.addr()).await.unwrap();
    slow_body
        .write_all(
            b"POST /api/redrive HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"ids\":",
        )
        .await
        .unwrap();
    let answer = read_until_closed(&mut slow_body, Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("request not done within"), "{answer}");
    ep.stop().await;

    // One connection at a time: while one is open, the next is closed unanswered.
    let single = Limits {
        clients: 1,
        header_read: Duration::from_secs(120),
        ..Limits::default()
    };
    let ep = Endpoint::start(&db, None, single).await;
    let mut first = TcpStream::connect(ep.addr()).await.unwrap();
    first
        .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = first.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    let mut second = TcpStream::connect(ep.addr()).await.unwrap();
    let _ = second
        .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let answer = read_until_closed(&mut second, Duration::from_secs(30)).await;
    assert_eq!(answer, "", "a connection over the limit gets nothing");
    drop(first);
    let livez = format!("{}/livez", ep.base);
    wait_for("a connection again", Duration::from_secs(30), || async {
        // Refused (closed) until the server has seen the first one go.
        let r = reqwest::get(&livez).await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    ep.stop().await;

    // One slot: a request that holds it (its body never comes) makes the next one 503.
    let one = Limits {
        concurrent_api: 1,
        request: Duration::from_secs(120),
        header_read: Duration::from_secs(120),
        ..Limits::default()
    };
    let ep = Endpoint::start(&db, None, one).await;
    let mut holder = TcpStream::connect(ep.addr()).await.unwrap();
    holder
        .write_all(
            b"POST /api/redrive HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
        )
        .await
        .unwrap();
    let refused = wait_for(
        "a request refused while the slot is held",
        Duration::from_secs(30),
        || async {
            let started = std::time::Instant::now();
            let r = ep.get("/api/parked", None).await;
            (r.status() == 503).then(|| (r, started.elapsed()))
        },
    )
    .await;
    let (r, took) = refused;
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(
        took < Duration::from_secs(60),
        "refused without waiting for the slot: {took:?}"
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "too many API requests at once; try again");
    drop(holder); // the slot comes back
    wait_for("the API again", Duration::from_secs(30), || async {
        (ep.get("/api/parked", None).await.status() == 200).then_some(())
    })
    .await;
    ep.stop().await;
}

/// A database error is logged; a caller without the admin token gets 503 with a generic
/// message, never the database's text (here: the database does not exist); with a token
/// configured the caller, who showed it, gets the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_errors_reach_only_callers_with_the_token() {
    let db = TestDb::new().await;
    let missing_name = unique("it_missing");
    let missing = db.target.with_dbname(&missing_name);
    let open = Endpoint::start_on(&db, &missing, None, Limits::default(), None).await;
    for path in ["/api/overview", "/api/parked"] {
        let r = open.get(path, None).await;
        assert_eq!(r.status(), 503, "{path}");
        let text = r.text().await.unwrap();
        assert!(
            !text.contains(&missing_name)
                && !text.contains("does not exist")
                && !text.contains("postgres"),
            "{path} told an anonymous caller about the database: {text}"
        );
        assert!(text.contains("the relay's log says why"), "{text}");
    }
    open.stop().await;
    let guarded = Endpoint::start_on(&db, &missing, Some(TOKEN), Limits::default(), None).await;
    let r = guarded.get("/api/overview", Some(TOKEN)).await;
    assert_eq!(r.status(), 503);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("does not exist"),
        "the operator sees why: {text}"
    );
    guarded.stop().await;
}

/// A port nobody listens on right now (the relay process binds it).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Partitions leased to a live owner now (one relay runs: its own).
async fn partitions_held(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_partitions WHERE owner IS NOT NULL AND lease_until > now()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// 32 clients hammer the open, read-only API of a relay process (`--lease 3s`) for at
/// least 10 s while 300,000 rows wait for tomorrow: the relay holds all 64 partitions
/// throughout (sampled every 100 ms) and delivers each batch of events committed during
/// the flood within 15 s (about a second without the flood). Before
/// the endpoint had its own pool, a concurrency limit and a bounded overview, such a flood
/// held the relay's pool and it dropped its partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_flood_does_not_cost_the_relay_its_leases() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, available_at)
             SELECT 'later', 'l' || (g % 1000), 'scheduled', '{}', now() + interval '1 day'
               FROM generate_series(1, 300000) AS g;
             ANALYZE outbox_events",
        )
        .await
        .unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = test_relay_args(&db.url(), &broker.exchange, &[]);
    for (flag, value) in [
        ("--http-listen", listen.as_str()),
        ("--poll-interval", "1s"),
    ] {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1] = value.to_owned();
    }
    let mut relay = RelayProcess::start(&unique("flood"), &args);
    wait_for(
        "the relay holding all 64 partitions",
        Duration::from_secs(60),
        || async { (partitions_held(&client).await == 64).then_some(()) },
    )
    .await;

    let stop = CancellationToken::new();
    let (ok, refused, failed) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let web = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut flood = Vec::new();
    for i in 0..32 {
        let (web, stop) = (web.clone(), stop.clone());
        let (ok, refused, failed) = (ok.clone(), refused.clone(), failed.clone());
        let url = format!(
            "http://{listen}{}",
            if i % 4 == 0 {
                "/api/parked"
            } else {
                "/api/overview"
            }
        );
        flood.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let counter = match web.get(&url).send().await.map(|r| r.status().as_u16()) {
                    Ok(200) => &ok,
                    Ok(503) => &refused,
                    _ => &failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let leases = {
        let (target, schema, stop) = (db.target.clone(), db.schema.clone(), stop.clone());
        tokio::spawn(async move {
            let c = target.connect(&schema, "outbox-it-leases").await.unwrap();
            let mut samples = Vec::new();
            while !stop.is_cancelled() {
                samples.push(partitions_held(&c).await);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        })
    };
    wait_for("the flood under way", Duration::from_secs(30), || async {
        (ok.load(Ordering::Relaxed) + refused.load(Ordering::Relaxed) >= 200).then_some(())
    })
    .await;
    // Batches committed during the flood, for at least 10 s of it.
    let flooding = std::time::Instant::now();
    let mut committed = Vec::new();
    while committed.len() < 300 || flooding.elapsed() < Duration::from_secs(10) {
        let ids = db.insert(&client, 100, 20).await;
        broker.wait_all(&ids, Duration::from_secs(15)).await;
        committed.extend(ids);
    }
    stop.cancel();
    for f in flood {
        f.await.unwrap();
    }
    let samples = leases.await.unwrap();
    let (ok, refused, failed) = (
        ok.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    println!(
        "flood: {ok} answered, {refused} refused (503), {failed} failed; {} lease samples",
        samples.len()
    );
    assert!(ok > 0, "the API still answered some requests");
    assert_eq!(failed, 0, "every request got 200 or 503");
    assert!(samples.len() >= 10, "{samples:?}");
    assert!(
        samples.iter().all(|&n| n == 64),
        "the relay lost partitions during the flood: {samples:?}\n{}",
        relay.log_tail(30)
    );
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(30)).await, Some(0));
    crate::support::checker::check(&committed, &broker.received()).assert_clean();
}

/// 300 rows whose routing key no queue is bound to, as a new user's first try: `status`
/// and `/api/overview` say why they do not move (returned as unroutable, with the reason
/// and the keys held), and `outbox_keys_held{reason="returned"}` counts the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_the_overview_say_why_pending_rows_wait() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    config.max_attempts = std::num::NonZeroU32::new(1000).unwrap();
    let ep = Endpoint::with_relay(&db, config, None).await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'ghost', 'g' || (g % 3), 'haunted', '{}' FROM generate_series(1, 300) AS g",
        )
        .await
        .unwrap();
    let overview = wait_for(
        "the overview naming the unroutable rows",
        Duration::from_secs(30),
        || async {
            let o = ep.json("/api/overview", None).await;
            (o["waiting"]["keys_held"]["returned"] == 3
                && o["this_relay_keys_held"]["returned"] == 3)
                .then_some(o)
        },
    )
    .await;
    let w = &overview["waiting"];
    assert_eq!(w["looked_at"], 300, "{w}");
    assert_eq!(w["rows_of_held_keys"], 300, "{w}");
    assert_eq!(w["keys_held"]["nack"], 0, "{w}");
    let reason = w["reasons"][0]["last_error"].as_str().unwrap();
    assert!(
        reason.starts_with("unroutable:") && reason.contains("'ghost.haunted'"),
        "{w}"
    );
    assert_eq!(w["reasons"][0]["keys"], 3, "{w}");
    assert_eq!(w["held_keys"].as_array().unwrap().len(), 3, "{w}");
    assert_eq!(w["held_keys"][0]["cause"], "returned", "{w}");
    assert_eq!(
        ep.metric("outbox_keys_held{reason=\"returned\"}").await,
        3.0
    );

    let (code, out, err) = run_to_end(&["status", "--database-url", &db.url()], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("why pending rows wait (the oldest 300 pending rows looked at)"),
        "{out}"
    );
    assert!(out.contains("key(s): unroutable: exchange"), "{out}");
    assert!(
        out.contains(
            "keys held: 0 by nacks (retried with backoff until the broker takes them), 3 by returns"
        ),
        "{out}"
    );
    assert!(out.contains("ghost/g0 (returned, "), "{out}");
    let (code, json, _) = run_to_end(&["status", "--json", "--database-url", &db.url()], &[]).await;
    assert_eq!(code, 0);
    let status: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(status["waiting"]["keys_held"]["returned"], 3, "{status}");
    ep.stop().await;
}

/// A queue that refuses everything (x-max-length 0, overflow reject-publish) makes the
/// broker nack: the row is retried past `--max-attempts` and never parked, its key is
/// shown as held by nacks (`outbox_keys_held{reason="nack"}`, `status`, `/api/overview`);
/// once the queue is gone, the rows go through and nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_rows_are_retried_past_max_attempts_and_their_keys_shown() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let (ch, full) = broker.refusing_queue().await;
    let mut config = test_config(&broker);
    config.max_attempts = std::num::NonZeroU32::new(2).unwrap();
    let ep = Endpoint::with_relay(&db, config, None).await;
    let client = db.client().await;
    let committed = db.insert(&client, 30, 3).await;
    wait_for(
        "heads nacked more often than --max-attempts, shown as held by nacks",
        Duration::from_secs(60),
        || async {
            let min_attempts: i32 = client
                .query_one(
                    "SELECT coalesce(min(attempts), 0) FROM outbox_events
                      WHERE attempts > 0 AND dispatched_at IS NULL",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            let heads = db.count(&client, "attempts > 0").await;
            let held = ep.metric("outbox_keys_held{reason=\"nack\"}").await;
            (heads == 3 && min_attempts > 4 && held == 3.0).then_some(())
        },
    )
    .await;
    assert_eq!(
        db.count(&client, "parked_at IS NOT NULL").await,
        0,
        "nacks never park"
    );
    assert_eq!(db.count(&client, "dispatched_at IS NOT NULL").await, 0);
    let o = ep.json("/api/overview", None).await;
    assert_eq!(o["waiting"]["keys_held"]["nack"], 3, "{o}");
    assert_eq!(o["waiting"]["held_keys"][0]["cause"], "nack", "{o}");
    let (code, out, err) = run_to_end(&["status", "--database-url", &db.url()], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("keys held: 3 by nacks"), "{out}");
    assert!(
        out.contains("row(s) of 3 key(s): nacked by the broker"),
        "{out}"
    );

    ch.queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    broker.wait_all(&committed, Duration::from_secs(60)).await;
    wait_for("nothing held any more", Duration::from_secs(30), || async {
        (ep.metric("outbox_keys_held{reason=\"nack\"}").await == 0.0
            && db.count(&client, "dispatched_at IS NULL").await == 0)
            .then_some(())
    })
    .await;
    assert_eq!(db.count(&client, "parked_at IS NOT NULL").await, 0);
    ep.stop().await;
}
