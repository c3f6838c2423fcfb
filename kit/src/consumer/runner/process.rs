//! One message from delivery to its settlement: parse it, then the inbox transaction
//! (record, maybe run the handler, commit) within `handler_timeout`, then settle.
//!
//! Unordered mode ([`process`]): a failure goes to a retry queue or the dead-letter
//! exchange (`settle`). Ordered groups ([`process_in_group`], [`apply_held`]): a transient
//! failure is retried in place with backoff (`retry_min` doubling to `retry_max`) while the
//! key's later events wait behind it in their lane; after `max_attempts` (or a terminal
//! failure) the event is dead-lettered with a broker confirm and recorded, and its key
//! blocked or not by the group's [`OnDead`].
//!
//! Invariants: the handler runs only when the inbox said apply, inside the transaction that
//! records the event, so "handled" commits together with the handler's writes. In a group,
//! an event is acked only once it is applied, a duplicate, held, or dead-lettered and
//! recorded; when the partition is given up meanwhile, the event is left unacked
//! ([`Settled::Abandoned`]) and the broker redelivers it in queue order.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::amqp::long_string;
use crate::consumer::events;
use crate::consumer::inbox::{self, GroupAdmission, HeldEvent};
use crate::db::deadline;

use super::message::{key_of, original_routing_key, parse};
use super::settle::{Applied, Shared, ack, dead_letter, publish_dead, recorded_after_all, settle};
use super::{Context, Handler, HandlerError, Message, OnDead};

/// Unordered mode: one message, start to ack. Never fails: what cannot be settled is
/// nacked for redelivery.
pub(super) async fn process<H: Handler>(shared: Arc<Shared>, handler: Arc<H>, d: Delivery) {
    let cfg = &shared.cfg;
    let msg = match parse(&d, false) {
        Ok(m) => m,
        Err(reason) => {
            dead_letter(&shared, &d, None, &reason).await;
            return;
        }
    };
    let spent = msg.attempt + earlier_deliveries(&shared, &d, &msg).await;
    if let Some(max) = cfg.max_attempts
        && spent >= max.get()
    {
        let reason = gave_up_unsettled(spent);
        dead_letter(&shared, &d, Some(&msg), &reason).await;
        return;
    }
    let outcome = within(cfg.handler_timeout, apply(&shared, &*handler, &msg)).await;
    settle(&shared, &d, &msg, outcome).await;
}

/// For a redelivered event (its member died, or its channel closed, with it unacked): how
/// many attempts its earlier deliveries made, counted in the database ([`count_in_db`]),
/// so that an event that kills every process it runs in is dead-lettered after
/// `max_attempts` rather than killing each next owner. Zero for a first delivery (nothing
/// written) and without `max_attempts`.
async fn earlier_deliveries(shared: &Shared, d: &Delivery, msg: &Message) -> u32 {
    if !d.redelivered || shared.cfg.max_attempts.is_none() {
        return 0;
    }
    count_in_db(shared, msg.event_id).await
}

/// Counts one more attempt of the event in `outbox_inbox_attempts` ([`inbox::count_attempt`],
/// committed before the attempt runs) and returns the count: its attempts before this one,
/// counting the unrecorded first run of its first delivery. Zero when the count cannot be
/// written (warned; the count then lives in memory as before).
async fn count_in_db(shared: &Shared, event_id: uuid::Uuid) -> u32 {
    let counted = async {
        let client = deadline(shared.pool.get()).await?;
        inbox::count_attempt(&**client, &shared.cfg.name, event_id).await
    }
    .await;
    match counted {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(target: "outbox_relay::consumer", error = %e, event_id = %event_id, "an attempt was not counted in outbox_inbox_attempts (re-apply sql/roles.sql?); counting in memory");
            0
        }
    }
}

/// For a held event about to run for the first time in this drain: how many earlier drains
/// ran it, counted in the database like a redelivery's attempts (a held event never ran at
/// its delivery, hence one less than the count). Its held row comes back whenever the run
/// dies with its process (the take rolls back), so without this count an event that kills
/// its process would kill the owner of its partition at every drain.
async fn earlier_held_runs(shared: &Shared, event_id: uuid::Uuid) -> u32 {
    if shared.cfg.max_attempts.is_none() {
        return 0;
    }
    count_in_db(shared, event_id).await.saturating_sub(1)
}

