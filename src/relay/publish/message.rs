//! The message contract: what one outbox row becomes on the wire (docs/contract.md, "The
//! message published for each row"): AMQP properties, the row's user headers plus the
//! relay's, the payload as the body, and the refusals for rows that cannot be published as
//! they are.
//!
//! Invariants: a producer never sets a reserved header (`CC`, `BCC`, `x-outbox-*`,
//! `traceparent`, `tracestate`): such a row is refused, not published with a forged value;
//! a message larger than `--max-message-bytes` is refused before it reaches the broker.
//! Pure: no I/O, so it is tested without a broker.

use std::fmt;
use std::sync::Arc;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde_json::Value;

use outbox_kit::amqp::long_string;
use outbox_kit::contract::headers;

use super::super::claim::ClaimedRow;
use super::super::key::Key;

/// Why a row cannot be published as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The message would be larger than `--max-message-bytes`.
    TooLarge { bytes: usize, limit: usize },
    /// A user header, the routing key or the event type breaks the contract.
    BadHeader(String),
    /// The row's text cannot be read as it was stored (not UTF-8); says which columns.
    Unreadable(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::TooLarge { bytes, limit } => write!(
                f,
                "message too large: {bytes} bytes, more than --max-message-bytes {limit}"
            ),
            Refusal::BadHeader(why) => write!(f, "refused header: {why}"),
            Refusal::Unreadable(why) => f.write_str(why),
        }
    }
}

/// A message ready to publish (lapin's types stay in the publish module).
pub(crate) struct Prepared {
    pub(super) row_id: i64,
    pub(super) seq: i64,
    pub(super) key: Key,
    pub(super) event_id: String,
    pub(super) routing_key: ShortString,
    pub(super) body: Arc<str>,
    pub(super) body_bytes: usize,
    pub(super) properties: BasicProperties,
}

/// How messages are built beyond the contract's fixed parts.
#[derive(Clone, Debug, Default)]
pub(crate) struct MessageOptions {
    /// `--cloudevents`: add the CloudEvents AMQP binding headers with this `source`.
    pub cloudevents_source: Option<String>,
}

const CLOUDEVENTS_PREFIX: &str = "cloudevents:";

/// Builds the AMQP message for a row, per the contract (docs/contract.md).
pub(crate) fn prepare(
    row: &ClaimedRow,
    max_message_bytes: usize,
    options: &MessageOptions,
) -> Result<Prepared, Refusal> {
    if let Some(why) = &row.unreadable {
        return Err(Refusal::Unreadable(why.clone()));
    }
    let Some(body) = row.body.clone() else {
        return Err(Refusal::TooLarge {
            bytes: row.body_bytes,
            limit: max_message_bytes,
        });
    };
    let mut size = body.len() + row.routing_key.len() + 128;
    // Most rows carry no headers of their own: skip the JSON parse for them.
    let user: serde_json::Map<String, Value> = if row.headers == "{}" {
        serde_json::Map::new()
    } else {
        match serde_json::from_str(&row.headers) {
            Ok(Value::Object(m)) => m,
            _ => return Err(Refusal::BadHeader("headers are not a JSON object".into())),
        }
    };
    let mut table = FieldTable::default();
    for (name, value) in user {
        if options.cloudevents_source.is_some()
            && name.to_ascii_lowercase().starts_with(CLOUDEVENTS_PREFIX)
        {
            continue; // set below from the row's columns
        }
        let upper = name.to_ascii_uppercase();
        let lower = name.to_ascii_lowercase();
        if upper == "CC"
            || upper == "BCC"
            || lower.starts_with(headers::RESERVED_HEADER_PREFIX)
            || lower == "traceparent"
            || lower == "tracestate"
        {
            return Err(Refusal::BadHeader(format!(
                "'{name}' is a reserved header name"
            )));
        }
        if name.is_empty() || name.len() > 255 {
            return Err(Refusal::BadHeader(
                "header names must be 1 to 255 bytes".into(),
            ));
        }
        size += name.len() + json_size(&value);
        table.insert(name.into(), amqp_value(value));
    }
    let mut put = |name: &str, value: AMQPValue| {
        table.insert(name.into(), value);
    };
    put(headers::AGGREGATE_TYPE, long_string(&row.aggregate_type));
    put(headers::AGGREGATE_ID, long_string(&row.aggregate_id));
    put(headers::SEQ, AMQPValue::LongLongInt(row.seq));
    put(headers::CREATED_AT, long_string(&row.created_text));
    if let Some(source) = &options.cloudevents_source {
        // The CloudEvents AMQP binding: attributes as `cloudEvents:`-prefixed headers
        // (content type is the message property). A user header of the same name is
        // replaced: these describe the event the relay publishes.
        put("cloudEvents:specversion", long_string("1.0"));
        put("cloudEvents:id", long_string(&row.event_id.to_string()));
        put("cloudEvents:type", long_string(&row.event_type));
        put("cloudEvents:source", long_string(source));
        put(
            "cloudEvents:subject",
            long_string(&format!("{}/{}", row.aggregate_type, row.aggregate_id)),
        );
        put("cloudEvents:time", long_string(&row.created_text));
        size += 256 + source.len() + row.event_type.len();
    }
    if let Some(tp) = &row.traceparent {
        put("traceparent", long_string(tp));
    }
    if let Some(ts) = &row.tracestate {
        put("tracestate", long_string(ts));
    }
    size += row.aggregate_type.len() + row.aggregate_id.len() + 128;
    size += row.traceparent.as_ref().map_or(0, String::len)
        + row.tracestate.as_ref().map_or(0, String::len);
    if size > max_message_bytes {
        return Err(Refusal::TooLarge {
            bytes: size,
            limit: max_message_bytes,
        });
    }
    for (what, s) in [
        ("routing key", &row.routing_key),
        ("event_type", &row.event_type),
    ] {
        if s.len() > 255 {
            return Err(Refusal::BadHeader(format!(
                "{what} is longer than 255 bytes"
            )));
        }
    }
    let event_id = row.event_id.to_string();
    let properties = BasicProperties::default()
        .with_message_id(event_id.as_str().into())
        .with_content_type("application/json".into())
        .with_type(row.event_type.as_str().into())
        .with_timestamp(row.created_epoch.max(0.0) as u64)
        .with_delivery_mode(2)
        .with_headers(table);
    Ok(Prepared {
        row_id: row.id,
        seq: row.seq,
        key: row.key(),
        event_id,
        routing_key: row.routing_key.as_str().into(),
        body_bytes: row.body_bytes,
        body,
        properties,
    })
}

