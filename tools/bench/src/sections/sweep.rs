//! The sweep: drain rate over batch sizes and channel counts, each next to a fresh broker
//! ceiling with the same channels.

use std::sync::Arc;

use anyhow::Result;

use crate::amqp::Ceiling;
use crate::relay::RelaySettings;

use super::Ctx;
use super::ceiling::broker_ceiling;
use super::drain::{Drain, drain, prepare_backlog};

#[derive(Clone, Debug)]
pub struct SweepPoint {
    pub batch_size: usize,
    pub channels: usize,
    /// The broker ceiling with the same channel count, measured just before this drain.
    pub ceiling: Ceiling,
    pub drain: Drain,
}

impl SweepPoint {
    pub fn ratio(&self) -> f64 {
        self.drain.rate / self.ceiling.rate
    }
}

#[derive(Clone, Debug)]
pub struct Sweep {
    pub events: u64,
    pub points: Vec<SweepPoint>,
}

/// Drain rate for every batch size × channel count, each next to a fresh broker ceiling
/// with the same channel count (measured seconds apart, so the ratio holds up even while
/// the machine's load changes over the minutes a sweep takes).
pub async fn sweep(ctx: &Ctx, bodies: Arc<Vec<String>>) -> Result<Sweep> {
    let s = &ctx.s;
    let mut out = Sweep {
        events: s.sweep_events,
        points: Vec::new(),
    };
    for &channels in &s.sweep_channels {
        for &batch_size in &s.sweep_batches {
            let settings = RelaySettings {
                batch_size,
                channels,
                ..s.relay.clone()
            };
            let (backlog, _) = prepare_backlog(ctx, s.sweep_events, 0).await?;
            let ceiling = broker_ceiling(ctx, bodies.clone(), s.sweep_events, channels).await?;
            let drain = drain(ctx, backlog, &settings, false).await?;
            eprintln!(
                "outbox-bench: sweep batch {batch_size} channels {channels}: {:.0} events/s, ceiling {:.0}",
                drain.rate, ceiling.rate
            );
            out.points.push(SweepPoint {
                batch_size,
                channels,
                ceiling,
                drain,
            });
        }
    }
    Ok(out)
}
