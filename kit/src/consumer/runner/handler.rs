//! What the user implements: the [`Handler`] trait and the [`Context`] it runs in (the
//! inbox transaction and a pool for effect steps); what it may return is in `error`.
//!
//! Invariant: a handler writes through [`Context::tx`], so its changes commit exactly when
//! the inbox records the event as handled.

use std::future::Future;

use deadpool_postgres::Pool;
use tokio_postgres::Transaction;

use crate::db::deadline;

use super::Message;
use super::error::HandlerError;

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
