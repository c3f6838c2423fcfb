//! The ticket service: a status change, in one transaction, updates the ticket, inserts one
//! delivery per channel (unique per ticket, status and channel), reserves the tenant's message
//! budget for each, and enqueues an outbox event naming the deliveries.
//!
//! A delivery is an effect in the kit's ledger (`effect_key` = `delivery:<id>`); the consumer
//! sends it. A tenant out of budget still gets its status change: the delivery is recorded
//! failed with the reason instead (a savepoint undoes just the reservation attempt).

use outbox_relay::consumer::budget;
use outbox_relay::consumer::effects::{Cancelled, EffectError, Ledger, NewEffect};
use outbox_relay::consumer::{Destination, HandlerError};
use outbox_relay::producer::{NewEvent, Outbox};
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
    effect_key text UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (ticket_id, status, channel)
);";

const UPDATE_TICKET: &str =
    "UPDATE tickets SET status = $2 WHERE id = $1 RETURNING tenant, email, phone";
const INSERT_DELIVERY: &str =
    "INSERT INTO deliveries (ticket_id, status, channel) VALUES ($1, $2, $3)
     ON CONFLICT (ticket_id, status, channel) DO NOTHING RETURNING id";
const SET_KEY: &str = "UPDATE deliveries SET effect_key = $2 WHERE id = $1";
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
pub async fn change_status(
    client: &mut Client,
    outbox: &Outbox,
    ticket_id: i64,
    status: &str,
) -> Result<Vec<String>, HandlerError> {
    let mut tx = client.transaction().await?;
    let row = tx.query_one(UPDATE_TICKET, &[&ticket_id, &status]).await?;
    let (tenant, email, phone): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    let mut keys = Vec::new();
    for channel in CHANNELS {
        let Some(d) = tx
            .query_opt(INSERT_DELIVERY, &[&ticket_id, &status, &channel])
            .await?
        else {
            continue; // this status was notified on this channel before
        };
        let delivery_id: i64 = d.get(0);
        let key = format!("delivery:{delivery_id}");
        tx.execute(SET_KEY, &[&delivery_id, &key]).await?;
        let to = if channel == "email" { &email } else { &phone };
        let payload = json!({
            "channel": channel,
            "to": to,
            "text": format!("ticket {ticket_id} is now {status}"),
        });
        let effect = NewEffect {
            key: &key,
            destination: "provider",
            payload: payload.clone(),
            budget: Some((&tenant, QUOTA, 1)),
            reserve_now: true,
        };
        // The reservation in this transaction; out of budget undoes only this attempt.
        let sp = tx.savepoint("reserve").await?;
        match Ledger::enqueue(&sp, &effect).await {
            Ok(_) => sp.commit().await?,
            Err(EffectError::OutOfBudget(why)) => {
                sp.rollback().await?;
                let id = Ledger::enqueue(
                    &tx,
                    &NewEffect {
                        reserve_now: false,
                        ..effect
                    },
                )
                .await?;
                tx.execute(FAIL_NOW, &[&id, &why.to_string()]).await?;
                continue; // nothing for the consumer to send
            }
            Err(e) => return Err(e.into()),
        }
        keys.push(key);
    }
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
