//! The latency breakdown: the relay's stage trace (`outbox-relay run --stage-trace FILE`,
//! written by src/trace.rs) joined with the bench's own commit and arrival times,
//! per event: commit → relay woken → claim sent → claim returned → published → confirmed
//! → marked, and published → delivered.
//!
//! "Woken" is the first NOTIFY the relay took in after it sent its previous claim, or,
//! when none came (busy polling, a poll tick, a claim again at once), the moment it sent
//! the claim that found the row. Every instant is clamped to be no earlier than the one
//! before it (a row can be claimed before its producer sees COMMIT return, and a NOTIFY
//! can come for an earlier row), so the stages of an event add up to its commit-to-marked
//! time. Times are wall-clock nanoseconds since the Unix epoch: the relay is another
//! process.

use std::collections::HashMap;

use crate::stats::Summary;

/// What the trace says about one row: its first claim, publish, ack and mark.
#[derive(Clone, Copy, Debug, Default)]
struct Row {
    woken: u128,
    sent: u128,
    returned: u128,
    published: Option<u128>,
    acked: Option<u128>,
    marked: Option<u128>,
}

/// One claim or mark round trip: sent, returned, rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundTrip {
    pub sent: u128,
    pub done: u128,
    pub rows: usize,
}

/// A parsed stage trace.
#[derive(Debug, Default)]
pub struct Trace {
    rows: HashMap<i64, Row>,
    pub claims: Vec<RoundTrip>,
    pub marks: Vec<RoundTrip>,
    pub notifies: Vec<u128>,
}

impl Trace {
    /// Parses the trace's lines (see src/trace.rs); lines it does not know are skipped,
    /// and so is a last line cut short.
    pub fn parse(text: &str) -> Trace {
        let mut t = Trace::default();
        let mut first_notify: Option<u128> = None;
        let mut claim: Option<(u128, u128)> = None; // (woken, sent)
        let mut mark_sent: Option<u128> = None;
        for line in text.lines() {
            let mut f = line.split(' ');
            let (Some(stage), Some(Ok(at))) = (f.next(), f.next().map(str::parse::<u128>)) else {
                continue;
            };
            let ids = f.filter_map(|x| x.parse::<i64>().ok());
            match stage {
                "N" => {
                    t.notifies.push(at);
                    first_notify.get_or_insert(at);
                }
                "S" => claim = Some((first_notify.take().map_or(at, |n| n.min(at)), at)),
                "R" => {
                    let Some((woken, sent)) = claim.take() else {
                        continue;
                    };
                    let mut n = 0;
                    for id in ids {
                        n += 1;
                        t.rows.entry(id).or_insert(Row {
                            woken,
                            sent,
                            returned: at,
                            ..Row::default()
                        });
                    }
                    t.claims.push(RoundTrip {
                        sent,
                        done: at,
                        rows: n,
                    });
                }
                "P" | "A" | "M" => {
                    let mut n = 0;
                    for id in ids {
                        n += 1;
                        if let Some(r) = t.rows.get_mut(&id) {
                            let slot = match stage {
                                "P" => &mut r.published,
                                "A" => &mut r.acked,
                                _ => &mut r.marked,
                            };
                            slot.get_or_insert(at);
                        }
                    }
                    if stage == "M"
                        && let Some(sent) = mark_sent.take()
                    {
                        t.marks.push(RoundTrip {
                            sent,
                            done: at,
                            rows: n,
                        });
                    }
                }
                "U" => mark_sent = Some(at),
                _ => {}
            }
        }
        t
    }
}

/// The stages reported, in order: (name, from, to) as indexes into an event's instants
/// [commit, woken, sent, returned, published, confirmed, marked, delivered].
pub const STAGES: [(&str, usize, usize); 10] = [
    ("commit → relay woken", 0, 1),
    ("woken → claim sent", 1, 2),
    ("claim sent → claim returned", 2, 3),
    ("claim returned → published", 3, 4),
    ("published → confirmed", 4, 5),
    ("confirmed → marked", 5, 6),
    ("published → delivered", 4, 7),
    ("commit → marked", 0, 6),
    ("commit → delivered", 0, 7),
    // Last, so the indexes above stay: the part of the latency that is the relay's own (the
    // broker's hop after it, and the floor report beside it, are not).
    (RELAY_SHARE, 0, 4),
];

/// The stage that is the relay's own share of the latency: commit → published.
pub const RELAY_SHARE: &str = "commit → published (the relay's own share)";

/// Per-stage latency and what the claims and marks did over the measured events.
#[derive(Clone, Debug, Default)]
pub struct Breakdown {
    /// One summary per entry of [`STAGES`].
    pub stages: Vec<Summary>,
    /// Events with every stage in the trace (the others are left out).
    pub events: usize,
    pub events_untraced: usize,
    /// Claims and marks sent from the first commit to the last mark of the measured events.
    pub claims: usize,
    pub claims_with_rows: usize,
    pub claim_rows: usize,
    pub claim_round_trip: Summary,
    pub marks: usize,
    pub mark_rows: usize,
    pub mark_round_trip: Summary,
    pub notifies: usize,
}

