//! The producer API: write outbox events inside the caller's own transaction.
//!
//! This is a convenience over the SQL contract (a plain `INSERT` into `outbox_events` with
//! the four required columns is a complete producer). It never opens a connection or a
//! transaction of its own: pass the `Transaction` that carries your change, so the event
//! commits or rolls back with it.
//!
//! ```no_run
//! use outbox_kit::producer::{NewEvent, Outbox};
//! use serde_json::json;
//!
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::new("public")?;
//! let tx = client.transaction().await?;
//! tx.execute("UPDATE orders SET status = 'paid' WHERE id = $1", &[&42_i64]).await?;
//! let event_id = outbox
//!     .enqueue(&tx, &NewEvent::new("order", "42", "order.paid", json!({"order_id": 42})))
//!     .await?;
//! tx.commit().await?;
//! println!("enqueued {event_id}");
//! # Ok(()) }
//! ```

use std::time::SystemTime;

use serde_json::Value;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

use crate::contract::Schema;

/// One event to enqueue. Only the first four fields are required.
#[derive(Clone, Debug)]
pub struct NewEvent<'a> {
    /// The kind of thing that changed (`order`); first half of the key.
    pub aggregate_type: &'a str,
    /// Which one (`42`); second half of the key.
    pub aggregate_id: &'a str,
    /// What happened (`order.paid`); the AMQP `type`.
    pub event_type: &'a str,
    /// The event's JSON body.
    pub payload: Value,
    /// AMQP headers (a JSON object). Reserved names (`CC`, `BCC`, `x-outbox-*`,
    /// `traceparent`, `tracestate`) are refused.
    pub headers: Option<Value>,
    /// Overrides the routing key `<aggregate_type>.<event_type>`.
    pub routing_key: Option<&'a str>,
    /// Publish no earlier than this.
    pub available_at: Option<SystemTime>,
    /// W3C trace context to carry as AMQP headers. With the `otel` feature, events enqueued
    /// without one take the current tracing span's (see `NewEvent::with_current_span`).
    pub traceparent: Option<String>,
    /// W3C `tracestate`, carried with `traceparent`.
    pub tracestate: Option<String>,
    /// The caller's idempotency key, scoped per `aggregate_type`: an enqueue whose key a row
    /// in the table already holds inserts nothing and returns that row's event id (see
    /// [`NewEvent::with_idempotency_key`]).
    pub idempotency_key: Option<&'a str>,
}

impl<'a> NewEvent<'a> {
    /// Takes `traceparent` and `tracestate` from the current tracing span's OpenTelemetry
    /// context (a `tracing_opentelemetry` layer must be installed). No valid context: no change.
    #[cfg(feature = "otel")]
    pub fn with_current_span(mut self) -> Self {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let sc = span.span_context();
        if sc.is_valid() {
            self.traceparent = Some(format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            ));
            let state = sc.trace_state().header();
            self.tracestate = (!state.is_empty()).then_some(state);
        }
        self
    }

    /// An event with the four required fields; the others default (no headers, the default routing key, publish now, no trace context).
    pub fn new(
        aggregate_type: &'a str,
        aggregate_id: &'a str,
        event_type: &'a str,
        payload: Value,
    ) -> Self {
        NewEvent {
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            headers: None,
            routing_key: None,
            available_at: None,
            traceparent: None,
            tracestate: None,
            idempotency_key: None,
        }
    }

    /// Enqueues this event at most once per `key` and `aggregate_type`: when a row holding
    /// the key is in the table (committed, or in this transaction), the enqueue inserts
    /// nothing, is no error, and returns that row's event id. A concurrent transaction
    /// holding the key makes the enqueue wait for it: its commit gives its id, its rollback
    /// lets this event in. The key is remembered while its row is in the table, so the
    /// relay's `--retention` is the window (docs/contract.md, "Idempotent enqueue").
    pub fn with_idempotency_key(mut self, key: &'a str) -> Self {
        self.idempotency_key = Some(key);
        self
    }
}

