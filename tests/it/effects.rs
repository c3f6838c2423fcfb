//! The effects ledger's edges: a worker whose claim was taken over while it was sending
//! learns the row is not its own and withdraws its item (or records it as a stray when the
//! destination keeps it); an in-doubt effect whose lookup fails stays in doubt; a claim's
//! lease must outlive a send, from SQL as from Rust, and a claim held past its lease is
//! given back unsent.

use std::sync::Arc;
use std::time::Duration;

use outbox_kit::consumer::effects::{
    EffectError, EffectState, EffectsConfig, Ledger, NewEffect, Performed,
};
use outbox_kit::consumer::{Destination, DestinationError, Effect};
use serde_json::json;
use tokio::sync::Notify;
use tokio_postgres::Client;

use crate::support::kit::{FakeDest, ledger};
use crate::support::{TestDb, wait_for};

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
