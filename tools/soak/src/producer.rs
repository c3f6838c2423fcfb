//! Producers: plain INSERTs into `outbox_events` in small transactions, as a service writes
//! them, at a paced rate over a key space with a few hot keys. Some transactions roll back
//! (their events must never arrive); one producer holds its transactions open for up to
//! three seconds before committing, so rows with lower ids commit after rows with higher
//! ones (the relay must not skip them).
//!
//! Producers talk to Postgres directly, not through a proxy: the faults are the relay's
//! and the consumers', and an event counts as committed only when its COMMIT returned.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::rng::Rng;

const INSERT: &str = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                      SELECT 'acct', k, 'changed', jsonb_build_object('producer', $2::int, 'n', n)
                        FROM unnest($1::text[]) WITH ORDINALITY AS t(k, n)
                      RETURNING event_id, aggregate_id";

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// One committed event.
#[derive(Clone, Debug)]
pub struct Committed {
    pub event_id: uuid::Uuid,
    pub aggregate_id: String,
    /// When its COMMIT returned (unix ms).
    pub at_ms: i64,
}

#[derive(Default)]
pub struct Ledger {
    pub committed: Vec<Committed>,
    pub rolled_back: Vec<uuid::Uuid>,
    /// Events committed by transactions held open (committed late, with lower ids).
    pub late: usize,
    /// Transactions whose COMMIT failed (the outcome was then looked up in the database):
    /// none are expected, the producers' connections are not faulted.
    pub unknown: usize,
    /// Transactions that failed before their COMMIT (nothing committed).
    pub failed: usize,
}

pub type Shared = Arc<Mutex<Ledger>>;

#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// Events per second, all producers together.
    pub rate: u32,
    pub keys: u32,
    pub producers: u32,
}

fn pick_keys(rng: &mut Rng, load: &Load, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            // A quarter of the events go to eight hot keys.
            let k = if rng.chance(0.25) {
                rng.below(8.min(load.keys as u64))
            } else {
                rng.below(load.keys as u64)
            };
            format!("k{k}")
        })
        .collect()
}

/// A producer's connection, opened again when it breaks (the database is shared: another
/// test restarting it must not end the soak).
pub struct Conn {
    target: DbTarget,
    client: Option<Client>,
}

impl Conn {
    pub fn new(target: DbTarget) -> Conn {
        Conn {
            target,
            client: None,
        }
    }

