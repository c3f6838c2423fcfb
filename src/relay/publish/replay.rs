//! What `outbox-relay replay` changes in a prepared message: the header that marks it a
//! replay. Everything else (message_id, type, headers, seq, body) is what [`prepare`] built
//! for the relay, so a replayed message is the one consumers first saw; the routing key is
//! the replay's queue (set on the row before `prepare`), published through the default
//! exchange so that no other queue receives it.
//!
//! [`prepare`]: super::prepare

use lapin::types::{AMQPValue, FieldTable};

use outbox_kit::contract::headers;

use super::message::Prepared;

/// Adds `x-outbox-replay: true` to a prepared message.
pub(crate) fn mark_replayed(mut message: Prepared) -> Prepared {
    let mut table: FieldTable = message.properties.headers().clone().unwrap_or_default();
    table.insert(headers::REPLAY.into(), AMQPValue::Boolean(true));
    message.properties = message.properties.with_headers(table);
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::claim::ClaimedRow;
    use crate::relay::publish::{MessageOptions, prepare};

    #[test]
    fn a_replayed_message_is_the_relays_with_one_header_more() {
        let row = ClaimedRow::for_test(7, "order", "42", 3);
        let first = prepare(&row, 1 << 20, &MessageOptions::default()).unwrap();
        let replayed = mark_replayed(prepare(&row, 1 << 20, &MessageOptions::default()).unwrap());
        let mut expected = first.properties.headers().clone().unwrap();
        expected.insert(headers::REPLAY.into(), AMQPValue::Boolean(true));
        assert_eq!(replayed.properties.headers().as_ref(), Some(&expected));
        assert_eq!(
            replayed.properties.message_id(),
            first.properties.message_id()
        );
        assert_eq!(&*replayed.body, &*first.body);
    }
}