fn gave_up_unsettled(spent: u32) -> String {
    format!(
        "gave up after {spent} attempts: its deliveries ended unsettled (the member died or lost its channel while handling it)"
    )
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

/// The unordered inbox transaction: record, maybe run the handler, commit.
async fn apply<H: Handler>(
    shared: &Shared,
    handler: &H,
    msg: &Message,
) -> Result<Applied, HandlerError> {
    let cfg = &shared.cfg;
    let mut conn = deadline(shared.pool.get()).await?;
    // The plain tokio-postgres transaction, so handlers see one type whatever the pool.
    let client: &mut tokio_postgres::Client = &mut conn;
    let tx = deadline(client.transaction()).await?;
    match inbox::record(&tx, &cfg.name, &msg.event_ref(false)).await? {
        inbox::Admission::Apply => {
            let cx = Context {
                tx: &tx,
                pool: &shared.pool,
                consumer: &cfg.name,
            };
            handler.handle(&cx, msg).await?;
            deadline(tx.commit()).await?;
            Ok(Applied::Done)
        }
        _ => {
            deadline(tx.commit()).await?;
            Ok(Applied::Duplicate)
        }
    }
}

/// How an ordered group's event ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Settled {
    /// Applied, duplicate, held or dead-lettered: the next event of the key may go.
    Done,
    /// Left unfinished because the partition is being given up: its key's later events
    /// must not be started here (the broker redelivers them all, in order).
    Abandoned,
}

/// What a group's event task needs besides the message.
pub(super) struct GroupCx<'a, H> {
    pub(super) shared: &'a Shared,
    pub(super) handler: &'a H,
    /// At most `prefetch` handlers of this instance run at once (the pool is sized for it).
    pub(super) permits: &'a Semaphore,
    /// Cancelled when the partition is given up (rebalance, shutdown, lost connection).
    pub(super) stop: &'a CancellationToken,
}

impl<H: Handler> GroupCx<'_, H> {
    /// Waits `delay`; false if the partition is given up meanwhile.
    async fn pause(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }
}

/// An ordered group's delivery, start to ack, in its key's lane.
pub(super) async fn process_in_group<H: Handler>(
    g: &GroupCx<'_, H>,
    partition: u16,
    d: &Delivery,
) -> Settled {
    let msg = match parse(d, true) {
        Ok(m) => m,
        Err(reason) => {
            if let Ok(mut msg) = parse(d, false)
                && key_of(d).is_some()
            {
                // An outbox event of a key whose seq cannot be read: dead-lettered and
                // recorded like any dead event (its key blocked with block-key), so the
                // key's next event does not apply as a jump past it unrecorded.
                msg.seq = None;
                return dead_in_group(g, &msg, &d.data, &d.properties, &reason)
                    .await
                    .acked(d)
                    .await;
            }
            // No outbox event (no id or no key): nothing to record or block.
            let rk = original_routing_key(d);
            if !dead_letter_in_place(g, &rk, &d.data, &d.properties, &reason).await {
                return Settled::Abandoned;
            }
            events::dead_lettered(&g.shared.cfg.name, "", &reason);
            ack(d).await;
            return Settled::Done;
        }
    };
    let headers = serde_json::Value::Object(msg.headers.clone());
    let held = HeldEvent {
        event: msg.event_ref(true),
        partition,
        event_type: &msg.event_type,
        routing_key: &msg.routing_key,
        headers: &headers,
        body: &msg.body,
    };
    let spent = earlier_deliveries(g.shared, d, &msg).await;
    let (held, msg) = (&held, &msg);
    let tried = with_retries(g, msg, spent, |attempt| async move {
        let shared = g.shared;
        let mut conn = deadline(shared.pool.get()).await?;
        let client: &mut tokio_postgres::Client = &mut conn;
        let tx = deadline(client.transaction()).await?;
        let admission = inbox::record_in_group(&tx, &shared.cfg.name, held).await?;
        let retried;
        let this = if attempt == 0 {
            msg
        } else {
            retried = Message {
                attempt,
                ..msg.clone()
            };
            &retried
        };
        run_admitted(shared, g.handler, &tx, this, admission).await?;
        deadline(tx.commit()).await?;
        Ok(())
    })
    .await;
    match tried {
        Tried::Done => Settled::Done,
        Tried::Stopped => Settled::Abandoned,
        Tried::Dead(reason) => dead_in_group(g, msg, &d.data, &d.properties, &reason).await,
    }
    .acked(d)
    .await
}

impl Settled {
    /// Acks `d` when it is done; returns how it ended.
    async fn acked(self, d: &Delivery) -> Settled {
        if self == Settled::Done {
            ack(d).await;
        }
        self
    }
}

