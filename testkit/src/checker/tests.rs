use super::*;

fn key(k: &str) -> (String, String) {
    ("acct".to_owned(), k.to_owned())
}

fn d(id: &str, k: &str, seq: i64) -> Delivery {
    Delivery {
        event_id: id.to_owned(),
        key: key(k),
        seq: Some(seq),
    }
}

fn ids(n: usize) -> Vec<uuid::Uuid> {
    (0..n)
        .map(|i| uuid::Uuid::from_u128(i as u128 + 1))
        .collect()
}

#[test]
fn a_clean_stream_passes_and_redeliveries_are_duplicates() {
    let c = ids(3);
    let got = vec![
        d(&c[0].to_string(), "a", 1),
        d(&c[1].to_string(), "a", 2),
        d(&c[0].to_string(), "a", 1), // redelivered after a later one: a duplicate
        d(&c[2].to_string(), "b", 1),
    ];
    let r = check(&c, &got);
    r.assert_clean();
    assert_eq!(r.duplicates, 1);
    assert_eq!(r.order_violations, 0);
}

#[test]
fn catches_a_planted_loss_an_unexpected_event_and_an_order_violation() {
    let c = ids(4);
    let stray = uuid::Uuid::from_u128(99).to_string();
    let got = vec![
        d(&c[1].to_string(), "a", 2),
        d(&c[0].to_string(), "a", 1), // first delivery after a higher seq
        d(&stray, "z", 1),            // never committed (a rolled-back row)
        d(&c[2].to_string(), "b", 1),
        // c[3] lost
    ];
    let r = check(&c, &got);
    assert_eq!(r.lost, 1, "{r:?}");
    assert_eq!(r.unexpected, 1, "{r:?}");
    assert_eq!(r.order_violations, 1, "{r:?}");
    assert!(std::panic::catch_unwind(|| r.assert_clean()).is_err());
}

#[test]
fn one_seq_naming_two_events_is_a_violation() {
    let c = ids(2);
    let got = vec![d(&c[0].to_string(), "a", 1), d(&c[1].to_string(), "a", 1)];
    assert_eq!(check(&c, &got).order_violations, 1);
}

fn accepted(key: &str, id: &str) -> Accepted {
    Accepted {
        effect_key: key.to_owned(),
        external_id: id.to_owned(),
    }
}

fn sent(id: &str) -> LedgerRow {
    LedgerRow {
        state: "sent".into(),
        external_id: Some(id.into()),
    }
}

#[test]
fn effects_performed_once_with_a_matching_ledger_pass() {
    let expected = vec!["e1".to_owned(), "e2".to_owned()];
    let got = vec![accepted("e1", "m1"), accepted("e2", "m2")];
    let ledger = HashMap::from([("e1".to_owned(), sent("m1")), ("e2".to_owned(), sent("m2"))]);
    let r = check_effects(&expected, &got, &ledger);
    assert!(r.exactly_once(), "{r:?}");
}

#[test]
fn catches_a_planted_duplicate_effect_a_missing_one_and_a_stray_one() {
    let expected = vec!["e1".to_owned(), "e2".to_owned(), "e3".to_owned()];
    let got = vec![
        accepted("e1", "m1"),
        accepted("e1", "m9"), // sent again: what exactly-once forbids
        accepted("e2", "m2"),
        accepted("rolled-back", "m3"),
    ];
    let ledger = HashMap::from([("e1".to_owned(), sent("m1")), ("e2".to_owned(), sent("m2"))]);
    let r = check_effects(&expected, &got, &ledger);
    assert_eq!(r.performed_twice, 1, "{r:?}");
    assert_eq!(r.missing, 1, "{r:?}");
    assert_eq!(r.unexpected, 1, "{r:?}");
    assert!(!r.exactly_once());
}

