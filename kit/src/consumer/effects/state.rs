//! The ledger's vocabulary: an effect's [`EffectState`], a [`NewEffect`] to enqueue, an
//! [`EffectRow`] as stored, a [`Claimed`] effect, and what each step reports
//! ([`Completion`], [`Performed`], [`Cancelled`]).
//!
//! Invariant: these mirror the states and results of the SQL functions in
//! `sql/0003_consumer.sql`; a change there is a change here.

use serde_json::Value;

use super::Effect;

/// An effect's state (`outbox_effects.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectState {
    /// Waiting to be claimed.
    Queued,
    /// Claimed by a worker that is sending it (or died doing so).
    Sending,
    /// Performed; `external_id` says where.
    Sent,
    /// Given up (terminal error); its reservation was released.
    Failed,
    /// Cancelled before it went out, or withdrawn after.
    Cancelled,
}

impl EffectState {
    /// The state named by the SQL text (`queued`, `sending`, ...); `None` for anything else.
    pub(crate) fn parse(s: &str) -> Option<EffectState> {
        Some(match s {
            "queued" => EffectState::Queued,
            "sending" => EffectState::Sending,
            "sent" => EffectState::Sent,
            "failed" => EffectState::Failed,
            "cancelled" => EffectState::Cancelled,
            _ => return None,
        })
    }
}

/// A new effect. `budget` is (tenant, quota key, cost).
#[derive(Clone, Debug)]
pub struct NewEffect<'a> {
    /// The idempotency key: enqueueing the same key again adds nothing.
    pub key: &'a str,
    /// The destination's name ([`super::Destination::name`]).
    pub destination: &'a str,
    /// What to send.
    pub payload: Value,
    /// The budget it spends, as (tenant, quota key, cost); `None`: free.
    pub budget: Option<(&'a str, &'a str, i64)>,
    /// Reserve the budget now (in the caller's transaction) rather than at the claim.
    pub reserve_now: bool,
}

/// A ledger row as it is (for callers that inspect, and for tests).
#[derive(Clone, Debug, PartialEq)]
pub struct EffectRow {
    /// The effect itself.
    pub effect: Effect,
    /// Where it is in its life.
    pub state: EffectState,
    /// The worker that claimed it last (`EffectsConfig::worker`).
    pub claimed_by: Option<String>,
    /// The destination's id for it, once sent.
    pub external_id: Option<String>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// An earlier attempt may have reached the destination: the next claimer looks it up first.
    pub uncertain: bool,
    /// A cancel was requested while it was being sent.
    pub cancel_requested: bool,
    /// Its item was deleted at the destination after it had been sent.
    pub withdrawn: bool,
}

/// What `complete` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
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
        /// The destination's id for it.
        external_id: String,
        /// Found by [`super::Destination::lookup`] rather than sent now.
        found_by_lookup: bool,
    },
    /// Not claimed: someone else is sending it, or it is finished. Nothing was sent.
    NotClaimed {
        /// The state it has (`None`: no such effect).
        state: Option<EffectState>,
    },
    /// Cancelled while we were sending: our item was withdrawn at the destination.
    Withdrawn {
        /// The destination's id of the withdrawn item.
        external_id: String,
    },
    /// Cancelled while we were sending, but the destination did not delete it: still out.
    StillOut {
        /// The destination's id of the item still out.
        external_id: String,
        /// Why the destination did not delete it.
        error: String,
    },
    /// Cancelled while we were sending, and the send did not go out: nothing to withdraw.
    Cancelled,
}

/// What `cancel` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// It was queued: nothing went out; the reservation was released.
    Cancelled,
    /// It was out and the destination deleted it.
    Withdrawn {
        /// The destination's id of the withdrawn item.
        external_id: String,
    },
    /// It is out and the destination did not delete it; the ledger says sent, with the error.
    StillOut {
        /// The destination's id of the item still out.
        external_id: String,
        /// Why the destination did not delete it.
        error: String,
    },
    /// It is being sent; its claimer withdraws it as soon as its send returns.
    Pending,
    /// It was already finished (failed or cancelled) or does not exist.
    Unchanged(Option<EffectState>),
}

/// A claim this worker holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimed {
    /// The claimed effect, with its attempts counted.
    pub effect: Effect,
    /// An earlier attempt may have reached the destination: look it up before sending.
    pub uncertain: bool,
}
