//! The notifications example end to end: the example's own modules (compiled into this
//! binary), the relay in-process, real Postgres, RabbitMQ and HTTP; and the example's
//! consumer as a real process killed with SIGKILL at its crash point.

#[allow(dead_code)]
#[path = "../../examples/notifications/consumer.rs"]
mod consumer;
// (provider.rs allows dead code itself)
#[path = "../../examples/notifications/provider.rs"]
mod provider;
#[allow(dead_code)]
#[path = "../../examples/notifications/tickets.rs"]
mod tickets;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_kit::consumer::budget;
use outbox_kit::consumer::effects::{EffectState, EffectsConfig, Ledger};
use outbox_kit::consumer::reconcile::{self, ReconcileConfig};
use outbox_kit::consumer::runner::ConsumerConfig;
use outbox_kit::producer::Outbox;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::support::checker::check;
use crate::support::kit::{self, Running};
use crate::support::{Broker, InProcessRelay, TestDb, amqp_url, test_config, unique, wait_for};

const STATUSES: [&str; 5] = ["open", "pending", "solved", "closed", "reopened"];

fn notifier_ledger(worker: &str, send_timeout: Duration) -> Ledger {
    Ledger::new(
        EffectsConfig::new(
            worker,
            send_timeout,
            Duration::from_millis(500),
            send_timeout * 2 + Duration::from_secs(1),
        )
        .unwrap(),
    )
}

/// One delivery as the ledger ended it.
#[derive(Debug)]
struct Outcome {
    key: String,
    tenant: String,
    state: String,
    last_error: Option<String>,
    external_id: Option<String>,
}

