//! The confirm decision, round by round: each test plays confirms in the order a lane would
//! drain them and checks what every row became.

use super::*;

fn row(id: i64) -> Pending {
    Pending {
        row_id: id,
        seq: id,
        key: Key {
            aggregate_type: "order".into(),
            aggregate_id: id.to_string(),
        },
        event_id: format!("event-{id}"),
        body_bytes: 2,
        sent_at: Instant::now(),
    }
}

/// The return of row `id` (unroutable), as lapin hands it over.
fn ret(id: i64) -> Option<ReturnInfo> {
    Some(ReturnInfo {
        message_id: Some(format!("event-{id}")),
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
    })
}

fn confirm(id: i64, result: ConfirmResult) -> Resolved {
    Resolved {
        pending: Some(row(id)),
        result,
    }
}

/// An ack of row `id` that carried the return `carried` (of any row, or none).
fn ack(id: i64, carried: Option<ReturnInfo>) -> Resolved {
    confirm(id, ConfirmResult::Ack(carried))
}

fn nack(id: i64, carried: Option<ReturnInfo>) -> Resolved {
    confirm(id, ConfirmResult::Nack(carried))
}

fn probe(carried: Option<ReturnInfo>) -> Resolved {
    Resolved {
        pending: None,
        result: ConfirmResult::Ack(carried),
    }
}

/// Plays rounds in order, carrying returns and suspects between them as a lane does;
/// returns each round's verdicts and suspects by row id.
struct Rounds {
    returns: Returns,
    suspects: Vec<Pending>,
}

#[derive(Debug, PartialEq)]
struct Round {
    settled: Vec<(i64, &'static str)>,
    suspects: Vec<i64>,
    end: Option<String>,
}

impl Rounds {
    fn new() -> Rounds {
        Rounds {
            returns: Returns::default(),
            suspects: Vec::new(),
        }
    }

