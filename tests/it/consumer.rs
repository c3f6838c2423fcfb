//! Consumer kit: inbox dedupe, the effects-ledger rules, budgets and the reconciler,
//! against the real Postgres and RabbitMQ (ordered consumer groups: `groups.rs`).

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_kit::consumer::budget;
use outbox_kit::consumer::effects::{
    Cancelled, EffectError, EffectState, EffectsConfig, Ledger, NewEffect, Performed,
};
use outbox_kit::consumer::reconcile::{self, ReconcileConfig, Resolution};
use outbox_kit::consumer::runner::Context;
use outbox_kit::consumer::{DestinationError, Handler, HandlerError, Message};
use serde_json::json;
use tokio::sync::Notify;
use tokio_postgres::Client;

use crate::support::kit::{
    self, DeadLetters, FakeDest, RawEvent, RawPublisher, Running, consumer_config, ledger,
};
use crate::support::{TestDb, unique, wait_for};

const APPLIED: &str = "CREATE TABLE it_applied (
    n bigint GENERATED ALWAYS AS IDENTITY,
    event_id uuid NOT NULL,
    aggregate_id text NOT NULL,
    seq bigint)";

/// Records every applied event in the inbox transaction and, when the payload names an
/// effect, performs it through the destination (enqueued with the payload's budget).
struct Recorder {
    dest: Arc<FakeDest>,
    ledger: Ledger,
}

impl Handler for Recorder {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        let p = msg.payload()?;
        cx.tx()
            .execute(
                "INSERT INTO it_applied (event_id, aggregate_id, seq) VALUES ($1, $2, $3)",
                &[&msg.event_id, &msg.aggregate_id, &msg.seq],
            )
            .await?;
        if let Some(key) = p["effect"].as_str() {
            let conn = cx.connection().await?;
            let budget = p["tenant"].as_str().map(|t| (t, "sms", 1));
            Ledger::enqueue(
                &**conn,
                &NewEffect {
                    key,
                    destination: &self.dest.name,
                    payload: p.clone(),
                    budget,
                    reserve_now: false,
                },
            )
            .await?;
            self.ledger.perform(&conn, key, &*self.dest).await?;
        }
        Ok(())
    }
}

async fn applied(client: &Client) -> Vec<(String, Option<i64>, uuid::Uuid)> {
    client
        .query(
            "SELECT aggregate_id, seq, event_id FROM it_applied ORDER BY n",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn queue_depth(queue: &str) -> u32 {
    kit::queue_counts(&crate::support::amqp_url(), queue)
        .await
        .unwrap_or_else(|| panic!("queue {queue} cannot be read within its deadline"))
        .0
}

async fn enqueue(client: &Client, key: &str, dest: &str, budget: Option<(&str, &str, i64)>) -> i64 {
    Ledger::enqueue(
        client,
        &NewEffect {
            key,
            destination: dest,
            payload: json!({"to": "a@example.com"}),
            budget,
            reserve_now: false,
        },
    )
    .await
    .unwrap()
}

/// Every event published twice, consumed by two runners sharing one inbox: each handler
/// effect (the applied row and the destination send) happens once per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_deliveries_to_two_consumers_apply_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let exchange = unique("it.ex").replace('_', ".");
    let cfg = consumer_config(&exchange);
    let dest = Arc::new(FakeDest::new("mail", false));
    let a = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Recorder {
            dest: dest.clone(),
            ledger: ledger("worker-a"),
        }),
    );
    let b = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Recorder {
            dest: dest.clone(),
            ledger: ledger("worker-b"),
        }),
    );
    kit::wait_queue_ready(&cfg.queue).await;
    let publisher = RawPublisher::new(&exchange).await;
    let events: Vec<RawEvent> = (0..30)
        .map(|i| RawEvent::new(&format!("k{i}"), 1, json!({"effect": format!("mail-{i}")})))
        .collect();
    for e in &events {
        // Back to back: round-robin hands the two copies to the two consumers at once.
        publisher.publish(e).await;
        publisher.publish(e).await;
    }
    wait_for(
        "30 events applied and the queue drained",
        Duration::from_secs(30),
        || async {
            let n = applied(&client).await.len();
            (n >= 30 && queue_depth(&cfg.queue).await == 0).then_some(())
        },
    )
    .await;
    a.stop().await;
    b.stop().await;
    // Both stopped after finishing what they had in hand: nothing left unacked.
    assert_eq!(queue_depth(&cfg.queue).await, 0, "every copy was acked");

    let rows = applied(&client).await;
    let mut per_event: HashMap<uuid::Uuid, usize> = HashMap::new();
    for (_, _, id) in &rows {
        *per_event.entry(*id).or_default() += 1;
    }
    assert_eq!(per_event.len(), 30);
    assert!(per_event.values().all(|n| *n == 1), "{per_event:?}");
    for i in 0..30 {
        assert_eq!(dest.accepted(&format!("mail-{i}")), 1, "mail-{i} sent once");
    }
    let inbox: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_inbox WHERE consumer = $1",
            &[&cfg.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox, 30);
    kit::delete_topology(&cfg).await;
}

