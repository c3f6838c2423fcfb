//! The effects ledger's edges: a worker whose claim was taken over while it was sending
//! learns the row is not its own and withdraws its item (or records it as a stray when the
//! destination keeps it); an in-doubt effect whose lookup fails stays in doubt; a claim's
//! lease must outlive a send, from SQL as from Rust, and a claim held past its lease is
//! given back unsent. A key's effects go out in the order of its events: a later one waits
//! while an earlier one is queued or being sent, an effect under another live claim is not
//! "done", and a claim whose lease ran out is taken over through the lookup.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_kit::consumer::effects::{
    EffectError, EffectState, EffectsConfig, Ledger, NewEffect, Performed,
};
use outbox_kit::consumer::runner::Context;
use outbox_kit::consumer::{Destination, DestinationError, Effect, Handler, HandlerError, Message};
use serde_json::json;
use tokio::sync::Notify;
use tokio_postgres::Client;

use crate::support::kit::{
    self, FakeDest, RawEvent, RawPublisher, Running, consumer_config, ledger,
};
use crate::support::{TestDb, unique, wait_for, wait_for_explained};

async fn enqueue(client: &Client, key: &str) -> i64 {
    Ledger::enqueue(
        client,
        &NewEffect {
            key,
            destination: "mail",
            payload: json!({"to": "a@example.com"}),
            budget: None,
            reserve_now: false,
        },
    )
    .await
    .unwrap()
}

/// While worker 1's send is held at the destination, its claim is taken over (as after a
/// lapsed lease) and worker 2 sends the item and writes it back. Worker 1's send then goes
/// through: its write-back must come back "not ours", and its duplicate must not stay out.
async fn late_worker(
    delete_fails: bool,
) -> (TestDb, FakeDest, Result<Performed, EffectError>, i64) {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "receipt").await;
    let gate = Arc::new(Notify::new());
    let dest = Arc::new(FakeDest {
        gate: Some(gate.clone()),
        ..FakeDest::new("mail", false)
    });
    *dest.delete_fails.lock().unwrap() = delete_fails;
    let entered = dest.entered.clone();
    let w1 = {
        let dest = dest.clone();
        let client = db.client().await;
        tokio::spawn(async move { ledger("w1").perform(&client, "receipt", &*dest).await })
    };
    tokio::time::timeout(Duration::from_secs(20), entered.notified())
        .await
        .expect("worker 1 reaches the destination");
    client
        .execute(
            "UPDATE outbox_effects SET claimed_by = 'w2', claimed_at = now() WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let done: String = client
        .query_one(
            "SELECT outbox_effect_complete($1, 'w2', 'ext-of-w2')",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(done, "sent", "worker 2's write-back");
    gate.notify_one();
    let outcome = tokio::time::timeout(Duration::from_secs(20), w1)
        .await
        .expect("worker 1 finishes")
        .unwrap();
    let dest = Arc::try_unwrap(dest).ok().expect("the task is done");
    (db, dest, outcome, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_worker_withdraws_its_item_when_someone_else_sent() {
    let (db, dest, outcome, _) = late_worker(false).await;
    assert!(
        matches!(outcome, Ok(Performed::Withdrawn { .. })),
        "{outcome:?}"
    );
    assert!(!dest.is_live("receipt"), "worker 1's duplicate was deleted");
    let row = Ledger::get(&db.client().await, "receipt")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.state, EffectState::Sent);
    assert_eq!(
        row.external_id.as_deref(),
        Some("ext-of-w2"),
        "worker 2's truth stands"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_that_cannot_be_withdrawn_is_recorded() {
    let (db, dest, outcome, id) = late_worker(true).await;
    let Ok(Performed::StillOut { external_id, .. }) = outcome else {
        panic!("{outcome:?}");
    };
    assert!(dest.is_live("receipt"));
    let strays: Vec<(String, String)> = db
        .client()
        .await
        .query(
            "SELECT worker, external_id FROM outbox_effect_strays
              WHERE effect_id = $1 AND resolved_at IS NULL",
            &[&id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(strays, [("w1".to_owned(), external_id)]);
}

/// A claim held past what its lease covers is given back unsent. Here the claim waits on a
/// row lock (as a paused process would wait): the database starts the lease when the
/// statement starts, so the claim it finally grants has already run out, and a reconciler
/// could decide about the row while the worker sends. The worker must not send; claiming
/// again gives a fresh lease and sends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_past_its_lease_is_given_back_unsent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "receipt").await;
    let short = Ledger::new(
        EffectsConfig::new(
            "w1",
            Duration::from_secs(1),
            Duration::from_secs(1),
            Duration::from_millis(3_500),
        )
        .unwrap(),
    );
    let dest = Arc::new(FakeDest::new("mail", false));
    let mut locker = db.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM outbox_effects WHERE id = $1 FOR UPDATE",
        &[&id],
    )
    .await
    .unwrap();
    let w1 = {
        let (dest, client) = (dest.clone(), db.client().await);
        tokio::spawn(async move { short.perform(&client, "receipt", &*dest).await })
    };
    wait_for(
        "the claim waiting on the lock",
        Duration::from_secs(20),
        || async {
            let waiting: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE '%outbox_effect_claim%'",
                    &[],
                )
                .await
                .ok()?
                .get(0);
            (waiting > 0).then_some(())
        },
    )
    .await;
    // Longer than the lease leaves for a send and its write-back (3.5 - 1 - 1 s). The
    // timeouts are long enough for the give-back's write on a busy machine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    lock.commit().await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), w1)
        .await
        .expect("worker 1 finishes")
        .unwrap();
    assert!(
        matches!(outcome, Err(EffectError::LeaseRunOut { .. })),
        "{outcome:?}"
    );
    assert!(outcome.unwrap_err().is_transient());
    assert_eq!(
        dest.total_accepted(),
        0,
        "nothing sent under a lease that ran out"
    );
    let row = Ledger::get(&client, "receipt").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Queued, "the claim was given back");

    let again = ledger("w1").perform(&client, "receipt", &*dest).await;
    assert!(matches!(again, Ok(Performed::Sent { .. })), "{again:?}");
    assert_eq!(dest.accepted("receipt"), 1);
}

/// A destination whose lookup cannot answer (a terminal error), sends otherwise succeed.
struct BrokenLookup(FakeDest);

impl Destination for BrokenLookup {
    fn name(&self) -> &str {
        self.0.name()
    }
    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        self.0.send(effect).await
    }
    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        self.0.delete(external_id).await
    }
    fn supports_lookup(&self) -> bool {
        true
    }
    async fn lookup(&self, _: &Effect) -> Result<Option<String>, DestinationError> {
        Err(DestinationError::Terminal("lookup refused (403)".into()))
    }
}

