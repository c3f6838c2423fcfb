//! Publishing to RabbitMQ with publisher confirms. The only module of the relay that knows
//! lapin.
//!
//! A `Session` is one AMQP connection with `--channels` lanes; each lane is a task that
//! owns a confirm-mode channel, publishes what the engine hands it and reports, per row,
//! how the broker settled it (`Outcome`). The parts, in the order a row meets them:
//! - `message`: the contract, a claimed row → AMQP properties, headers and body, or a
//!   `Refusal` (`prepare`);
//! - `session`: connect, declare, open the lanes, end them all together (`lost`: the
//!   end they share);
//! - `lane`: publish, wait on confirms with a deadline, send probes, report;
//! - `confirm`: the decision, a pure function from one round of confirms to each row's
//!   `Outcome`.
//!
//! Invariant (the core one): a row is reported `Outcome::Acked` only for a broker ack
//! with no return for that row, matched by message_id (the rules are in `confirm`, and in
//! `lane` what they rely on). Only this module can construct [`Acked`], the value that
//! marks rows dispatched: its fields are private here and only `confirm` builds it.

mod confirm;
mod lane;
mod lost;
mod message;
mod replay;
mod session;

pub(crate) use message::{MessageOptions, prepare};
pub(crate) use replay::mark_replayed;
// What `prepare` returns; part of the module's face so the engine can name them, though
// today it only passes them on.
#[allow(unused_imports)]
pub(crate) use message::{Prepared, Refusal};
pub(crate) use session::{Session, SessionConfig};

use super::key::Key;

/// A broker ack without a return for this row. Only the publish module makes them; marking
/// rows dispatched takes nothing else.
#[derive(Debug)]
pub struct Acked {
    row_id: i64,
    seq: i64,
    body_bytes: usize,
}

impl Acked {
    /// The acked row's `id`.
    pub fn row_id(&self) -> i64 {
        self.row_id
    }

    /// The number the row was published with (`x-outbox-seq`).
    pub fn seq(&self) -> i64 {
        self.seq
    }

    /// The size of the row's payload, for the in-memory budget the mark releases.
    pub fn body_bytes(&self) -> usize {
        self.body_bytes
    }
}

/// How the broker settled one published row.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Acked, with no return for this row: the row may be marked dispatched.
    Acked(Acked),
    /// Unroutable: no queue is bound for the routing key.
    Returned { reply_code: u16, reply_text: String },
    /// The broker refused the message (a full queue, a leader that cannot take it).
    Nacked,
    /// No confirm within `--confirm-timeout`.
    TimedOut,
    /// The channel or connection failed before the row was confirmed.
    Lost(String),
}

/// One row's outcome, as a lane reports it.
#[derive(Debug)]
pub(crate) struct Settled {
    pub row_id: i64,
    pub key: Key,
    pub outcome: Outcome,
    /// From handing the message to the channel to the broker's answer.
    pub confirm_secs: f64,
}

/// A batch of outcomes from one lane of session `generation`.
pub(crate) type SettledBatch = (u64, Vec<Settled>);