/// Ten workers race to claim one effect: exactly one gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_workers_race_to_claim_one_effect() {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue(&client, "race", "mail", None).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(10));
    let mut tasks = Vec::new();
    for w in 0..10 {
        let c = db.client().await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let l = ledger(&format!("worker-{w}"));
            barrier.wait().await;
            l.claim(&c, "race").await.unwrap().map(|_| w)
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let Some(w) = t.await.unwrap() {
            winners.push(w);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let row = Ledger::get(&client, "race").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Sending);
    assert_eq!(row.claimed_by, Some(format!("worker-{}", winners[0])));
    assert_eq!(row.effect.attempts, 1);
}

/// Cancel while the send is in progress: the claimer withdraws the item once its send
/// returns, and the ledger says cancelled and withdrawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_while_sending_withdraws_at_the_destination() {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue(&client, "welcome", "mail", None).await;
    let gate = Arc::new(Notify::new());
    let dest = Arc::new(FakeDest {
        gate: Some(gate.clone()),
        ..FakeDest::new("mail", false)
    });
    let worker = db.client().await;
    let d = dest.clone();
    let sending =
        tokio::spawn(async move { ledger("worker").perform(&worker, "welcome", &*d).await });
    tokio::time::timeout(Duration::from_secs(5), dest.entered.notified())
        .await
        .expect("send started");

    let outcome = ledger("ticket-service")
        .cancel(&client, "welcome", &*dest)
        .await
        .unwrap();
    assert_eq!(outcome, Cancelled::Pending);
    assert_eq!(
        Ledger::get(&client, "welcome")
            .await
            .unwrap()
            .unwrap()
            .state,
        EffectState::Sending,
        "not cancelled before the item is withdrawn"
    );
    gate.notify_one();
    let performed = sending.await.unwrap().unwrap();
    assert!(
        matches!(performed, Performed::Withdrawn { .. }),
        "{performed:?}"
    );

    let row = Ledger::get(&client, "welcome").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Cancelled);
    assert!(row.withdrawn && row.cancel_requested);
    assert_eq!(dest.accepted("welcome"), 1);
    assert!(!dest.is_live("welcome"), "withdrawn at the destination");
}

/// Cancel of a sent item whose delete fails: the ledger says it is still out; once the
/// destination deletes it, cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_when_the_destination_delete_fails_says_still_out() {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue(&client, "invoice-7", "mail", None).await;
    let dest = FakeDest::new("mail", false);
    let l = ledger("worker");
    assert!(matches!(
        l.perform(&client, "invoice-7", &dest).await.unwrap(),
        Performed::Sent { .. }
    ));
    *dest.delete_fails.lock().unwrap() = true;
    let outcome = l.cancel(&client, "invoice-7", &dest).await.unwrap();
    assert!(matches!(outcome, Cancelled::StillOut { .. }), "{outcome:?}");
    let row = Ledger::get(&client, "invoice-7").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Sent, "still out");
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("did not withdraw"),
        "{:?}",
        row.last_error
    );
    assert!(dest.is_live("invoice-7"));

    *dest.delete_fails.lock().unwrap() = false;
    let outcome = l.cancel(&client, "invoice-7", &dest).await.unwrap();
    assert!(
        matches!(outcome, Cancelled::Withdrawn { .. }),
        "{outcome:?}"
    );
    let row = Ledger::get(&client, "invoice-7").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Cancelled);
    assert!(!dest.is_live("invoice-7"));
    // A queued one is cancelled without the destination.
    enqueue(&client, "never-sent", "mail", None).await;
    assert_eq!(
        l.cancel(&client, "never-sent", &dest).await.unwrap(),
        Cancelled::Cancelled
    );
}

