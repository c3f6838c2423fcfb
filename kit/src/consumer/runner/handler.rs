//! What the user implements and what it may return: the [`Handler`] trait, its typed
//! [`HandlerError`] (transient or terminal decides retry tier versus dead letter), and the
//! [`Context`] it runs in (the inbox transaction and a pool for effect steps).
//!
//! Invariant: a handler writes through [`Context::tx`], so its changes commit exactly when
//! the inbox records the event as handled.

use std::future::Future;

use deadpool_postgres::Pool;
use tokio_postgres::Transaction;

use crate::consumer::effects::EffectError;
use crate::db::{DbError, deadline};

use super::Message;

/// Why a handler did not apply a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later (with backoff): a dependency is down, a destination said 5xx.
    #[error("transient: {0}")]
    Transient(String),
    /// Never going to work: recorded and dead-lettered.
    #[error("terminal: {0}")]
    Terminal(String),
    /// The database failed; transient when [`DbError::is_transient`] says so.
    #[error(transparent)]
    Db(#[from] DbError),
    /// An effects-ledger step failed; transient when [`EffectError::is_transient`] says so.
    #[error(transparent)]
    Effect(#[from] EffectError),
}

impl HandlerError {
    /// Whether the message goes to a retry queue (true) or to the dead-letter exchange.
    pub fn is_transient(&self) -> bool {
        match self {
            HandlerError::Transient(_) => true,
            HandlerError::Terminal(_) => false,
            HandlerError::Db(e) => e.is_transient(),
            HandlerError::Effect(e) => e.is_transient(),
        }
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(e: tokio_postgres::Error) -> Self {
        HandlerError::Db(e.into())
    }
}

/// What a handler gets besides the message.
pub struct Context<'a> {
    pub(super) tx: &'a Transaction<'a>,
    pub(super) pool: &'a Pool,
    pub(super) consumer: &'a str,
}

impl<'a> Context<'a> {
    /// The inbox transaction: write here what must commit together with "handled".
    pub fn tx(&self) -> &'a Transaction<'a> {
        self.tx
    }

    /// Another pooled connection, in autocommit, for effects-ledger steps that must commit
    /// on their own before a send ([`crate::consumer::Ledger::perform`]).
    pub async fn connection(&self) -> Result<deadpool_postgres::Object, HandlerError> {
        Ok(deadline(self.pool.get()).await?)
    }

    /// This consumer's name (the inbox key).
    pub fn consumer(&self) -> &str {
        self.consumer
    }
}

/// What the runner calls for every message that is new (and, in ordered mode, next in line).
pub trait Handler: Send + Sync + 'static {
    /// Applies `msg`, writing through [`Context::tx`]; an error rolls the transaction back.
    fn handle(
        &self,
        cx: &Context<'_>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
