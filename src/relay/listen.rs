//! The wake-up hint: LISTEN on a dedicated connection, forward each NOTIFY to the engine.
//!
//! Invariants: the connection is our own (never pooled). After every (re)connect the
//! order is LISTEN first, then [`ListenEvent::Connected`], on which the engine polls: a row
//! committed while we were not listening is found by that poll. A silent dead connection is
//! found by a periodic `SELECT 1` with a deadline. Losing this connection costs latency
//! only; polling remains the source of truth.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use outbox_kit::contract::Schema;
use outbox_kit::db::{DbError, DbTarget};
use outbox_kit::internal::Down;
use outbox_kit::internal::deadline;

use crate::telemetry::Telemetry;

/// What the listener tells the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ListenEvent {
    /// LISTEN is in place (again): poll now to catch up.
    Connected,
    /// A producer committed rows.
    Notified,
    /// The connection failed; reconnecting.
    Lost,
}

const LIVENESS_CHECK: Duration = Duration::from_secs(15);

/// Runs until `shutdown`, reconnecting with backoff.
pub(crate) async fn run(
    db: DbTarget,
    schema: Schema,
    events: mpsc::Sender<ListenEvent>,
    tel: Telemetry,
    shutdown: CancellationToken,
) {
    let mut backoff =
        outbox_kit::internal::Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let mut down = Down::new("listen");
    let mut connections = 0u64;
    loop {
        let result = session(
            &db,
            &schema,
            &events,
            &shutdown,
            &mut down,
            &tel,
            &mut connections,
        )
        .await;
        if shutdown.is_cancelled() {
            return;
        }
        let retry_in = backoff.next_delay();
        if let Err(e) = result {
            down.failed(&e, retry_in);
        }
        let _ = events.try_send(ListenEvent::Lost);
        tel.listen_state(false, false);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(retry_in) => {}
        }
        if down.is_up() {
            backoff.reset();
        }
    }
}

async fn session(
    db: &DbTarget,
    schema: &Schema,
    events: &mpsc::Sender<ListenEvent>,
    shutdown: &CancellationToken,
    down: &mut Down,
    tel: &Telemetry,
    connections: &mut u64,
) -> Result<(), DbError> {
    let (client, mut connection) = db.connect_dedicated(schema, "outbox-relay-listen").await?;
    let (notified_tx, mut notified) = mpsc::unbounded_channel::<()>();
    // The connection must be polled for queries to progress and to receive notifications.
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(_)) => {
                    let _ = notified_tx.send(());
                }
                Ok(_) => {}
                Err(e) => return Err(DbError::from(e)),
            }
        }
        Err(DbError::Closed)
    });
    let guard = AbortOnDrop(Some(driver));
    deadline(client.batch_execute(&format!("LISTEN \"{}\"", schema.notify_channel()))).await?;
    down.recovered();
    *connections += 1;
    tel.listen_state(true, *connections > 1);
    let _ = events.try_send(ListenEvent::Connected);
    let mut check = tokio::time::interval(LIVENESS_CHECK);
    check.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            n = notified.recv() => match n {
                Some(()) => {
                    // Coalesce: one pending wake-up is enough.
                    let _ = events.try_send(ListenEvent::Notified);
                }
                None => {
                    let driver = guard.take();
                    return match driver.await {
                        Ok(Err(e)) => Err(e),
                        _ => Err(DbError::Closed),
                    };
                }
            },
            _ = check.tick() => {
                deadline(client.simple_query("SELECT 1")).await?;
            }
        }
    }
}

struct AbortOnDrop(Option<tokio::task::JoinHandle<Result<(), DbError>>>);

impl AbortOnDrop {
    fn take(mut self) -> tokio::task::JoinHandle<Result<(), DbError>> {
        self.0.take().expect("taken once")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}