/// A failure reported after success (a late timeout, another worker, an operator) does not
/// overwrite `sent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_failure_does_not_overwrite_sent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "receipt", "mail", None).await;
    let dest = FakeDest::new("mail", false);
    let l = ledger("worker");
    l.perform(&client, "receipt", &dest).await.unwrap();
    assert!(!l.fail(&client, id, "late timeout").await.unwrap());
    assert!(
        !ledger("other")
            .fail(&client, id, "other worker")
            .await
            .unwrap()
    );
    let by_operator: bool = client
        .query_one("SELECT outbox_effect_fail($1, NULL, 'operator')", &[&id])
        .await
        .unwrap()
        .get(0);
    assert!(!by_operator);
    let row = Ledger::get(&client, "receipt").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Sent);
    assert_eq!(row.last_error, None);
}

/// Terminal destination error through the runner: the effect fails, its reservation goes
/// back to the budget, and the message lands in the dead-letter queue with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminal_error_releases_the_budget_and_dead_letters() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    budget::set(&client, "acme", "sms", 5).await.unwrap();
    let exchange = unique("it.ex").replace('_', ".");
    let cfg = consumer_config(&exchange);
    let dest = Arc::new(FakeDest::new("sms", false));
    dest.then(Err(DestinationError::Terminal("invalid address".into())));
    let running = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Recorder {
            dest: dest.clone(),
            ledger: ledger("worker"),
        }),
    );
    kit::wait_queue_ready(&cfg.queue).await;
    let dead = DeadLetters::watch(&cfg.dead_letter_queue()).await;
    let e = RawEvent::new("t1", 1, json!({"effect": "sms-1", "tenant": "acme"}));
    RawPublisher::new(&exchange).await.publish(&e).await;
    let got = wait_for(
        "the message dead-lettered",
        Duration::from_secs(20),
        || async { dead.all().into_iter().next() },
    )
    .await;
    running.stop().await;
    assert_eq!(got.event_id, e.event_id.to_string());
    assert!(got.reason.contains("invalid address"), "{}", got.reason);

    let row = Ledger::get(&client, "sms-1").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Failed);
    assert!(row.last_error.unwrap().contains("invalid address"));
    let t = budget::totals(&client, "acme", "sms")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.remaining, t.held, t.consumed), (5, 0, 0), "released");
    let outcome: String = client
        .query_one(
            "SELECT outcome FROM outbox_inbox WHERE event_id = $1",
            &[&e.event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outcome, "dead");
    assert!(
        applied(&client).await.is_empty(),
        "the handler's transaction rolled back"
    );
    kit::delete_topology(&cfg).await;
}