/// An effect whose last attempt may have gone out (uncertain) and whose lookup fails for
/// good stays in doubt: not failed (that would invite a resend), nothing sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_doubt_effect_whose_lookup_fails_stays_in_doubt() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "receipt").await;
    client
        .execute(
            "UPDATE outbox_effects SET uncertain = true WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let dest = BrokenLookup(FakeDest::new("mail", true));
    let outcome = ledger("w1").perform(&client, "receipt", &dest).await;
    assert!(
        matches!(outcome, Err(EffectError::InDoubt { .. })),
        "{outcome:?}"
    );
    assert_eq!(dest.0.total_accepted(), 0, "nothing sent blind");
    let row = Ledger::get(&client, "receipt").await.unwrap().unwrap();
    assert_eq!(row.state, EffectState::Sending, "left for the reconciler");
    assert!(row.uncertain);
}

/// Other languages claim through SQL: a lease that cannot outlive a send is refused there
/// too, with the rule in the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_from_sql_refuses_a_lease_shorter_than_the_work() {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue(&client, "receipt").await;
    let err = client
        .query(
            "SELECT * FROM outbox_effect_claim('receipt', 'w1', 10, 5, 1)",
            &[],
        )
        .await
        .unwrap_err();
    let db_err = err.as_db_error().expect("refused by the database");
    assert_eq!(db_err.code().code(), "22023", "{db_err:?}");
    assert!(
        db_err
            .message()
            .contains("not longer than the work it guards"),
        "{db_err:?}"
    );
    let rows = client
        .query(
            "SELECT id FROM outbox_effect_claim('receipt', 'w1', 12, 5, 1)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
}

