//! The latency tables of the Markdown report: our relay next to the yardstick and to no
//! relay at each rate (latency, Postgres CPU and WAL per event, the producers' INSERT), and
//! where our relay's time goes, stage by stage.

use std::fmt::Write;

use super::Results;
use crate::sections::{Floor, Latency, Runner};
use crate::stages::STAGES;
use crate::stats::{Summary, thousands};

impl Results {
    /// Steady latency next to the yardstick and without a relay, and our relay's stages.
    pub(super) fn latency_tables(&self) -> String {
        let mut o = String::new();
        let ours = self.latency_runs(Runner::Relay { listen: true });
        if ours.is_empty() {
            return o;
        }
        let _ = writeln!(
            o,
            "Steady latency next to the yardstick (the simplest correct relay, run in this sitting) and \
             without a relay; CPU and WAL from the first producer commit until every event is marked, per event:\n"
        );
        let _ = writeln!(
            o,
            "| rate (achieved) | run | commit → delivered p50 / p99 | of the yardstick's (p50, p99) | Postgres CPU per event: relay's backends + producers' | relay process CPU per event | WAL per event | producers' INSERT p50 / p99 | of no relay's (p50, p99) |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|");
        for rate in ours.iter().map(|l| l.target_rate) {
            let yard = self.latency_at(rate, Runner::Yardstick);
            let bare = self.latency_at(rate, Runner::NoRelay);
            for runner in Runner::ALL {
                let Some(l) = self.latency_at(rate, runner) else {
                    continue;
                };
                let delivered = if runner == Runner::NoRelay {
                    "-".to_owned()
                } else {
                    format!("{:.2} / {:.2} ms", l.summary.p50_ms, l.summary.p99_ms)
                };
                let vs_yard = match (runner, yard) {
                    (Runner::Relay { .. }, Some(y)) => ratio_pair(&l.summary, &y.summary),
                    _ => "-".into(),
                };
                let vs_bare = match (runner, bare) {
                    (Runner::NoRelay, _) | (_, None) => "-".into(),
                    (_, Some(b)) => ratio_pair(&l.insert, &b.insert),
                };
                let d = &l.load;
                let us = |s: f64| d.per_event(s) * 1e6;
                let _ = writeln!(
                    o,
                    "| {}/s ({}/s) | {} | {delivered} | {vs_yard} | {:.0} + {:.0} = {:.0} µs | {:.0} µs | {:.0} B | {:.2} / {:.2} ms | {vs_bare} |",
                    thousands(rate as f64),
                    thousands(l.achieved_rate),
                    runner.describe(),
                    us(d.pg_relay_cpu_s),
                    us(d.pg_producers_cpu_s),
                    us(d.pg_cpu_s()),
                    us(d.relay_cpu_s),
                    d.per_event(d.wal_bytes),
                    l.insert.p50_ms,
                    l.insert.p99_ms,
                );
            }
        }
        o.push('\n');
        let traced: Vec<&Latency> = ours.into_iter().filter(|l| l.stages.is_some()).collect();
        if traced.is_empty() {
            return o;
        }
        let _ = writeln!(
            o,
            "Where the time goes: outbox-relay with LISTEN, per event, from its stage trace joined with the bench's commit and arrival times (p50 / p99, ms):\n"
        );
        let _ = write!(o, "| stage |");
        for l in &traced {
            let _ = write!(o, " {}/s |", thousands(l.target_rate as f64));
        }
        let _ = write!(o, "\n|---|");
        for _ in &traced {
            o.push_str("---|");
        }
        o.push('\n');
        let mut line = |name: &str, cell: &dyn Fn(&Latency) -> String| {
            let _ = write!(o, "| {name} |");
            for l in &traced {
                let _ = write!(o, " {} |", cell(l));
            }
            o.push('\n');
        };
        for (i, (name, _, _)) in STAGES.iter().enumerate() {
            line(name, &|l| {
                let s = &l.stages.as_ref().expect("traced").stages[i];
                format!("{:.2} / {:.2}", s.p50_ms, s.p99_ms)
            });
        }
        let floor = |l: &Latency, hop: fn(&Floor) -> &Summary| {
            l.floor.as_ref().map_or("-".into(), |f| {
                format!("{:.2} / {:.2}", hop(f).p50_ms, hop(f).p99_ms)
            })
        };
        line(
            "floor beside it: the broker's hop alone (publish → delivered)",
            &|l| floor(l, |f| &f.broker),
        );
        line(
            "floor beside it: the wake-up's hop alone (INSERT sent → NOTIFY received)",
            &|l| floor(l, |f| &f.wakeup),
        );
        line("events traced (not traced)", &|l| {
            let b = l.stages.as_ref().expect("traced");
            format!("{} ({})", b.events, b.events_untraced)
        });
        line("claims per event; rows per claim that found rows", &|l| {
            let b = l.stages.as_ref().expect("traced");
            format!(
                "{:.2}; {:.1} ({:.0}% of claims found none)",
                b.claims as f64 / b.events.max(1) as f64,
                b.claim_rows as f64 / b.claims_with_rows.max(1) as f64,
                100.0 * (b.claims - b.claims_with_rows) as f64 / b.claims.max(1) as f64
            )
        });
        line(
            "claim round trip p50 / p99; inside outbox_claim, mean",
            &|l| {
                let b = l.stages.as_ref().expect("traced");
                format!(
                    "{:.2} / {:.2}; {:.2}",
                    b.claim_round_trip.p50_ms,
                    b.claim_round_trip.p99_ms,
                    l.pg.claim_ms / l.pg.claim_calls.max(1) as f64
                )
            },
        );
        line(
            "marks per event; rows per mark; round trip p50 / p99",
            &|l| {
                let b = l.stages.as_ref().expect("traced");
                format!(
                    "{:.2}; {:.1}; {:.2} / {:.2}",
                    b.marks as f64 / b.events.max(1) as f64,
                    b.mark_rows as f64 / b.marks.max(1) as f64,
                    b.mark_round_trip.p50_ms,
                    b.mark_round_trip.p99_ms
                )
            },
        );
        line("NOTIFYs taken in per event", &|l| {
            let b = l.stages.as_ref().expect("traced");
            format!("{:.2}", b.notifies as f64 / b.events.max(1) as f64)
        });
        o.push('\n');
        o
    }
}

/// `a / b` for p50 and p99.
fn ratio_pair(a: &Summary, b: &Summary) -> String {
    let r = |x: f64, y: f64| {
        if y > 0.0 {
            format!("{:.2}", x / y)
        } else {
            "-".into()
        }
    };
    format!("{}, {}", r(a.p50_ms, b.p50_ms), r(a.p99_ms, b.p99_ms))
}