/// Transient errors keep the reservation and retry: once directly through the ledger, then
/// through the runner's retry queues until the destination takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transient_error_keeps_the_budget_and_retries() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    budget::set(&client, "acme", "sms", 5).await.unwrap();

    // The rule itself.
    enqueue(&client, "sms-direct", "sms", Some(("acme", "sms", 1))).await;
    let dest = Arc::new(FakeDest::new("sms", false));
    dest.then(Err(DestinationError::Transient("503".into())));
    let err = ledger("w")
        .perform(&client, "sms-direct", &*dest)
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    let row = Ledger::get(&client, "sms-direct").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Queued);
    let t = budget::totals(&client, "acme", "sms")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.remaining, t.held), (4, 1), "the reservation is kept");
    assert!(matches!(
        ledger("w")
            .perform(&client, "sms-direct", &*dest)
            .await
            .unwrap(),
        Performed::Sent { .. }
    ));

    // Through the runner: two 503s, then accepted.
    dest.then(Err(DestinationError::Transient("503".into())))
        .then(Err(DestinationError::Transient("503".into())));
    let exchange = unique("it.ex").replace('_', ".");
    let cfg = consumer_config(&exchange);
    let running = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Recorder {
            dest: dest.clone(),
            ledger: ledger("worker"),
        }),
    );
    kit::wait_queue_ready(&cfg.queue).await;
    let started = Instant::now();
    RawPublisher::new(&exchange)
        .await
        .publish(&RawEvent::new(
            "t1",
            1,
            json!({"effect": "sms-runner", "tenant": "acme"}),
        ))
        .await;
    let row = wait_for("sms-runner sent", Duration::from_secs(20), || async {
        Ledger::get(&client, "sms-runner")
            .await
            .unwrap()
            .filter(|r| r.state == EffectState::Sent)
    })
    .await;
    running.stop().await;
    assert_eq!(row.effect.attempts, 3);
    assert_eq!(dest.accepted("sms-runner"), 1);
    // Retry delays 100 ms then 200 ms came from the retry queues, not a spin.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    let t = budget::totals(&client, "acme", "sms")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.remaining, t.held, t.consumed), (3, 0, 2));
    assert_eq!(
        applied(&client).await.len(),
        1,
        "applied once, after the retries"
    );
    kit::delete_topology(&cfg).await;
}

/// Out of budget: the claim rolls back whole (still queued, unclaimed, no attempt counted,
/// no reservation) and the error says what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_budget_rolls_back_the_whole_claim() {
    let db = TestDb::new().await;
    let client = db.client().await;
    budget::set(&client, "acme", "sms", 0).await.unwrap();
    enqueue(&client, "sms-1", "sms", Some(("acme", "sms", 1))).await;
    let err = ledger("w").claim(&client, "sms-1").await.unwrap_err();
    let EffectError::OutOfBudget(o) = &err else {
        panic!("expected out of budget, got {err}")
    };
    assert_eq!(
        (
            o.tenant.as_str(),
            o.quota_key.as_str(),
            o.needed,
            o.remaining
        ),
        ("acme", "sms", 1, 0)
    );
    assert!(err.to_string().contains("out of budget"), "{err}");
    assert!(!err.is_transient());
    let row = Ledger::get(&client, "sms-1").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Queued);
    assert_eq!(row.claimed_by, None);
    assert_eq!(row.effect.attempts, 0);
    let reservations: i64 = client
        .query_one("SELECT count(*) FROM outbox_budget_reservations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(reservations, 0);
    // With budget, the same claim goes through and reserves.
    budget::set(&client, "acme", "sms", 1).await.unwrap();
    assert!(ledger("w").claim(&client, "sms-1").await.unwrap().is_some());
    let t = budget::totals(&client, "acme", "sms")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.remaining, t.held), (0, 1));
}

/// A ledger whose claims run out fast: 100 ms sends and write-backs, 500 ms lease.
fn short_lease(worker: &str) -> Ledger {
    Ledger::new(
        EffectsConfig::new(
            worker,
            Duration::from_millis(100),
            Duration::from_millis(100),
            Duration::from_millis(500),
        )
        .unwrap(),
    )
}