#[test]
fn catches_a_ledger_that_disagrees_with_the_destination() {
    let expected = vec!["e1".to_owned(), "e2".to_owned()];
    let got = vec![accepted("e1", "m1"), accepted("e2", "m2")];
    let ledger = HashMap::from([
        (
            "e1".to_owned(),
            LedgerRow {
                state: "sending".into(),
                external_id: None,
            },
        ),
        ("e2".to_owned(), sent("m7")),
    ]);
    let r = check_effects(&expected, &got, &ledger);
    assert_eq!(r.ledger_wrong, 2, "{r:?}");
}

fn ap(id: &str, k: &str, seq: i64) -> Applied {
    Applied {
        event_id: id.to_owned(),
        key: key(k),
        seq,
    }
}

fn committed(list: &[(&str, &str)]) -> Vec<(String, (String, String))> {
    list.iter()
        .map(|(id, k)| (id.to_string(), key(k)))
        .collect()
}

#[test]
fn applied_in_seq_order_passes() {
    let c = committed(&[("a1", "a"), ("a2", "a"), ("b1", "b")]);
    let r = check_applied(&c, &[ap("a1", "a", 1), ap("b1", "b", 1), ap("a2", "a", 2)]);
    assert!(r.clean(), "{r:?}");
    assert_eq!(r.keys, 2);
}

#[test]
fn catches_a_planted_order_violation_gap_repeat_and_missing_apply() {
    let c = committed(&[
        ("a1", "a"),
        ("a2", "a"),
        ("a3", "a"),
        ("b1", "b"),
        ("b2", "b"),
    ]);
    let r = check_applied(
        &c,
        &[
            ap("a2", "a", 2), // gap: seq 1 not applied first
            ap("a1", "a", 1), // step back
            ap("b1", "b", 1),
            ap("b1", "b", 1), // applied twice
            ap("x9", "x", 1), // never committed
        ],
    );
    assert_eq!(r.gaps, 1, "{r:?}");
    assert_eq!(r.not_increasing, 2, "{r:?}");
    assert_eq!(r.applied_twice, 1, "{r:?}");
    assert_eq!(r.missing, 2, "a3 and b2: {r:?}");
    assert_eq!(r.unexpected, 1, "{r:?}");
    assert!(!r.clean());
}

#[test]
fn a_dead_lettered_event_with_a_record_is_handled_and_no_gap() {
    let c = committed(&[("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]);
    let dead = [("a2".to_owned(), key("a"), 2)];
    let r = check_applied_or_dead(
        &c,
        &[ap("a1", "a", 1), ap("a3", "a", 3), ap("b1", "b", 1)],
        &dead,
    );
    assert!(r.clean(), "{r:?}");
    // Without its record the same applies show a gap and a missing event.
    let r = check_applied(&c, &[ap("a1", "a", 1), ap("a3", "a", 3), ap("b1", "b", 1)]);
    assert_eq!((r.gaps, r.missing), (1, 1), "{r:?}");
    // A dead event that was also applied is handled twice.
    let r = check_applied_or_dead(
        &c,
        &[
            ap("a1", "a", 1),
            ap("a2", "a", 2),
            ap("a3", "a", 3),
            ap("b1", "b", 1),
        ],
        &dead,
    );
    assert_eq!(r.applied_twice, 1, "{r:?}");
}

#[test]
fn recovery_is_the_wait_for_everything_committed_before_the_end() {
    let commits = vec![
        ("e1".to_owned(), 100),
        ("e2".to_owned(), 200),
        ("e3".to_owned(), 300),
        ("e4".to_owned(), 400),
    ];
    let applied = HashMap::from([
        ("e1".to_owned(), 150),
        ("e2".to_owned(), 900), // stalled by the fault
        ("e3".to_owned(), 350),
        ("e4".to_owned(), 420),
    ]);
    // A fault ending at 250: e1 and e2 committed by then; e2 applied at 900.
    // At 50 nothing had committed. At 1000 everything was applied already.
    assert_eq!(
        recovery(&commits, &applied, &[250, 50, 1000, 300]),
        vec![Some(650), Some(0), Some(0), Some(600)]
    );
    let mut lost = applied.clone();
    lost.remove("e1");
    assert_eq!(recovery(&commits, &lost, &[250, 50]), vec![None, Some(0)]);
}
