//! The session: one AMQP connection, the exchange declared on it and its `--channels`
//! lanes, numbered by a generation so the engine can drop the late reports of a session
//! it already gave up on.
//!
//! Invariants: a session ends as a whole. Whatever ends it first (a lane's timeout or
//! channel error, a connection error, the relay closing it) raises [`Lost`] once, with the
//! first reason kept; every lane then stops and reports nothing more, and the engine fails
//! the rows still in flight and opens a new session. A key always publishes on the same lane,
//! so its messages reach the broker in order.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::{Connection, ExchangeKind};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use outbox_kit::amqp::{self, AmqpError, AmqpTarget};
use outbox_kit::internal::rpc;

use super::SettledBatch;
use super::lane::Lane;
use super::message::Prepared;

/// Settings of one AMQP session.
#[derive(Clone, Debug)]
pub(crate) struct SessionConfig {
    /// The exchange every row is published to.
    pub exchange: String,
    /// Declare the exchange (topic, durable) when opening; otherwise only check it exists.
    pub declare_exchange: bool,
    /// How many confirm-mode channels (lanes) to open.
    pub channels: usize,
    /// How long a publish may wait for its confirm before the session is given up.
    pub confirm_timeout: Duration,
    /// The connection name the broker shows.
    pub connection_name: String,
}

/// The end of a session, raised once by whatever ended it; the first reason given is kept.
#[derive(Clone)]
pub(super) struct Lost {
    token: CancellationToken,
    why: Arc<std::sync::OnceLock<String>>,
    /// The broker the session is on, and which of its nodes (shared by the lanes' copies).
    node: Arc<(AmqpTarget, usize)>,
}

impl Lost {
    fn new(target: &AmqpTarget, node: usize) -> Lost {
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

    fn is_raised(&self) -> bool {
        self.token.is_cancelled()
    }

    fn why(&self) -> &str {
        self.why.get().map_or("unknown", String::as_str)
    }
}

/// One AMQP connection and its publishing lanes.
pub(crate) struct Session {
    conn: Connection,
    lanes: Vec<mpsc::UnboundedSender<Prepared>>,
    lost: Lost,
    generation: u64,
}

impl Session {
    /// Connects, declares the exchange (unless told not to) and opens the lanes.
    pub(crate) async fn open(
        target: &AmqpTarget,
        config: &SessionConfig,
        generation: u64,
        settled: mpsc::UnboundedSender<SettledBatch>,
    ) -> Result<Session, AmqpError> {
        let (conn, node) =
            outbox_kit::internal::connect_node(target, &config.connection_name).await?;
        let lost = Lost::new(target, node);
        let setup = async {
            // The default exchange ("", replay's) always exists and cannot be declared.
            if !config.exchange.is_empty() {
                let ch = rpc("channel.open", conn.create_channel()).await?;
                amqp::declare_exchange(
                    &ch,
                    &config.exchange,
                    ExchangeKind::Topic,
                    !config.declare_exchange,
                )
                .await?;
                let _ = rpc("channel.close", ch.close(200, "ok".into())).await;
            }
            let mut lanes = Vec::with_capacity(config.channels);
            for lane_no in 0..config.channels {
                let ch = rpc("channel.open", conn.create_channel()).await?;
                rpc(
                    "confirm.select",
                    ch.confirm_select(ConfirmSelectOptions::default()),
                )
                .await?;
                let (tx, rx) = mpsc::unbounded_channel();
                let lane = Lane {
                    channel: ch,
                    exchange: config.exchange.as_str().into(),
                    probe_key: format!("outbox-relay.probe.{}.{lane_no}", std::process::id())
                        .into(),
                    confirm_timeout: config.confirm_timeout,
                    generation,
                    settled: settled.clone(),
                    lost: lost.clone(),
                };
                tokio::spawn(lane.run(rx));
                lanes.push(tx);
            }
            Ok::<_, AmqpError>(lanes)
        };
        let lanes = match setup.await {
            Ok(lanes) => lanes,
            Err(e) => {
                amqp::close_after_failed_setup(&conn).await;
                return Err(e);
            }
        };
        // Connection-level failures (heartbeat timeout, broker closing us) end the session.
        let connection_lost = amqp::connection_lost(&conn);
        let watch = lost.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = watch.raised() => {}
                why = connection_lost => watch.raise(why),
            }
        });
        Ok(Session {
            conn,
            lanes,
            lost,
            generation,
        })
    }

    /// The number the engine gave this session; its lanes tag every report with it.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Hands a message to the lane for its partition (a key always uses the same lane).
    pub(crate) fn publish(&self, partition: u8, message: Prepared) {
        let lane = partition as usize % self.lanes.len();
        if self.lanes[lane].send(message).is_err() {
            self.lost.raise("a publishing lane had ended");
        }
    }

    /// Resolves when the connection or any lane failed.
    pub(crate) async fn lost(&self) {
        self.lost.raised().await
    }

    /// Whether the connection or any lane failed.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_raised()
    }

    /// Why the session ended (the first failure seen), once [`Session::is_lost`].
    pub(crate) fn lost_why(&self) -> &str {
        self.lost.why()
    }

    /// Closes the connection; the lanes stop, and the rows they had in flight are the
    /// engine's to fail.
    pub(crate) async fn close(self) {
        self.lost.raise("closed by the relay");
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.conn.close(200, "outbox-relay closing".into()),
        )
        .await;
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