/// Effects left in `sending` by a dead worker: resolved through lookup (found → sent;
/// absent → sent now, once), listed for review without lookup, never sent blindly; the
/// command lists them too; retention deletes old finished rows in batches and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_resolves_through_lookup_or_lists_for_review() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let with_lookup = FakeDest::new("mail", true);
    let without = FakeDest::new("fax", false);
    // The dead worker: claimed three, the destination accepted one, then it died.
    let dead = short_lease("dead-worker");
    for (key, dest) in [("arrived", "mail"), ("lost", "mail"), ("fax-1", "fax")] {
        enqueue(&client, key, dest, None).await;
        dead.claim(&client, key).await.unwrap().unwrap();
    }
    with_lookup.accept("arrived");

    let cfg = ReconcileConfig::new(
        Duration::from_millis(300),
        Duration::from_secs(3600),
        NonZeroUsize::new(100).unwrap(),
        Duration::from_millis(100),
    )
    .unwrap();
    wait_for("leases run out", Duration::from_secs(10), || async {
        (reconcile::stuck(&client, &cfg).await.unwrap().len() == 3).then_some(())
    })
    .await;

    // The command lists them (it has no destinations).
    let url = db.url();
    let (code, out, err) = crate::support::process::run_to_end(
        &[
            "reconcile",
            "--stuck-after",
            "300ms",
            "--send-timeout",
            "100ms",
            "--retention",
            "1h",
        ],
        &[("DATABASE_URL", url.as_str())],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    for key in ["arrived", "lost", "fax-1"] {
        assert!(out.contains(&format!("review: effect {key} ")), "{out}");
    }
    assert!(
        out.contains("reconcile: 3 stuck effects for review"),
        "{out}"
    );

    let report = reconcile::reconcile(&client, &cfg, &short_lease("reconciler"), &with_lookup)
        .await
        .unwrap();
    let resolved: HashMap<String, Resolution> = report
        .resolved
        .iter()
        .map(|(s, r)| (s.key.clone(), r.clone()))
        .collect();
    assert!(
        matches!(resolved["arrived"], Resolution::Found { .. }),
        "{resolved:?}"
    );
    assert!(
        matches!(resolved["lost"], Resolution::Resent { .. }),
        "{resolved:?}"
    );
    assert_eq!(
        report
            .review
            .iter()
            .map(|s| s.key.as_str())
            .collect::<Vec<_>>(),
        ["fax-1"]
    );
    assert_eq!(with_lookup.accepted("arrived"), 1, "found, not sent again");
    assert_eq!(with_lookup.accepted("lost"), 1, "absent, so sent once");
    assert_eq!(without.total_accepted(), 0);
    for key in ["arrived", "lost"] {
        assert_eq!(
            Ledger::get(&client, key).await.unwrap().unwrap().state,
            EffectState::Sent
        );
    }
    assert_eq!(
        Ledger::get(&client, "fax-1").await.unwrap().unwrap().state,
        EffectState::Sending,
        "without lookup it stays for review"
    );

    // Retention: finished rows past the age go, in batches; sending and recent rows stay.
    client
        .batch_execute(
            "INSERT INTO outbox_effects (effect_key, destination, state, updated_at)
             SELECT 'old-' || g, 'mail', 'sent', now() - interval '2 hours' FROM generate_series(1, 7) g;
             INSERT INTO outbox_inbox (consumer, event_id, handled_at)
             SELECT 'c', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 5) g;
             INSERT INTO outbox_inbox (consumer, event_id) VALUES ('c', gen_random_uuid());
             UPDATE outbox_effects SET updated_at = now() - interval '2 hours' WHERE effect_key = 'fax-1';",
        )
        .await
        .unwrap();
    let small = ReconcileConfig::new(
        Duration::from_millis(300),
        Duration::from_secs(3600),
        NonZeroUsize::new(3).unwrap(),
        Duration::from_millis(100),
    )
    .unwrap();
    let (effects, inbox) = reconcile::prune(&client, &small).await.unwrap();
    assert_eq!((effects, inbox), (7, 5));
    let left: i64 = client
        .query_one("SELECT count(*) FROM outbox_effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 3, "arrived, lost and the stuck fax-1 stay");
}

/// The broker closes the consumer's connection: the runner reconnects by itself and goes on
/// applying, with nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_runner_reconnects_after_the_broker_closes_its_connection() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let exchange = unique("it.ex").replace('_', ".");
    let cfg = consumer_config(&exchange);
    let running = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Recorder {
            dest: Arc::new(FakeDest::new("none", false)),
            ledger: ledger("w"),
        }),
    );
    kit::wait_queue_ready(&cfg.queue).await;
    let publisher = RawPublisher::new(&exchange).await;
    publisher.publish(&RawEvent::new("a", 1, json!({}))).await;
    wait_for(
        "the first event applied",
        Duration::from_secs(20),
        || async { (applied(&client).await.len() == 1).then_some(()) },
    )
    .await;
    let closed = crate::support::close_connections(&cfg.connection_name).await;
    assert!(closed >= 1, "no connection named {}", cfg.connection_name);
    for i in 0..5 {
        publisher
            .publish(&RawEvent::new(&format!("b{i}"), 1, json!({})))
            .await;
    }
    wait_for(
        "events after the reconnect applied",
        Duration::from_secs(30),
        || async { (applied(&client).await.len() == 6).then_some(()) },
    )
    .await;
    running.stop().await;
    assert_eq!(applied(&client).await.len(), 6);
    kit::delete_topology(&cfg).await;
}

