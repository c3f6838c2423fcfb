//! The ledger's vocabulary: an effect's [`EffectState`], a [`NewEffect`] to enqueue, an
//! [`EffectRow`] as stored, a [`Claimed`] effect, and what each step reports
//! ([`Completion`], [`Performed`], [`Cancelled`]).
//!
//! Invariant: these mirror `sql/0003_consumer.sql`; a state string the SQL returns that is
//! not listed here parses to `None`, never to a guess.

use serde_json::Value;

use super::Effect;

/// An effect's state (`outbox_effects.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectState {
    Queued,
    Sending,
    Sent,
    Failed,
    Cancelled,
}

impl EffectState {
    pub fn parse(s: &str) -> Option<EffectState> {
        Some(match s {
            "queued" => EffectState::Queued,
            "sending" => EffectState::Sending,
            "sent" => EffectState::Sent,
            "failed" => EffectState::Failed,
            "cancelled" => EffectState::Cancelled,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            EffectState::Queued => "queued",
            EffectState::Sending => "sending",
            EffectState::Sent => "sent",
            EffectState::Failed => "failed",
            EffectState::Cancelled => "cancelled",
        }
    }
}

/// A new effect. `budget` is (tenant, quota key, cost).
#[derive(Clone, Debug)]
pub struct NewEffect<'a> {
    pub key: &'a str,
    pub destination: &'a str,
    pub payload: Value,
    pub budget: Option<(&'a str, &'a str, i64)>,
    /// Reserve the budget now (in the caller's transaction) rather than at the claim.
    pub reserve_now: bool,
}

/// A ledger row as it is (for callers that inspect, and for tests).
#[derive(Clone, Debug, PartialEq)]
pub struct EffectRow {
    pub effect: Effect,
    pub state: EffectState,
    pub claimed_by: Option<String>,
    pub external_id: Option<String>,
    pub last_error: Option<String>,
    pub uncertain: bool,
    pub cancel_requested: bool,
    pub withdrawn: bool,
}

/// What `complete` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Written: the effect is `sent` and its reservation consumed.
    Sent,
    /// Still ours, but a cancel was requested meanwhile: withdraw the item.
    CancelRequested,
    /// Not ours any more (the reconciler or an operator changed it); the state it has.
    NotOurs(String),
}

/// What `perform` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Performed {
    /// Sent now, or found at the destination by lookup after an unknown outcome.
    Sent {
        external_id: String,
        found_by_lookup: bool,
    },
    /// Not claimed: someone else is sending it, or it is finished. Nothing was sent.
    NotClaimed { state: Option<EffectState> },
    /// Cancelled while we were sending: our item was withdrawn at the destination.
    Withdrawn { external_id: String },
    /// Cancelled while we were sending, but the destination did not delete it: still out.
    StillOut { external_id: String, error: String },
    /// Cancelled while we were sending, and the send did not go out: nothing to withdraw.
    Cancelled,
}

/// What `cancel` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// It was queued: nothing went out; the reservation was released.
    Cancelled,
    /// It was out and the destination deleted it.
    Withdrawn { external_id: String },
    /// It is out and the destination did not delete it; the ledger says sent, with the error.
    StillOut { external_id: String, error: String },
    /// It is being sent; its claimer withdraws it as soon as its send returns.
    Pending,
    /// It was already finished (failed or cancelled) or does not exist.
    Unchanged(Option<EffectState>),
}

/// A claim this worker holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimed {
    pub effect: Effect,
    /// An earlier attempt may have reached the destination: look it up before sending.
    pub uncertain: bool,
}
