//! The ticket service: a status change, in one transaction, updates the ticket, inserts one
//! delivery per channel (unique per ticket, status and channel), reserves the tenant's message
//! budget for each, and enqueues an outbox event naming the deliveries.
//!
//! A delivery is an effect in the kit's ledger (`effect_key` = `delivery:<ticket>:<status>:<channel>`); the consumer
//! sends it. A ticket's deliveries on one channel go out in the order of its status changes:
//! each is enqueued under the order key `ticket:<id>:<channel>` (`Ledger::enqueue_in_order`),
//! and a delivery waiting for an earlier one of its ticket waits without spending its event's
//! attempts (docs/consumer-kit.md, "A key's effects go out in the order of its events"). A tenant out of budget still
//! gets its status change: the delivery is recorded
//! failed with the reason instead (a savepoint undoes just the reservation attempt).

use outbox_kit::consumer::budget;
use outbox_kit::consumer::effects::{Cancelled, EffectError, Ledger, NewEffect};
use outbox_kit::consumer::{Destination, HandlerError};
use outbox_kit::producer::{NewEvent, Outbox};
use serde_json::json;
use tokio_postgres::Client;

/// The example's own tables (its "business" schema), next to the kit's.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tickets (
    id      bigint PRIMARY KEY,
    tenant  text NOT NULL,
    status  text NOT NULL DEFAULT 'new',
    email   text NOT NULL,
    phone   text NOT NULL
);
CREATE TABLE IF NOT EXISTS deliveries (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ticket_id  bigint NOT NULL REFERENCES tickets (id),
    status     text NOT NULL,
    channel    text NOT NULL,
    effect_key text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (ticket_id, status, channel)
);";

const UPDATE_TICKET: &str =
    "UPDATE tickets SET status = $2 WHERE id = $1 RETURNING tenant, email, phone";
// The effect key names the business fact (this ticket reached this status, notify on this
// channel), so it is unique for the same reason the delivery is.
const INSERT_DELIVERIES: &str = "
INSERT INTO deliveries (ticket_id, status, channel, effect_key)
SELECT $1::bigint, $2::text, c, 'delivery:' || $1::bigint || ':' || $2::text || ':' || c FROM unnest($3::text[]) AS c
    ON CONFLICT (ticket_id, status, channel) DO NOTHING
RETURNING channel, effect_key";
const FAIL_NOW: &str = "SELECT outbox_effect_fail($1, NULL, $2)";
const INSERT_TICKET: &str = "INSERT INTO tickets (id, tenant, email, phone) VALUES ($1, $2, $3, $4)
     ON CONFLICT (id) DO NOTHING";

/// The channels every status change notifies.
pub const CHANNELS: [&str; 2] = ["email", "sms"];
/// The budget's quota key: one unit per message.
pub const QUOTA: &str = "messages";

pub async fn setup(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(SCHEMA).await
}

pub async fn open_ticket(
    client: &Client,
    id: i64,
    tenant: &str,
    email: &str,
    phone: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(INSERT_TICKET, &[&id, &tenant, &email, &phone])
        .await?;
    Ok(())
}

pub async fn grant(client: &Client, tenant: &str, messages: i64) -> Result<(), HandlerError> {
    budget::set(client, tenant, QUOTA, messages).await?;
    Ok(())
}

/// Changes a ticket's status; returns the effect keys of the deliveries it created (none
/// when the ticket already had this status once).
///
/// The budget is reserved last, just before the commit: the reservation locks the tenant's
/// budget row, and every other status change of that tenant waits for it until we commit.
pub async fn change_status(
    client: &mut Client,
    outbox: &Outbox,
    ticket_id: i64,
    status: &str,
) -> Result<Vec<String>, HandlerError> {
    let mut tx = client.transaction().await?;
    let row = tx.query_one(UPDATE_TICKET, &[&ticket_id, &status]).await?;
    let (tenant, email, phone): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    let channels: Vec<&str> = CHANNELS.to_vec();
    let created: Vec<(String, String)> = tx
        .query(INSERT_DELIVERIES, &[&ticket_id, &status, &channels])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let keys: Vec<String> = created.iter().map(|(_, key)| key.clone()).collect();
    let aggregate_id = ticket_id.to_string();
    let event = NewEvent::new(
        "ticket",
        &aggregate_id,
        "status_changed",
        json!({ "ticket_id": ticket_id, "status": status, "deliveries": keys }),
    );
    outbox
        .enqueue(&tx, &event)
        .await
        .map_err(|e| HandlerError::Terminal(e.to_string()))?;
    for (channel, key) in &created {
        let to = if channel == "email" { &email } else { &phone };
        let effect = NewEffect {
            key,
            destination: "provider",
            payload: json!({
                "channel": channel,
                "to": to,
                "text": format!("ticket {ticket_id} is now {status}"),
            }),
            budget: Some((&tenant, QUOTA, 1)),
            reserve_now: true,
        };
        // Out of budget undoes only this attempt: the delivery is recorded failed with the
        // reason, and the consumer finds nothing to send.
        let order_key = format!("ticket:{ticket_id}:{channel}");
        let sp = tx.savepoint("reserve").await?;
        match Ledger::enqueue_in_order(&sp, &effect, &order_key).await {
            Ok(_) => sp.commit().await?,
            Err(EffectError::OutOfBudget(why)) => {
                sp.rollback().await?;
                let unreserved = NewEffect {
                    reserve_now: false,
                    ..effect
                };
                let id = Ledger::enqueue_in_order(&tx, &unreserved, &order_key).await?;
                tx.execute(FAIL_NOW, &[&id, &why.to_string()]).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    tx.commit().await?;
    Ok(keys)
}

/// The ticket service withdraws a delivery (the ticket was merged, the customer unsubscribed):
/// queued ones are cancelled, sent ones deleted at the provider first.
pub async fn cancel_delivery<D: Destination>(
    client: &Client,
    ledger: &Ledger,
    provider: &D,
    key: &str,
) -> Result<Cancelled, EffectError> {
    ledger.cancel(client, key, provider).await
}