/// 1,000 status changes with random provider faults (503, answers lost after acceptance,
/// requests dropped), bad addresses, a tenant running out of budget and cancels racing the
/// sends: every delivery ends sent, failed with a reason, or cancelled; the provider got no
/// message twice and holds exactly the sent ones; every budget adds up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_status_changes_with_provider_faults_end_consistent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    tickets::setup(&client).await.unwrap();
    let granted = [("acme", 1000i64), ("globex", 1000), ("initech", 300)];
    for (tenant, n) in granted {
        tickets::grant(&client, tenant, n).await.unwrap();
    }
    let faults = provider::Faults {
        p_unavailable: 0.08,
        p_slow_accepted: 0.04,
        p_slow_dropped: 0.04,
        slow: Duration::from_millis(600),
        seed: 0x5eed,
    };
    let provider = provider::Provider::start(faults).await.unwrap();
    let send_timeout = Duration::from_millis(250);
    let dest = Arc::new(consumer::ProviderClient::new(
        &provider.url(),
        send_timeout * 2,
    ));

    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let name = unique("it.notifier").replace('_', ".");
    let mut cfg = ConsumerConfig::new(&name, &broker.exchange, &["ticket.#"]);
    cfg.prefetch = std::num::NonZeroU16::new(16).unwrap();
    cfg.retry_min = Duration::from_millis(50);
    cfg.retry_max = Duration::from_millis(400);
    cfg.handler_timeout = Duration::from_secs(10);
    let running = Running::start(
        &db,
        cfg.clone(),
        Arc::new(consumer::Notifier {
            ledger: notifier_ledger("notifier", send_timeout),
            provider: dest.clone(),
        }),
    );
    // Events published before the queue is bound would never reach it.
    kit::wait_queue_ready(&cfg.queue).await;
    let started = Instant::now();

    // 200 tickets, 5 status changes each, from 8 producer connections.
    let tenants = ["acme", "globex", "initech"];
    let (keys_tx, mut keys_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut producers = Vec::new();
    for p in 0..8i64 {
        let mut c = db.client().await;
        let keys_tx = keys_tx.clone();
        producers.push(tokio::spawn(async move {
            let outbox = Outbox::new("public").unwrap();
            for t in 0..25i64 {
                let ticket = p * 1000 + t;
                let email = if ticket % 17 == 0 {
                    format!("t{ticket}@invalid")
                } else {
                    format!("t{ticket}@example.com")
                };
                let tenant = tenants[(ticket % 3) as usize];
                tickets::open_ticket(&c, ticket, tenant, &email, "+15550100")
                    .await
                    .unwrap();
                for status in STATUSES {
                    for key in tickets::change_status(&mut c, &outbox, ticket, status)
                        .await
                        .unwrap()
                    {
                        let _ = keys_tx.send(key);
                    }
                }
                // Once: a status the ticket already had notifies nobody again.
                if t == 0 {
                    let again = tickets::change_status(&mut c, &outbox, ticket, "open")
                        .await
                        .unwrap();
                    assert!(again.is_empty(), "unique per ticket, status and channel");
                }
            }
        }));
    }
    drop(keys_tx);
    // The ticket service withdraws every 40th delivery while the sends are going on.
    let canceller = {
        let c = db.client().await;
        let dest = dest.clone();
        tokio::spawn(async move {
            let ledger = notifier_ledger("ticket-service", send_timeout);
            let mut n = 0usize;
            let mut outcomes = Vec::new();
            while let Some(key) = keys_rx.recv().await {
                n += 1;
                if n.is_multiple_of(40) {
                    let outcome = tickets::cancel_delivery(&c, &ledger, &*dest, &key)
                        .await
                        .unwrap();
                    outcomes.push((key, outcome));
                }
            }
            outcomes
        })
    };
    // The reconciler runs beside the consumer, as deployed: a cancel that meets a lost answer
    // leaves its delivery in `sending` for a lookup after the lease.
    let reconciler_stop = tokio_util::sync::CancellationToken::new();
    let reconciler = {
        let c = db.client().await;
        let dest = dest.clone();
        let stop = reconciler_stop.clone();
        tokio::spawn(async move {
            let cfg = ReconcileConfig::new(
                Duration::from_secs(1),
                Duration::from_secs(3600),
                std::num::NonZeroUsize::new(100).unwrap(),
                send_timeout,
            )
            .unwrap();
            let ledger = notifier_ledger("reconciler", send_timeout);
            let mut resolved = 0;
            while !stop.is_cancelled() {
                let report = reconcile::reconcile(&c, &cfg, &ledger, &*dest)
                    .await
                    .unwrap();
                resolved += report.resolved.len();
                assert!(report.review.is_empty(), "{:?}", report.review);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            resolved
        })
    };
    for p in producers {
        p.await.unwrap();
    }
    let produced_in = started.elapsed();
    let cancels = canceller.await.unwrap();
    assert!(cancels.len() >= 30, "{}", cancels.len());

    // About 10 s on an idle 2-core machine; the deadline only catches deliveries that never end.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let open: Vec<String> = client
            .query(
                "SELECT effect_key || ' ' || state || ' attempts=' || attempts || ' uncertain=' || uncertain
                        || ' cancel=' || (cancel_requested_at IS NOT NULL) || ' ' || coalesce(last_error, '')
                   FROM outbox_effects WHERE state IN ('queued', 'sending')",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        if open.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "deliveries not finished: {open:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    reconciler_stop.cancel();
    let resolved_by_reconciler = reconciler.await.unwrap();
    running.stop().await;
    relay.stop().await;

    let changes: i64 = client
        .query_one("SELECT count(*) FROM outbox_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        changes,
        1000 + 8,
        "1,000 changes plus the 8 repeated statuses"
    );
    let outcomes: Vec<Outcome> = client
        .query(
            "SELECT d.effect_key, t.tenant, e.state, e.last_error, e.external_id
               FROM deliveries d JOIN tickets t ON t.id = d.ticket_id
               JOIN outbox_effects e ON e.effect_key = d.effect_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| Outcome {
            key: r.get(0),
            tenant: r.get(1),
            state: r.get(2),
            last_error: r.get(3),
            external_id: r.get(4),
        })
        .collect();
    assert_eq!(outcomes.len(), 2000, "two channels per change");

    // No message twice; the provider holds exactly what the ledger says is out.
    let per_key = provider.book.per_key();
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "sent twice: {twice:?}");
    let mut states: HashMap<&str, usize> = HashMap::new();
    for o in &outcomes {
        *states.entry(o.state.as_str()).or_default() += 1;
        match o.state.as_str() {
            "sent" => {
                assert!(o.external_id.is_some(), "{o:?}");
                assert!(
                    provider.book.live(&o.key),
                    "sent but not at the provider: {o:?}"
                );
            }
            "failed" => {
                assert!(
                    o.last_error.as_deref().is_some_and(|e| !e.is_empty()),
                    "{o:?}"
                );
                assert_eq!(
                    provider.book.accepted(&o.key),
                    0,
                    "failed but accepted: {o:?}"
                );
            }
            "cancelled" => assert!(!provider.book.live(&o.key), "cancelled but out: {o:?}"),
            other => panic!("delivery ended {other}: {o:?}"),
        }
    }
    let failed_by = |needle: &str| {
        outcomes
            .iter()
            .filter(|o| {
                o.state == "failed" && o.last_error.as_deref().unwrap_or("").contains(needle)
            })
            .count()
    };
    assert!(failed_by("invalid address") > 0);
    assert!(failed_by("out of budget") > 0, "initech ran out");
    assert!(states.get("cancelled").copied().unwrap_or(0) > 0);
    let live_total = per_key.keys().filter(|k| provider.book.live(k)).count();
    assert_eq!(live_total, states.get("sent").copied().unwrap_or(0));

    // Budgets add up: granted = remaining + held + consumed, nothing left held.
    for (tenant, grant) in granted {
        let t = budget::totals(&client, tenant, tickets::QUOTA)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(t.held, 0, "{tenant}: {t:?}");
        assert_eq!(t.granted(), grant, "{tenant}: {t:?}");
        let sent = outcomes
            .iter()
            .filter(|o| o.tenant == tenant && o.state == "sent")
            .count() as i64;
        assert!(t.consumed >= sent, "{tenant}: {t:?} but {sent} sent");
    }

    // The relay side: every event published once, in order per ticket.
    let committed: Vec<uuid::Uuid> = client
        .query("SELECT event_id FROM outbox_events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    check(&committed, &broker.received()).assert_clean();
    let retried = provider
        .book
        .requests
        .load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "notifications e2e: 1000 changes (produced in {produced_in:?}), 2000 deliveries {states:?}, {} cancels, {retried} provider requests, {resolved_by_reconciler} resolved by the reconciler, finished in {took:?}",
        cancels.len()
    );
    kit::delete_topology(&cfg).await;
}

/// The example binary, built by `cargo test` next to this test binary.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|d| d.parent()).unwrap();
    let path = debug.join("examples").join("notifications");
    assert!(
        path.exists(),
        "{} missing: build it with `cargo build --example notifications` (cargo test builds it)",
        path.display()
    );
    path
}

struct Child {
    child: tokio::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

fn spawn_consumer(
    db: &TestDb,
    exchange: &str,
    queue: &str,
    provider: &str,
    worker: &str,
    crash: bool,
) -> Child {
    let mut args = vec![
        "consumer",
        "--exchange",
        exchange,
        "--queue",
        queue,
        "--provider",
        provider,
        "--worker",
        worker,
        "--send-timeout-ms",
        "1000",
    ];
    if crash {
        args.push("--crash-after-send");
    }
    let mut child = Command::new(example_binary())
        .args(&args)
        .env("DATABASE_URL", db.url())
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "warn,lapin=error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the notifications example");
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut reader = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            let _ = tx.send(line);
        }
    });
    Child { child, lines }
}