async fn enqueue_in_order(client: &Client, key: &str, order_key: &str) -> i64 {
    Ledger::enqueue_in_order(
        client,
        &NewEffect {
            key,
            destination: "mail",
            payload: json!({"to": "a@example.com"}),
            budget: None,
            reserve_now: false,
        },
        order_key,
    )
    .await
    .unwrap()
}

/// Two effects of one order key: the later one is not claimed while the earlier one is
/// queued or being sent (nothing is sent, the error is transient and names the earlier
/// one), and goes once the earlier one is sent. An effect of another order key, or of none,
/// does not wait. Other languages get the same from SQL (SQLSTATE OB003), and the older
/// forms of enqueue and claim keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_effect_of_a_key_waits_for_the_earlier_one() {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue_in_order(&client, "x1", "ticket/1").await;
    enqueue_in_order(&client, "x2", "ticket/1").await;
    enqueue_in_order(&client, "y1", "ticket/2").await;
    enqueue(&client, "free").await;
    let dest = FakeDest::new("mail", true);
    let w = ledger("w1");

    let early = w.perform(&client, "x2", &dest).await;
    let Err(EffectError::Behind { earlier, state, .. }) = &early else {
        panic!("x2 must wait for x1: {early:?}");
    };
    assert_eq!((earlier.as_str(), state.as_str()), ("x1", "queued"));
    assert!(early.as_ref().unwrap_err().is_transient());
    let row = Ledger::get(&client, "x2").await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.effect.attempts),
        (EffectState::Queued, 0),
        "nothing claimed"
    );

    // x1 being sent (claimed by another worker) holds x2 too.
    let x1 = ledger("w0").claim(&client, "x1").await.unwrap().unwrap();
    let held = w.perform(&client, "x2", &dest).await;
    assert!(
        matches!(&held, Err(EffectError::Behind { state, .. }) if state == "sending"),
        "{held:?}"
    );
    let sql = client
        .query(
            "SELECT * FROM outbox_effect_claim('x2', 'w9', 12, 5, 1)",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(sql.as_db_error().unwrap().code().code(), "OB003", "{sql:?}");
    assert_eq!(dest.total_accepted(), 0, "nothing sent out of order");

    // Other keys do not wait.
    for key in ["y1", "free"] {
        let sent = w.perform(&client, key, &dest).await;
        assert!(
            matches!(sent, Ok(Performed::Sent { .. })),
            "{key}: {sent:?}"
        );
    }

    let done: String = client
        .query_one(
            "SELECT outbox_effect_complete($1, 'w0', 'ext-x1')",
            &[&x1.effect.id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(done, "sent");
    let sent = w.perform(&client, "x2", &dest).await;
    assert!(matches!(sent, Ok(Performed::Sent { .. })), "{sent:?}");

    // The forms other languages used before order keys.
    client
        .query_one("SELECT outbox_effect_enqueue('old', 'mail')", &[])
        .await
        .unwrap();
    let claimed = client
        .query(
            "SELECT id FROM outbox_effect_claim('old', 'w9', 12, 5, 1)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "the five-argument claim");
}

/// An effect under another worker's live claim is not done: `perform` says so with a
/// transient error, never `NotClaimed`. Once that claim's lease ran out, a worker whose
/// destination has a lookup takes it over: it looks the effect up and sends it only if it
/// is not there; without a lookup it stays under the old claim for the reconciler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_under_another_claim_is_not_done() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = enqueue(&client, "receipt").await;
    ledger("w0")
        .claim(&client, "receipt")
        .await
        .unwrap()
        .unwrap();
    let dest = FakeDest::new("mail", true);
    let busy = ledger("w1").perform(&client, "receipt", &dest).await;
    assert!(
        matches!(&busy, Err(EffectError::InFlight { claimed_by, .. }) if claimed_by == "w0"),
        "{busy:?}"
    );
    assert!(busy.unwrap_err().is_transient());

    client
        .execute(
            "UPDATE outbox_effects SET lease_until = now() - interval '1 second' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let no_lookup = FakeDest::new("mail", false);
    let left = ledger("w1").perform(&client, "receipt", &no_lookup).await;
    assert!(
        matches!(left, Err(EffectError::InFlight { .. })),
        "{left:?}"
    );
    assert_eq!(no_lookup.total_accepted(), 0, "never sent blind");

    let taken = ledger("w1").perform(&client, "receipt", &dest).await;
    assert!(
        matches!(
            taken,
            Ok(Performed::Sent {
                found_by_lookup: false,
                ..
            })
        ),
        "{taken:?}"
    );
    assert_eq!(dest.accepted("receipt"), 1);
    let late: String = client
        .query_one(
            "SELECT outbox_effect_complete($1, 'w0', 'ext-of-w0')",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(late, "not_ours", "the old claimer's write-back is refused");
    let done = ledger("w2").perform(&client, "receipt", &dest).await;
    assert!(
        matches!(
            done,
            Ok(Performed::NotClaimed {
                state: Some(EffectState::Sent)
            })
        ),
        "{done:?}"
    );
}

/// A destination whose first send of `hang` never returns (the request never leaves), and
/// which notes the order in which it accepted items.
struct HangsOnce {
    inner: FakeDest,
    hang: &'static str,
    hung: AtomicBool,
    order: Mutex<Vec<(String, Instant)>>,
}

impl Destination for HangsOnce {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        if effect.key == self.hang && !self.hung.swap(true, Ordering::SeqCst) {
            self.inner.entered.notify_one();
            std::future::pending::<()>().await;
        }
        let id = self.inner.send(effect).await?;
        self.order
            .lock()
            .unwrap()
            .push((effect.key.clone(), Instant::now()));
        Ok(id)
    }
    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        self.inner.delete(external_id).await
    }
    fn supports_lookup(&self) -> bool {
        true
    }
    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        self.inner.lookup(effect).await
    }
}

/// The handler as docs/consumer-kit.md shows it: perform the event's effect; a transient
/// ledger error retries the event.
struct Performer {
    dest: Arc<HangsOnce>,
    ledger: Ledger,
    /// How many times the handler ran.
    calls: AtomicUsize,
}

impl Handler for Performer {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let p = msg.payload()?;
        let key = p["effect"].as_str().unwrap_or_default();
        let conn = cx.connection().await?;
        match self.ledger.perform(&conn, key, &*self.dest).await {
            Ok(_) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// The scenario of the effects-order bug: e1's handler times out while its effect X1 is
/// being sent (the request never left), so X1 stays `sending` under a claim nobody will
/// finish. e2 of the same key, handled meanwhile, must not send X2 before X1 is resolved;
/// e1's retries must not take X1's `sending` for done. X1 is taken over once its lease ran
/// out (looked up: not there; sent), then X2 goes: each once, X1 first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_dropped_mid_send_goes_out_before_the_next_one_of_its_key() {
    dropped_mid_send(false).await;
}

/// The same in an ordered group, where e2 waits behind e1 in its lane: e1's retries in
/// place must not take x1's `sending` for done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_dropped_mid_send_goes_out_before_the_next_one_of_its_key_in_a_group() {
    dropped_mid_send(true).await;
}

async fn dropped_mid_send(ordered: bool) {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue_in_order(&client, "x1", "order/k").await;
    enqueue_in_order(&client, "x2", "order/k").await;
    let exchange = unique("it.ex").replace('_', ".");
    let mut cfg = if ordered {
        // Retries in place at most 400 ms apart: 100 attempts outlast the 7.5 s lease.
        let mut c = kit::group_config(&exchange, 1);
        c.max_attempts = std::num::NonZeroU32::new(100);
        c
    } else {
        let mut c = consumer_config(&exchange);
        c.max_attempts = None;
        c
    };
    cfg.handler_timeout = Duration::from_secs(2);
    let dest = Arc::new(HangsOnce {
        inner: FakeDest::new("mail", true),
        hang: "x1",
        hung: AtomicBool::new(false),
        order: Mutex::new(Vec::new()),
    });
    // Sends may take 3 s: the handler's 2 s run out first, mid-send.
    let ledger = Ledger::new(
        EffectsConfig::new(
            "w1",
            Duration::from_secs(3),
            Duration::from_secs(1),
            Duration::from_millis(7_500),
        )
        .unwrap(),
    );
    let consumer = Running::start(
        &db,
        cfg.clone(),
        Arc::new(Performer {
            dest: dest.clone(),
            ledger,
            calls: AtomicUsize::new(0),
        }),
    );
    if ordered {
        kit::wait_group_ready(&cfg).await;
    } else {
        kit::wait_queue_ready(&cfg.queue).await;
    }
    let publisher = RawPublisher::new(&exchange).await;
    publisher
        .publish(&RawEvent::new("k", 1, json!({"effect": "x1"})))
        .await;
    tokio::time::timeout(Duration::from_secs(20), dest.inner.entered.notified())
        .await
        .expect("x1's first send reaches the destination within 20 s");
    publisher
        .publish(&RawEvent::new("k", 2, json!({"effect": "x2"})))
        .await;
    let order = || dest.order.lock().unwrap().clone();
    wait_for_explained(
        "x1 and x2 both sent",
        Duration::from_secs(60),
        || async { (order().len() >= 2).then_some(()) },
        || async { format!("; sent so far: {:?}", order()) },
    )
    .await;
    let keys: Vec<String> = order().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["x1", "x2"], "x1 first, each once");
    consumer.stop().await;
    assert_eq!(dest.inner.accepted("x1"), 1);
    assert_eq!(dest.inner.accepted("x2"), 1);
    if ordered {
        kit::delete_group_topology(&cfg).await;
    } else {
        kit::delete_topology(&cfg).await;
    }
}

