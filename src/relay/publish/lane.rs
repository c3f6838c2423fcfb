//! A lane: one confirm-mode channel and the task that owns it. It publishes what the
//! session hands it (mandatory, so an unroutable message comes back), waits on each
//! publish's confirm with a deadline, and reports per row how the broker settled it, as
//! [`confirm::decide`] rules.
//!
//! Invariants: a round of confirms is decided only after draining every confirm already
//! resolved, so all confirms resolved before a given one are seen with it (the decision's
//! proof that an ack carried no hidden return rests on this). While suspects wait and no
//! other confirm would come, the lane sends a probe (a message to an unbound routing key of
//! the default exchange, not mandatory) whose confirm carries nothing; a probe that times
//! out ends the lane like a row's confirm would. Once the lane ends, confirms still
//! outstanding are never reported: they may carry returns it would never see, so none of
//! them may count as acked; the engine fails their rows when it sees the session lost.
//! Only here does the relay touch lapin's publish, confirm and return API.

use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::{FutureExt, future::BoxFuture};
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{BasicProperties, Confirmation};
use tokio::sync::mpsc;

use super::confirm::{self, ConfirmResult, NackRun, Pending, Resolved, ReturnInfo, Returns};
use super::lost::Lost;
use super::message::Prepared;
use super::{Outcome, Settled, SettledBatch};

/// A publish's confirm: the row it is for (`None` for a probe) and how it resolved.
type ConfirmFuture = BoxFuture<'static, (Option<Pending>, ConfirmResult)>;

/// One publishing lane of a session (built by `Session::open`).
pub(super) struct Lane {
    pub(super) channel: lapin::Channel,
    pub(super) exchange: ShortString,
    /// Where probes go: a routing key no queue is bound to, unique per process and lane.
    pub(super) probe_key: ShortString,
    pub(super) confirm_timeout: Duration,
    pub(super) generation: u64,
    pub(super) settled: mpsc::UnboundedSender<SettledBatch>,
    pub(super) lost: Lost,
}

impl Lane {
    pub(super) async fn run(self, mut rx: mpsc::UnboundedReceiver<Prepared>) {
        let mut in_flight: FuturesUnordered<ConfirmFuture> = FuturesUnordered::new();
        let mut returns = Returns::default();
        let mut suspects: Vec<Pending> = Vec::new();
        let mut probe_out = false;
        let mut broken: Option<String> = None;
        let mut nacks = NackRun::default();
        loop {
            if broken.is_some() {
                break;
            }
            if !suspects.is_empty() && in_flight.is_empty() && !probe_out {
                match self.send_probe().await {
                    Ok(fut) => {
                        in_flight.push(fut);
                        probe_out = true;
                    }
                    Err(e) => broken = Some(e),
                }
                continue;
            }
            tokio::select! {
                biased;
                _ = self.lost.raised() => { broken = Some("amqp session closed".into()); }
                Some((pending, result)) = in_flight.next(), if !in_flight.is_empty() => {
                    let mut round = vec![Resolved { pending, result }];
                    while let Some(Some((pending, result))) = in_flight.next().now_or_never() {
                        round.push(Resolved { pending, result });
                    }
                    if round.iter().any(|r| r.pending.is_none()) {
                        probe_out = false;
                    }
                    let decision =
                        confirm::decide(round, &mut returns, std::mem::take(&mut suspects));
                    suspects = decision.suspects;
                    if decision.end.is_some() {
                        broken = decision.end;
                    }
                    let outcomes = decision.settled.iter().map(|(_, outcome)| outcome);
                    if nacks.for_good(outcomes, Instant::now(), self.confirm_timeout) {
                        let limit = self.confirm_timeout;
                        let why = format!("the broker nacked every publish for {limit:?}");
                        // The node answers but refuses: the next session goes to another.
                        self.lost.raise_refused(why.clone());
                        broken = Some(why);
                    }
                    self.send(decision.settled);
                }
                msg = rx.recv() => match msg {
                    Some(message) => match self.publish(message).await {
                        Ok(fut) => in_flight.push(fut),
                        Err(e) => broken = Some(e),
                    },
                    None => { broken = Some("amqp session closed".into()); }
                }
            }
        }
        // The lane is done. Rows still unsettled are failed by the engine when it sees the
        // session lost; confirms still outstanding may carry returns we would never see, so
        // none of them may count as acked.
        self.lost
            .raise(broken.unwrap_or_else(|| "amqp session closed".into()));
        drop(in_flight);
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            self.channel.close(200, "lane closed".into()),
        )
        .await;
    }

    fn send(&self, settled: Vec<(Pending, Outcome)>) {
        if settled.is_empty() {
            return;
        }
        let out = settled
            .into_iter()
            .map(|(p, outcome)| Settled {
                row_id: p.row_id,
                confirm_secs: p.sent_at.elapsed().as_secs_f64(),
                key: p.key,
                outcome,
            })
            .collect();
        let _ = self.settled.send((self.generation, out));
    }

    async fn publish(&self, message: Prepared) -> Result<ConfirmFuture, String> {
        let Prepared {
            row_id,
            seq,
            key,
            event_id,
            routing_key,
            body,
            body_bytes,
            properties,
        } = message;
        let pending = Pending {
            row_id,
            seq,
            key,
            event_id,
            body_bytes,
            sent_at: Instant::now(),
        };
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let publish = self.channel.basic_publish(
            self.exchange.clone(),
            routing_key,
            options,
            body.as_bytes(),
            properties,
        );
        let confirm = match tokio::time::timeout(self.confirm_timeout, publish).await {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(e)) => return Err(format!("publish failed: {e}")),
            Err(_) => return Err("publish not written in time".into()),
        };
        let timeout = self.confirm_timeout;
        Ok(async move {
            let result = match tokio::time::timeout(timeout, confirm).await {
                Ok(c) => confirm_result(c),
                Err(_) => ConfirmResult::TimedOut,
            };
            (Some(pending), result)
        }
        .boxed())
    }

    async fn send_probe(&self) -> Result<ConfirmFuture, String> {
        let options = BasicPublishOptions {
            mandatory: false,
            immediate: false,
        };
        let publish = self.channel.basic_publish(
            "".into(),
            self.probe_key.clone(),
            options,
            b"",
            BasicProperties::default(),
        );
        let confirm = match tokio::time::timeout(self.confirm_timeout, publish).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(format!("probe publish failed: {e}")),
            Err(_) => return Err("probe not written in time".into()),
        };
        let timeout = self.confirm_timeout;
        Ok(async move {
            let result = match tokio::time::timeout(timeout, confirm).await {
                Ok(c) => confirm_result(c),
                Err(_) => ConfirmResult::TimedOut,
            };
            (None, result)
        }
        .boxed())
    }
}

/// lapin's confirmation, reduced to what the decision needs.
fn confirm_result(c: lapin::Result<Confirmation>) -> ConfirmResult {
    let info = |m: lapin::message::BasicReturnMessage| ReturnInfo {
        message_id: m
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned()),
        reply_code: m.reply_code,
        reply_text: m.reply_text.as_str().to_owned(),
    };
    match c {
        Ok(Confirmation::Ack(m)) => ConfirmResult::Ack(m.map(info)),
        Ok(Confirmation::Nack(m)) => ConfirmResult::Nack(m.map(info)),
        Ok(Confirmation::NotRequested) => ConfirmResult::NotRequested,
        Err(e) => ConfirmResult::Failed(e.to_string()),
    }
}