/// Applies the held events of a released key in seq order, each in the transaction that
/// deletes it from `outbox_inbox_held`, until none is left or the key is blocked again.
/// Returns how many were taken.
pub(super) async fn apply_held<H: Handler>(
    g: &GroupCx<'_, H>,
    aggregate_type: &str,
    aggregate_id: &str,
) -> usize {
    let mut taken = 0;
    loop {
        // The event the last attempt took, kept for a dead letter.
        let last: std::sync::Mutex<Option<Message>> = std::sync::Mutex::new(None);
        let template = Message {
            event_id: uuid::Uuid::nil(),
            event_type: String::new(),
            routing_key: String::new(),
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            seq: None,
            headers: serde_json::Map::new(),
            body: Vec::new(),
            redelivered: true,
            attempt: 0,
        };
        let (last_ref, template_ref) = (&last, &template);
        let tried = with_retries(g, &template, 0, |attempt| async move {
            let (last, template) = (last_ref, template_ref);
            let shared = g.shared;
            let mut conn = deadline(shared.pool.get()).await?;
            let client: &mut tokio_postgres::Client = &mut conn;
            let tx = deadline(client.transaction()).await?;
            let Some(t) =
                inbox::take_held(&tx, &shared.cfg.name, aggregate_type, aggregate_id).await?
            else {
                deadline(tx.commit()).await?;
                *last.lock().expect("not poisoned") = None;
                return Ok(());
            };
            let msg = Message {
                event_id: t.event_id,
                event_type: t.event_type.unwrap_or_default(),
                routing_key: t.routing_key,
                seq: Some(t.seq),
                headers: match t.headers {
                    serde_json::Value::Object(m) => m,
                    _ => serde_json::Map::new(),
                },
                body: t.body,
                attempt,
                ..template.clone()
            };
            *last.lock().expect("not poisoned") = Some(msg.clone());
            if attempt == 0 {
                let earlier = earlier_held_runs(shared, msg.event_id).await;
                if shared.cfg.max_attempts.is_some_and(|max| earlier >= max.get()) {
                    return Err(HandlerError::Terminal(format!(
                        "gave up after {earlier} attempts: its runs from the held events ended unsettled (the member died while handling it)"
                    )));
                }
            }
            run_admitted(shared, g.handler, &tx, &msg, t.admission).await?;
            deadline(tx.commit()).await?;
            Ok(())
        })
        .await;
        let last = last.into_inner().expect("not poisoned");
        match tried {
            Tried::Stopped => return taken,
            Tried::Done if last.is_none() => return taken,
            Tried::Done => taken += 1,
            Tried::Dead(reason) => {
                let Some(msg) = last else { return taken };
                let props = held_properties(&msg);
                let body = msg.body.clone();
                if dead_in_group(g, &msg, &body, &props, &reason).await == Settled::Abandoned {
                    return taken;
                }
                taken += 1;
            }
        }
    }
}

/// The AMQP properties of a held event's dead-letter copy, rebuilt from what was stored.
fn held_properties(msg: &Message) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (k, v) in &msg.headers {
        let value = match v {
            serde_json::Value::String(s) => long_string(s),
            serde_json::Value::Number(n) if n.is_i64() => {
                AMQPValue::LongLongInt(n.as_i64().unwrap_or_default())
            }
            serde_json::Value::Bool(b) => AMQPValue::Boolean(*b),
            other => long_string(&other.to_string()),
        };
        headers.insert(k.as_str().into(), value);
    }
    BasicProperties::default()
        .with_message_id(msg.event_id.to_string().as_str().into())
        .with_type(msg.event_type.as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Runs the handler for an admitted event in `tx`; reports a jump.
async fn run_admitted<H: Handler>(
    shared: &Shared,
    handler: &H,
    tx: &tokio_postgres::Transaction<'_>,
    msg: &Message,
    admission: GroupAdmission,
) -> Result<(), HandlerError> {
    if admission == GroupAdmission::Jumped {
        events::seq_jumped(
            &shared.cfg.name,
            &msg.aggregate_type,
            &msg.aggregate_id,
            msg.seq.unwrap_or_default(),
        );
    }
    if admission.applies() {
        let cx = Context {
            tx,
            pool: &shared.pool,
            consumer: &shared.cfg.name,
        };
        handler.handle(&cx, msg).await?;
    }
    Ok(())
}

/// How an attempt loop ended.
enum Tried {
    Done,
    Dead(String),
    /// The partition is given up: leave the event unacked.
    Stopped,
}

/// Runs `attempt` (one inbox transaction, given how many attempts failed before it) until it
/// succeeds, retrying transient failures in place with backoff while holding no handler
/// permit. `spent`: attempts earlier deliveries made (counted in the database); once they
/// reach `max_attempts` the event is dead-lettered without running. A wait
/// ([`HandlerError::is_wait`]: an earlier effect, or no database connection) is retried
/// with backoff but spends no attempt.
async fn with_retries<H, F, Fut>(g: &GroupCx<'_, H>, msg: &Message, spent: u32, attempt: F) -> Tried
where
    H: Handler,
    F: Fn(u32) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let cfg = &g.shared.cfg;
    let mut tries = spent;
    let mut waits = 0u32;
    if cfg.max_attempts.is_some_and(|max| tries >= max.get()) {
        return Tried::Dead(gave_up_unsettled(tries));
    }
    loop {
        let outcome = {
            let permit = tokio::select! {
                _ = g.stop.cancelled() => return Tried::Stopped,
                p = g.permits.acquire() => p,
            };
            let Ok(_permit) = permit else {
                return Tried::Stopped;
            };
            // A panicking handler must not unwind the partition task: dropping its lapin
            // consumer would send basic.cancel, and single-active-consumer would activate the
            // next consumer while this channel still holds unacked events. A panic is a bug
            // that a retry will not fix: dead-letter the event.
            let guarded = std::panic::AssertUnwindSafe(attempt(tries)).catch_unwind();
            match tokio::time::timeout(cfg.handler_timeout, guarded).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(HandlerError::Terminal("the handler panicked".into())),
                Err(_) => Err(HandlerError::Transient(format!(
                    "message not handled within handler_timeout {:?}",
                    cfg.handler_timeout
                ))),
            }
        };
        match outcome {
            Ok(()) => return Tried::Done,
            Err(e) if e.is_transient() => {
                if e.is_wait() {
                    waits = waits.saturating_add(1);
                } else {
                    tries += 1;
                }
                if cfg.max_attempts.is_some_and(|max| tries >= max.get()) {
                    return Tried::Dead(format!("gave up after {tries} attempts: {e}"));
                }
                let delay = cfg.retry_delay(tries.saturating_add(waits));
                events::retrying_in_place(
                    &cfg.name,
                    &msg.event_id.to_string(),
                    tries,
                    delay.as_millis() as u64,
                    &e.to_string(),
                );
                if !g.pause(delay).await {
                    return Tried::Stopped;
                }
            }
            Err(e) => return Tried::Dead(e.to_string()),
        }
    }
}