/// The consumer process is killed with SIGKILL after the provider accepted a message and
/// before its write-back: the ledger says `sending` and the reconcile command lists it; the
/// restarted consumer takes the run-out claim over and resolves it through the provider's
/// lookup (found: recorded sent, not sent again) before the ticket's other delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_killed_between_send_and_commit_is_resolved_by_lookup() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    tickets::setup(&client).await.unwrap();
    tickets::grant(&client, "acme", 10).await.unwrap();
    tickets::open_ticket(&client, 1, "acme", "a@example.com", "+15550100")
        .await
        .unwrap();
    let provider = provider::Provider::start(provider::Faults::none())
        .await
        .unwrap();
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let queue = unique("it.crash").replace('_', ".");

    let mut first = spawn_consumer(
        &db,
        &broker.exchange,
        &queue,
        &provider.url(),
        "crashy",
        true,
    );
    kit::wait_queue_ready(&queue).await;
    let outbox = Outbox::new("public").unwrap();
    let keys = tickets::change_status(&mut client, &outbox, 1, "open")
        .await
        .unwrap();
    assert_eq!(keys.len(), 2);
    let line = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let line = first.lines.recv().await.expect("consumer output");
            if line.starts_with("CRASH POINT") {
                return line;
            }
        }
    })
    .await
    .expect("the consumer reaches its crash point");
    first.child.start_kill().unwrap(); // SIGKILL
    let status = first.child.wait().await.unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let crashed = keys
        .iter()
        .find(|k| line.contains(&format!("{k} ")))
        .unwrap()
        .clone();
    let other = keys.iter().find(|k| **k != crashed).unwrap().clone();

    let row = Ledger::get(&client, &crashed).await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Sending);
    assert_eq!(row.claimed_by.as_deref(), Some("crashy"));
    assert_eq!(provider.book.accepted(&crashed), 1);

    // Without lookup (the command has no destinations): listed for review once the lease ran out.
    let url = db.url();
    let listed = wait_for(
        "the command lists the stuck delivery",
        Duration::from_secs(20),
        || async {
            let (code, out, err) = crate::support::process::run_to_end(
                &[
                    "reconcile",
                    "--stuck-after",
                    "1s",
                    "--send-timeout",
                    "500ms",
                    "--retention",
                    "1h",
                ],
                &[("DATABASE_URL", url.as_str())],
            )
            .await;
            assert_eq!(code, 0, "{err}");
            out.contains(&format!("review: effect {crashed} "))
                .then_some(out)
        },
    )
    .await;
    assert!(listed.contains("claimed by crashy"), "{listed}");

    // Restarted: the unacked event comes again. The crashed delivery's claim has run out: the
    // new consumer takes it over and finds it at the provider by lookup (recorded sent, not
    // sent again); the other delivery is sent after it; the event is acked.
    let mut second = spawn_consumer(
        &db,
        &broker.exchange,
        &queue,
        &provider.url(),
        "restarted",
        false,
    );
    for key in [&crashed, &other] {
        wait_for(
            &format!("delivery {key} sent"),
            Duration::from_secs(30),
            || async {
                Ledger::get(&client, key)
                    .await
                    .unwrap()
                    .filter(|r| r.state == EffectState::Sent)
            },
        )
        .await;
    }
    wait_for(
        "the event recorded in the inbox",
        Duration::from_secs(10),
        || async {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_inbox WHERE consumer = $1",
                    &[&queue],
                )
                .await
                .unwrap()
                .get(0);
            (n == 1).then_some(())
        },
    )
    .await;
    assert_eq!(provider.book.accepted(&crashed), 1, "not sent again");
    assert_eq!(provider.book.accepted(&other), 1);

    // Nothing is left for the reconciler.
    let cfg = ReconcileConfig::new(
        Duration::from_secs(1),
        Duration::from_secs(3600),
        std::num::NonZeroUsize::new(100).unwrap(),
        Duration::from_millis(500),
    )
    .unwrap();
    let dest = consumer::ProviderClient::new(&provider.url(), Duration::from_secs(2));
    let report = reconcile::reconcile(
        &client,
        &cfg,
        &notifier_ledger("reconciler", Duration::from_secs(1)),
        &dest,
    )
    .await
    .unwrap();
    assert!(
        report.resolved.is_empty() && report.review.is_empty(),
        "{report:?}"
    );
    let t = budget::totals(&client, "acme", tickets::QUOTA)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.remaining, t.held, t.consumed), (8, 0, 2));

    // A graceful stop of the restarted consumer (SIGINT) exits 0.
    let pid = second.child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), second.child.wait())
        .await
        .expect("stops within 20 s")
        .unwrap();
    assert!(status.success(), "{status:?}");
    relay.stop().await;
}
