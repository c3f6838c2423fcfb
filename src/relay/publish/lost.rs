//! The end of a session, shared by the session and its lanes: whatever ends it first (a
//! lane's timeout or channel error, a connection error, the relay closing it) raises it
//! once and its reason is kept; the lanes and the session watch it. A file of its own so
//! that the session (which opens lanes) and the lanes (which raise it) both depend on it
//! and not on each other.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use outbox_kit::amqp::AmqpTarget;

/// The end of a session, raised once by whatever ended it; the first reason given is kept.
#[derive(Clone)]
pub(super) struct Lost {
    token: CancellationToken,
    why: Arc<std::sync::OnceLock<String>>,
    /// The broker the session is on, and which of its nodes (shared by the lanes' copies).
    node: Arc<(AmqpTarget, usize)>,
}

impl Lost {
    pub(super) fn new(target: &AmqpTarget, node: usize) -> Lost {
        Lost {
            token: CancellationToken::default(),
            why: Arc::default(),
            node: Arc::new((target.clone(), node)),
        }
    }

    pub(super) fn raise(&self, why: impl Into<String>) {
        let _ = self.why.set(why.into());
        self.token.cancel();
    }

    /// Ends the session because its node refuses every publish (nacks for a confirm
    /// timeout): the node answers, so without this the reconnect would go back to it. The
    /// target moves on before anyone learns of the loss, so the engine's reconnect starts
    /// with the next node of the list.
    pub(super) fn raise_refused(&self, why: impl Into<String>) {
        let (target, node) = &*self.node;
        target.give_up_on(*node);
        self.raise(why);
    }

    pub(super) async fn raised(&self) {
        self.token.cancelled().await
    }

    pub(super) fn is_raised(&self) -> bool {
        self.token.is_cancelled()
    }

    pub(super) fn why(&self) -> &str {
        self.why.get().map_or("unknown", String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session replaced for nacks reconnects to the next node of the list; a session
    /// lost for another reason (a timeout, a closed connection) leaves the choice to the
    /// connect, which retries the node that last worked first.
    #[test]
    fn a_session_ended_for_nacks_moves_on_to_the_next_node() {
        let target = AmqpTarget::parse("amqp://a/%2f,amqp://b/%2f,amqp://c/%2f").unwrap();
        let lost = Lost::new(&target, 0);
        lost.raise("a confirm timed out");
        assert_eq!(target.preferred_node(), 0, "a timeout: the same node first");
        let lost = Lost::new(&target, 0);
        lost.raise_refused("the broker nacked every publish for 15s");
        assert!(lost.is_raised());
        assert_eq!(target.preferred_node(), 1, "nacks: the next node first");
        assert_eq!(lost.why(), "the broker nacked every publish for 15s");
    }
}
