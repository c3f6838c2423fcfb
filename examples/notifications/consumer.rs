//! The notifier: consumes `ticket.status_changed` events and sends their deliveries through
//! the provider, one effect at a time, with the kit's rules (claim before sending, write back
//! only while still ours, look up before resending after an unknown outcome).
//!
//! A delivery the provider rejects for good (invalid address) is recorded failed and the
//! event still counts as handled: that is the delivery's outcome, not a poison event. A
//! transient failure (503, timeout) makes the whole event retry later; deliveries already
//! sent are then not claimed again. So does a delivery still being sent under another claim
//! (say, an attempt cut off by the handler timeout) or one whose ticket has an earlier
//! delivery unresolved: the ledger keeps a ticket's deliveries in order.

use std::sync::Arc;
use std::time::Duration;

use outbox_kit::consumer::effects::{Ledger, Performed};
use outbox_kit::consumer::runner::Context;
use outbox_kit::consumer::{
    Destination, DestinationError, Effect, EffectError, Handler, HandlerError, Message,
};
use serde_json::json;

/// The provider's HTTP API as a kit [`Destination`].
#[derive(Clone)]
pub struct ProviderClient {
    http: reqwest::Client,
    base: String,
}

impl ProviderClient {
    pub fn new(base: &str, timeout: Duration) -> ProviderClient {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("an http client without TLS builds");
        ProviderClient {
            http,
            base: base.trim_end_matches('/').to_owned(),
        }
    }
}

/// Connect errors mean the request never left: safe to retry. Anything after that (a
/// timeout, a reset) may have been processed: unknown.
fn classify(e: reqwest::Error) -> DestinationError {
    if e.is_connect() || e.is_builder() {
        DestinationError::Transient(e.to_string())
    } else {
        DestinationError::Unknown(e.to_string())
    }
}

fn by_status(status: reqwest::StatusCode, body: &str) -> DestinationError {
    if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        DestinationError::Transient(format!("{status}: {body}"))
    } else {
        DestinationError::Terminal(format!("{status}: {body}"))
    }
}

impl Destination for ProviderClient {
    fn name(&self) -> &str {
        "provider"
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        let body = json!({
            "key": effect.key,
            "to": effect.payload["to"],
            "text": effect.payload["text"],
        });
        let resp = self
            .http
            .post(format!("{}/messages", self.base))
            .json(&body)
            .send()
            .await
            .map_err(classify)?;
        let status = resp.status();
        let answer: serde_json::Value = resp.json().await.map_err(classify)?;
        if status.is_success() {
            return answer["id"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| DestinationError::Unknown("200 without an id".into()));
        }
        Err(by_status(status, &answer["error"].to_string()))
    }

    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        let resp = self
            .http
            .delete(format!("{}/messages/{external_id}", self.base))
            .send()
            .await
            .map_err(classify)?;
        let status = resp.status();
        if status.is_success() || status == reqwest::StatusCode::NOT_FOUND {
            return Ok(());
        }
        Err(by_status(status, "delete refused"))
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        let resp = self
            .http
            .get(format!("{}/messages", self.base))
            .query(&[("key", effect.key.as_str())])
            .send()
            .await
            .map_err(classify)?;
        match resp.status() {
            reqwest::StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => {
                let answer: serde_json::Value = resp.json().await.map_err(classify)?;
                Ok(answer["id"].as_str().map(str::to_owned))
            }
            s => Err(by_status(s, "lookup refused")),
        }
    }
}

/// Stops the process between "the provider accepted it" and the write-back, and waits there
/// to be killed (the crash test sends SIGKILL when it reads the line).
pub struct CrashAfterSend<D>(pub D);

impl<D: Destination> Destination for CrashAfterSend<D> {
    fn name(&self) -> &str {
        self.0.name()
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        let id = self.0.send(effect).await?;
        println!("CRASH POINT: {} accepted as {id}", effect.key);
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::future::pending::<()>().await;
        unreachable!("killed at the crash point")
    }

    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        self.0.delete(external_id).await
    }

    fn supports_lookup(&self) -> bool {
        self.0.supports_lookup()
    }

    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        self.0.lookup(effect).await
    }
}

/// The handler: every delivery named by the event, through the ledger.
pub struct Notifier<D> {
    pub ledger: Ledger,
    pub provider: Arc<D>,
}

impl<D: Destination + 'static> Handler for Notifier<D> {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        let event = msg.payload()?;
        let Some(keys) = event["deliveries"].as_array() else {
            return Err(HandlerError::Terminal(
                "event has no deliveries list".into(),
            ));
        };
        let conn = cx.connection().await?;
        let mut retry: Option<EffectError> = None;
        for key in keys.iter().filter_map(|k| k.as_str()) {
            match self.ledger.perform(&conn, key, &*self.provider).await {
                Ok(Performed::Sent { .. } | Performed::Withdrawn { .. } | Performed::Cancelled) => {
                }
                // Finished: sent before, failed at creation, cancelled. (One that another
                // claim holds, or that waits for an earlier delivery of its ticket, is a
                // transient error below: the event is retried, so order holds.)
                Ok(Performed::NotClaimed { .. }) => {}
                Ok(Performed::StillOut { external_id, error }) => {
                    tracing::warn!(
                        key,
                        external_id,
                        error,
                        "cancelled delivery still out at the provider"
                    );
                }
                // Recorded failed (budget released): the delivery's outcome.
                Err(EffectError::Destination(DestinationError::Terminal(_))) => {}
                // Left for review; the ticket's later deliveries wait for it in the ledger.
                Err(EffectError::InDoubt { .. }) => {}
                Err(e) if e.is_transient() => retry = Some(e),
                Err(e) => return Err(e.into()),
            }
        }
        match retry {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}
