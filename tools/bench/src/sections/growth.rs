//! Measurement 5, growth: the drain with millions of dispatched rows in the table against
//! the same drain on an empty table, alternated so a change in the machine's load does not
//! pass for an effect of the table's size.

use anyhow::Result;

use crate::relay::RelaySettings;

use super::Ctx;
use super::drain::{Drain, drain, drain_keep, prepare_backlog};

#[derive(Clone, Debug)]
pub struct Growth {
    pub history_rows: u64,
    pub history_s: f64,
    /// Drains with the dispatched rows in the table, one per round.
    pub loaded: Vec<Drain>,
    /// Drains of an empty table, each right after a loaded one.
    pub empty: Vec<Drain>,
    /// A last drain with the dispatched rows in the table while the relay's `--retention`
    /// deletes them, and how many it deleted by the end of that drain.
    pub retained: Option<(Drain, i64)>,
}

fn mean_rate(d: &[Drain]) -> f64 {
    d.iter().map(|d| d.rate).sum::<f64>() / d.len().max(1) as f64
}

impl Growth {
    pub fn loaded_rate(&self) -> f64 {
        mean_rate(&self.loaded)
    }

    pub fn empty_rate(&self) -> f64 {
        mean_rate(&self.empty)
    }

    pub fn ratio(&self) -> f64 {
        self.loaded_rate() / self.empty_rate()
    }

    /// The drain while retention deletes the history, against the empty table's.
    pub fn retained_ratio(&self) -> Option<f64> {
        Some(self.retained.as_ref()?.0.rate / self.empty_rate())
    }
}

/// Rounds of: the drain with `growth_rows` dispatched rows already in the table (a new
/// backlog on the same table each round), then the same drain on an empty table right
/// after it. Alternating and averaging keeps a change in the machine's load from passing
/// for an effect of the table's size.
pub async fn growth(ctx: &Ctx) -> Result<Growth> {
    let s = &ctx.s;
    let (mut big, history_s) = prepare_backlog(ctx, s.events, s.growth_rows).await?;
    let result = async {
        let mut out = Growth {
            history_rows: s.growth_rows,
            history_s,
            loaded: Vec::new(),
            empty: Vec::new(),
            retained: None,
        };
        for round in 0..s.growth_rounds.max(1) {
            if round > 0 {
                big.after_id = big.db.max_id().await?;
                let first = s.growth_rows + round as u64 * s.events;
                big.db.insert_backlog(first, s.events, s.keys).await?;
            }
            out.loaded
                .push(drain_keep(ctx, &big, &s.relay, false).await?);
            let (empty, _) = prepare_backlog(ctx, s.events, 0).await?;
            out.empty.push(drain(ctx, empty, &s.relay, false).await?);
            eprintln!(
                "outbox-bench: growth round {}: {:.0} events/s with history, {:.0} without",
                round + 1,
                out.loaded[round].rate,
                out.empty[round].rate
            );
        }
        // Then once more with retention on: the relay deletes the history (dispatched a
        // day ago) in batches while it drains the new backlog.
        big.after_id = big.db.max_id().await?;
        let first = s.growth_rows + out.loaded.len() as u64 * s.events;
        big.db.insert_backlog(first, s.events, s.keys).await?;
        let before = big.db.old_dispatched().await?;
        let settings = RelaySettings {
            retention: Some("1h".into()),
            ..s.relay.clone()
        };
        let d = drain_keep(ctx, &big, &settings, false).await?;
        let deleted = before - big.db.old_dispatched().await?;
        eprintln!(
            "outbox-bench: growth with retention: {:.0} events/s, {deleted} old rows deleted meanwhile",
            d.rate
        );
        out.retained = Some((d, deleted));
        Ok::<_, anyhow::Error>(out)
    }
    .await;
    ctx.admin.drop_db(&big.db.name).await;
    result
}
