//! The session: one AMQP connection, the exchange declared on it and its `--channels`
//! lanes, numbered by a generation so the engine can drop the late reports of a session
//! it already gave up on.
//!
//! Invariants: a session ends as a whole. Whatever ends it first (a lane's timeout or
//! channel error, a connection error, the relay closing it) raises [`Lost`](super::lost::Lost) once, with the
//! first reason kept; every lane then stops and reports nothing more, and the engine fails
//! the rows still in flight and opens a new session. A key always publishes on the same lane,
//! so its messages reach the broker in order.

use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::{Connection, ExchangeKind};
use tokio::sync::mpsc;

use outbox_kit::amqp::{self, AmqpError, AmqpTarget};
use outbox_kit::internal::rpc;

use super::SettledBatch;
use super::lane::Lane;
use super::lost::Lost;
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