/// Holds every message until the test opens the gate.
struct Slow {
    gate: Arc<Notify>,
    entered: Arc<Notify>,
}

impl Handler for Slow {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        cx.tx()
            .execute(
                "INSERT INTO it_applied (event_id, aggregate_id, seq) VALUES ($1, $2, $3)",
                &[&msg.event_id, &msg.aggregate_id, &msg.seq],
            )
            .await?;
        self.entered.notify_one();
        self.gate.notified().await;
        Ok(())
    }
}

/// A graceful stop while a message is in hand: the runner does not return until that message
/// is committed and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_stop_finishes_the_message_in_hand() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(APPLIED).await.unwrap();
    let exchange = unique("it.ex").replace('_', ".");
    let mut cfg = consumer_config(&exchange);
    cfg.prefetch = std::num::NonZeroU16::new(1).unwrap();
    let (gate, entered) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let mut running = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Slow {
            gate: gate.clone(),
            entered: entered.clone(),
        }),
    );
    kit::wait_queue_ready(&cfg.queue).await;
    let publisher = RawPublisher::new(&exchange).await;
    let first = RawEvent::new("a", 1, json!({}));
    publisher.publish(&first).await;
    publisher.publish(&RawEvent::new("b", 1, json!({}))).await;
    tokio::time::timeout(Duration::from_secs(20), entered.notified())
        .await
        .expect("the handler started");
    running.stop.cancel();
    // The gate is closed: the runner must still be waiting for the message in hand.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut running.handle)
            .await
            .is_err(),
        "the runner returned with a message in hand"
    );
    gate.notify_one();
    tokio::time::timeout(Duration::from_secs(20), running.handle)
        .await
        .expect("stops once the message is done")
        .unwrap()
        .unwrap();
    let rows = applied(&client).await;
    assert_eq!(rows.len(), 1, "only the message in hand: {rows:?}");
    assert_eq!(rows[0].2, first.event_id);
    // Acked: only the second message is left in the queue, unapplied.
    assert_eq!(queue_depth(&cfg.queue).await, 1);
    kit::delete_topology(&cfg).await;
}

/// The row changes under a worker while it sends (an operator fails it): the worker's
/// write-back is refused and its item is withdrawn at the destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_back_to_a_row_no_longer_ours_withdraws_the_item() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "webhook-1", "hooks", None).await;
    let gate = Arc::new(Notify::new());
    let dest = Arc::new(FakeDest {
        gate: Some(gate.clone()),
        ..FakeDest::new("hooks", false)
    });
    let worker = db.client().await;
    let d = dest.clone();
    let sending =
        tokio::spawn(async move { ledger("worker").perform(&worker, "webhook-1", &*d).await });
    tokio::time::timeout(Duration::from_secs(5), dest.entered.notified())
        .await
        .expect("send started");
    let by_operator: bool = client
        .query_one(
            "SELECT outbox_effect_fail($1, NULL, 'stopped by an operator')",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(by_operator);
    gate.notify_one();
    let performed = sending.await.unwrap().unwrap();
    assert!(
        matches!(performed, Performed::Withdrawn { .. }),
        "{performed:?}"
    );
    assert_eq!(dest.accepted("webhook-1"), 1);
    assert!(!dest.is_live("webhook-1"), "withdrawn");
    let row = Ledger::get(&client, "webhook-1").await.unwrap().unwrap();
    assert_eq!(
        row.state,
        EffectState::Failed,
        "the operator's verdict stands"
    );
}