    async fn get(&mut self, stop: &CancellationToken) -> Option<&mut Client> {
        while self.client.as_ref().is_none_or(|c| c.is_closed()) {
            match self
                .target
                .connect(&Schema::default(), "outbox-soak-producer")
                .await
            {
                Ok(c) => self.client = Some(c),
                Err(e) => {
                    eprintln!("soak: producer connection: {e}");
                    tokio::select! {
                        _ = stop.cancelled() => return None,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
        self.client.as_mut()
    }
}

/// One transaction, and what became of it.
enum Outcome {
    Done(Vec<(uuid::Uuid, String)>),
    /// Failed before COMMIT: nothing committed.
    Failed(tokio_postgres::Error),
    /// The COMMIT failed: these rows may or may not have committed.
    Unknown(Vec<(uuid::Uuid, String)>, tokio_postgres::Error),
}

/// Runs one transaction and records it.
#[allow(clippy::too_many_arguments)]
async fn one(
    conn: &mut Conn,
    id: u32,
    keys: &[String],
    rollback: bool,
    hold: Duration,
    late: bool,
    ledger: &Shared,
    stop: &CancellationToken,
) {
    let Some(client) = conn.get(stop).await else {
        return;
    };
    match transaction(client, id, keys, rollback, hold).await {
        Outcome::Done(rows) => record(ledger, rows, rollback, late),
        Outcome::Failed(e) => {
            eprintln!("soak: producer {id}: {e}");
            ledger.lock().unwrap().failed += 1;
        }
        Outcome::Unknown(rows, e) => {
            eprintln!("soak: producer {id}: commit failed ({e}); looking the rows up");
            ledger.lock().unwrap().unknown += 1;
            let ids: Vec<uuid::Uuid> = rows.iter().map(|(id, _)| *id).collect();
            loop {
                let Some(client) = conn.get(stop).await else {
                    return;
                };
                match client
                    .query(
                        "SELECT event_id FROM outbox_events WHERE event_id = ANY($1)",
                        &[&ids],
                    )
                    .await
                {
                    Ok(found) => {
                        let found: std::collections::HashSet<uuid::Uuid> =
                            found.iter().map(|r| r.get(0)).collect();
                        let (done, gone): (Vec<_>, Vec<_>) =
                            rows.into_iter().partition(|(id, _)| found.contains(id));
                        record(ledger, done, false, late);
                        record(ledger, gone, true, late);
                        return;
                    }
                    Err(e) => eprintln!("soak: producer {id}: lookup: {e}"),
                }
            }
        }
    }
}

/// A normal producer: small transactions, 5 % rolled back, paced to its share of `rate`.
pub async fn steady(
    id: u32,
    target: DbTarget,
    mut rng: Rng,
    load: Load,
    ledger: Shared,
    stop: CancellationToken,
) {
    let share = (load.rate as f64 / load.producers.max(1) as f64).max(1.0);
    let mut conn = Conn::new(target);
    while !stop.is_cancelled() {
        let n = rng.range(1, 4) as usize;
        let keys = pick_keys(&mut rng, &load, n);
        let rollback = rng.chance(0.05);
        let started = std::time::Instant::now();
        one(
            &mut conn,
            id,
            &keys,
            rollback,
            Duration::ZERO,
            false,
            &ledger,
            &stop,
        )
        .await;
        let pace = Duration::from_secs_f64(n as f64 / share);
        let wait = pace.saturating_sub(started.elapsed());
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// The late producer: each transaction stays open 0.5 to 3 s before it commits (one in ten
/// rolls back), while the others commit rows with higher ids.
pub async fn late(
    id: u32,
    target: DbTarget,
    mut rng: Rng,
    load: Load,
    ledger: Shared,
    stop: CancellationToken,
) {
    let mut conn = Conn::new(target);
    while !stop.is_cancelled() {
        let n = rng.range(1, 3) as usize;
        let keys = pick_keys(&mut rng, &load, n);
        let rollback = rng.chance(0.1);
        let hold = rng.millis(500, 3_000);
        one(&mut conn, id, &keys, rollback, hold, true, &ledger, &stop).await;
    }
}

async fn transaction(
    client: &mut Client,
    producer: u32,
    keys: &[String],
    rollback: bool,
    hold: Duration,
) -> Outcome {
    let tx = match client.transaction().await {
        Ok(tx) => tx,
        Err(e) => return Outcome::Failed(e),
    };
    let rows: Vec<(uuid::Uuid, String)> = match tx.query(INSERT, &[&keys, &(producer as i32)]).await
    {
        Ok(rows) => rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        Err(e) => return Outcome::Failed(e),
    };
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    if rollback {
        // A failed ROLLBACK rolls back all the same.
        let _ = tx.rollback().await;
        return Outcome::Done(rows);
    }
    match tx.commit().await {
        Ok(()) => Outcome::Done(rows),
        Err(e) => Outcome::Unknown(rows, e),
    }
}

fn record(ledger: &Shared, rows: Vec<(uuid::Uuid, String)>, rolled_back: bool, late: bool) {
    let at_ms = now_ms();
    let mut l = ledger.lock().unwrap();
    if rolled_back {
        l.rolled_back.extend(rows.into_iter().map(|(id, _)| id));
        return;
    }
    if late {
        l.late += rows.len();
    }
    l.committed
        .extend(rows.into_iter().map(|(event_id, aggregate_id)| Committed {
            event_id,
            aggregate_id,
            at_ms,
        }));
}
