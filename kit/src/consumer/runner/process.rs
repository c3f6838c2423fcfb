//! One message from delivery to its settlement: parse it, then the inbox transaction
//! (record, maybe run the handler, commit) within `handler_timeout`, then `settle`.
//!
//! Invariant: the handler runs only when the inbox said apply, inside the transaction that
//! records the event, so "handled" commits together with the handler's writes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::Channel;
use lapin::message::Delivery;
use tokio::sync::Mutex;

use crate::consumer::inbox::{self, Admission, GapAction};
use crate::db::deadline;

use super::message::parse;
use super::settle::{dead_letter, settle};
use super::{ConsumerConfig, Context, Handler, HandlerError, Message};

/// What every message task shares.
pub(super) struct Shared {
    pub(super) cfg: Arc<ConsumerConfig>,
    pub(super) pool: Pool,
    /// One publish at a time, each awaited to its confirm: lapin pairs a returned message
    /// with whichever confirm resolves next, so only a lone publish knows its own return.
    pub(super) publisher: Mutex<Channel>,
}

/// What the inbox transaction ended with.
pub(super) enum Applied {
    Done,
    Duplicate,
    Gap { expected: i64 },
}

/// One message, start to ack. Never fails: what cannot be settled is nacked for redelivery.
pub(super) async fn process<H: Handler>(shared: Arc<Shared>, handler: Arc<H>, d: Delivery) {
    let cfg = &shared.cfg;
    let msg = match parse(&d, cfg.ordered.is_some()) {
        Ok(m) => m,
        Err(reason) => {
            dead_letter(&shared, &d, None, &reason).await;
            return;
        }
    };
    let outcome = within(cfg.handler_timeout, apply(&shared, &*handler, &msg, None)).await;
    settle(&shared, &*handler, &d, &msg, outcome).await;
}

pub(super) async fn within(
    limit: Duration,
    fut: impl Future<Output = Result<Applied, HandlerError>>,
) -> Result<Applied, HandlerError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(HandlerError::Transient(format!(
            "message not handled within handler_timeout {limit:?}"
        ))),
    }
}

/// The inbox transaction: record, maybe run the handler, commit. `skip_to` first gives up
/// the gap before this event (ordered mode, after gap_timeout, on_gap = skip).
pub(super) async fn apply<H: Handler>(
    shared: &Shared,
    handler: &H,
    msg: &Message,
    skip_to: Option<i64>,
) -> Result<Applied, HandlerError> {
    let cfg = &shared.cfg;
    let ordered = cfg.ordered.is_some();
    let mut conn = deadline(shared.pool.get()).await?;
    // The plain tokio-postgres transaction, so handlers see one type whatever the pool.
    let client: &mut tokio_postgres::Client = &mut conn;
    let tx = deadline(client.transaction()).await?;
    let ev = msg.event_ref(ordered);
    if let Some(expected) = skip_to {
        inbox::gap(&tx, &cfg.name, &ev, expected, GapAction::Skipped).await?;
    }
    match inbox::record(&tx, &cfg.name, &ev).await? {
        Admission::Duplicate => {
            deadline(tx.commit()).await?;
            Ok(Applied::Duplicate)
        }
        Admission::Gap { expected } => {
            deadline(tx.rollback()).await?;
            Ok(Applied::Gap { expected })
        }
        Admission::Apply => {
            let cx = Context {
                tx: &tx,
                pool: &shared.pool,
                consumer: &cfg.name,
            };
            handler.handle(&cx, msg).await?;
            deadline(tx.commit()).await?;
            Ok(Applied::Done)
        }
    }
}