/// Commits take 3 s (a deferred constraint trigger sleeps at COMMIT), longer than the
/// handler's 2 s: the attempt gives up while its commit is still under way, and the commit
/// then goes through.
const SLOW_COMMIT: &str = "
CREATE TABLE it_slow_commit (event_id uuid NOT NULL);
CREATE FUNCTION it_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER it_slow_commit AFTER INSERT ON it_slow_commit
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION it_slow_commit();";

struct SlowCommit;

/// The event's inbox outcome, once its slow commit went through.
async fn inbox_outcome(client: &Client, consumer: &str, event_id: uuid::Uuid) -> Option<String> {
    client
        .query_opt(
            "SELECT i.outcome FROM outbox_inbox i
               JOIN it_slow_commit s USING (event_id)
              WHERE i.consumer = $1 AND i.event_id = $2",
            &[&consumer, &event_id],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

impl Handler for SlowCommit {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        cx.tx()
            .execute(
                "INSERT INTO it_slow_commit (event_id) VALUES ($1)",
                &[&msg.event_id],
            )
            .await?;
        Ok(())
    }
}

/// The last attempt fails while its commit is under way, and the commit goes through. The
/// event is applied: it must be acked, not also dead-lettered with its inbox record turned
/// to `dead` (unordered consumers and ordered groups alike).
async fn a_commit_that_went_through_is_not_dead_lettered(ordered: bool) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(SLOW_COMMIT).await.unwrap();
    let exchange = unique("it.ex").replace('_', ".");
    let mut cfg = if ordered {
        kit::group_config(&exchange, 1)
    } else {
        consumer_config(&exchange)
    };
    cfg.handler_timeout = Duration::from_secs(2);
    cfg.max_attempts = std::num::NonZeroU32::new(1);
    let consumer = Running::start(&db, cfg.clone(), Arc::new(SlowCommit));
    if ordered {
        kit::wait_group_ready(&cfg).await;
    } else {
        kit::wait_queue_ready(&cfg.queue).await;
    }
    let publisher = RawPublisher::new(&exchange).await;
    let event = RawEvent::new("k", 1, json!({}));
    publisher.publish(&event).await;
    wait_for(
        "the slow commit recorded the event",
        Duration::from_secs(30),
        || inbox_outcome(&client, &cfg.name, event.event_id),
    )
    .await;
    // A graceful stop finishes the message in hand: it is settled one way or the other.
    consumer.stop().await;
    assert_eq!(
        inbox_outcome(&client, &cfg.name, event.event_id)
            .await
            .as_deref(),
        Some("applied"),
        "the applied event keeps its record"
    );
    assert_eq!(
        queue_depth(&cfg.dead_letter_queue()).await,
        0,
        "an applied event is not dead-lettered"
    );
    if ordered {
        kit::delete_group_topology(&cfg).await;
    } else {
        kit::delete_topology(&cfg).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_went_through_is_not_dead_lettered_unordered() {
    a_commit_that_went_through_is_not_dead_lettered(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_went_through_is_not_dead_lettered_in_a_group() {
    a_commit_that_went_through_is_not_dead_lettered(true).await;
}

/// A test's broker call never hangs: a raw publish whose connection went silent (a
/// blackhole: no answer, no close) fails within its deadline, naming what it waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_publish_on_a_silent_connection_fails_within_its_deadline() {
    use crate::support::proxy::{Mode, TcpProxy};
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let publisher = RawPublisher::on(&url, "amq.topic").await;
    proxy.set(Mode::Blackhole);
    let publish = tokio::spawn(async move {
        publisher.publish(&RawEvent::new("k", 1, json!({}))).await;
    });
    let ended = tokio::time::timeout(Duration::from_secs(40), publish)
        .await
        .expect("the publish ends within 40 s (its deadline is 15 s) instead of hanging");
    let panic = ended
        .expect_err("a publish nobody confirms fails")
        .into_panic();
    let said = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    assert!(
        said.contains("basic.publish") || said.contains("confirm"),
        "the failure names the call it waited for: {said}"
    );
    proxy.set(Mode::Pass);
}