/// Publishes the dead-letter copy, retrying in place until the broker confirms it (a
/// requeue would let the key's later events overtake it); false if the partition is given
/// up first.
async fn dead_letter_in_place<H: Handler>(
    g: &GroupCx<'_, H>,
    routing_key: &str,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
) -> bool {
    let mut tries = 0;
    loop {
        match publish_dead(g.shared, routing_key, body, props, reason).await {
            Ok(()) => return true,
            Err(e) => {
                events::republish_failed(&g.shared.cfg.name, &e);
                tries += 1;
                if !g.pause(g.shared.cfg.retry_delay(tries)).await {
                    return false;
                }
            }
        }
    }
}

/// Dead-letters a group's event and records it (blocking its key with block-key), each
/// step retried in place until done or the partition is given up.
async fn dead_in_group<H: Handler>(
    g: &GroupCx<'_, H>,
    msg: &Message,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
) -> Settled {
    let cfg = &g.shared.cfg;
    // The last attempt's commit may have gone through although the attempt failed: an
    // applied event is acked, never also dead-lettered.
    let mut tries = 0;
    loop {
        match recorded_after_all(g.shared, msg).await {
            Ok(false) => break,
            Ok(true) => {
                events::applied_after_all(&cfg.name, &msg.event_id.to_string(), reason);
                return Settled::Done;
            }
            Err(e) => {
                tracing::warn!(target: "outbox_relay::consumer", error = %e, event_id = %msg.event_id, "inbox not readable before a dead letter; retrying before the key goes on");
                tries += 1;
                if !g.pause(cfg.retry_delay(tries)).await {
                    return Settled::Abandoned;
                }
            }
        }
    }
    if !dead_letter_in_place(g, &msg.routing_key, body, props, reason).await {
        return Settled::Abandoned;
    }
    let block = cfg
        .ordered
        .as_ref()
        .is_some_and(|o| o.on_dead == OnDead::BlockKey);
    let mut tries = 0;
    loop {
        let recorded = async {
            let client = deadline(g.shared.pool.get()).await?;
            inbox::dead_in_group(&**client, &cfg.name, &msg.event_ref(true), reason, block).await
        }
        .await;
        match recorded {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(target: "outbox_relay::consumer", error = %e, event_id = %msg.event_id, "dead-lettered event not recorded yet; retrying before the key goes on");
                tries += 1;
                if !g.pause(cfg.retry_delay(tries)).await {
                    return Settled::Abandoned;
                }
            }
        }
    }
    events::dead_lettered(&cfg.name, &msg.event_id.to_string(), reason);
    if block {
        events::key_blocked(
            &cfg.name,
            &msg.aggregate_type,
            &msg.aggregate_id,
            msg.seq.unwrap_or_default(),
        );
    }
    Settled::Done
}
