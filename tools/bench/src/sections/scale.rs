//! Measurement 7, scale-out: the same backlog drained by one, two and three relays started
//! together.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::amqp::{BenchBroker, Ceiling};

use super::ceiling::broker_ceiling;
use super::drain::{Backlog, prepare_backlog};
use super::{Ctx, wait_until};

#[derive(Clone, Debug)]
pub struct ScalePoint {
    pub relays: usize,
    /// The broker ceiling measured just before this drain.
    pub ceiling: Ceiling,
    /// From starting the relays to every row dispatched and every message queued.
    pub seconds: f64,
    pub rate: f64,
    /// Messages queued beyond one per event (partition hand-overs may republish a few).
    pub duplicates: u64,
}

impl ScalePoint {
    pub fn ratio(&self) -> f64 {
        self.rate / self.ceiling.rate
    }
}

#[derive(Clone, Debug)]
pub struct Scale {
    pub events: u64,
    pub points: Vec<ScalePoint>,
}

/// For each relay count: a fresh backlog, a fresh broker ceiling, then that many relay
/// processes started together on the backlog, timed until every row is dispatched and
/// every message queued. On one small machine the relays share its cores with Postgres
/// and RabbitMQ, so this shows what sharing costs or gains here, not what more machines
/// would give.
pub async fn scale_out(ctx: &Ctx, bodies: Arc<Vec<String>>) -> Result<Scale> {
    let s = &ctx.s;
    let mut out = Scale {
        events: s.scale_events,
        points: Vec::new(),
    };
    for &relays in &s.scale_relays {
        let (backlog, _) = prepare_backlog(ctx, s.scale_events, 0).await?;
        let measured = async {
            let ceiling =
                broker_ceiling(ctx, bodies.clone(), s.scale_events, s.relay.channels).await?;
            Ok::<_, anyhow::Error>((ceiling, shared_drain(ctx, &backlog, relays).await?))
        }
        .await;
        ctx.admin.drop_db(&backlog.db.name).await;
        let (ceiling, (seconds, duplicates)) = measured?;
        let rate = s.scale_events as f64 / seconds;
        eprintln!(
            "outbox-bench: scale {relays} relay(s): {rate:.0} events/s, ceiling {:.0}",
            ceiling.rate
        );
        out.points.push(ScalePoint {
            relays,
            ceiling,
            seconds,
            rate,
            duplicates,
        });
    }
    Ok(out)
}

/// Runs `relays` relay processes on the backlog; returns seconds to drain and duplicates.
async fn shared_drain(ctx: &Ctx, backlog: &Backlog, relays: usize) -> Result<(f64, u64)> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("scale")).await?;
    let result = async {
        let (db, n) = (&backlog.db, backlog.events);
        let started = Instant::now();
        let mut procs = (0..relays)
            .map(|i| {
                let name = format!("{}-scale{relays}-{i}", db.name);
                ctx.start_relay(&name, db, &broker, &ctx.s.relay)
            })
            .collect::<Result<Vec<_>>>()?;
        let broker = &broker;
        wait_until(
            "every row dispatched and queued",
            Duration::from_secs(60 + n / 200),
            &mut procs,
            || async move { Ok(db.pending().await? == 0 && u64::from(broker.depth().await?) >= n) },
        )
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        for p in procs {
            p.stop()?;
        }
        let depth = u64::from(broker.depth().await?);
        Ok((seconds, depth.saturating_sub(n)))
    }
    .await;
    broker.purge().await.ok();
    broker.delete().await;
    result
}
