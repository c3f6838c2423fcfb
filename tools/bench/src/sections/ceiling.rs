//! Measurement 1, the broker ceiling: publish and confirm with no database, the figure
//! every drain is compared with.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::{Result, bail};

use crate::amqp::{self, BenchBroker, Ceiling};
use crate::procfs::{CpuSplit, Snapshot};

use super::Ctx;

/// Publishes `n` messages raw (no database) with `channels` and the relay's window.
pub async fn broker_ceiling(
    ctx: &Ctx,
    bodies: Arc<Vec<String>>,
    n: u64,
    channels: usize,
) -> Result<Ceiling> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("ceiling")).await?;
    let before = Snapshot::take();
    let result = amqp::ceiling(
        &ctx.amqp,
        &broker,
        bodies,
        n,
        ctx.s.keys,
        channels,
        ctx.s.relay.confirm_window,
    )
    .await;
    let after = Snapshot::take();
    // Every message confirmed must be in the bound queue.
    let depth = broker.depth().await.unwrap_or(0);
    broker.purge().await.ok();
    broker.delete().await;
    let mut c = result?;
    c.cpu = CpuSplit::between(&before, &after, None, &HashSet::new());
    if u64::from(depth) != n {
        bail!("broker confirmed {n} messages but the queue holds {depth}");
    }
    Ok(c)
}

/// The broker ceiling measured before and, when the drain ran, after it. The drain is
/// compared with their mean, so a machine that got busier or quieter in between shows up
/// as a spread between the two rather than as a wrong ratio.
#[derive(Clone, Debug)]
pub struct CeilingRuns {
    pub runs: Vec<Ceiling>,
}

impl CeilingRuns {
    pub fn rate(&self) -> f64 {
        self.runs.iter().map(|c| c.rate).sum::<f64>() / self.runs.len().max(1) as f64
    }

    pub fn first(&self) -> &Ceiling {
        &self.runs[0]
    }
}