/// An upper bound of a header value's encoded size, for the size refusal.
fn json_size(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 5,
        Value::Array(a) => a.iter().map(json_size).sum::<usize>() + 5,
        Value::Object(o) => {
            o.iter()
                .map(|(k, v)| k.len() + 1 + json_size(v))
                .sum::<usize>()
                + 5
        }
        _ => 9,
    }
}

fn amqp_value(v: Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.into_bytes())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.into_iter().map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(o) => {
            let mut t = FieldTable::default();
            for (k, v) in o {
                // AMQP field names are short strings: a longer nested name cannot be sent.
                if k.len() <= 255 {
                    t.insert(k.into(), amqp_value(v));
                }
            }
            AMQPValue::FieldTable(t)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_follows_the_contract() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 3);
        row.headers = r#"{"tenant": "acme", "n": 5, "ok": true}"#.into();
        row.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let p = prepare(&row, 1 << 20, &MessageOptions::default()).unwrap();
        assert_eq!(
            p.properties.message_id().as_ref().unwrap().as_str(),
            row.event_id.to_string()
        );
        assert_eq!(
            p.properties.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(p.properties.kind().as_ref().unwrap().as_str(), "created");
        assert_eq!(*p.properties.delivery_mode(), Some(2));
        let h = p.properties.headers().as_ref().unwrap().inner();
        assert_eq!(h.get("x-outbox-seq"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(h.get("n"), Some(&AMQPValue::LongLongInt(5)));
        assert_eq!(h.get("ok"), Some(&AMQPValue::Boolean(true)));
        assert!(h.contains_key("traceparent"));
        assert!(h.contains_key("x-outbox-created-at"));
        assert_eq!(&*p.body, "{}");
    }

    #[test]
    fn cloudevents_headers_come_from_the_row() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 3);
        row.headers = r#"{"cloudEvents:type": "forged"}"#.into();
        let options = MessageOptions {
            cloudevents_source: Some("/shop".into()),
        };
        let p = prepare(&row, 1 << 20, &options).unwrap();
        let h = p.properties.headers().as_ref().unwrap().inner();
        let text = |k: &str| match h.get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("cloudEvents:specversion"), "1.0");
        assert_eq!(text("cloudEvents:id"), row.event_id.to_string());
        assert_eq!(text("cloudEvents:type"), "created");
        assert_eq!(text("cloudEvents:source"), "/shop");
        assert_eq!(text("cloudEvents:subject"), "order/42");
        assert_eq!(text("cloudEvents:time"), row.created_text);
        let plain = prepare(&row, 1 << 20, &MessageOptions::default()).unwrap();
        assert!(
            !plain
                .properties
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .contains_key("cloudEvents:id")
        );
    }

    #[test]
    fn reserved_headers_and_oversize_are_refused() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 1);
        row.headers = r#"{"CC": "other.key"}"#.into();
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::BadHeader(_))
        ));
        row.headers = r#"{"X-Outbox-Seq": 1}"#.into();
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::BadHeader(_))
        ));
        row.headers = "{}".into();
        row.body = None;
        row.body_bytes = 5_000_000;
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::TooLarge { .. })
        ));
        row.body = Some("x".repeat(1000).into());
        assert!(matches!(
            prepare(&row, 600, &MessageOptions::default()),
            Err(Refusal::TooLarge { .. })
        ));
    }

    #[test]
    fn unreadable_rows_are_refused_with_their_reason() {
        let mut row = ClaimedRow::for_test(7, "order", "\u{fffd}", 1);
        row.unreadable = Some("unreadable row: aggregate_id not valid UTF-8".into());
        let refusal = prepare(&row, 1 << 20, &MessageOptions::default()).err();
        assert_eq!(
            refusal.map(|r| r.to_string()).as_deref(),
            Some("unreadable row: aggregate_id not valid UTF-8")
        );
    }
}