    fn round(&mut self, confirms: Vec<Resolved>) -> Round {
        let d = decide(
            confirms,
            &mut self.returns,
            std::mem::take(&mut self.suspects),
        );
        self.suspects = d.suspects;
        let settled = d
            .settled
            .iter()
            .map(|(p, outcome)| {
                let verdict = match outcome {
                    Outcome::Acked(a) => {
                        assert_eq!((a.row_id(), a.seq()), (p.row_id, p.seq));
                        "acked"
                    }
                    Outcome::Returned { reply_code, .. } => {
                        assert_eq!(*reply_code, 312);
                        "returned"
                    }
                    Outcome::Nacked => "nacked",
                    Outcome::TimedOut => "timed out",
                    Outcome::Lost(_) => "lost",
                };
                (p.row_id, verdict)
            })
            .collect();
        Round {
            settled,
            suspects: self.suspects.iter().map(|p| p.row_id).collect(),
            end: d.end,
        }
    }
}

fn settled(rows: &[(i64, &'static str)]) -> Round {
    Round {
        settled: rows.to_vec(),
        suspects: vec![],
        end: None,
    }
}

#[test]
fn clean_acks_and_nacks_settle_at_once() {
    let mut lane = Rounds::new();
    let round = lane.round(vec![ack(1, None), nack(2, None), ack(3, None)]);
    assert_eq!(round, settled(&[(1, "acked"), (2, "nacked"), (3, "acked")]));
}

#[test]
fn a_return_carried_by_another_rows_confirm_is_matched_by_message_id() {
    // Row 2 is unroutable; lapin hands its return to row 1's confirm (FIFO). Row 2's own
    // ack, later in the round, carries nothing: still returned, never acked.
    let mut lane = Rounds::new();
    let round = lane.round(vec![ack(1, ret(2)), ack(2, None)]);
    assert_eq!(
        round,
        Round {
            settled: vec![(2, "returned")],
            suspects: vec![1],
            end: None,
        }
    );
    // Row 1 carried another row's return, so its own may still be queued: a clean confirm
    // of a later round proves it is not.
    assert_eq!(
        lane.round(vec![ack(3, None)]),
        settled(&[(3, "acked"), (1, "acked")])
    );
}

#[test]
fn an_ack_that_carried_another_rows_return_waits_for_its_own() {
    let mut lane = Rounds::new();
    let first = lane.round(vec![ack(1, ret(2))]);
    assert_eq!(first.suspects, vec![1]);
    // Row 2's ack comes in a later round: the return recorded earlier settles it.
    // Row 1's own return is carried by row 3's confirm: row 1 is returned, and row 3
    // is a suspect in turn.
    let second = lane.round(vec![ack(2, None), ack(3, ret(1))]);
    assert_eq!(
        second,
        Round {
            settled: vec![(2, "returned"), (1, "returned")],
            suspects: vec![3],
            end: None,
        }
    );
    // Rounds whose confirms all carried returns prove nothing for the suspects.
    let third = lane.round(vec![ack(4, ret(5))]);
    assert_eq!(third.settled, vec![]);
    assert_eq!(third.suspects, vec![3, 4]);
    // A probe that carried nothing settles them; the probe itself is no row.
    assert_eq!(
        lane.round(vec![probe(None)]),
        settled(&[(3, "acked"), (4, "acked")])
    );
}

#[test]
fn a_clean_confirm_of_the_same_round_does_not_clear_a_new_suspect() {
    // Within a round the drain order is not lapin's order: the clean ack of row 2 may have
    // resolved before row 1's confirm, while row 1's own return was still queued.
    let mut lane = Rounds::new();
    let round = lane.round(vec![ack(1, ret(9)), ack(2, None)]);
    assert_eq!(round.settled, vec![(2, "acked")]);
    assert_eq!(round.suspects, vec![1]);
    // A nack that carried nothing is as good a proof as an ack.
    let next = lane.round(vec![nack(3, None)]);
    assert_eq!(next.settled, vec![(3, "nacked"), (1, "acked")]);
}

#[test]
fn multiple_ack_order_does_not_matter_within_a_round() {
    // A multiple-ack resolves its confirms in hash order: row 2's clean ack may be drained
    // before row 1's confirm that carried row 2's return. Every return of the round is
    // recorded before any row is decided.
    let mut lane = Rounds::new();
    let round = lane.round(vec![ack(2, None), ack(3, None), ack(1, ret(2))]);
    assert_eq!(round.settled, vec![(2, "returned"), (3, "acked")]);
    assert_eq!(round.suspects, vec![1]);
}

#[test]
fn a_nack_that_carried_a_return_records_it() {
    let mut lane = Rounds::new();
    let round = lane.round(vec![nack(1, ret(2)), ack(2, None)]);
    assert_eq!(round, settled(&[(1, "nacked"), (2, "returned")]));
}

#[test]
fn rounds_mixing_timeouts_nacks_and_returns_end_the_lane() {
    let mut lane = Rounds::new();
    let round = lane.round(vec![
        confirm(1, ConfirmResult::TimedOut),
        nack(2, ret(3)),
        ack(3, None),
    ]);
    assert_eq!(
        round.settled,
        vec![(1, "timed out"), (2, "nacked"), (3, "returned")]
    );
    assert_eq!(round.end.as_deref(), Some("a confirm timed out"));

    let mut lane = Rounds::new();
    let round = lane.round(vec![
        confirm(1, ConfirmResult::Failed("channel closed".into())),
        confirm(2, ConfirmResult::NotRequested),
    ]);
    assert_eq!(round.settled, vec![(1, "lost"), (2, "lost")]);
    assert_eq!(round.end.as_deref(), Some("channel not in confirm mode"));
}

#[test]
fn returns_without_a_message_id_or_for_settled_rows_are_never_claimed() {
    let mut lane = Rounds::new();
    let anonymous = Some(ReturnInfo {
        message_id: None,
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
    });
    // Row 1 carried a return, even one that matches no row: it waits for proof.
    let round = lane.round(vec![ack(1, anonymous), ack(2, ret(7))]);
    assert_eq!(round.suspects, vec![1, 2]);
    assert_eq!(
        lane.round(vec![probe(None)]).settled,
        vec![(1, "acked"), (2, "acked")]
    );
    // Row 7's return, recorded above, is taken once: a later row 7 ack is returned, and
    // nothing is left for the next one.
    assert_eq!(lane.round(vec![ack(7, None)]), settled(&[(7, "returned")]));
    assert_eq!(lane.round(vec![ack(7, None)]), settled(&[(7, "acked")]));
}

#[test]
fn only_nacks_for_a_confirm_timeout_end_the_lane() {
    let acked = || {
        Outcome::Acked(Acked {
            row_id: 1,
            seq: 1,
            body_bytes: 1,
        })
    };
    let limit = Duration::from_secs(5);
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut run = NackRun::default();
    assert!(!run.for_good(&[Outcome::Nacked], at(0), limit));
    assert!(!run.for_good(&[Outcome::Nacked], at(4), limit));
    // An ack in the same round as nacks ends the run.
    assert!(!run.for_good(&[Outcome::Nacked, acked()], at(5), limit));
    assert!(!run.for_good(&[Outcome::Nacked], at(6), limit));
    assert!(!run.for_good(&[], at(10), limit));
    assert!(run.for_good(&[Outcome::Nacked], at(11), limit));
    // A return is the broker's answer too: not a nack run.
    let mut run = NackRun::default();
    assert!(!run.for_good(&[Outcome::Nacked], at(0), limit));
    let returned = Outcome::Returned {
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
    };
    assert!(!run.for_good(&[returned], at(6), limit));
    assert!(!run.for_good(&[Outcome::Nacked], at(7), limit));
}

#[test]
fn acks_in_a_round_with_a_timeout_are_not_trusted() {
    // Row 1's confirm timed out, but lapin still pairs the next queued return with it when
    // its ack arrives: row 2's return can be consumed there, and row 2's ack, drained in
    // the same round, then carries nothing. Its row stays pending (a duplicate, never a
    // loss); a return that did reach the lane still settles its row.
    let mut lane = Rounds::new();
    let round = lane.round(vec![
        confirm(1, ConfirmResult::TimedOut),
        ack(2, None),
        ack(3, ret(4)),
        ack(4, None),
    ]);
    assert_eq!(
        round.settled,
        vec![(1, "timed out"), (2, "lost"), (3, "lost"), (4, "returned")]
    );
    assert_eq!(round.suspects, Vec::<i64>::new());
    assert_eq!(round.end.as_deref(), Some("a confirm timed out"));

    // The same after a channel error, and for suspects of earlier rounds: a clean confirm
    // of such a round proves nothing.
    let mut lane = Rounds::new();
    assert_eq!(lane.round(vec![ack(1, ret(9))]).suspects, vec![1]);
    let round = lane.round(vec![
        ack(2, None),
        confirm(3, ConfirmResult::Failed("channel closed".into())),
    ]);
    assert_eq!(round.settled, vec![(2, "lost"), (3, "lost"), (1, "lost")]);
    assert_eq!(round.suspects, Vec::<i64>::new());
    assert_eq!(round.end.as_deref(), Some("channel closed"));
}

#[test]
fn a_probe_that_timed_out_ends_the_lane_like_a_row() {
    // lapin pairs a queued return with a probe's confirm as with any other, so a probe
    // we stopped watching may swallow a suspect's return: the suspect is not cleared by
    // the round, and the lane ends.
    let mut lane = Rounds::new();
    assert_eq!(lane.round(vec![ack(1, ret(9))]).suspects, vec![1]);
    let round = lane.round(vec![Resolved {
        pending: None,
        result: ConfirmResult::TimedOut,
    }]);
    assert_eq!(round.settled, vec![(1, "lost")]);
    assert_eq!(round.end.as_deref(), Some("a confirm timed out"));
}
