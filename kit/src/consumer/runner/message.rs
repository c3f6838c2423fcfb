//! A delivery as a handler sees it: [`Message`], parsed once from the lapin `Delivery` and
//! its headers (`crate::contract::headers`), with no lapin type in its public face.
//!
//! Invariant: a delivery without a uuid `message_id`, or (ordered mode) without a seq
//! header of 1 or more, cannot be applied; parsing says so and the runner dead-letters it
//! (an ordered group records one with an id and a key as dead, blocking its key with
//! block-key).

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use serde_json::Value;
use uuid::Uuid;

use crate::consumer::inbox::EventRef;
use crate::contract::headers::{
    AGGREGATE_ID as H_AGGREGATE_ID, AGGREGATE_TYPE as H_AGGREGATE_TYPE, ATTEMPT as H_ATTEMPT,
    ROUTING_KEY as H_ROUTING_KEY, SEQ as H_SEQ,
};

use super::error::HandlerError;

/// One delivered event, as a handler sees it (no lapin types).
#[derive(Clone, Debug)]
pub struct Message {
    /// The AMQP message_id: the outbox event_id.
    pub event_id: Uuid,
    /// The AMQP `type` property: the event type.
    pub event_type: String,
    /// The routing key it was first published with.
    pub routing_key: String,
    /// `x-outbox-aggregate-type`.
    pub aggregate_type: String,
    /// `x-outbox-aggregate-id`.
    pub aggregate_id: String,
    /// `x-outbox-seq`, per key 1, 2, 3, ...
    pub seq: Option<i64>,
    /// All headers, as JSON values.
    pub headers: serde_json::Map<String, Value>,
    /// The body: the payload's JSON text.
    pub body: Vec<u8>,
    /// The broker's redelivered flag (a consumer died or a channel closed with it unacked).
    pub redelivered: bool,
    /// How many times the runner retried it after transient errors (through retry queues,
    /// or in place in an ordered group).
    pub attempt: u32,
}

impl Message {
    /// The body parsed as JSON (the outbox payload).
    pub fn payload(&self) -> Result<Value, HandlerError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| HandlerError::Terminal(format!("body is not JSON: {e}")))
    }

    pub(super) fn event_ref(&self, ordered: bool) -> EventRef<'_> {
        EventRef {
            event_id: self.event_id,
            aggregate_type: &self.aggregate_type,
            aggregate_id: &self.aggregate_id,
            seq: if ordered { self.seq } else { None },
        }
    }
}

/// The key a delivery belongs to (its aggregate type and id headers), read before parsing
/// so that an ordered group can put it in its key's lane.
pub(super) fn key_of(d: &Delivery) -> Option<(String, String)> {
    Some((
        header_string(d, H_AGGREGATE_TYPE)?,
        header_string(d, H_AGGREGATE_ID)?,
    ))
}

/// The seq header of a delivery (`x-outbox-seq`), read before parsing.
pub(super) fn seq_of(d: &Delivery) -> Option<i64> {
    header_i64(d, H_SEQ)
}

pub(super) fn original_routing_key(d: &Delivery) -> String {
    header_string(d, H_ROUTING_KEY).unwrap_or_else(|| d.routing_key.as_str().to_owned())
}

fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(name)
}

fn header_string(d: &Delivery, name: &str) -> Option<String> {
    match header(d, name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn header_i64(d: &Delivery, name: &str) -> Option<i64> {
    header_value_i64(header(d, name)?)
}

fn json_of(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::Float(f) => serde_json::json!(f),
        AMQPValue::Double(f) => serde_json::json!(f),
        AMQPValue::Timestamp(t) => serde_json::json!(t),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), json_of(v)))
                .collect(),
        ),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(json_of).collect()),
        AMQPValue::Void => Value::Null,
        other => match header_value_i64(other) {
            Some(n) => serde_json::json!(n),
            None => Value::String(format!("{other:?}")),
        },
    }
}

fn header_value_i64(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// The handler's view of a delivery; an error is a reason to dead-letter it.
pub(super) fn parse(d: &Delivery, ordered: bool) -> Result<Message, String> {
    let p = &d.properties;
    let event_id = p
        .message_id()
        .as_ref()
        .and_then(|s| Uuid::parse_str(s.as_str()).ok())
        .ok_or("no message_id holding a uuid: not an outbox event")?;
    let seq = header_i64(d, H_SEQ);
    if ordered && seq.is_none_or(|s| s < 1) {
        return Err(format!(
            "no usable {H_SEQ} header (an integer from 1 up): cannot be applied in order"
        ));
    }
    if ordered && key_of(d).is_none() {
        return Err(format!(
            "no {H_AGGREGATE_TYPE} or {H_AGGREGATE_ID} header: cannot be applied in order"
        ));
    }
    let headers = p
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), json_of(v)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Message {
        event_id,
        event_type: p
            .kind()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default(),
        routing_key: original_routing_key(d),
        aggregate_type: header_string(d, H_AGGREGATE_TYPE).unwrap_or_default(),
        aggregate_id: header_string(d, H_AGGREGATE_ID).unwrap_or_default(),
        seq,
        headers,
        body: d.data.clone(),
        redelivered: d.redelivered,
        attempt: header_i64(d, H_ATTEMPT)
            .unwrap_or(0)
            .clamp(0, u32::MAX as i64) as u32,
    })
}