/// An event whose effect waits for an earlier effect of its order key (`Behind`) is retried
/// without spending its attempts: with max_attempts 3 it meets the wait many more times and
/// is not dead-lettered; once the earlier effect is sent, the event is applied and its own
/// effect goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_an_earlier_effect_spends_no_attempts() {
    waits_spend_no_attempts(false).await;
}

/// The same in an ordered group, where the event waits in place in its key's lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_an_earlier_effect_spends_no_attempts_in_a_group() {
    waits_spend_no_attempts(true).await;
}

async fn waits_spend_no_attempts(ordered: bool) {
    let db = TestDb::new().await;
    let client = db.client().await;
    enqueue_in_order(&client, "y1", "order/w").await;
    enqueue_in_order(&client, "y2", "order/w").await;
    let exchange = unique("it.ex").replace('_', ".");
    let mut cfg = if ordered {
        kit::group_config(&exchange, 1)
    } else {
        consumer_config(&exchange)
    };
    cfg.max_attempts = std::num::NonZeroU32::new(3);
    let dest = Arc::new(HangsOnce {
        inner: FakeDest::new("mail", true),
        hang: "nothing hangs",
        hung: AtomicBool::new(false),
        order: Mutex::new(Vec::new()),
    });
    let performer = Arc::new(Performer {
        dest: dest.clone(),
        ledger: ledger("w1"),
        calls: AtomicUsize::new(0),
    });
    let consumer = Running::start(&db, cfg.clone(), performer.clone());
    if ordered {
        kit::wait_group_ready(&cfg).await;
    } else {
        kit::wait_queue_ready(&cfg.queue).await;
    }
    let publisher = RawPublisher::new(&exchange).await;
    let event = RawEvent::new("w", 1, json!({"effect": "y2"}));
    publisher.publish(&event).await;
    wait_for(
        "the event met the wait six times",
        Duration::from_secs(60),
        || async { (performer.calls.load(Ordering::SeqCst) >= 6).then_some(()) },
    )
    .await;
    let inbox = || async {
        tokio::time::timeout(
            Duration::from_secs(20),
            client.query_opt(
                "SELECT outcome FROM outbox_inbox WHERE event_id = $1",
                &[&event.event_id],
            ),
        )
        .await
        .expect("the inbox answers within 20 s")
        .unwrap()
        .map(|r| r.get::<_, String>(0))
    };
    assert_eq!(inbox().await, None, "waiting, not dead-lettered");
    assert_eq!(dest.inner.accepted("y2"), 0);
    let sent = tokio::time::timeout(
        Duration::from_secs(20),
        ledger("w2").perform(&client, "y1", &*dest),
    )
    .await
    .expect("y1 performed within 20 s")
    .unwrap();
    assert!(matches!(sent, Performed::Sent { .. }), "{sent:?}");
    wait_for("the event applied", Duration::from_secs(30), || async {
        (inbox().await.as_deref() == Some("applied")).then_some(())
    })
    .await;
    consumer.stop().await;
    assert_eq!(dest.inner.accepted("y1"), 1);
    assert_eq!(dest.inner.accepted("y2"), 1);
    if ordered {
        kit::delete_group_topology(&cfg).await;
    } else {
        kit::delete_topology(&cfg).await;
    }
}