/// Why an event was not enqueued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The row breaks a rule of the table (reserved header name, headers not an object,
    /// routing key longer than 255 bytes). Fix the event; retrying will not help.
    #[error("outbox refused the event: {0}")]
    Refused(String),
    /// The database failed; the caller's transaction is aborted and should be retried whole.
    #[error("outbox insert failed: {0}")]
    Db(#[from] tokio_postgres::Error),
}

/// Writes events into `<schema>.outbox_events`.
#[derive(Clone, Debug)]
pub struct Outbox {
    insert_many: String,
    lookup: String,
}

// One statement for the batch. A row whose idempotency key is taken is skipped (ON CONFLICT
// DO NOTHING waits for a concurrent holder's transaction and never raises), and comes back
// with `inserted` false; its holder's id is read by LOOKUP, a statement of its own so that
// it sees a holder that committed while this one waited.
const INSERT_MANY: &str = "
WITH src AS MATERIALIZED (
    SELECT {schema}.outbox_uuid_v7() AS event_id, u.*
      FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::jsonb[], $6::text[],
                  $7::timestamptz[], $8::text[], $9::text[], $10::text[])
           WITH ORDINALITY AS u(aggregate_type, aggregate_id, event_type, payload, headers,
                                routing_key, available_at, traceparent, tracestate,
                                idempotency_key, ord)
), ins AS (
    INSERT INTO {schema}.outbox_events
        (event_id, aggregate_type, aggregate_id, event_type, payload, headers, routing_key,
         available_at, traceparent, tracestate, idempotency_key)
    SELECT event_id, aggregate_type, aggregate_id, event_type, payload, coalesce(headers, '{}'),
           routing_key, coalesce(available_at, now()), traceparent, tracestate, idempotency_key
      FROM src ORDER BY ord
    ON CONFLICT (aggregate_type, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING event_id
)
SELECT src.event_id, ins.event_id IS NOT NULL AS inserted
  FROM src LEFT JOIN ins USING (event_id) ORDER BY src.ord";

const LOOKUP: &str = "
SELECT e.event_id
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(aggregate_type, idempotency_key, ord)
  LEFT JOIN {schema}.outbox_events e
         ON e.aggregate_type = k.aggregate_type AND e.idempotency_key = k.idempotency_key
 ORDER BY k.ord";

impl Outbox {
    /// An outbox in `schema` (`public` unless you run the relay with `--schema`).
    pub fn new(schema: &str) -> Result<Outbox, ProduceError> {
        let schema = Schema::parse(schema).map_err(ProduceError::Refused)?;
        Ok(Outbox {
            insert_many: INSERT_MANY.replace("{schema}", schema.as_str()),
            lookup: LOOKUP.replace("{schema}", schema.as_str()),
        })
    }

    /// Enqueues one event through `client` (use your transaction); returns its event id.
    pub async fn enqueue(
        &self,
        client: &impl GenericClient,
        event: &NewEvent<'_>,
    ) -> Result<Uuid, ProduceError> {
        let ids = self
            .enqueue_many(client, std::slice::from_ref(event))
            .await?;
        Ok(ids[0])
    }

    /// Enqueues several events in one statement; returns their event ids in order. An event
    /// whose idempotency key is taken (by a row in the table or an earlier event of this
    /// batch) gets the holder's id and inserts nothing.
    pub async fn enqueue_many(
        &self,
        client: &impl GenericClient,
        events: &[NewEvent<'_>],
    ) -> Result<Vec<Uuid>, ProduceError> {
        let mut ids: Vec<Option<Uuid>> = vec![None; events.len()];
        let mut todo: Vec<usize> = (0..events.len()).collect();
        // Rounds end when every event has an id: the second round runs only if a key's
        // holder was deleted (retention) between the insert and the lookup, which frees it.
        while !todo.is_empty() {
            let batch: Vec<NewEvent<'_>> = todo.iter().map(|&i| events[i].clone()).collect();
            let inserted = self.insert(client, &batch).await?;
            let skipped: Vec<usize> = (0..batch.len())
                .filter(|&j| inserted[j].is_none())
                .collect();
            for (j, &i) in todo.iter().enumerate() {
                ids[i] = inserted[j];
            }
            if skipped.is_empty() {
                break;
            }
            let types: Vec<&str> = skipped.iter().map(|&j| batch[j].aggregate_type).collect();
            let keys: Vec<Option<&str>> =
                skipped.iter().map(|&j| batch[j].idempotency_key).collect();
            let held = client
                .query(&self.lookup, &[&types, &keys])
                .await
                .map_err(refused_or_db)?;
            let mut next = Vec::new();
            for (row, &j) in held.iter().zip(&skipped) {
                match row.get::<_, Option<Uuid>>(0) {
                    Some(id) => ids[todo[j]] = Some(id),
                    None => next.push(todo[j]),
                }
            }
            todo = next;
        }
        Ok(ids
            .into_iter()
            .map(|id| id.expect("every event has an id"))
            .collect())
    }

    /// One INSERT of `events`; for each, its new event id, or None when its key was taken.
    async fn insert(
        &self,
        client: &impl GenericClient,
        events: &[NewEvent<'_>],
    ) -> Result<Vec<Option<Uuid>>, ProduceError> {
        let aggregate_types: Vec<&str> = events.iter().map(|e| e.aggregate_type).collect();
        let aggregate_ids: Vec<&str> = events.iter().map(|e| e.aggregate_id).collect();
        let event_types: Vec<&str> = events.iter().map(|e| e.event_type).collect();
        let routing_keys: Vec<Option<&str>> = events.iter().map(|e| e.routing_key).collect();
        #[cfg(feature = "otel")]
        let current = NewEvent::new("", "", "", Value::Null).with_current_span();
        let trace = |e: &'_ NewEvent<'_>| -> (Option<String>, Option<String>) {
            if e.traceparent.is_some() {
                return (e.traceparent.clone(), e.tracestate.clone());
            }
            #[cfg(feature = "otel")]
            return (current.traceparent.clone(), current.tracestate.clone());
            #[cfg(not(feature = "otel"))]
            (None, None)
        };
        let (traceparents, tracestates): (Vec<Option<String>>, Vec<Option<String>>) =
            events.iter().map(trace).unzip();
        let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
        let headers: Vec<Option<&Value>> = events.iter().map(|e| e.headers.as_ref()).collect();
        let available: Vec<Option<SystemTime>> = events.iter().map(|e| e.available_at).collect();
        let keys: Vec<Option<&str>> = events.iter().map(|e| e.idempotency_key).collect();
        let rows = client
            .query(
                &self.insert_many,
                &[
                    &aggregate_types,
                    &aggregate_ids,
                    &event_types,
                    &payloads,
                    &headers,
                    &routing_keys,
                    &available,
                    &traceparents,
                    &tracestates,
                    &keys,
                ],
            )
            .await
            .map_err(refused_or_db)?;
        Ok(rows
            .iter()
            .map(|r| r.get::<_, bool>(1).then(|| r.get(0)))
            .collect())
    }
}

fn refused_or_db(e: tokio_postgres::Error) -> ProduceError {
    match e.as_db_error() {
        Some(db)
            if *db.code() == SqlState::CHECK_VIOLATION
                || *db.code() == SqlState::NOT_NULL_VIOLATION =>
        {
            let what = match db.constraint() {
                Some("outbox_events_headers_reserved") => {
                    "headers must be a JSON object without reserved names (CC, BCC, x-outbox-*, traceparent, tracestate)"
                        .to_owned()
                }
                Some("outbox_events_routing_key_length") => "routing_key is longer than 255 bytes".to_owned(),
                _ => db.message().to_owned(),
            };
            ProduceError::Refused(what)
        }
        _ => ProduceError::Db(e),
    }
}