impl Breakdown {
    /// `events`: for each measured event, its row id, commit and arrival instants (unix ns).
    pub fn of(trace: &Trace, events: &[(i64, u128, u128)]) -> Breakdown {
        let mut per_stage: Vec<Vec<f64>> = vec![Vec::with_capacity(events.len()); STAGES.len()];
        let mut out = Breakdown::default();
        let (mut first, mut last) = (u128::MAX, 0);
        for &(id, commit, delivered) in events {
            let Some(r) = trace.rows.get(&id) else {
                out.events_untraced += 1;
                continue;
            };
            let (Some(p), Some(a), Some(m)) = (r.published, r.acked, r.marked) else {
                out.events_untraced += 1;
                continue;
            };
            let mut at = [commit, r.woken, r.sent, r.returned, p, a, m, delivered];
            for i in 1..7 {
                at[i] = at[i].max(at[i - 1]);
            }
            at[7] = at[7].max(at[4]);
            for (samples, (_, from, to)) in per_stage.iter_mut().zip(STAGES) {
                samples.push((at[to] - at[from]) as f64 / 1e6);
            }
            out.events += 1;
            first = first.min(commit);
            last = last.max(at[6]);
        }
        out.stages = per_stage.into_iter().map(Summary::of).collect();
        let within = |rt: &&RoundTrip| rt.sent >= first && rt.sent <= last;
        let claims: Vec<&RoundTrip> = trace.claims.iter().filter(within).collect();
        out.claims = claims.len();
        out.claims_with_rows = claims.iter().filter(|c| c.rows > 0).count();
        out.claim_rows = claims.iter().map(|c| c.rows).sum();
        out.claim_round_trip = Summary::of(claims.iter().map(|c| ms(c)).collect());
        let marks: Vec<&RoundTrip> = trace.marks.iter().filter(within).collect();
        out.marks = marks.len();
        out.mark_rows = marks.iter().map(|m| m.rows).sum();
        out.mark_round_trip = Summary::of(marks.iter().map(|m| ms(m)).collect());
        out.notifies = trace
            .notifies
            .iter()
            .filter(|n| **n >= first && **n <= last)
            .count();
        out
    }
}

fn ms(rt: &RoundTrip) -> f64 {
    rt.done.saturating_sub(rt.sent) as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u128 = 1_000_000;

    /// Two claims: the first woken by a NOTIFY that came during the claim before it, the
    /// second by nothing (a poll); stages are measured from the commit and clamped.
    #[test]
    fn stages_follow_the_trace_and_are_clamped() {
        let text = [
            "S 100000000", // an empty claim, before anything was committed
            "N 101000000", // came while that claim ran
            "R 102000000",
            "S 103000000",
            "R 105000000 1 2",
            "P 105500000 1 2",
            "A 107000000 1",
            "A 108000000 2",
            "U 108000000",
            "M 110000000 1 2",
            "S 120000000",
            "R 121000000 3",
            "P 121000000 3",
            "A 122000000 3",
            "U 122000000",
            "M 123000000 3",
            "M 999 cut sh", // a cut last line: skipped
        ]
        .join("\n");
        let t = Trace::parse(&text);
        assert_eq!(t.claims.len(), 3);
        assert_eq!(t.marks.len(), 2);
        assert_eq!(t.marks[0].rows, 2);
        // Event 1 committed at 100.5 ms (before the NOTIFY), event 2 at 102 ms (after it:
        // woken is clamped to the commit), event 3 at 115 ms (no NOTIFY: woken at its claim).
        let events = [
            (1, 100 * MS + MS / 2, 106 * MS),
            (2, 102 * MS, 109 * MS),
            (3, 115 * MS, 121 * MS + MS / 2),
            (4, 116 * MS, 130 * MS), // not in the trace
        ];
        let b = Breakdown::of(&t, &events);
        assert_eq!((b.events, b.events_untraced), (3, 1));
        let p50 = |i: usize| b.stages[i].p50_ms;
        let max = |i: usize| b.stages[i].max_ms;
        // commit → woken: 0.5 ms (event 1), 0 (event 2), 5 ms (event 3, woken by its claim).
        assert_eq!((p50(0), max(0)), (0.5, 5.0));
        // claim round trip: 2 ms, 2 ms, 1 ms.
        assert_eq!((p50(2), max(2)), (2.0, 2.0));
        // published → confirmed: 1.5, 2.5, 1 ms.
        assert_eq!(p50(4), 1.5);
        // commit → delivered never earlier than published.
        assert_eq!(max(8), 7.0);
        // commit → marked = the sum of the chain: 9.5, 8, 8 ms.
        assert_eq!(max(7), 9.5);
        // The relay's own share ends at the publish, before the confirm and the mark.
        assert!(max(9) > 0.0 && max(9) < max(7));
        assert_eq!((b.claims, b.claims_with_rows, b.claim_rows), (2, 2, 3));
        assert_eq!((b.marks, b.mark_rows), (2, 3));
        assert_eq!(b.notifies, 1);
    }
}
